"""The teacher's top-k logits, computed once (`python -m tasks.distill_cache`) and read by the
student's job (`python -m tasks.distill` with teacher_cache set), so the big teacher runs in one
job, on hardware that fits it, and the student trains without it.

    <cache>/sft_values.npy      (P, k) float16  teacher logits at every SFT loss position, example
    <cache>/sft_indices.npy     (P, k) int32    after example, in order; their token ids
    <cache>/sft_offsets.npy     (N+1,) int64    example i owns rows offsets[i]:offsets[i+1]
    <cache>/replay_rows.npy     (R,)   int64    the pretraining rows the student's steps replay
    <cache>/replay_values.npy   (R, T, k) float16, replay_indices.npy (R, T, k) int32
    <cache>/manifest.json       key (teacher weights, data, SFT files, k, block size, replayed
                                rows), shapes and the teacher's held-out metrics; written last

Any teacher the stages load works (our GPT or a transformers model): the cache holds only token
ids and logits, so the student may be of another architecture, with the same tokenizer.

The directory is assembled beside its final place and renamed in. A student job checks the key
against its own config and refuses a cache made for another teacher or other data.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from tasks.common.io import publish_dir, read_json, sha256_file, write_json
from tasks.train.prepared_data import SFTExample, TokenRows, collate_sft
from tasks.model.gpt import IGNORE_INDEX

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"


def cache_key(*, teacher_dir: str | Path, data_hash: str, sft_sha256: str, top_k: int,
              block_size: int, replay_rows: np.ndarray) -> dict[str, Any]:
    """What a cache was computed from; a student may use it only if its own key is equal."""
    rows = np.asarray(replay_rows, dtype=np.int64)
    return {"format": FORMAT, "teacher_sha256": weights_sha256(teacher_dir),
            "data_content_hash": data_hash, "sft_sha256": sft_sha256, "top_k": int(top_k),
            "block_size": int(block_size),
            "replay_rows_sha256": hashlib.sha256(rows.tobytes()).hexdigest()}


def weights_sha256(model_dir: str | Path) -> str:
    """One digest of a model directory's weight files (every *.safetensors shard, by name; or the
    model.pt of the format before Hugging Face directories)."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors")) or [model_dir / "model.pt"]
    if len(files) == 1:
        return sha256_file(files[0])
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}:{sha256_file(f)}\n".encode())
    return digest.hexdigest()


@torch.no_grad()
def _topk(teacher: nn.Module, inputs: torch.Tensor, k: int, device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor]:
    logits, _ = teacher(inputs.to(device))
    values, indices = logits.float().topk(k, dim=-1)
    return values.half().cpu(), indices.int().cpu()


def build_cache(teacher: nn.Module, out_dir: str | Path, *, key: dict[str, Any],
                examples: list[SFTExample], replay: TokenRows | None, replay_rows: np.ndarray,
                batch_size: int, device: torch.device, teacher_metrics: dict[str, Any]) -> Path:
    """Compute and write the cache atomically; reuse an existing one with the same key."""
    out_dir = Path(out_dir)
    if (out_dir / MANIFEST).is_file() and read_json(out_dir / MANIFEST).get("key") == key:
        log.info("teacher cache %s already holds this key; reusing it", out_dir)
        return out_dir
    teacher.eval()
    k, block_size = key["top_k"], key["block_size"]
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    started = time.perf_counter()
    try:
        values, indices, counts = [], [], []
        for i in range(0, len(examples), batch_size):
            batch = collate_sft(examples[i:i + batch_size], block_size, pad_id=0)
            v, ix = _topk(teacher, batch.inputs, k, device)
            mask = batch.targets != IGNORE_INDEX
            # row-major order of the loss positions is example order: what SFTSteps reads back
            values.append(v[mask])
            indices.append(ix[mask])
            counts += mask.sum(dim=1).tolist()
        np.save(tmp / "sft_values.npy", torch.cat(values).numpy())
        np.save(tmp / "sft_indices.npy", torch.cat(indices).numpy())
        np.save(tmp / "sft_offsets.npy", np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))

        rows = np.asarray(replay_rows, dtype=np.int64)
        np.save(tmp / "replay_rows.npy", rows)
        r_values, r_indices = [], []
        for i in range(0, len(rows), batch_size):
            v, ix = _topk(teacher, replay.take(rows[i:i + batch_size]).inputs, k, device)
            r_values.append(v)
            r_indices.append(ix)
        T = replay.row_len - 1 if replay is not None else 0
        np.save(tmp / "replay_values.npy", torch.cat(r_values).numpy() if r_values
                else np.zeros((0, T, k), np.float16))
        np.save(tmp / "replay_indices.npy", torch.cat(r_indices).numpy() if r_indices
                else np.zeros((0, T, k), np.int32))
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        write_json(tmp / MANIFEST, {"key": key, "examples": len(examples),
                                    "sft_positions": int(sum(counts)), "replay_rows": len(rows),
                                    "files": files, "teacher_metrics": teacher_metrics,
                                    "seconds": round(time.perf_counter() - started, 3)})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, out_dir)
    log.info("teacher cache: %d examples (%d positions) and %d replayed rows, top-%d, %.1f MB, "
             "in %.1fs -> %s", len(examples), sum(counts), len(rows), k,
             sum(files.values()) / 1e6, time.perf_counter() - started, out_dir)
    return out_dir


