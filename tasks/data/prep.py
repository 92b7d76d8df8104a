"""Data prep: raw text -> filtered, redacted, deduplicated documents -> tokenized, packed shards.

    python -m tasks.data.prep --config CONFIG.json --result RESULT.json      (Airflow, any backend)
    python -m tasks.data.prep --input PATH [PATH ...] --output DIR [--config FILE] [--workers N]

Inputs (DataPrepConfig.inputs): JSONL, Parquet or text files, directories or globs, local or
s3://; each entry is a *source* with an optional mix weight (input_weights). A shard, the unit of
parallelism and of restart, is an input file, or one split of a file larger than split_bytes
(readers.plan_splits: byte ranges of JSONL and text, row groups of Parquet). What a run will do,
its shards, engine and dedup buckets, is planned in tasks/data/planning.py; this module is the
driver (`prepare`), the per-shard and global steps it runs, and the command line.

Stages (the order they run in; [shard] stages are shared-nothing, one task per shard):

  1 [shard]  parse -> binary-junk check -> normalize (NFC, whitespace, control characters) ->
             min length -> quality filters (Gopher repetition, Gopher quality, C4, FineWeb, at the
             published thresholds) -> blocklist -> PII redaction -> content hash + MinHash LSH
             keys, written sorted (dedup.shard_index)
  2 [bucket] exact and near-duplicate pairs per key range, one task per bucket (dedup.bucket_pairs,
             reading only its slice of every shard's keys); then one process joins the pairs
             into clusters (dedup.resolve_pairs): no process holds every document's keys
  3 [shard]  the train/validation split (seeded hash of the id) and the tokenizer's sample: each
             shard reports the few documents below a cut that the plan could pick
             (split.shard_candidates); one process merges them
    global   tokenizer: byte-level BPE trained on that seeded sample of training documents, or
             DataPrepConfig.tokenizer_path
  4 [shard]  documents/ and dropped/ written; documents tokenized into per-shard token streams
             (training documents repeated or sampled by their source's mix weight)
  5 global   the streams cut into rows of seq_len + 1 tokens; manifest.json written last
             (tasks/data/manifest.py, which also reads a finished data set: load_manifest,
             open_token_rows)

What lands in the output directory:

    documents/NNNNN.parquet       kept documents: id, text (normalized, redacted), source (input
                                  file), line, split (train | val), metadata (JSON of other fields)
    dropped/NNNNN.parquet         one row per dropped document: id, source, line, step, reason,
                                  duplicate_of (the kept document, for duplicates), detail
    tokenizer.json                byte-level BPE; <|endoftext|> is id 0 when trained here
    tokens/train_NNNNN.bin ...    little-endian rows of seq_len + 1 tokens (uint16 or uint32)
    tokens/index.json             dtype, row_len, eos_id and the token files of each split
    sft/train.jsonl, eval.jsonl   the instruction set for fine-tuning and evaluation
    raw/demo_*.jsonl              the demo corpus, written when `inputs` is empty
    completions/*.json            markers of finished steps; a rerun after a crash skips them
                                  (tasks/data/markers.py)
    staging/                      intermediate per-shard files; removed once the manifest exists
    ngrams/                       the contamination audit's index of the training text's 13-word
                                  runs (tasks/data/contamination.py), built after the manifest
                                  from what it lists (derived, so not in its content_hash; its
                                  index.json names the content_hash it was built from)
    manifest.json                 written last: the data set is complete once it exists. Holds
                                  the config, tokenizer hash, per-step counts and drop reasons,
                                  per-source counts and tokens, tokens per split, the sha256 of
                                  every output file and their combined content_hash.

Every input document ends up in exactly one of documents/ and dropped/.

Restart: every file is written to a temporary name and renamed; a step's completion marker is
written after its files. A rerun skips shards whose marker matches the input file's fingerprint
(size and mtime, or S3 ETag) and global steps whose inputs are unchanged, so a crash loses only the
shards in flight. A rerun after the manifest exists is a no-op; one with a different config
(engine and workers aside) is refused.

Engines (DataPrepConfig.engine): `auto` (by input size: in this process, `workers`
processes, or Ray Data on the cluster at RAY_ADDRESS; planning.choose_engine, which logs why), `processes`,
`ray` (Ray Data, local with `workers` CPUs, or the cluster at RAY_ADDRESS) or `local` (in this
process). Shards, dedup buckets and the documents-and-tokens step run on it.

SageMaker Processing (one container per instance) -- the contract for a backend:

  * Job 1, N instances, each runs `python -m tasks.data.prep --config C --result R --stage shards`
    with the same config. Instance `rank` of N (from /opt/ml/config/resourceconfig.json, or the
    DATA_PREP_HOST_RANK / DATA_PREP_NUM_HOSTS environment variables, which win when set) processes
    the shards with index % N == rank, and writes only staging/NNNNN.* and completions/shard_NNNNN.json
    (and completions/config.json, identical on every host) under output_dir. Inputs should be
    s3:// URIs (read directly with boto3) or a ProcessingInput mounted at the same local path on
    every instance; output_dir is a local path such as /opt/ml/processing/output/data, uploaded by
    a ProcessingOutput to one S3 prefix shared by all instances (file names never collide).
  * Job 2, 1 instance, runs the same command with `--stage finalize`, output_dir holding that S3
    prefix (a ProcessingInput downloaded to output_dir, and a ProcessingOutput uploading it back).
    It checks that every shard's marker is there (or fails naming the missing ones), then runs
    stages 2-5 (the dedup buckets and the per-shard stage 4 on its own engine's workers) and
    writes manifest.json. Its result file is the one Airflow reads.
  * `--stage all` (the default) does both on one machine. The stage may also come from the
    DATA_PREP_STAGE environment variable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np

from tasks.common.io import atomic_write, read_json, sha256_file, write_json
from tasks.configs import ConfigError, DataPrepConfig, from_dict, to_dict
from tasks.data import prep_report as report
from tasks.data.manifest import LENGTH_BINS, pack_and_write_manifest
from tasks.data.markers import DROPPED_COLUMNS, digest, finished, mark_finished, read_table, schemas, \
    shard_files, write_table
from tasks.data.planning import choose_engine, dedup_buckets, output_fields, set_line_bases, shard_jobs, \
    write_dedup_plan
from tasks.data.split import SplitCuts, SplitPlan, mix_repeats, plan_by_shard, shard_candidates, split_score
from tasks.data.readers import InputFile, default_id, dropped_record, fingerprint, read_bytes, \
    read_shard, resolve_inputs
from tasks.data.pipeline import build_pipeline
from tasks.data.steps import normalize_text, run_batch
from tasks.data.tokens import EOS, EOS_ID, check_tokenizer, encode_stream, load_tokenizer, token_dtype, \
    train_tokenizer
from tasks.data.tokens import declared_eos

if TYPE_CHECKING:
    from tasks.data.contamination import MapJobs

__all__ = ["EOS", "EOS_ID", "normalize_text", "prepare", "main", "Prepared"]

log = logging.getLogger(__name__)

STAGES = ("all", "shards", "finalize")
# The phases each stage reports progress by (prepare's `lap`).
_ALL_PHASES = ("plan", "shards", "dedup", "tokenizer", "documents_and_tokens", "pack_and_manifest",
               "contamination_index")
PHASES = {"all": _ALL_PHASES, "finalize": _ALL_PHASES, "shards": ("plan", "shards")}


# --------------------------------------------------------------------------------------------
# Stage 1 (per shard): parse, clean, filter, redact, hash.


STEP_BATCH = 256  # documents the steps see at once: enough to spread numpy's per-call cost


def process_shard(job: dict) -> dict:
    """Read one input file (or one split of it) and run every document through the steps; write
    the survivors, the sorted indexes of their content hashes and LSH keys (dedup.shard_index),
    and the dropped records; then the shard's marker. Touches only this shard's files, so it runs
    anywhere (Ray worker, SageMaker host, this process)."""
    from tasks.data.dedup import MinHasher, content_hash, hashes_to_array, shard_index

    started = time.perf_counter()
    config = from_dict(DataPrepConfig, job["config"])
    out_dir, index, file = Path(job["out_dir"]), job["index"], InputFile(**job["file"])
    paths = shard_files(out_dir, index)
    steps = build_pipeline(config)
    hasher = MinHasher(config.minhash_ngram, config.minhash_bands, config.minhash_rows,
                       seed=config.seed) if config.near_dedup else None
    kept: dict[str, list] = {"id": [], "text": [], "line": [], "metadata": []}
    hashes: list[bytes] = []
    keys: list[np.ndarray] = []
    dropped: list[dict] = []
    parse = Counter()
    n_documents = n_bytes = 0
    shard = read_shard(file, job["split"], config.text_field, config.id_field, job["fingerprint"]["size"])

    def run(items: list) -> None:
        """The steps over a batch of documents, then every item recorded in input order."""
        docs = [item for item in items if not isinstance(item, dict)]
        drops = iter(run_batch(steps, docs))
        survivors = []
        for item in items:
            if isinstance(item, dict):
                parse[f"dropped.{item['reason']}"] += 1
                dropped.append(item)
            elif (drop := next(drops)) is not None:
                dropped.append(dropped_record(item.id, item.line, *drop))
            else:
                survivors.append(item)
        for doc in survivors:
            kept["id"].append(doc.id)
            kept["text"].append(doc.text)
            kept["line"].append(doc.line)
            kept["metadata"].append(json.dumps(doc.metadata, ensure_ascii=False, default=str)
                                    if doc.metadata else None)
            hashes.append(content_hash(doc.text))
        if hasher is not None and survivors:
            keys.append(hasher.band_keys_batch([doc.text for doc in survivors]))

    batch: list = []
    in_batch = 0
    for item in shard.documents:
        n_documents += 1
        batch.append(item)
        if not isinstance(item, dict):
            n_bytes += len(item.text.encode("utf-8"))
            in_batch += 1
            if in_batch == STEP_BATCH:
                run(batch)
                batch, in_batch = [], 0
    run(batch)
    parse["in"], parse["kept"] = n_documents, n_documents - sum(parse.values())

    table_schemas = schemas()
    write_table(paths["docs"], kept, table_schemas["staging"])
    band_keys = np.concatenate(keys) if keys else \
        np.zeros((len(kept["id"]), config.minhash_bands if hasher else 0), dtype=np.uint64)
    exact, near, band_starts = shard_index(hashes_to_array(hashes), band_keys)
    atomic_write(paths["exact"], lambda fh: np.save(fh, exact))
    atomic_write(paths["near"], lambda fh: np.save(fh, near))
    write_table(paths["dropped"], _dropped_columns(dropped, file.path), table_schemas["dropped"])
    reasons = Counter(r["reason"] for r in dropped)
    summary = {"input": job["fingerprint"], "split": job["split"], "documents": n_documents,
               "kept": len(kept["id"]), "lines": shard.lines, "band_starts": band_starts,
               "text_bytes": n_bytes, "dropped": dict(reasons),
               "steps": {"parse": dict(parse), **{s.name: dict(s.stats) for s in steps}},
               "seconds": round(time.perf_counter() - started, 3)}
    mark_finished(out_dir, f"shard_{index:05d}", job["key"],
                   [paths["docs"], paths["exact"], paths["near"], paths["dropped"]], **summary)
    return summary


def _dropped_columns(records: list[dict], source: str) -> dict[str, list]:
    columns: dict[str, list] = {name: [] for name in DROPPED_COLUMNS}
    for record in records:
        columns["id"].append(record["id"])
        columns["source"].append(source)
        columns["line"].append(record.get("line", 0))
        columns["step"].append(record["step"])
        columns["reason"].append(record["reason"])
        columns["duplicate_of"].append(record.get("duplicate_of"))
        columns["detail"].append(record.get("error"))
    return columns


# --------------------------------------------------------------------------------------------
# Stage 2 (global): exact and near duplicates across all shards.


def dedup_bucket(job: dict) -> dict:
    """One bucket of the sharded dedup: its slice of every shard's sorted indexes (memory-mapped),
    the duplicate pairs within it, written to staging/dedup/BBBBB.npz."""
    from tasks.data.dedup import bucket_pairs

    started = time.perf_counter()
    out_dir, bucket = Path(job["out_dir"]), job["bucket"]
    plan = np.load(out_dir / "staging" / "dedup" / "plan.npy")
    empty = np.zeros((3, 0), np.uint64)
    shards = []
    for index, row in enumerate(plan):
        paths = shard_files(out_dir, index)
        shards.append((int(row[0]), np.load(paths["exact"], mmap_mode="r") if job["exact"] else empty,
                       np.load(paths["near"], mmap_mode="r") if job["bands"] else empty, row[1:].tolist()))
    exact, near = bucket_pairs(shards, bucket, job["buckets"], job["bands"])
    path = out_dir / "staging" / "dedup" / f"{bucket:05d}.npz"
    atomic_write(path, lambda fh: np.savez(fh, exact=exact, near=near))
    summary = {"exact_pairs": len(exact), "near_pairs": len(near), "seconds": round(time.perf_counter() - started, 3)}
    mark_finished(out_dir, f"dedup_{bucket:05d}", job["key"], [path], **summary)
    return summary


def deduplicate(out_dir: Path, jobs: list[dict], shards: list[dict], config: DataPrepConfig, key: str,
                engine: Any) -> dict:
    """Find duplicates among every shard's survivors, sharded by key range over the engine's
    workers (tasks/data/dedup.py); write staging/dedup.parquet with one row per duplicate (shard,
    row, reason, duplicate_of id). No process reads every document's keys."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.data.dedup import EXACT, resolve_pairs

    path = out_dir / "staging" / "dedup.parquet"
    if done := finished(out_dir, "dedup", key):
        return done
    bands = config.minhash_bands if config.near_dedup else 0
    buckets = dedup_buckets(config, shards) if (config.exact_dedup or bands) else 0
    offsets = write_dedup_plan(out_dir, shards, bands)
    bucket_key = digest(key, buckets)
    bucket_jobs = [{"out_dir": str(out_dir), "bucket": b, "buckets": buckets, "bands": bands,
                    "exact": config.exact_dedup, "key": bucket_key} for b in range(buckets)]
    todo = [j for j in bucket_jobs if not finished(out_dir, f"dedup_{j['bucket']:05d}", bucket_key)]
    log.info("dedup: %d documents, %d buckets (%d to do) over engine=%s", offsets[-1], buckets, len(todo),
             engine.name)
    engine.map(dedup_bucket, todo)
    exact_pairs, near_pairs = [np.zeros((0, 2), np.int64)], [np.zeros((0, 2), np.int64)]
    for b in range(buckets):
        with np.load(out_dir / "staging" / "dedup" / f"{b:05d}.npz") as pairs:
            exact_pairs.append(pairs["exact"])
            near_pairs.append(pairs["near"])
    removed, kept_of, kind, stats = resolve_pairs(int(offsets[-1]), np.concatenate(exact_pairs),
                                                  np.concatenate(near_pairs))
    shard_of = np.searchsorted(offsets, removed, side="right") - 1
    table = pa.table({
        "shard": pa.array(shard_of, type=pa.int32()),
        "row": pa.array(removed - offsets[shard_of], type=pa.int64()),
        "reason": pa.array(np.where(kind == EXACT, "exact_duplicate", "near_duplicate"), type=pa.string()),
        "duplicate_of": pa.array(_ids_at(out_dir, jobs, offsets, kept_of), type=pa.string()),
    })
    atomic_write(path, lambda fh: pq.write_table(table, fh))
    stats["kept"] = stats["in"] - int(removed.size)
    return mark_finished(out_dir, "dedup", key, [path], stats=stats)


