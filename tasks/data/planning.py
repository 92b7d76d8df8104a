"""Data prep's planning: what a run will do before it does it (tasks/data/prep.py, the driver, does it).

- the shards: one per input file, or per split of one over MIN_SPLIT_BYTES (`split_bytes_for`;
  readers.plan_splits: byte ranges of JSONL and text, row groups of Parquet), each a job keyed
  by its input's fingerprint, its split and the config's output fields, and which of them a
  completion marker says are done (`shard_jobs`); each split's first line in its file
  (`set_line_bases`);
- the engine that runs the jobs, by input size (`choose_engine`);
- the dedup's key-range buckets and the plan every bucket reads first (`dedup_buckets`,
  `write_dedup_plan`).
Which config fields are layout, not output (`LAYOUT_ONLY_FIELDS`, `output_fields`): they change
where and how the work is spread, never what is written.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tasks.common.io import atomic_write, read_json
from tasks.configs import DataPrepConfig, to_dict
from tasks.data.markers import digest, finished
from tasks.data.readers import InputFile, fingerprint, plan_splits

# Config fields that change where and how the work is spread, not what is written: a data set
# may be moved, or finished by another engine, without redoing anything.
LAYOUT_ONLY_FIELDS = ("engine", "workers", "output_dir", "processes_above_bytes", "ray_above_bytes",
                      "dedup_buckets")
RECORDS_PER_BUCKET = 1 << 22  # hashes + band keys a dedup bucket holds at most (auto): ~100 MB
# How a file is cut into shards: into up to SPLITS_PER_FILE splits of at least MIN_SPLIT_BYTES
# each, and never into splits larger than split_bytes. A file below split_bytes was one shard, so
# one worker read it while the others waited: a 46 MB file ran 0.96x as fast on 2 workers as on 1,
# the same bytes as 16 files 1.80x. Never by the number of workers or hosts, which would make the
# shards, and with them every output file and the manifest's content_hash, depend on where the
# run ran (datatrove likewise fixes its tasks apart from its workers). Every shard costs time of
# its own (its files and markers, each step's set-up): at 2 MiB the 16 files of 3 MB became 32
# shards and their 1-worker run took 30.6 s against 25.6 s for the same bytes as one file in 16
# (benchmarks/results/data_prep_one_file_min2mib.json, medians of 5 rounds at load 11-21); at
# 4 MiB files of a few MB stay whole, as before.
SPLITS_PER_FILE = 16
MIN_SPLIT_BYTES = 4 << 20


def output_fields(config: dict) -> dict:
    """A config (as a dict) without its layout fields: what decides the data set written."""
    return {k: v for k, v in config.items() if k not in LAYOUT_ONLY_FIELDS}


def split_bytes_for(size: int, split_bytes: int) -> int:
    """The split size of a file of `size` bytes (SPLITS_PER_FILE): a 46 MB file is cut into 11
    splits of 4.2 MB, a 100 MB one into 16, a 3 MB one into one, a 10 GB one into splits of
    split_bytes."""
    return min(split_bytes, max(MIN_SPLIT_BYTES, -(-size // SPLITS_PER_FILE)))


def shard_jobs(config: DataPrepConfig, out_dir: Path, files: list[InputFile],
               trust_markers: bool = False) -> tuple[list[dict], list[dict]]:
    """(every shard's job, the jobs whose output is missing or stale): one shard per file, or per
    split of a large one (readers.plan_splits). With `trust_markers` (the finalize job) a marker
    for the same input path and split counts as done without comparing fingerprints: that job
    has copies of the inputs with new timestamps, or none (then the markers tell the splits)."""
    cfg = to_dict(config)
    jobs, todo = [], []
    for file in files:
        try:
            fp = fingerprint(file.path)
            splits = plan_splits(file.path, fp["size"], split_bytes_for(fp["size"], config.split_bytes))
        except OSError:
            if not trust_markers:
                raise
            fp, splits = None, _splits_in_markers(out_dir, len(jobs), file.path)
        for split in splits:
            index = len(jobs)
            name = f"shard_{index:05d}"
            marker = out_dir / "completions" / f"{name}.json"
            done = read_json(marker) if trust_markers and marker.exists() else None
            if done and done["input"]["path"] == file.path and done.get("split") == split \
                    and finished(out_dir, name, done["key"]):
                jobs.append(_job(index, file, split, done["input"], done["key"], out_dir, cfg, len(splits)))
                continue
            if fp is None:
                fp = fingerprint(file.path)  # not there: the error names the file
            job = _job(index, file, split, fp, digest(fp, split, output_fields(cfg)), out_dir, cfg, len(splits))
            jobs.append(job)
            if not finished(out_dir, name, job["key"]):
                todo.append(job)
    return jobs, todo


def _job(index: int, file: InputFile, split: dict | None, fp: dict, key: str, out_dir: Path, cfg: dict,
         n_splits: int) -> dict:
    size = split["end"] - split["start"] if split and "start" in split else fp["size"] // n_splits
    return {"index": index, "file": file.__dict__, "split": split, "bytes": size, "fingerprint": fp,
            "key": key, "out_dir": str(out_dir), "config": cfg}


def _splits_in_markers(out_dir: Path, first: int, path: str) -> list[dict | None]:
    """The splits of `path` as its shards' markers recorded them, from shard `first` on."""
    splits = []
    while (marker := out_dir / "completions" / f"shard_{first + len(splits):05d}.json").exists():
        done = read_json(marker)
        if done["input"]["path"] != path:
            break
        splits.append(done.get("split"))
    if not splits:
        raise FileNotFoundError(f"{path}: no such input file, and no shard marker for it in {out_dir}/completions.")
    return splits


def set_line_bases(jobs: list[dict], shards: list[dict]) -> None:
    """Each split's line_base: the lines (or rows) of the file's splits before it."""
    base, path = 0, None
    for job, shard in zip(jobs, shards):
        if job["file"]["path"] != path:
            base, path = 0, job["file"]["path"]
        job["line_base"] = base
        base += shard["lines"]


def choose_engine(config: DataPrepConfig, input_bytes: int) -> tuple[str, str]:
    """(engine, why): DataPrepConfig.engine, or with "auto", by input size:
    - Ray Data when a Ray cluster is there to use (RAY_ADDRESS) and the input reaches
      ray_above_bytes: other machines' cores are worth Ray's start-up;
    - in this process with one worker, or below processes_above_bytes, where starting workers costs
      more than they save;
    - otherwise `workers` processes (this one and a pool). On one machine it spreads the same shards as a local
      Ray would, without Ray's 5-10 s start-up (benchmarks/data_prep_bench.py measures both)."""
    if config.engine != "auto":
        return config.engine, f"engine={config.engine!r} in the config"
    size = f"{input_bytes / 1e6:.1f} MB of input"
    if os.environ.get("RAY_ADDRESS") and input_bytes >= config.ray_above_bytes:
        return "ray", (f"{size} >= ray_above_bytes = {config.ray_above_bytes / 1e6:.1f} MB: Ray Data "
                       "on the cluster at RAY_ADDRESS")
    if config.workers == 1:
        return "local", f"{size}, one worker: in-process"
    limit = f"processes_above_bytes = {config.processes_above_bytes / 1e6:.1f} MB"
    if input_bytes < config.processes_above_bytes:
        return "local", f"{size} < {limit}: in-process, no workers to start"
    return "processes", f"{size} >= {limit}: {config.workers} worker processes"


def dedup_buckets(config: DataPrepConfig, shards: list[dict]) -> int:
    """DataPrepConfig.dedup_buckets, or enough buckets that none holds more than
    RECORDS_PER_BUCKET keys, and at least one per worker."""
    if config.dedup_buckets:
        return config.dedup_buckets
    records = sum(s["kept"] + s["band_starts"][-1] for s in shards)
    return max(config.workers, -(-records // RECORDS_PER_BUCKET), 1)


def write_dedup_plan(out_dir: Path, shards: list[dict], bands: int) -> np.ndarray:
    """staging/dedup/plan.npy, what every bucket reads first: per shard, the index of its first
    document among all shards and where each band starts in its sorted keys. Returns the
    offsets (with the total last)."""
    offsets = np.cumsum([0] + [s["kept"] for s in shards]).astype(np.int64)
    plan = np.array([[offsets[i], *(s["band_starts"] if bands else [0])] for i, s in enumerate(shards)],
                    dtype=np.int64).reshape(len(shards), -1)
    atomic_write(out_dir / "staging" / "dedup" / "plan.npy", lambda fh: np.save(fh, plan))
    return offsets