class TeacherCache:
    """A finished cache, memory-mapped; lookups return torch tensors for SFTSteps."""

    def __init__(self, path: str | Path, expected_key: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        if not (self.path / MANIFEST).is_file():
            raise FileNotFoundError(f"{self.path} is not a finished teacher cache (no {MANIFEST}); "
                                    "run `python -m tasks.distill_cache` with the same config first.")
        self.manifest = read_json(self.path / MANIFEST)
        if expected_key is not None and self.manifest["key"] != expected_key:
            diff = sorted(k for k in expected_key if self.manifest["key"].get(k) != expected_key[k])
            raise ValueError(f"teacher cache {self.path} was built for other inputs (differs in "
                             f"{diff}); rebuild it with `python -m tasks.distill_cache` and this "
                             "config.")
        load = lambda name: np.load(self.path / name, mmap_mode="r")  # noqa: E731
        self.sft_values, self.sft_indices = load("sft_values.npy"), load("sft_indices.npy")
        self.sft_offsets = load("sft_offsets.npy")
        self.replay_rows = load("replay_rows.npy")
        self.replay_values, self.replay_indices = load("replay_values.npy"), load("replay_indices.npy")

    @property
    def teacher_metrics(self) -> dict[str, Any]:
        return self.manifest.get("teacher_metrics", {})

    def sft_topk(self, example_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, k) values and indices of these examples' loss positions, in this order."""
        spans = [np.arange(self.sft_offsets[i], self.sft_offsets[i + 1]) for i in example_ids]
        rows = np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)
        return (torch.from_numpy(np.asarray(self.sft_values[rows])),
                torch.from_numpy(np.asarray(self.sft_indices[rows])))

    def replay_topk(self, row_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, T, k) values and indices for these pretraining rows."""
        where = np.searchsorted(self.replay_rows, row_ids)
        if np.any(where >= len(self.replay_rows)) or np.any(self.replay_rows[np.minimum(
                where, len(self.replay_rows) - 1)] != row_ids):
            raise ValueError("a replayed row is missing from the teacher cache; it was built for "
                             "fewer steps or another seed. Rebuild it with this config.")
        return (torch.from_numpy(np.asarray(self.replay_values[where])),
                torch.from_numpy(np.asarray(self.replay_indices[where])))


def replayed_rows(steps: Any, max_steps: int) -> np.ndarray:
    """Every pretraining row the student's batches will replay, sorted, unique: batches 0 to
    max_steps plus a margin, because the loop reads past max_steps when it skips the batches of a
    loss spike."""
    if not getattr(steps, "n_replay", 0):
        return np.zeros(0, dtype=np.int64)
    batches = max_steps + max(16, max_steps // 10)
    return np.unique(np.concatenate([steps.replay_indices(b) for b in range(batches)]))