def _staging_ids(job: dict, table: Any) -> tuple[list[str], list[int]]:
    """Ids and file lines of a staging table's rows (documents or dropped records): rows without
    an id of their own are named by file and line once the split's line_base is known."""
    label, base = job["file"]["label"], job["line_base"]
    lines = [line + base if line else line for line in table.column("line").to_pylist()]
    return [default_id(i, label, line) for i, line in zip(table.column("id").to_pylist(), lines)], lines


def _ids_at(out_dir: Path, jobs: list[dict], offsets: np.ndarray, documents: np.ndarray) -> list[str]:
    """The ids of the given documents (global indices), reading one shard's id column at a time."""
    shard_of = np.searchsorted(offsets, documents, side="right") - 1
    found: dict[int, str] = {}
    for index in np.unique(shard_of).tolist():
        table = read_table(shard_files(out_dir, index)["docs"], columns=["id", "line"])
        ids, _ = _staging_ids(jobs[index], table)
        for doc in documents[shard_of == index].tolist():
            found[doc] = ids[doc - int(offsets[index])]
    return [found[doc] for doc in documents.tolist()]


# --------------------------------------------------------------------------------------------
# Stage 3: the split (its candidates by shard, merged here), then the tokenizer (global).


def split_candidates(job: dict) -> dict:
    """One shard's part of the split plan (tasks.data.split.shard_candidates) from its documents
    that survived deduplication: a job per shard, so no one process hashes every kept id."""
    config = from_dict(DataPrepConfig, job["config"])
    out_dir, index = Path(job["out_dir"]), job["index"]
    gone = set(_removed(out_dir, index, ["row"])["row"])
    ids, _ = _staging_ids(job, read_table(shard_files(out_dir, index)["docs"], columns=["id", "line"]))
    kept = ((index, row, doc_id) for row, doc_id in enumerate(ids) if row not in gone)
    return shard_candidates(kept, config.seed, config.val_fraction, _sample_docs(config),
                            config.seq_len + 1, SplitCuts(**job["cuts"]))


