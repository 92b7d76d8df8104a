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

from tasks.model import IGNORE_INDEX
from tasks.train.data import Batch, DataDir, shares_tokenizer
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
    from tasks.train.data import load_tokenizer

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
def language_scores(model, batches: list[Batch], byte_lengths: np.ndarray, device: torch.device
                    ) -> dict[str, Any]:
    """Summed next-token loss over the batches -> val_loss (nats/token), perplexity and
    bits_per_byte."""
    was_training = model.training
    model.eval()
    nats, tokens, n_bytes = 0.0, 0, 0
    lengths = torch.from_numpy(byte_lengths)
    try:
        for batch in batches:
            with autocast(device):
                logits = model(batch.inputs.to(device))[0]
            targets = batch.targets
            nats += float(F.cross_entropy(logits.float().flatten(0, 1).cpu(), targets.flatten(),
                                          ignore_index=IGNORE_INDEX, reduction="sum"))
            scored = targets[targets != IGNORE_INDEX]
            tokens += int(scored.numel())
            n_bytes += int(lengths[scored].sum())
    finally:
        model.train(was_training)
    val_loss = nats / max(tokens, 1)
    return {"val_loss": val_loss, "perplexity": math.exp(val_loss),
            "bits_per_byte": nats / math.log(2) / max(n_bytes, 1), "scored_tokens": tokens,
            "scored_bytes": n_bytes}
