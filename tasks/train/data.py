"""Reading what data prep wrote: memory-mapped token shards and prompt/completion examples.

Batch order is a pure function of (seed, step): batch `s` holds positions s*B .. s*B+B-1 of an
endless stream made of one seeded permutation of all rows per epoch. The data cursor is therefore
just the step, and a job resumed at step s reads exactly the batches the uninterrupted job would.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.common.io import read_json, sha256_file
from tasks.model import IGNORE_INDEX

log = logging.getLogger(__name__)


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, T) token ids
    targets: torch.Tensor  # (B, T) next-token ids, IGNORE_INDEX where no loss is taken
    tokens: int  # real (not padding) input tokens: what tokens/s counts

    def to(self, device: torch.device) -> "Batch":
        # pinned memory + non_blocking lets the copy overlap the previous step on a GPU
        if device.type == "cuda":
            return Batch(self.inputs.pin_memory().to(device, non_blocking=True),
                         self.targets.pin_memory().to(device, non_blocking=True), self.tokens)
        return self


class DataDir:
    """A data prep output directory, read through its manifest (which prep writes last)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        manifest = self.path / "manifest.json"
        if not manifest.exists():
            raise FileNotFoundError(
                f"{manifest} is missing: {self.path} is not a finished data prep output. "
                "Run `python -m tasks.data.prep` first (it writes manifest.json last).")
        self.manifest: dict[str, Any] = read_json(manifest)
        self.eos_id: int = int(self.manifest["eos_id"])
        self.vocab_size: int = int(self.manifest["vocab_size"])
        self.seq_len: int = int(self.manifest["seq_len"])
        self.content_hash: str = self.manifest["content_hash"]

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest["tokenizer"]

    def check_tokenizer(self) -> None:
        actual = sha256_file(self.tokenizer_path)
        if actual != self.manifest["tokenizer_sha256"]:
            raise ValueError(f"{self.tokenizer_path} does not match the sha256 in the manifest; "
                             "the data dir was modified after prep. Rerun data prep.")

    def split(self, name: str) -> "TokenRows":
        if name not in self.manifest["splits"]:
            raise KeyError(f"Split {name!r} is not in {self.path}/manifest.json; "
                           f"it has {sorted(self.manifest['splits'])}.")
        return TokenRows(self.path, self.manifest, name)

    def sft_path(self, name: str) -> Path:
        return self.path / self.manifest["sft"][name]


