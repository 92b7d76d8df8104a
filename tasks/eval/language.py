"""Held-out language modelling: perplexity and bits per byte, for models with any tokenizer.

Perplexity is per token, so it compares models only when they share a tokenizer. Bits per byte
divides the same summed loss by the UTF-8 bytes the scored tokens stand for, which does not
depend on the tokenizer: it is what the promotion gate compares when a challenger's tokenizer
differs from the champion's (a lifecycle run trains its own BPE). A model whose tokenizer is not
the data dir's is scored on the same held-out text, decoded and re-encoded with its own.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tasks.model.gpt import IGNORE_INDEX
from tasks.train.prepared_data import Batch, DataDir, shares_tokenizer
from tasks.train.runtime import autocast


def token_byte_lengths(tokenizer_path: str | Path, tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (special tokens: 0). For a byte-level BPE a token's
    string has one character per byte; otherwise each token is decoded alone."""
    spec = json.loads(Path(tokenizer_path).read_text())
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    sizes = np.zeros(tokenizer.get_vocab_size(), dtype=np.int64)
    for i in range(len(sizes)):
        if i in special:
            continue
        sizes[i] = (len(tokenizer.id_to_token(i) or "") if byte_level
                    else len(tokenizer.decode([i]).encode("utf-8")))
    return sizes


def eos_id_of(tokenizer, data: DataDir, tokenizer_path: str | Path) -> int:
    """The data dir's EOS when the model shares its tokenizer, else the EOS its
    tokenizer_config.json declares (a Hugging Face directory), else its first special token
    (how data prep defines EOS)."""
    from tasks.common.hf_dir import TOKENIZER_CONFIG, eos_token

    if shares_tokenizer(data, tokenizer_path):
        return data.eos_id
    config_path = Path(tokenizer_path).parent / TOKENIZER_CONFIG
    if config_path.is_file():
        declared = eos_token(json.loads(config_path.read_text()))
        if declared is not None and tokenizer.token_to_id(declared) is not None:
            return tokenizer.token_to_id(declared)
    specials = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    if not specials:
        raise ValueError(f"{tokenizer_path} has no special token to use as EOS.")
    return specials[0]