def _sample_docs(config: DataPrepConfig) -> int:
    """The tokenizer's sample size: none when the tokenizer is given (tokenizer_path), so the
    shards neither hash nor report a sample that nothing reads."""
    return 0 if config.tokenizer_path else config.tokenizer_sample_docs


def _removed(out_dir: Path, index: int, columns: list[str]) -> dict[str, list]:
    """The given columns of staging/dedup.parquet for shard `index`: its documents that
    deduplication removed. The file is sorted by shard: only the row groups whose statistics
    can hold the shard are read, and its rows are one slice of them."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(out_dir / "staging" / "dedup.parquet")
    at = file.schema_arrow.get_field_index("shard")
    groups = []
    for group in range(file.num_row_groups):
        stats = file.metadata.row_group(group).column(at).statistics
        if stats is None or not stats.has_min_max or stats.min <= index <= stats.max:
            groups.append(group)
    table = file.read_row_groups(groups, columns=["shard", *columns])
    first, end = np.searchsorted(table.column("shard").to_numpy(), [index, index + 1])
    return table.slice(first, end - first).select(columns).to_pydict()


def plan_the_split(jobs: list[dict], config: DataPrepConfig, kept: int, map_jobs: MapJobs) -> SplitPlan:
    """The split plan of the `kept` documents: one job per shard (split_candidates), their few
    candidates merged here (tasks.data.split.plan_by_shard)."""
    return plan_by_shard(lambda cuts: map_jobs(split_candidates, [{**job, "cuts": asdict(cuts)} for job in jobs]),
                         kept, config.val_fraction, _sample_docs(config), config.seq_len + 1)


def _texts(out_dir: Path, documents: Iterable[tuple[int, int, str]]) -> Iterator[str]:
    """Texts of the given (shard, row, id) documents, in the order given, read as they are asked
    for (a caller that stops early reads no more). One shard's texts are held at a time:
    documents in shard order, as the sample and the validation documents are, read each shard once."""
    held, column = None, None
    for shard, row, _ in documents:
        if shard != held:
            held, column = shard, read_table(shard_files(out_dir, shard)["docs"], columns=["text"]).column("text")
        yield column[row].as_py()


def _token_counts(out_dir: Path, documents: Iterable[tuple[int, int, str]], tokenizer: Any) -> Iterator[int]:
    """Each document's tokens plus its end-of-text, in the order given, encoded as asked for."""
    for text in _texts(out_dir, documents):
        yield len(tokenizer.encode(text, add_special_tokens=False).ids) + 1


