"""Data prep: raw text -> normalized, exact-deduplicated, tokenized, packed train/val shards.

    python -m tasks.data.prep --config CONFIG.json --result RESULT.json

Each input file is one shard, processed with no coordination (parse, normalize, filter, hash)
as a Ray task or in-process; then one global step deduplicates, splits, trains the tokenizer and
packs tokens. What lands in `output_dir`:

    raw/demo_*.jsonl              the demo corpus, written when `inputs` is empty
    sft/train.jsonl, eval.jsonl   the instruction set for fine-tuning and evaluation
    shards/00000.docs.jsonl       per input file: kept documents, normalized, with content hash
    shards/00000.dropped.jsonl    per input file: {id, step, reason} of every document dropped
    dropped.jsonl                 every dropped document, exact duplicates included
    tokenizer.json                byte-level BPE; <|endoftext|> is id 0
    tokens/train_00000.bin ...    little-endian rows of seq_len + 1 tokens
    completions/*.json            markers of finished steps; a rerun after a crash skips them
    manifest.json                 written last: the data set is complete once it exists
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from tasks.common.io import atomic_write, read_json, sha256_file, write_json
from tasks.configs import DataPrepConfig, to_dict

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
EOS_ID = 0  # the tokenizer's first special token; train_tokenizer checks it
MAX_TOKENS_PER_SHARD = 1 << 27  # 256 MiB of uint16 per token file
# Config fields that change how the work is spread, not what is written.
LAYOUT_ONLY_FIELDS = ("engine", "workers")


# --------------------------------------------------------------------------------------------
# Per-shard work: parse, then a plain list of steps, each able to drop a document with a reason.


@dataclass
class Doc:
    id: str
    text: str
    line: int  # 1-based line where the document starts in its input file
    hash: str = ""


def dropped_record(doc_id: str, line: int, step: str, reason: str, **extra: Any) -> dict:
    return {"id": doc_id, "line": line, "step": step, "reason": reason, **extra}


_HORIZONTAL_SPACE = re.compile(r"[^\S\n]+")  # any whitespace but newline, Unicode spaces too
_CONTROL_CHARS = dict.fromkeys([*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)])


def normalize_text(text: str) -> str:
    """NFC, one space for any run of spaces, at most one blank line, no control characters."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    # Whitespace controls (tab, form feed) become spaces first, so words they separate stay apart.
    text = _HORIZONTAL_SPACE.sub(" ", text).translate(_CONTROL_CHARS)
    text = re.sub(r" ?\n ?", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def normalize(doc: Doc, config: DataPrepConfig) -> str | None:
    doc.text = normalize_text(doc.text)
    return None if doc.text else "empty_after_normalize"


def drop_short(doc: Doc, config: DataPrepConfig) -> str | None:
    return "too_short" if len(doc.text) < config.min_chars else None


def add_content_hash(doc: Doc, config: DataPrepConfig) -> str | None:
    doc.hash = hashlib.sha256(doc.text.encode()).hexdigest()
    return None


# Run in order on every parsed document; the first reason returned drops it. Quality filters
# and near-duplicate signatures are added here as more small functions.
SHARD_STEPS: list[Callable[[Doc, DataPrepConfig], str | None]] = [normalize, drop_short,
                                                                  add_content_hash]


def _parse_jsonl_line(raw: bytes, line: int, default_id: str) -> Doc | dict:
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return dropped_record(default_id, line, "parse", "invalid_utf8")
    except json.JSONDecodeError:
        return dropped_record(default_id, line, "parse", "malformed_json")
    if not isinstance(record, dict):
        return dropped_record(default_id, line, "parse", "not_an_object")
    doc_id = str(record["id"]) if record.get("id") is not None else default_id
    text = record.get("text")
    if text is None:
        return dropped_record(doc_id, line, "parse", "missing_text")
    if not isinstance(text, str):
        return dropped_record(doc_id, line, "parse", "non_string_text")
    if not text.strip():
        return dropped_record(doc_id, line, "parse", "empty_text")
    return Doc(doc_id, text, line)


def read_documents(path: Path) -> Iterator[Doc | dict]:
    """Yield each document of a JSONL or text file, or a dropped record where one is unreadable.

    Text files hold one document per block of lines separated by blank lines. Bytes are decoded
    per document, so one bad byte sequence costs one document, not the file.
    """
    data = path.read_bytes()
    if not data.strip():
        yield dropped_record(path.name, 0, "parse", "empty_file")
        return
    lines = data.split(b"\n")
    if path.suffix in (".jsonl", ".json"):
        for line_no, raw in enumerate(lines, 1):
            if raw.strip():  # blank lines separate nothing in JSONL; they are not records
                yield _parse_jsonl_line(raw, line_no, f"{path.name}:{line_no}")
        return
    block: list[bytes] = []
    for line_no, raw in enumerate([*lines, b""], 1):
        if raw.strip():
            block.append(raw)
            continue
        if block:
            start = line_no - len(block)
            try:
                yield Doc(f"{path.name}:{start}", b"\n".join(block).decode("utf-8"), start)
            except UnicodeDecodeError:
                yield dropped_record(f"{path.name}:{start}", start, "parse", "invalid_utf8")
            block = []


def _jsonl_bytes(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def shard_paths(out_dir: Path, index: int) -> tuple[Path, Path, Path]:
    """(kept docs, dropped records, completion marker) of input shard `index`."""
    return (out_dir / "shards" / f"{index:05d}.docs.jsonl",
            out_dir / "shards" / f"{index:05d}.dropped.jsonl",
            out_dir / "completions" / f"shard_{index:05d}.json")


def input_fingerprint(path: str) -> dict:
    """Enough to notice that an input changed between a crashed run and its rerun."""
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def process_shard(index: int, path: str, out_dir: str, config: DataPrepConfig) -> dict:
    """Parse, normalize and filter one input file; write its kept and dropped records, then a
    completion marker. Runs anywhere (Ray worker or in-process): it touches only its own files."""
    docs_path, dropped_path, marker = shard_paths(Path(out_dir), index)
    kept: list[dict] = []
    dropped: list[dict] = []
    n_documents = 0
    for item in read_documents(Path(path)):
        n_documents += 1
        if isinstance(item, dict):
            dropped.append(item)
            continue
        for step in SHARD_STEPS:
            reason = step(item, config)
            if reason:
                dropped.append(dropped_record(item.id, item.line, step.__name__, reason))
                break
        else:
            kept.append({"id": item.id, "line": item.line, "hash": item.hash, "text": item.text})
    atomic_write(docs_path, lambda fh: fh.write(_jsonl_bytes(kept)))
    atomic_write(dropped_path, lambda fh: fh.write(_jsonl_bytes(dropped)))
    summary = {"input": input_fingerprint(path), "documents": n_documents, "kept": len(kept),
               "dropped": len(dropped)}
    write_json(marker, summary)
    return summary


# --------------------------------------------------------------------------------------------
# Running the shards: Ray tasks, or a loop in this process.


def _run_local(jobs: list[tuple[int, str]], out_dir: Path, config: DataPrepConfig) -> None:
    for index, path in jobs:
        process_shard(index, path, str(out_dir), config)


def _run_on_ray(jobs: list[tuple[int, str]], out_dir: Path, config: DataPrepConfig) -> None:
    """One Ray task per shard: on the cluster at RAY_ADDRESS if set, else on a local one."""
    import ray

    # Local ray clusters of this Ray version ask for an auth token unless told not to.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started_here, temp_dir = not ray.is_initialized(), None
    if started_here and os.environ.get("RAY_ADDRESS"):
        # A running cluster: its workers must already have this repo (the job image does).
        ray.init(log_to_driver=False)
    elif started_here:
        # Ray's socket paths must stay under ~107 characters, so no deep pytest tmp dirs here.
        temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        repo_root = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
        ray.init(num_cpus=config.workers, include_dashboard=False, _temp_dir=temp_dir,
                 log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        # Retries are safe: a shard only ever writes its own files, atomically.
        task = ray.remote(num_cpus=1, max_retries=2)(process_shard)
        ray.get([task.remote(index, path, str(out_dir), config) for index, path in jobs])
    finally:
        if started_here:
            ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


ENGINES = {"local": _run_local, "ray": _run_on_ray}


# --------------------------------------------------------------------------------------------
# Inputs: the user's files, or the demo corpus and task written into output_dir.


def resolve_inputs(patterns: list[str]) -> list[str]:
    """Each pattern expanded and sorted, in the order given; a pattern matching nothing is an error."""
    paths: list[str] = []
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not matches:
            raise FileNotFoundError(f"DataPrepConfig.inputs: {pattern!r} matches no file. "
                                    "Fix the path or glob, or leave inputs empty for the demo corpus.")
        paths += [p for p in matches if p not in paths]
    return paths


# A global step's marker holds a key: a digest of everything the step was built from. A rerun
# redoes the step when the key differs, e.g. when a shard it read was redone after a crash.


def digest(*parts: Any) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(json.dumps(part, sort_keys=True).encode() + b"\0")
    return hasher.hexdigest()


def _finished(out_dir: Path, name: str, key: str) -> dict | None:
    """The marker of step `name` if it finished with this key and its files are all there."""
    marker = out_dir / "completions" / f"{name}.json"
    if not marker.exists():
        return None
    done = read_json(marker)
    if done["key"] != key or not all((out_dir / f).exists() for f in done["files"]):
        return None
    return done


def _mark_finished(out_dir: Path, name: str, key: str, files: list[Path], **data: Any) -> None:
    write_json(out_dir / "completions" / f"{name}.json",
               {"key": key, "files": [str(f.relative_to(out_dir)) for f in files], **data})


def _demo_corpus(config: DataPrepConfig, out_dir: Path) -> list[str]:
    from tasks.data.corpus import write_demo_corpus

    key = digest(config.demo_corpus_docs, config.seed)
    if done := _finished(out_dir, "raw", key):
        return [str(out_dir / f) for f in done["files"]]
    paths = write_demo_corpus(out_dir / "raw", config.demo_corpus_docs, config.seed)
    _mark_finished(out_dir, "raw", key, paths)
    return [str(p) for p in paths]


def _sft_set(config: DataPrepConfig, out_dir: Path) -> tuple[list[dict], list[dict]]:
    """Write sft/train.jsonl and sft/eval.jsonl (demo task, or the given files checked)."""
    from tasks.data.instructions import load_examples, write_demo_sft, write_examples

    train_path, eval_path = out_dir / "sft" / "train.jsonl", out_dir / "sft" / "eval.jsonl"
    key = digest(config.demo_sft_examples, config.seed, [input_fingerprint(p) for p in config.sft_inputs])
    if not _finished(out_dir, "sft", key):
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
        _mark_finished(out_dir, "sft", key, [train_path, eval_path])
    return load_examples(train_path), load_examples(eval_path)


# --------------------------------------------------------------------------------------------
# The global step: exact dedup across shards, split, tokenizer, packed token rows.


def split_score(doc_id: str, seed: int) -> float:
    """Uniform in [0, 1) from the id alone, so a document's split never depends on the others."""
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def deduplicate(out_dir: Path, n_shards: int) -> tuple[list[dict], list[dict]]:
    """(kept docs, dropped records) over all shards; of equal texts the first by (shard, line) wins."""
    kept, dropped, first_with = [], [], {}
    for index in range(n_shards):
        docs_path, dropped_path, _ = shard_paths(out_dir, index)
        dropped += [{**r, "shard": index} for r in _read_jsonl(dropped_path)]
        for doc in _read_jsonl(docs_path):
            if doc["hash"] in first_with:
                dropped.append(dropped_record(doc["id"], doc["line"], "dedup", "exact_duplicate",
                                              duplicate_of=first_with[doc["hash"]], shard=index))
            else:
                first_with[doc["hash"]] = doc["id"]
                kept.append(doc)
    dropped.sort(key=lambda r: (r["shard"], r["line"]))
    return kept, dropped


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
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
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tokenizer.token_to_id(EOS) != EOS_ID:  # models and loaders rely on it
        raise RuntimeError(f"{EOS} got id {tokenizer.token_to_id(EOS)}, expected {EOS_ID}.")
    return tokenizer


def _tokenizer(out_dir: Path, train_texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer

    path = out_dir / "tokenizer.json"
    key = digest(vocab_size, hashlib.sha256("\0".join(train_texts).encode()).hexdigest())
    if _finished(out_dir, "tokenizer", key):
        return Tokenizer.from_file(str(path))
    tokenizer = train_tokenizer(train_texts, vocab_size)
    atomic_write(path, lambda fh: fh.write(tokenizer.to_str(pretty=True).encode()))
    _mark_finished(out_dir, "tokenizer", key, [path])
    return tokenizer


def write_split(out_dir: Path, split: str, token_lists: list[list[int]], row_len: int,
                dtype: str) -> dict:
    """Concatenate documents, each followed by EOS, into rows of row_len; write the full rows."""
    little_endian = np.dtype(dtype).newbyteorder("<")
    pieces = [np.asarray([*ids, EOS_ID], dtype=little_endian) for ids in token_lists]
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=little_endian)
    n_rows = len(stream) // row_len
    rows = stream[: n_rows * row_len].reshape(n_rows, row_len)
    rows_per_file = max(1, MAX_TOKENS_PER_SHARD // row_len)
    shards = []
    for number, start in enumerate(range(0, n_rows, rows_per_file)):
        chunk = rows[start:start + rows_per_file]
        data = chunk.tobytes()
        rel = f"tokens/{split}_{number:05d}.bin"
        atomic_write(out_dir / rel, lambda fh: fh.write(data))
        shards.append({"path": rel, "rows": len(chunk), "sha256": hashlib.sha256(data).hexdigest()})
    return {"shards": shards, "rows": n_rows, "tokens": n_rows * row_len,
            "documents": len(token_lists), "remainder_tokens": len(stream) - n_rows * row_len}


def _pack(out_dir: Path, tokenizer: Any, train: list[dict], val: list[dict],
          config: DataPrepConfig) -> tuple[str, dict]:
    row_len = config.seq_len + 1  # seq_len inputs plus the one-shifted targets
    dtype = "uint16" if tokenizer.get_vocab_size() < 2**16 else "uint32"
    key = digest(sha256_file(out_dir / "tokenizer.json"), row_len,
                 [d["hash"] for d in train], [d["hash"] for d in val])
    if done := _finished(out_dir, "tokens", key):
        return dtype, done["splits"]
    encode = lambda docs: [e.ids for e in tokenizer.encode_batch([d["text"] for d in docs],
                                                                    add_special_tokens=False)]
    train_ids, val_ids = encode(train), encode(val)
    # Training and evaluation both need validation rows. Tiny inputs may hash too few documents
    # into val, so lend it the train documents with the lowest split scores until it fills a row.
    while sum(len(ids) + 1 for ids in val_ids) < row_len and len(train_ids) > 1:
        val_ids.append(train_ids.pop(0))
    splits = {"train": write_split(out_dir, "train", train_ids, row_len, dtype),
              "val": write_split(out_dir, "val", val_ids, row_len, dtype)}
    for name, split in splits.items():
        if split["rows"] == 0:
            total = sum(len(ids) + 1 for ids in train_ids + val_ids)
            raise ValueError(f"The {name} split has no full row of seq_len + 1 = {row_len} tokens "
                             f"({total} tokens in all kept documents). Add more input data or "
                             "lower DataPrepConfig.seq_len.")
    files = [out_dir / s["path"] for split in splits.values() for s in split["shards"]]
    _mark_finished(out_dir, "tokens", key, files, splits=splits)
    return dtype, splits


# --------------------------------------------------------------------------------------------
# The stage


@dataclass
class Prepared:
    manifest: dict
    doc_lengths: list[int]  # characters per kept document; empty when the output was reused
    reused: bool


def _output_fields(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in LAYOUT_ONLY_FIELDS}


def _reuse_or_reset(out_dir: Path, config: DataPrepConfig) -> dict | None:
    """The existing manifest if this config already completed here. Otherwise clear the markers
    of a crashed run made with a different config, so none of its steps is mistaken for done."""
    wanted = _output_fields(to_dict(config))
    manifest_path = out_dir / "manifest.json"
    if manifest_path.exists():
        manifest = read_json(manifest_path)
        if _output_fields(manifest["config"]) == wanted:
            return manifest
        differ = sorted(k for k in wanted if manifest["config"].get(k) != wanted[k])
        raise ValueError(f"{out_dir} already holds data prepared with a different config "
                         f"(fields {differ} differ). Use a new output_dir or delete this one.")
    config_marker = out_dir / "completions" / "config.json"
    if config_marker.exists() and read_json(config_marker) != wanted:
        shutil.rmtree(out_dir / "completions")
    write_json(config_marker, wanted)
    return None


def prepare(config: DataPrepConfig) -> Prepared:
    """Run (or resume, or reuse) data prep into config.output_dir and return its manifest."""
    out_dir = Path(config.output_dir)
    existing = _reuse_or_reset(out_dir, config)
    if existing is not None:
        log.info("%s is complete for this config; nothing to do", out_dir)
        return Prepared(existing, [], reused=True)

    inputs = resolve_inputs(config.inputs) if config.inputs else _demo_corpus(config, out_dir)
    sft_train, sft_eval = _sft_set(config, out_dir)

    jobs = []
    for index, path in enumerate(inputs):
        marker = shard_paths(out_dir, index)[2]
        if not (marker.exists() and read_json(marker)["input"] == input_fingerprint(path)):
            jobs.append((index, path))
    log.info("%d input shards, %d to process with engine=%s", len(inputs), len(jobs), config.engine)
    if jobs:
        ENGINES[config.engine](jobs, out_dir, config)
    n_documents = sum(read_json(shard_paths(out_dir, i)[2])["documents"] for i in range(len(inputs)))

    kept, dropped = deduplicate(out_dir, len(inputs))
    atomic_write(out_dir / "dropped.jsonl", lambda fh: fh.write(_jsonl_bytes(dropped)))
    if not kept:
        raise ValueError(f"No documents left after filtering ({n_documents} read); see "
                         f"{out_dir / 'dropped.jsonl'} for why each was dropped.")
    # Ordering by split score shuffles documents (seeded) so packed rows mix sources.
    kept.sort(key=lambda d: split_score(d["id"], config.seed))
    val = [d for d in kept if split_score(d["id"], config.seed) < config.val_fraction]
    train = [d for d in kept if split_score(d["id"], config.seed) >= config.val_fraction]

    # SFT text is in the tokenizer's training text so every character of the task has tokens,
    # but it stays out of the pretraining rows: the pretrained model must not have seen the task.
    tokenizer = _tokenizer(out_dir, [d["text"] for d in train] +
                           [ex["prompt"] + ex["completion"] for ex in sft_train], config.vocab_size)
    dtype, splits = _pack(out_dir, tokenizer, train, val, config)

    outputs = [out_dir / "tokenizer.json", out_dir / "dropped.jsonl", out_dir / "sft" / "train.jsonl",
               out_dir / "sft" / "eval.jsonl"]
    outputs += [p for i in range(len(inputs)) for p in shard_paths(out_dir, i)[:2]]
    outputs += [out_dir / s["path"] for split in splits.values() for s in split["shards"]]
    outputs += [Path(p) for p in inputs if not config.inputs]  # the demo corpus we wrote
    hashes = sorted((str(p.relative_to(out_dir)), sha256_file(p)) for p in outputs)
    reasons: dict[str, int] = {}
    for record in dropped:
        reasons[record["reason"]] = reasons.get(record["reason"], 0) + 1
    manifest = {
        "config": to_dict(config),
        "tokenizer": "tokenizer.json",
        "tokenizer_sha256": dict(hashes)["tokenizer.json"],
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_id": tokenizer.token_to_id(EOS),
        "dtype": dtype,
        "seq_len": config.seq_len,
        "row_len": config.seq_len + 1,
        "splits": splits,
        "sft": {"train": "sft/train.jsonl", "eval": "sft/eval.jsonl",
                "train_examples": len(sft_train), "eval_examples": len(sft_eval)},
        "counts": {"input_documents": n_documents, "kept_documents": len(kept),
                   "dropped": dict(sorted(reasons.items()))},
        "content_hash": hashlib.sha256("".join(f"{p}\t{h}\n" for p, h in hashes).encode()).hexdigest(),
    }
    write_json(out_dir / "manifest.json", manifest)
    return Prepared(manifest, [len(d["text"]) for d in kept], reused=False)


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


def _metrics(manifest: dict) -> dict[str, float]:
    counts, splits = manifest["counts"], manifest["splits"]
    return {
        "documents_in": counts["input_documents"],
        "documents_kept": counts["kept_documents"],
        "documents_dropped": sum(counts["dropped"].values()),
        "train_tokens": splits["train"]["tokens"],
        "val_tokens": splits["val"]["tokens"],
        "train_rows": splits["train"]["rows"],
        "val_rows": splits["val"]["rows"],
        "vocab_size": manifest["vocab_size"],
        "sft_train_examples": manifest["sft"]["train_examples"],
        "sft_eval_examples": manifest["sft"]["eval_examples"],
    }


def _figure(manifest: dict, doc_lengths: list[int]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    reasons = manifest["counts"]["dropped"]
    left.barh(list(reasons) or ["(none)"], list(reasons.values()) or [0], height=0.6)
    left.set_title(f"Dropped documents ({sum(reasons.values())} of "
                   f"{manifest['counts']['input_documents']})")
    left.set_xlabel("documents")
    right.hist(doc_lengths, bins=np.geomspace(max(1, min(doc_lengths)), max(doc_lengths) + 1, 40))
    right.set_xscale("log")
    right.set_title(f"Kept document length ({len(doc_lengths)} documents)")
    right.set_xlabel("characters")
    fig.tight_layout()
    return fig


def main(config: DataPrepConfig) -> dict[str, Any]:
    import mlflow

    from tasks.common.tracking import log_figure, log_json_artifact, stage_run

    started = time.time()
    with stage_run("data_prep", config):
        prepared = prepare(config)
        manifest = prepared.manifest
        metrics = _metrics(manifest)
        mlflow.log_metrics({**metrics, "seconds": time.time() - started,
                            **{f"dropped.{r}": n for r, n in manifest["counts"]["dropped"].items()}})
        log_json_artifact(manifest, "manifest.json")
        if not prepared.reused:
            log_figure(_figure(manifest, prepared.doc_lengths), "data_prep.png")
    out_dir = Path(config.output_dir)
    return {"outputs": {"data_dir": str(out_dir), "manifest": str(out_dir / "manifest.json")},
            "metrics": metrics, "data_hash": manifest["content_hash"]}


if __name__ == "__main__":
    from tasks.common.entry import run_stage

    run_stage("data.prep", DataPrepConfig, main)
