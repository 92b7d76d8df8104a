"""Data prep's manifest (tasks/data/prep.py is the driver): stage 5, which cuts the token streams
into rows and writes manifest.json last, and the readers of a finished data set.

manifest.json holds the config, tokenizer hash, per-step counts and drop reasons, per-source
counts and tokens, tokens per split, the sha256 of every output file and their combined
content_hash. The data set is complete once it exists.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import numpy as np

from tasks.common.io import read_json, sha256_file, write_json
from tasks.configs import DataPrepConfig, to_dict
from tasks.data.markers import shard_files
from tasks.data.readers import InputFile
from tasks.data.steps import merge_stats
from tasks.data.tokens import pack_split, token_dtype, write_index

# Kept-document length histogram: log-spaced character counts, fixed so shards can be summed.
LENGTH_BINS = np.unique(np.round(np.geomspace(1, 10_000_000, 57)).astype(np.int64))


def pack_and_write_manifest(out_dir: Path, config: DataPrepConfig, files: list[InputFile], jobs: list[dict],
                            shards: list[dict], dedup: dict, tok: dict, finals: list[dict],
                            sft_train: list[dict], sft_eval: list[dict], demo: bool) -> dict:
    row_len = config.seq_len + 1
    dtype = token_dtype(tok["vocab_size"])
    n = len(jobs)
    splits = {split: pack_split(out_dir, split, [shard_files(out_dir, i)[split] for i in range(n)],
                                row_len, dtype) for split in ("train", "val")}
    for name, split in splits.items():
        split["documents"] = sum(f["tokens"][name]["documents"] for f in finals)
        if split["rows"] == 0:
            total = sum(f["tokens"][s]["tokens"] for f in finals for s in ("train", "val"))
            raise ValueError(f"The {name} split has no full row of seq_len + 1 = {row_len} tokens "
                             f"({total} tokens in all kept documents). Add more input data or "
                             "lower DataPrepConfig.seq_len.")
    index_path = write_index(out_dir, {"dtype": dtype, "row_len": row_len, "seq_len": config.seq_len,
                                       "eos_id": tok["eos_id"], "splits": splits})

    hashes: dict[str, str] = {}
    for final in finals:
        hashes.update(final["sha256"])
    for split in splits.values():
        hashes.update({s["path"]: s["sha256"] for s in split["shards"]})
    small = [out_dir / "tokenizer.json", index_path, out_dir / "sft" / "train.jsonl", out_dir / "sft" / "eval.jsonl"]
    small += [Path(f.path) for f in files] if demo else []  # the demo corpus we wrote
    hashes.update({str(p.relative_to(out_dir)): sha256_file(p) for p in small})
    _remove_stale_outputs(out_dir, set(hashes))

    dropped: Counter = Counter()
    steps: dict[str, dict[str, int]] = {}
    for shard in shards:
        dropped.update(shard["dropped"])
        merge_stats(steps, shard["steps"])
    dedup_stats = dedup["stats"]
    dropped.update({"exact_duplicate": dedup_stats["exact_duplicates"],
                    "near_duplicate": dedup_stats["near_duplicates"]})
    steps["dedup"] = dedup_stats
    dropped = Counter({k: v for k, v in dropped.items() if v})
    counts = {"input_documents": sum(s["documents"] for s in shards),
              "kept_documents": sum(f["kept"] for f in finals),
              "dropped": dict(sorted(dropped.items()))}
    sources = []
    for source, pattern in enumerate(config.inputs or ["<demo corpus>"]):
        mine = [i for i, job in enumerate(jobs) if job["file"]["source"] == source]
        sources.append({
            "input": pattern, "files": len({jobs[i]["file"]["path"] for i in mine}),
            "weight": config.input_weights[source] if config.input_weights else 1.0,
            "documents_in": sum(shards[i]["documents"] for i in mine),
            "documents_kept": sum(finals[i]["kept"] for i in mine),
            "text_bytes": sum(shards[i]["text_bytes"] for i in mine),
            "train_documents": sum(finals[i]["tokens"]["train"]["documents"] for i in mine),
            "train_tokens": sum(finals[i]["tokens"]["train"]["tokens"] for i in mine),
            "unweighted_train_tokens": sum(finals[i]["tokens"]["train"]["unique_tokens"] for i in mine),
            "val_tokens": sum(finals[i]["tokens"]["val"]["tokens"] for i in mine)})
    listing = "".join(f"{path}\t{sha}\n" for path, sha in sorted(hashes.items()))
    manifest = {
        "config": to_dict(config),
        "tokenizer": "tokenizer.json",
        "tokenizer_sha256": hashes["tokenizer.json"],
        "vocab_size": tok["vocab_size"],
        "eos_id": tok["eos_id"],
        "dtype": dtype,
        "seq_len": config.seq_len,
        "row_len": row_len,
        "splits": splits,
        "sft": {"train": "sft/train.jsonl", "eval": "sft/eval.jsonl",
                "train_examples": len(sft_train), "eval_examples": len(sft_eval)},
        "counts": counts,
        "steps": steps,
        "sources": sources,
        "documents": {"files": sorted(p for p in hashes if p.startswith("documents/")),
                      "rows": counts["kept_documents"],
                      # each file's `inputs` entry: its mix weight, for tasks.train.seen's replay
                      "sources": {shard_files(out_dir, job["index"])["documents"].relative_to(out_dir)
                                  .as_posix(): job["file"]["source"] for job in jobs}},
        "dropped": {"files": sorted(p for p in hashes if p.startswith("dropped/")),
                    "rows": sum(dropped.values())},
        "length_histogram": {"bin_edges": LENGTH_BINS.tolist(),
                             "counts": np.sum([f["length_histogram"] for f in finals], axis=0).tolist()},
        "files": dict(sorted(hashes.items())),
        "content_hash": hashlib.sha256(listing.encode()).hexdigest(),
    }
    write_json(out_dir / "manifest.json", manifest)
    return manifest


def _remove_stale_outputs(out_dir: Path, keep: set[str]) -> None:
    """Files of an earlier attempt with more input files must not pass for part of this data set."""
    for folder in ("documents", "dropped", "tokens"):
        for path in (out_dir / folder).glob("*"):
            if path.is_file() and str(path.relative_to(out_dir)) not in keep:
                path.unlink()


def load_manifest(data_dir: str | Path) -> dict:
    """The manifest of a finished data prep; a clear error if the prep never completed."""
    path = Path(data_dir) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: data prep has not completed in {data_dir}.")
    return read_json(path)


def open_token_rows(data_dir: str | Path, split: str) -> list[np.memmap]:
    """Each token file of `split` as a read-only (rows, row_len) array, without loading it."""
    manifest = load_manifest(data_dir)
    return [np.memmap(Path(data_dir) / shard["path"], mode="r",
                      dtype=np.dtype(manifest["dtype"]).newbyteorder("<"),
                      shape=(shard["rows"], manifest["row_len"]))
            for shard in manifest["splits"][split]["shards"]]