def held_out_batches(data: DataDir, tokenizer, eos_id: int, tokenizer_path: str | Path,
                     block_size: int, batch_size: int, max_batches: int) -> list[Batch]:
    """The data dir's first val rows; re-tokenized with the model's tokenizer when it differs."""
    rows = data.split("val")
    batches = [rows.take(i) for i in rows.in_order(batch_size, max_batches)]
    if shares_tokenizer(data, tokenizer_path):
        return batches
    from tasks.train.prepared_data import load_tokenizer

    data_tokenizer = load_tokenizer(data.tokenizer_path)
    stream: list[int] = []
    for b in batches:
        ids = torch.cat([b.inputs, b.targets[:, -1:]], dim=1).flatten().tolist()
        docs, current = [], []
        for t in ids:
            if t == data.eos_id:
                docs.append(current)
                current = []
            else:
                current.append(t)
        docs.append(current)
        for doc in docs:
            if doc:
                stream += tokenizer.encode(data_tokenizer.decode(doc), add_special_tokens=False).ids
            stream.append(eos_id)
    row = block_size + 1
    n_rows = min(len(stream) // row, batch_size * max_batches)
    if n_rows == 0:
        raise ValueError("too little held-out text to fill one row with the model's tokenizer.")
    table = torch.tensor(stream[: n_rows * row]).view(n_rows, row)
    return [Batch(table[i:i + batch_size, :-1], table[i:i + batch_size, 1:],
                  int(table[i:i + batch_size, :-1].numel()))
            for i in range(0, n_rows, batch_size)]


@torch.no_grad()
def language_scores(model, batches: list[Batch], byte_lengths: np.ndarray, device: torch.device,
                    eos_id: int | None = None, doc_keys: list[str] | None = None
                    ) -> dict[str, Any]:
    """Summed next-token loss over the batches -> val_loss (nats/token), perplexity and
    bits_per_byte; with `eos_id`, also `documents`: each held-out document's bits and scored
    bytes (what the gate pairs, plugins/llmops/policy/paired.py).

    The batches are consecutive rows of one token stream with EOS between documents; a target
    belongs to the document its position falls in (an EOS to the document it ends). Only
    documents whose EOS was scored count: a document cut off by the last row is left out, so two
    models pair on whole documents whatever their tokenizers. `doc_keys` names the documents in
    stream order (document_keys: the same names for every tokenizer)."""
    was_training = model.training
    model.eval()
    nats, tokens, n_bytes = 0.0, 0, 0
    lengths = torch.from_numpy(byte_lengths)
    doc_bits: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (document, bits, bytes)
    ended: set[int] = set()
    eos_before = 0   # EOS tokens in the stream before the current row
    try:
        for batch in batches:
            with autocast(device):
                logits = model(batch.inputs.to(device))[0]
            targets = batch.targets
            per_token = F.cross_entropy(logits.float().flatten(0, 1).cpu(), targets.flatten(),
                                        ignore_index=IGNORE_INDEX, reduction="none")
            nats += float(per_token.sum())
            scored_mask = targets != IGNORE_INDEX
            scored = targets[scored_mask]
            tokens += int(scored.numel())
            n_bytes += int(lengths[scored].sum())
            if eos_id is None:
                continue
            rows = torch.cat([batch.inputs[:, :1], targets], dim=1)     # (B, L): the stream
            is_eos = (rows == eos_id).long().flatten()
            # the document of every stream position: the EOS tokens strictly before it
            doc = (eos_before + torch.cumsum(is_eos, 0) - is_eos).view(rows.shape)[:, 1:]
            eos_before += int(is_eos.sum())
            keep = scored_mask.flatten().numpy()
            doc_of, target = doc.flatten().numpy()[keep], targets.flatten().numpy()[keep]
            doc_bits.append((doc_of, per_token.numpy()[keep] / math.log(2), byte_lengths[target]))
            ended.update(doc_of[target == eos_id].tolist())
    finally:
        model.train(was_training)
    val_loss = nats / max(tokens, 1)
    out = {"val_loss": val_loss, "perplexity": math.exp(val_loss),
           "bits_per_byte": nats / math.log(2) / max(n_bytes, 1), "scored_tokens": tokens,
           "scored_bytes": n_bytes}
    if eos_id is not None:
        doc_of = np.concatenate([d for d, _, _ in doc_bits]) if doc_bits else np.zeros(0, int)
        bits = np.bincount(doc_of, weights=np.concatenate([b for _, b, _ in doc_bits])) \
            if doc_bits else np.zeros(0)
        n_bytes_of = np.bincount(doc_of, weights=np.concatenate([n for _, _, n in doc_bits])) \
            if doc_bits else np.zeros(0)
        whole = [d for d in sorted(ended) if n_bytes_of[d] > 0 and
                 (doc_keys is None or d < len(doc_keys))]
        out["documents"] = {"keys": [doc_keys[d] if doc_keys else str(d) for d in whole],
                            "bits": [float(bits[d]) for d in whole],
                            "bytes": [int(n_bytes_of[d]) for d in whole], "tokens": tokens}
    return out


def document_keys(data: DataDir, batch_size: int, max_batches: int) -> list[str]:
    """A name for each document of the held-out rows, in stream order: the hash of its tokens in
    the data dir's tokenizer, so a model with another tokenizer (whose stream held_out_batches
    rebuilds from the same rows) names the same document the same way."""
    import hashlib

    rows = data.split("val")
    stream = np.concatenate([np.concatenate([b.inputs.numpy(), b.targets[:, -1:].numpy()], 1).ravel()
                             for b in (rows.take(i) for i in rows.in_order(batch_size, max_batches))])
    keys, start = [], 0
    for end in [*np.flatnonzero(stream == data.eos_id), len(stream)]:
        keys.append(hashlib.sha256(stream[start:end].astype("<u4").tobytes()).hexdigest()[:12])
        start = end + 1
    return keys