class TokenRows:
    """All rows of one split across its shards, memory-mapped (nothing is read until used)."""

    def __init__(self, root: Path, manifest: dict[str, Any], split: str) -> None:
        self.row_len = int(manifest["row_len"])
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")  # shards are little-endian
        self.shards: list[np.memmap] = []
        for shard in manifest["splits"][split]["shards"]:
            path = root / shard["path"]
            expected = int(shard["rows"]) * self.row_len * dtype.itemsize
            if not path.exists() or path.stat().st_size != expected:
                raise ValueError(f"Shard {path} should hold {shard['rows']} rows "
                                 f"({expected} bytes); it is missing or truncated. Rerun data prep.")
            if int(shard["rows"]):
                self.shards.append(np.memmap(path, dtype=dtype, mode="r",
                                             shape=(int(shard["rows"]), self.row_len)))
        # first global row index of each shard, for searchsorted
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.rows = int(self.starts[-1])
        if self.rows == 0:
            raise ValueError(f"Split {split!r} has no rows; data prep produced too little text "
                             "for seq_len. Add input text or lower seq_len.")

    def take(self, indices: np.ndarray) -> Batch:
        shard_of = np.searchsorted(self.starts, indices, side="right") - 1
        rows = np.stack([self.shards[s][i - self.starts[s]] for s, i in zip(shard_of, indices)])
        rows = torch.from_numpy(rows.astype(np.int64))
        return Batch(rows[:, :-1], rows[:, 1:], rows.shape[0] * (rows.shape[1] - 1))

    def in_order(self, batch_size: int, max_batches: int) -> list[np.ndarray]:
        """The first max_batches batches in file order: a fixed val set, comparable across evals."""
        n = min(self.rows, batch_size * max_batches)
        return [np.arange(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


class EpochSampler:
    """Indices of batch `step`: an endless stream of seeded per-epoch permutations of n items."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) > 2:
                self._cache.clear()
            self._cache[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._cache[epoch]

    def indices(self, step: int) -> np.ndarray:
        positions = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        return np.array([self._perm(int(p // self.n))[p % self.n] for p in positions])


class PretrainBatches:
    """Batch `step` of next-token training: input = row[:-1], target = row[1:]."""

    def __init__(self, rows: TokenRows, batch_size: int, seed: int) -> None:
        self.rows = rows
        self.sampler = EpochSampler(rows.rows, batch_size, seed)

    def __call__(self, step: int) -> Batch:
        return self.rows.take(self.sampler.indices(step))


# --------------------------------------------------------------------------------------------
# Supervised fine-tuning: prompt/completion pairs, loss on the completion only


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


@dataclass
class SFTExample:
    id: str
    prompt: str
    completion: str
    skill: str
    prompt_ids: list[int]
    completion_ids: list[int]  # ends with EOS


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_sft(path: str | Path, tokenizer, eos_id: int, limit: int | None = None) -> list[SFTExample]:
    records = read_jsonl(path)[:limit]
    if not records:
        raise ValueError(f"{path} holds no examples; data prep should write prompt/completion "
                         "JSONL there.")
    # Prompt and completion are tokenized separately, as at inference time the model sees the
    # prompt's tokens alone and must produce the completion's tokens from there.
    prompts = tokenizer.encode_batch([r["prompt"] for r in records], add_special_tokens=False)
    completions = tokenizer.encode_batch([r["completion"] for r in records], add_special_tokens=False)
    return [SFTExample(id=str(r.get("id", i)), prompt=r["prompt"], completion=r["completion"],
                       skill=str(r.get("skill", "all")), prompt_ids=p.ids,
                       completion_ids=c.ids + [eos_id])
            for i, (r, p, c) in enumerate(zip(records, prompts, completions))]


def collate_sft(examples: list[SFTExample], block_size: int, pad_id: int) -> Batch:
    """Right-padded (B, T) inputs and targets; targets are IGNORE_INDEX on prompt and padding,
    so only completion tokens (and the EOS that ends them) carry loss."""
    seqs, n_prompt = [], []
    for ex in examples:
        ids = ex.prompt_ids + ex.completion_ids
        # too long: drop the oldest prompt tokens, never the completion the loss is about
        cut = max(0, len(ids) - (block_size + 1))
        seqs.append(ids[cut:])
        n_prompt.append(max(0, len(ex.prompt_ids) - cut))
    T = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), T), IGNORE_INDEX, dtype=torch.long)
    for b, (ids, p) in enumerate(zip(seqs, n_prompt)):
        ids_t = torch.tensor(ids, dtype=torch.long)
        inputs[b, : len(ids) - 1] = ids_t[:-1]
        targets[b, : len(ids) - 1] = ids_t[1:]
        # target position t predicts token t+1: it is a prompt token while t+1 < p
        targets[b, : max(0, p - 1)] = IGNORE_INDEX
    return Batch(inputs, targets, sum(len(ids) - 1 for ids in seqs))


class SFTBatches:
    def __init__(self, examples: list[SFTExample], batch_size: int, seed: int, block_size: int,
                 pad_id: int) -> None:
        self.examples, self.block_size, self.pad_id = examples, block_size, pad_id
        self.sampler = EpochSampler(len(examples), batch_size, seed)

    def __call__(self, step: int) -> Batch:
        return collate_sft([self.examples[i] for i in self.sampler.indices(step)],
                           self.block_size, self.pad_id)


def model_tokenizer(data: DataDir, model_dir: str | Path):
    """The tokenizer a model directory was trained with, after checking that the data was
    prepared with it too: otherwise the same token ids would stand for other text."""
    path = Path(model_dir) / "tokenizer.json"
    if sha256_file(path) != data.manifest["tokenizer_sha256"]:
        raise ValueError(f"{path} differs from the tokenizer of {data.path}; use data prepared "
                         "with the tokenizer the model was pretrained with.")
    return load_tokenizer(path)


def load_sft_splits(data_dir: str | Path, model_dir: str | Path, block_size: int, eval_limit: int
                    ) -> tuple[DataDir, Any, list[SFTExample], list[SFTExample]]:
    """(data dir, the model's tokenizer, SFT train examples, the first eval_limit eval examples)."""
    data = DataDir(data_dir)
    tokenizer = model_tokenizer(data, model_dir)
    train_examples = load_sft(data.sft_path("train"), tokenizer, data.eos_id)
    eval_examples = load_sft(data.sft_path("eval"), tokenizer, data.eos_id, limit=eval_limit)
    too_long = sum(len(e.prompt_ids) + len(e.completion_ids) > block_size + 1 for e in train_examples)
    if too_long:
        log.warning("%d of %d SFT examples exceed block_size %d; their prompts are cut from the "
                    "left", too_long, len(train_examples), block_size)
    return data, tokenizer, train_examples, eval_examples


def prompt_example(examples: list[SFTExample], n: int = 2) -> torch.Tensor:
    """(n, T) real prompt tokens, cut to the shortest: an example input for tracing a model."""
    shortest = min(16, *(len(e.prompt_ids) for e in examples[:n]))
    return torch.tensor([e.prompt_ids[:shortest] for e in examples[:n]], dtype=torch.long)
