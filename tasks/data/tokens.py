"""Tokenizer and packed token rows.

A byte-level BPE is trained on a sample of the training documents (or an existing tokenizer.json
is used); each shard's documents are tokenized with EOS appended into one token stream per split;
the packer then cuts the concatenated streams into rows of seq_len + 1 tokens (inputs plus the
one-shifted targets), uint16 when the vocabulary fits, else uint32, little-endian.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from tasks.common.io import atomic_write

EOS = "<|endoftext|>"
EOS_ID = 0  # the trained tokenizer's first special token; train_tokenizer checks it
MAX_TOKENS_PER_FILE = 1 << 27  # 256 MiB of uint16 per token file


def load_tokenizer(path: Path) -> Any:
    """A tokenizer.json, parsed once per process (every shard job of a run reads the same one;
    ~10 ms a parse). Here, not in tasks.data.prep: Ray pickles the shard functions of a module
    run as __main__ by value, and a cache must be found by its module's name in the worker."""
    stat = path.stat()  # a rewritten file (new inode, size or time) is parsed again
    return _parse_tokenizer(str(path), (stat.st_ino, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _parse_tokenizer(path: str, stamp: tuple[int, int, int]) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def train_tokenizer(texts: Iterable[str], vocab_size: int, length: int | None = None) -> Any:
    """Byte-level BPE with digits kept one per token; the EOS special token gets id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),  # numbers are spelled out digit by digit
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    if tokenizer.token_to_id(EOS) != EOS_ID:  # models and loaders rely on it
        raise RuntimeError(f"{EOS} got id {tokenizer.token_to_id(EOS)}, expected {EOS_ID}.")
    return tokenizer


def check_tokenizer(tokenizer: Any, where: str, declared_eos: str | None = None) -> int:
    """The EOS id of a tokenizer we did not train: its {EOS} token, else the EOS a Hugging Face
    tokenizer_config.json beside it declares (a Llama's </s>, say); refuse one with neither."""
    eos_id = tokenizer.token_to_id(EOS)
    if eos_id is None and declared_eos:
        eos_id = tokenizer.token_to_id(declared_eos)
    if eos_id is None:
        raise ValueError(f"{where} has no {EOS!r} token and no tokenizer_config.json beside it "
                         "declaring an eos_token it has: documents could not be separated. Add "
                         "one, or leave DataPrepConfig.tokenizer_path empty to train a tokenizer "
                         "on the data.")
    return eos_id


def declared_eos(tokenizer_path: str, read: Any) -> str | None:
    """The eos_token of the tokenizer_config.json beside a tokenizer.json (a Hugging Face model
    directory), read with `read(path) -> bytes`; None when there is none."""
    from tasks.common.hf_dir import TOKENIZER, TOKENIZER_CONFIG, eos_token

    if not tokenizer_path.endswith(TOKENIZER):
        return None
    try:
        config = json.loads(read(tokenizer_path[: -len(TOKENIZER)] + TOKENIZER_CONFIG))
    except Exception:  # noqa: BLE001 - no config beside it (or unreadable): no declared EOS
        return None
    return eos_token(config) if isinstance(config, dict) else None


def encode_stream(tokenizer: Any, texts: list[str], eos_id: int, dtype: str,
                  repeats: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    """All texts tokenized, each followed by EOS, as one array; and the tokens per text (EOS
    included). With `repeats`, text i is emitted repeats[i] times: first one pass over every text
    kept once or more, then a second pass over those kept twice or more, and so on."""
    # encode_batch_fast: the same ids without the character offsets, which nothing here reads.
    encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False) if texts else []
    pieces = [np.asarray(e.ids + [eos_id], dtype=dtype) for e in encodings]
    lengths = [len(p) for p in pieces]
    if repeats is not None:
        passes = max(repeats, default=0)
        pieces = [p for k in range(passes) for p, r in zip(pieces, repeats) if r > k]
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    return stream.astype(np.dtype(dtype).newbyteorder("<"), copy=False), lengths


def pack_split(out_dir: Path, split: str, streams: list[Path], row_len: int, dtype: str) -> dict:
    """Concatenate the token streams in order and write full rows of `row_len` into
    tokens/{split}_NNNNN.bin files; the tail that does not fill a row is left out."""
    little_endian = np.dtype(dtype).newbyteorder("<")
    rows_per_file = max(1, MAX_TOKENS_PER_FILE // row_len)
    files: list[dict] = []
    pending: list[np.ndarray] = []
    pending_tokens = total_tokens = 0

    def flush(final: bool) -> None:
        nonlocal pending, pending_tokens
        data = np.concatenate(pending) if pending else np.zeros(0, dtype=little_endian)
        while len(data) >= rows_per_file * row_len or (final and len(data) >= row_len):
            n_rows = min(rows_per_file, len(data) // row_len)
            chunk, data = data[: n_rows * row_len], data[n_rows * row_len:]
            payload = chunk.tobytes()
            rel = f"tokens/{split}_{len(files):05d}.bin"
            atomic_write(out_dir / rel, lambda fh: fh.write(payload))
            files.append({"path": rel, "rows": n_rows, "sha256": hashlib.sha256(payload).hexdigest()})
        pending, pending_tokens = [data], len(data)

    for path in streams:
        part = np.fromfile(path, dtype=little_endian)
        total_tokens += len(part)
        pending.append(part)
        pending_tokens += len(part)
        if pending_tokens >= rows_per_file * row_len:
            flush(final=False)
    flush(final=True)
    n_rows = sum(f["rows"] for f in files)
    return {"shards": files, "rows": n_rows, "tokens": n_rows * row_len,
            "remainder_tokens": total_tokens - n_rows * row_len}


def write_index(out_dir: Path, manifest_part: dict) -> Path:
    """tokens/index.json: what a reader needs to open the rows without the manifest."""
    text = json.dumps(manifest_part, indent=2, sort_keys=True) + "\n"
    return atomic_write(out_dir / "tokens" / "index.json", lambda fh: fh.write(text.encode()))