def tokenizer_and_split(out_dir: Path, jobs: list[dict], config: DataPrepConfig, sft_texts: list[str],
                        key: str, kept: int, map_jobs: MapJobs) -> dict:
    """Train (or load) the tokenizer; decide which documents are validation. Validation is every
    document whose split score is below val_fraction; when that holds less than one row of tokens
    (tiny inputs), the training documents with the lowest scores are lent to it until it fills one."""
    from tokenizers import Tokenizer

    path = out_dir / "tokenizer.json"
    if done := finished(out_dir, "tokenizer", key):
        return done
    row_len = config.seq_len + 1
    plan = plan_the_split(jobs, config, kept, map_jobs)
    if not plan.kept:
        reasons: Counter = Counter()
        for index in range(len(jobs)):
            reasons.update(read_json(out_dir / "completions" / f"shard_{index:05d}.json")["dropped"])
        raise ValueError(f"No documents left after filtering and deduplication (dropped: "
                         f"{dict(reasons.most_common())}); {out_dir}/staging/*.dropped.parquet says "
                         "why each was dropped. Check the inputs, or relax DataPrepConfig.filters.")

    if config.tokenizer_path:
        data = read_bytes(config.tokenizer_path)
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        eos_id = check_tokenizer(tokenizer, config.tokenizer_path,
                                 declared_eos(config.tokenizer_path, read_bytes))
        atomic_write(path, lambda fh: fh.write(data))
    else:
        texts = [*_texts(out_dir, plan.sample), *sft_texts]
        # SFT text is in the tokenizer's training text so every character of the task has tokens;
        # it never enters the pretraining rows (the pretrained model must not see the task).
        tokenizer = train_tokenizer(texts, config.vocab_size, length=len(texts))
        eos_id = EOS_ID
        atomic_write(path, lambda fh: fh.write(tokenizer.to_str(pretty=True).encode()))

    borrowed: list[str] = []
    if plan.val is not None:  # fewer documents than tokens in a row: count the tokens
        # ... only until they fill a row: past that nothing is lent, and the count is not kept.
        # (Counting every one read every shard's text and encoded it here, one process: 0.25 s
        # of a 2-worker run at 48 MB.)
        val_tokens = 0
        for count in _token_counts(out_dir, plan.val, tokenizer):
            val_tokens += count
            if val_tokens >= row_len:
                break
        train_left = plan.train
        lent_tokens = _token_counts(out_dir, plan.lendable, tokenizer)
        for doc in plan.lendable:
            if val_tokens >= row_len or train_left <= 1:
                break
            train_left -= 1
            borrowed.append(doc[2])
            val_tokens += next(lent_tokens)
    return mark_finished(out_dir, "tokenizer", key, [path], eos_id=eos_id, borrowed=borrowed,
                          vocab_size=tokenizer.get_vocab_size(), kept_documents=plan.kept)


