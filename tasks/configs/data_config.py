"""Data prep's config (`python -m tasks.data.prep`): the raw inputs, the quality filters it runs
(`DATA_QUALITY_FILTERS`, in FineWeb's order), PII redaction, exact and MinHash near-dedup, the
tokenizer and the packed shards it writes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.configs.fields import bounded, check, check_bounds


# Quality filters data prep knows, in the order FineWeb runs them (see tasks/data/filters.py).
DATA_QUALITY_FILTERS = ("gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality")


@dataclass(kw_only=True)
class DataPrepConfig:
    """Raw text -> filtered, PII-redacted, deduplicated documents; tokenized, packed train/val
    shards + manifest (tasks/data/prep.py).

    Inputs are JSONL (`{"id", "text", ...}`), Parquet or plain text files, local or s3://. With no
    inputs the stage writes the built-in demo corpus (docstrings of the installed Python).
    """

    inputs: list = bounded([], help="Raw text files, dirs or globs (JSONL, Parquet, .txt; local or "
                                    "s3://); empty = demo corpus.")
    output_dir: str = ""
    sft_inputs: list = bounded([], help="Prompt/completion JSONL (train, eval); empty = demo task.")
    demo_corpus_docs: int = bounded(4000, minimum=10, maximum=10_000_000,
                                    help="Documents in the generated demo corpus.")
    demo_sft_examples: int = bounded(4000, minimum=10, maximum=10_000_000,
                                     help="Examples in the generated demo instruction set.")
    vocab_size: int = bounded(1024, minimum=260, maximum=1 << 20, help="BPE vocabulary size.")
    seq_len: int = bounded(128, minimum=8, maximum=1 << 16, help="Context length of packed rows.")
    val_fraction: float = bounded(0.05, minimum=0.0, maximum=0.5, help="Share of documents held out.")
    min_chars: int = bounded(20, minimum=0, maximum=1_000_000, help="Shorter documents are dropped.")
    workers: int = bounded(2, minimum=1, maximum=4096, help="Parallel shard workers.")
    engine: str = bounded("auto", choices=("auto", "processes", "ray", "local"),
                          help="auto (chosen by input size: in-process, a process pool, or Ray Data "
                               "on the cluster at RAY_ADDRESS), processes, ray, or local (in-process).")
    processes_above_bytes: int = bounded(2 << 20, minimum=0, maximum=1 << 60,
                                         help="engine auto: `workers` processes (this one and a pool) from this "
                                              "many input bytes on.")
    ray_above_bytes: int = bounded(64 << 20, minimum=0, maximum=1 << 60,
                                   help="engine auto, with a Ray cluster at RAY_ADDRESS: Ray Data from "
                                        "this many input bytes on.")
    split_bytes: int = bounded(64 << 20, minimum=1024, maximum=1 << 40,
                               help="Input files larger than this are read as several shards (JSONL "
                                    "and text by byte range, Parquet by row groups).")
    dedup_buckets: int = bounded(0, minimum=0, maximum=1 << 20,
                                 help="Key-range buckets the dedup is sharded into; 0 = enough for "
                                      "~4M keys each, at least one per worker.")
    seed: int = bounded(1234, minimum=0, maximum=2**31 - 1)
    input_weights: list = bounded([], help="Mix weight per inputs entry, same order: a source's "
                                           "training documents are repeated (2.0) or sampled (0.5); "
                                           "empty = 1 each.")
    text_field: str = bounded("text", help="JSONL key or Parquet column holding the text.")
    id_field: str = bounded("id", help="JSONL key or Parquet column holding the document id.")
    filters: list = bounded(list(DATA_QUALITY_FILTERS),
                            help=f"Quality filters to run, in order: any of {list(DATA_QUALITY_FILTERS)}.")
    filter_params: dict = bounded({}, help="Threshold overrides per step, e.g. "
                                           "{'gopher_quality': {'min_doc_words': 30}}.")
    blocklist: list = bounded([], help="Words or phrases; a document containing one is dropped.")
    redact_pii: bool = bounded(True, help="Replace emails, public IP addresses and phone numbers.")
    exact_dedup: bool = bounded(True, help="Drop documents whose text equals an earlier one.")
    near_dedup: bool = bounded(True, help="MinHash-LSH near-duplicate removal across all shards.")
    minhash_ngram: int = bounded(5, minimum=1, maximum=64, help="Words per near-dedup shingle.")
    minhash_bands: int = bounded(14, minimum=1, maximum=1024,
                                 help="LSH bands (more bands: lower similarity threshold).")
    minhash_rows: int = bounded(8, minimum=1, maximum=1024,
                                help="Minhashes per band (more rows: higher similarity threshold).")
    tokenizer_path: str = bounded("", help="An existing tokenizer.json (local or s3://); empty = "
                                           "train a byte-level BPE on the data.")
    tokenizer_sample_docs: int = bounded(100_000, minimum=1, maximum=1_000_000_000,
                                         help="Training documents (a seeded sample) the BPE learns from.")

    def __post_init__(self) -> None:
        check_bounds(self)
        check(bool(self.output_dir), "DataPrepConfig.output_dir is required: where to write shards.")
        check(all(isinstance(p, str) and p for p in self.inputs),
               "DataPrepConfig.inputs must be a list of non-empty paths or globs.")
        check(len(self.sft_inputs) in (0, 2),
               "DataPrepConfig.sft_inputs must be empty or [train.jsonl, eval.jsonl].")
        unknown = [f for f in self.filters if f not in DATA_QUALITY_FILTERS]
        check(not unknown and len(set(self.filters)) == len(self.filters),
               f"DataPrepConfig.filters must name each of {list(DATA_QUALITY_FILTERS)} at most once, "
               f"got {self.filters!r}.")
        check(isinstance(self.filter_params, dict)
               and all(isinstance(v, dict) for v in self.filter_params.values()),
               "DataPrepConfig.filter_params must map a step name to an object of threshold overrides.")
        check(all(isinstance(w, str) and w.strip() for w in self.blocklist),
               "DataPrepConfig.blocklist must be a list of non-empty words or phrases.")
        check(not self.input_weights or len(self.input_weights) == len(self.inputs),
               f"DataPrepConfig.input_weights has {len(self.input_weights)} weights for "
               f"{len(self.inputs)} inputs: give one per inputs entry, or none.")
        check(all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                   and 0 <= w <= 1000 for w in self.input_weights),
               "DataPrepConfig.input_weights must be numbers between 0 and 1000.")