# --------------------------------------------------------------------------------------------
# Stage 4 (per shard): documents/, dropped/, token streams.


def finalize_shard(job: dict) -> dict:
    started = time.perf_counter()
    config = from_dict(DataPrepConfig, job["config"])
    out_dir, index, file = Path(job["out_dir"]), job["index"], InputFile(**job["file"])
    paths = shard_files(out_dir, index)
    table = read_table(paths["docs"])
    docs = table.to_pydict()
    docs["id"], docs["line"] = _staging_ids(job, table)
    removed = _removed(out_dir, index, ["row", "reason", "duplicate_of"])
    gone = dict(zip(removed["row"], zip(removed["reason"], removed["duplicate_of"])))
    borrowed = set(job["borrowed"])

    def split_of(doc_id: str) -> str:
        return "val" if split_score(doc_id, config.seed) < config.val_fraction or doc_id in borrowed \
            else "train"

    rows = [r for r in range(len(docs["id"])) if r not in gone]
    splits = [split_of(docs["id"][r]) for r in rows]
    table_schemas = schemas()
    documents_sha = write_table(paths["documents"], {
        "id": [docs["id"][r] for r in rows], "text": [docs["text"][r] for r in rows],
        "source": [file.path] * len(rows), "line": [docs["line"][r] for r in rows],
        "split": splits, "metadata": [docs["metadata"][r] for r in rows]}, table_schemas["documents"])
    table = read_table(paths["dropped"])
    dropped = table.to_pydict()
    dropped["id"], dropped["line"] = _staging_ids(job, table)
    for row, (reason, duplicate_of) in sorted(gone.items()):
        for name, value in (("id", docs["id"][row]), ("source", file.path), ("line", docs["line"][row]),
                            ("step", "dedup"), ("reason", reason), ("duplicate_of", duplicate_of),
                            ("detail", None)):
            dropped[name].append(value)
    dropped_sha = write_table(paths["dropped_out"], dropped, table_schemas["dropped"])

    # Documents in split-score order: a seeded shuffle, so rows mix documents from the whole file.
    tokenizer = load_tokenizer(out_dir / "tokenizer.json")
    dtype = token_dtype(tokenizer.get_vocab_size())
    order = sorted(zip(rows, splits), key=lambda rs: split_score(docs["id"][rs[0]], config.seed))
    weight = config.input_weights[file.source] if config.input_weights else 1.0
    tokens = {}
    for split in ("train", "val"):
        chosen = [r for r, s in order if s == split]
        # Mix weights shape the training mixture only; validation keeps the natural distribution.
        repeats = [mix_repeats(docs["id"][r], weight, config.seed) for r in chosen] if split == "train" else None
        stream, lengths = encode_stream(tokenizer, [docs["text"][r] for r in chosen], job["eos_id"], dtype, repeats)
        atomic_write(paths[split], lambda fh, s=stream: fh.write(s.tobytes()))
        tokens[split] = {"documents": len(chosen), "tokens": int(stream.size),
                         "unique_tokens": int(sum(lengths))}
    lengths = np.array([len(docs["text"][r]) for r in rows], dtype=np.int64)
    summary = {"kept": len(rows), "dropped": len(dropped["id"]), "tokens": tokens,
               "length_histogram": np.histogram(lengths, bins=LENGTH_BINS)[0].tolist(),
               "sha256": {str(paths["documents"].relative_to(out_dir)): documents_sha,
                          str(paths["dropped_out"].relative_to(out_dir)): dropped_sha},
               "seconds": round(time.perf_counter() - started, 3)}
    mark_finished(out_dir, f"final_{index:05d}", job["key"],
                   [paths["documents"], paths["dropped_out"], paths["train"], paths["val"]], **summary)
    return summary


# --------------------------------------------------------------------------------------------
# Inputs that are not the user's: the demo corpus and the instruction set.


def _demo_corpus(config: DataPrepConfig, out_dir: Path) -> list[str]:
    from tasks.data.corpus import write_demo_corpus

    key = digest(config.demo_corpus_docs, config.seed)
    if done := finished(out_dir, "raw", key):
        return [str(out_dir / f) for f in done["files"]]
    paths = write_demo_corpus(out_dir / "raw", config.demo_corpus_docs, config.seed)
    mark_finished(out_dir, "raw", key, paths)
    return [str(p) for p in paths]


def _sft_set(config: DataPrepConfig, out_dir: Path) -> tuple[list[dict], list[dict]]:
    """Write sft/train.jsonl and sft/eval.jsonl (demo task, or the given files checked)."""
    from tasks.data.instructions import load_examples, write_demo_sft, write_examples

    train_path, eval_path = out_dir / "sft" / "train.jsonl", out_dir / "sft" / "eval.jsonl"
    key = digest(config.demo_sft_examples, config.seed, [fingerprint(os.path.abspath(p)) for p in config.sft_inputs])
    if not finished(out_dir, "sft", key):
        if config.sft_inputs:
            train, evaluation = (load_examples(p) for p in config.sft_inputs)
            leaked = {ex["prompt"] for ex in train} & {ex["prompt"] for ex in evaluation}
            if leaked:
                raise ValueError(f"DataPrepConfig.sft_inputs: {len(leaked)} eval prompt(s) also appear "
                                 f"in train (e.g. {sorted(leaked)[0]!r}); remove them from one side "
                                 "so the eval measures the skill, not recall.")
            write_examples(train_path, train)
            write_examples(eval_path, evaluation)
        else:
            write_demo_sft(out_dir / "sft", config.demo_sft_examples, config.seed)
        mark_finished(out_dir, "sft", key, [train_path, eval_path])
    return load_examples(train_path), load_examples(eval_path)


# --------------------------------------------------------------------------------------------
# The stage


@dataclass
class Prepared:
    manifest: dict
    reused: bool
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per stage, this run
    engine: str = ""  # the engine this run used, and why (choose_engine)
    engine_reason: str = ""


def _reuse_or_reset(out_dir: Path, config: DataPrepConfig) -> dict | None:
    """The existing manifest if this config already completed here. Otherwise clear the markers
    of a crashed run made with a different config, so none of its steps is mistaken for done."""
    wanted = output_fields(to_dict(config))
    manifest_path = out_dir / "manifest.json"
    if manifest_path.exists():
        manifest = read_json(manifest_path)
        if output_fields(manifest["config"]) == wanted:
            return manifest
        differ = sorted(k for k in wanted if manifest["config"].get(k) != wanted[k])
        raise ValueError(f"{out_dir} already holds data prepared with a different config "
                         f"(fields {differ} differ). Use a new output_dir or delete this one.")
    config_marker = out_dir / "completions" / "config.json"
    if config_marker.exists() and read_json(config_marker) != wanted:
        shutil.rmtree(out_dir / "completions")
    write_json(config_marker, wanted)
    return None


def _remove_temporaries(out_dir: Path) -> None:
    """Temporary files a killed run left behind (atomic_write's `.name.*.tmp`)."""
    for tmp in out_dir.rglob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def prepare(config: DataPrepConfig, stage: str = "all") -> Prepared:
    """Run (or resume, or reuse) data prep into config.output_dir and return its manifest.
    `stage` is "all", or "shards" / "finalize" for the two SageMaker jobs (module docstring)."""
    from tasks.data.contamination import build_index as build_contamination_index
    from tasks.data.engine import host_share, open_engine

    if stage not in STAGES:
        raise ValueError(f"Unknown data prep stage {stage!r}; use one of {list(STAGES)}.")
    build_pipeline(config)  # refuse bad filter settings before any work
    out_dir = Path(config.output_dir)
    existing = _reuse_or_reset(out_dir, config)
    if existing is not None:
        log.info("%s is complete for this config; nothing to do", out_dir)
        if stage != "shards":
            build_contamination_index(out_dir)   # kept when built; made when a crash left none
        return Prepared(existing, reused=True)
    if stage != "shards":
        _remove_temporaries(out_dir)
    from tasks.train.telemetry import Progress

    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    phases = PHASES[stage]
    progress = Progress(len(phases))

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = round(now - clock, 3)
        clock = now
        done = phases.index(name) + 1
        log.info("data prep phase %d/%d %s done in %.1fs | %s", done, len(phases), name,
                 seconds[name], progress.line(done))

    if config.inputs:
        files = resolve_inputs(config.inputs)
    else:  # the demo corpus is one source, its files labelled by name
        files = [InputFile(p, 0, Path(p).name) for p in _demo_corpus(config, out_dir)]
    sft_train, sft_eval = _sft_set(config, out_dir)
    jobs, todo = shard_jobs(config, out_dir, files, trust_markers=stage == "finalize")
    if stage == "shards":
        rank, hosts = host_share()
        todo = [job for job in todo if job["index"] % hosts == rank]
    # What this run reads: its shards, or (all, finalize) every shard again for documents and tokens.
    engine_name, why = choose_engine(config, sum(j["bytes"] for j in (todo if stage == "shards" else jobs)))
    log.info("data prep engine: %s (%s)", engine_name, why)
    lap("plan")

    with open_engine(engine_name, config.workers) as engine:
        if stage == "shards":
            mine = todo
            log.info("host %d of %d: %d of %d shards to process", rank, hosts, len(mine), len(jobs))
            summaries = engine.map(process_shard, mine)
            lap("shards")
            return Prepared({"shards_processed": len(mine), "shards_total": len(jobs),
                             "host": [rank, hosts],
                             "documents": sum(s["documents"] for s in summaries)}, False, seconds,
                            engine_name, why)
        if stage == "finalize" and todo:
            missing = [f"{j['index']:05d} ({j['file']['path']})" for j in todo]
            raise RuntimeError(f"{len(todo)} shard(s) have no completion marker in {out_dir}/completions: "
                               f"{missing[:10]}. Rerun the shards job for them, or use --stage all.")
        log.info("%d input shards, %d to process with engine=%s", len(jobs), len(todo), engine.name)
        engine.map(process_shard, todo)
        shards = [read_json(out_dir / "completions" / f"shard_{j['index']:05d}.json") for j in jobs]
        set_line_bases(jobs, shards)
        lap("shards")

        dedup_key = digest([s["key"] for s in shards], config.exact_dedup, config.near_dedup)
        dedup = deduplicate(out_dir, jobs, shards, config, dedup_key, engine)
        lap("dedup")

        sft_texts = [ex["prompt"] + ex["completion"] for ex in sft_train]
        tok_key = digest(dedup_key, config.tokenizer_path, config.tokenizer_sample_docs,
                         hashlib.sha256("\0".join(sft_texts).encode()).hexdigest())
        tok = tokenizer_and_split(out_dir, jobs, config, sft_texts, tok_key, dedup["stats"]["kept"], engine.map)
        lap("tokenizer")

        final_key = digest(tok_key, sha256_file(out_dir / "tokenizer.json"), tok["borrowed"])
        final_jobs = [{**job, "key": final_key, "borrowed": tok["borrowed"], "eos_id": tok["eos_id"]}
                      for job in jobs]
        engine.map(finalize_shard, [j for j in final_jobs
                                    if not finished(out_dir, f"final_{j['index']:05d}", final_key)])
        finals = [read_json(out_dir / "completions" / f"final_{j['index']:05d}.json") for j in jobs]
        lap("documents_and_tokens")

        manifest = pack_and_write_manifest(out_dir, config, files, jobs, shards, dedup, tok, finals,
                                           sft_train, sft_eval, demo=not config.inputs)
        lap("pack_and_manifest")
        # evaluation's audit: which items training text holds; one map job per documents file
        build_contamination_index(out_dir, map_jobs=engine.map)
        lap("contamination_index")
    shutil.rmtree(out_dir / "staging", ignore_errors=True)
    return Prepared(manifest, reused=False, seconds=seconds, engine=engine_name, engine_reason=why)


# --------------------------------------------------------------------------------------------
# The entrypoints (the MLflow report: tasks/data/prep_report.py)


def main(config: DataPrepConfig, stage: str = "all") -> dict[str, Any]:
    """Prepare and log to the stage's MLflow run (the one in MLFLOW_RUN_ID, or a new one)."""
    from tasks.common.job_tracking import stage_run

    out_dir = Path(config.output_dir)
    if stage == "shards":  # one of several hosts: the finalize job logs the data set
        prepared = prepare(config, stage)
        return {"outputs": {"data_dir": str(out_dir), "manifest": ""},
                "metrics": prepared.manifest, "data_hash": ""}
    started = time.time()
    with stage_run("data_prep", config):
        prepared = prepare(config, stage)
        metrics = report.log_run(prepared, started)
    return {"outputs": {"data_dir": str(out_dir), "manifest": str(out_dir / "manifest.json")},
            "metrics": metrics, "data_hash": prepared.manifest["content_hash"]}


def _run_without_tracking(config: DataPrepConfig, stage: str) -> dict[str, Any]:
    """The CLI outside Airflow with no MLflow configured: prepare and report, no tracking store."""
    prepared = prepare(config, stage)
    out_dir = Path(config.output_dir)
    if stage == "shards":
        return {"outputs": {"data_dir": str(out_dir), "manifest": ""}, "metrics": prepared.manifest,
                "data_hash": ""}
    return {"outputs": {"data_dir": str(out_dir), "manifest": str(out_dir / "manifest.json")},
            "metrics": {**report.metrics(prepared.manifest), **{f"seconds.{k}": v for k, v in prepared.seconds.items()}},
            "data_hash": prepared.manifest["content_hash"], "engine": prepared.engine}


def cli(argv: list[str] | None = None) -> None:
    from tasks.common.entry import run_stage

    parser = argparse.ArgumentParser(
        prog="python -m tasks.data.prep",
        description="Either --config FILE --result FILE (the stage contract), or --input PATH... "
                    "--output DIR (standalone; --config then supplies the other settings).")
    parser.add_argument("--input", nargs="+", metavar="PATH", help="Input files, dirs or globs (local or s3://).")
    parser.add_argument("--output", metavar="DIR", help="Output directory.")
    parser.add_argument("--config", help="DataPrepConfig JSON file.")
    parser.add_argument("--result", help="Where to write the result JSON.")
    parser.add_argument("--workers", type=int, help="Parallel shard workers (overrides the config).")
    parser.add_argument("--stage", choices=STAGES, default=os.environ.get("DATA_PREP_STAGE", "all"),
                        help="all (default), or shards / finalize for multi-host runs.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    standalone = args.input is not None or args.output is not None
    try:
        data = read_json(args.config) if args.config else {}
        if standalone:
            if not args.input or not args.output:
                parser.error("--input and --output go together (or use --config and --result).")
            data = {**data, "inputs": args.input, "output_dir": args.output}
        elif not (args.config and args.result):
            parser.error("give --config and --result, or --input and --output.")
        if args.workers is not None:
            data["workers"] = args.workers
        config = from_dict(DataPrepConfig, data)
        build_pipeline(config)  # filter names and thresholds, before any work
    except (ConfigError, OSError, ValueError) as exc:
        log.error("invalid data prep config: %s", exc)
        sys.exit(2)
    if not standalone and args.workers is None:
        # The stage contract: the shared entry point validates, runs and writes the result.
        run_stage("data.prep", DataPrepConfig, lambda cfg: main(cfg, args.stage),
                  ["--config", args.config, "--result", args.result])
        return
    started = time.time()
    tracked = os.environ.get("MLFLOW_TRACKING_URI") or os.environ.get("MLFLOW_RUN_ID")
    result = main(config, args.stage) if tracked else _run_without_tracking(config, args.stage)
    result.update(stage="data.prep", seconds=round(time.time() - started, 3))
    if args.result:
        write_json(args.result, result)
    print(json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    cli()
