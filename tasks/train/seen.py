"""What a checkpoint trained on: its consumed shard rows, and whether it saw a given document.

Every pretraining checkpoint's trainer state (trainer.pt, listed with its sha256 in the
checkpoint's manifest) holds `data_seen`: the sampler's seed, the global batch in rows, the
split's row count, the data's content hash and the trained global batch ranges (the data cursor
less any skipped batches). Batch order is a pure function of (seed, batch index)
(tasks/train/prepared_data.py), so that record is exact; the rows are computed from it on demand
here. An answer asked against another data dir than the one it trained on is refused (by the content
hash; by the row count for records without one).

A document's rows are found by replaying data prep's packing (tasks/data/prep.py): per input
shard, its training documents in split-score order, each tokenized and followed by EOS, the
shards' streams concatenated and cut into rows of seq_len + 1 tokens. The replayed tokens are
compared with the rows on disk, so a wrong answer is refused rather than given.

    python -m tasks.train.seen CHECKPOINT --data-dir D --doc ID     # did CHECKPOINT see ID
    python -m tasks.train.seen CHECKPOINT --data-dir D              # its consumed row ranges
    python -m tasks.train.seen CHECKPOINT --data-dir D --diff OTHER # rows one read, not the other
    python -m tasks.train.seen FT_CHECKPOINT --data-dir D --example ID  # did fine-tuning see it

A fine-tuning (or distillation) checkpoint records its SFT sampler instead (`kind: sft`: seed,
units per step, the trained steps, the examples behind each packed row, the ids' count and
hash) and, with replay, the sampler of the pretraining rows it replayed.

A pretraining checkpoint saved before the trainer recorded `data_seen` gets the same record
derived from its data cursor (`derived_from: data_cursor`, see `_derived`), with the content
hash of the data dir its config names where that is readable here (else only the row count
tells a wrong data dir); a fine-tuning one of then is refused, as its packed steps cannot be
recovered from a cursor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from tasks.common.io import read_json
from tasks.train import checkpoint as ckpt
from tasks.train.prepared_data import (BlockShuffleSampler, DataDir, EpochSampler, PretrainBatches,
                                       TokenRows, content_hash, read_jsonl, sampler_of)


def record(checkpoint_dir: str | Path, data_dir: str | Path | None = None) -> dict[str, Any]:
    """The checkpoint's `data_seen`, after verifying every file its manifest lists; for a
    pretraining checkpoint saved before the trainer recorded it, derived (`_derived`: needs the
    data dir it trained on)."""
    path = Path(checkpoint_dir)
    why = ckpt.verify_checkpoint(path)
    if why:
        raise ValueError(f"{path} does not verify: {why}.")
    trainer = ckpt.read_part(path, "trainer") or {}
    if "data_seen" in trainer:
        return trainer["data_seen"]
    return _derived(path, trainer, data_dir)


def _derived(path: Path, trainer: dict[str, Any], data_dir: str | Path | None) -> dict[str, Any]:
    """What PretrainBatches.seen(data_cursor, skipped_batches) would have written, from what
    every older pretraining checkpoint holds (git history of tasks/train/loop.py `_state`):
    data_cursor in its trainer state from the first; skipped_batches and world_size since
    66bca62 (before, batches were never skipped and training ran on one process); global_batch
    since f4a6254. The seed and per-process batch size are its config.json's (the TrainConfig
    it ran with: tasks/train/pretraining.py builds the batch reader from cfg.seed and
    cfg.batch_size), the row count is the data dir's train split. Which data it trained on is its
    config's data_dir: where that is readable here, its content hash is the record's, and a `data_dir`
    with other content is refused. A world size never changed mid-run without a recorded global
    batch (the loop refused such a resume), so one global batch covers the whole cursor."""
    config = read_json(path / "config.json") if (path / "config.json").is_file() else {}
    if "base_model" in config or "teacher_model" in config:   # FinetuneConfig, DistillConfig
        raise ValueError(f"{path} is a fine-tuning checkpoint saved before the trainer recorded "
                         "data_seen: its steps packed SFT examples in an order its data cursor "
                         "does not give, so what it saw cannot be derived.")
    missing = ([k for k in ("data_cursor",) if k not in trainer]
               + [f"config.json {k}" for k in ("seed", "batch_size") if k not in config])
    if missing:
        raise ValueError(f"{path} records no data_seen (saved before the trainer recorded it) and "
                         f"lacks {', '.join(missing)} to derive it from.")
    if data_dir is None:
        raise ValueError(f"{path} records no data_seen (saved before the trainer recorded it): "
                         "pass the data dir it trained on to derive it from its data cursor.")
    data = DataDir(data_dir)
    batch, world = int(config["batch_size"]), int(trainer.get("world_size", 1))
    # global_batch_tokens (with the recorded global batch since f4a6254) fixes the global batch
    # whatever the world size; without it, it is batch_size sequences on each process
    tokens = int(config.get("global_batch_tokens") or 0)
    configured = tokens // data.seq_len if tokens else batch * world
    recorded = int(trainer.get("global_batch") or configured)
    if recorded != configured or configured % (batch * world):
        raise ValueError(f"{path} records a global batch of {recorded} rows, but its config "
                         f"and {data_dir} give {configured}: not the data it trained on, or a "
                         "config that is not its own; what it saw cannot be derived.")
    # the very reader the job trained with, so the record is the one it would have written
    # checkpoints without data_seen were all trained in the global permutation (block shuffling
    # came later, and records itself)
    reader = PretrainBatches(data.split("train"), batch, int(config["seed"]), world_size=world,
                             accumulation=configured // (batch * world), order="global_permutation")
    seen = reader.seen(int(trainer["data_cursor"]), set(trainer.get("skipped_batches", [])))
    # the data it trained on, where readable here (rows_of checks data_dir's hash against it);
    # else the record vouches for no data and only the row count is checked
    seen["data_hash"] = content_hash(config.get("data_dir"))
    if seen["data_hash"] is None:
        del seen["data_hash"]
    return {**seen, "derived_from": "data_cursor"}


def _same_data(drawn: dict[str, Any], data: DataDir) -> None:
    """Refuse a data dir other than the one the record says its rows are of."""
    if drawn.get("data_hash") and drawn["data_hash"] != data.content_hash:
        raise ValueError(f"{data.path} is not the data the checkpoint trained on: its content hash "
                         f"is {data.content_hash[:12]}, the checkpoint's data {drawn['data_hash'][:12]} "
                         "(another data prep output, though it may have as many rows). Pass the "
                         "data dir it trained on (its config.json's data_dir).")


def _drawn(n: int, global_batch: int, seed: int, batches: list[list[int]],
           sampler: EpochSampler | BlockShuffleSampler | None = None) -> np.ndarray:
    """Sorted unique indices (of n items) that the sampler (the epoch sampler unless given) gave
    the trained batches."""
    if not batches or not global_batch:
        return np.zeros(0, dtype=np.int64)
    positions = np.concatenate([np.arange(a * global_batch, b * global_batch, dtype=np.int64)
                                for a, b in batches])
    return np.unique((sampler or EpochSampler(n, global_batch, seed)).at(positions))


def consumed_rows(checkpoint_dir: str | Path, data_dir: str | Path) -> np.ndarray:
    """Sorted unique global row indices of the train split that the checkpoint trained on (for
    a fine-tuning checkpoint: the pretraining rows it replayed)."""
    return rows_of(record(checkpoint_dir, data_dir), data_dir)


def rows_of(seen: dict[str, Any], data_dir: str | Path) -> np.ndarray:
    """consumed_rows from a record already read (record() verifies every file of the
    checkpoint, its weights included: read it once per answer)."""
    drawn = seen if seen.get("kind") != "sft" else {**(seen.get("replay") or {}), "batches": seen["batches"]}
    if "rows" not in drawn:   # fine-tuning without replay: no pretraining row
        return np.zeros(0, dtype=np.int64)
    data = DataDir(data_dir)
    _same_data(drawn, data)
    split = data.split("train")
    if split.rows != int(drawn["rows"]):
        raise ValueError(f"{data_dir} has {split.rows} train rows; the checkpoint trained on data "
                         f"with {drawn['rows']}: not the same data.")
    return _drawn(split.rows, int(drawn["global_batch"]), int(drawn["seed"]), drawn["batches"],
                  sampler_of(drawn, split))


def example_ids(sft_files: list[str | Path]) -> list[str]:
    """The ids of the SFT examples in these files, in the order fine-tuning reads them
    (tasks.posttrain.datasets.load_sft_data: an example without an id is its line's index)."""
    return [str(r.get("id", i)) for path in sft_files for i, r in enumerate(read_jsonl(path))]


def consumed_examples(checkpoint_dir: str | Path, sft_files: list[str | Path]) -> list[str]:
    """The ids of the SFT examples a fine-tuning (or distillation) checkpoint trained on, in file
    order. The files must be the ones it read, in the same order (checked by the ids' hash)."""
    return examples_of(record(checkpoint_dir), sft_files, checkpoint_dir)


def examples_of(seen: dict[str, Any], sft_files: list[str | Path], checkpoint_dir: str | Path
                ) -> list[str]:
    """consumed_examples from a record already read."""
    if seen.get("kind") != "sft":
        raise ValueError(f"{checkpoint_dir} is a pretraining checkpoint: it trained on rows, not "
                         "SFT examples (ask for its rows or documents).")
    ids = example_ids(sft_files)
    digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
    if len(ids) != int(seen["examples"]) or digest != seen["examples_sha256"]:
        raise ValueError(f"{[str(f) for f in sft_files]} hold {len(ids)} examples that are not the "
                         f"{seen['examples']} the checkpoint trained on: pass the files it read "
                         "(its config's train_files, else the data dir's sft/train.jsonl).")
    units = _drawn(int(seen["units"]), int(seen["global_batch"]), int(seen["seed"]), seen["batches"])
    packed = seen.get("packed_units")
    chosen = sorted({i for u in units.tolist() for i in (packed[u] if packed else [u])})
    return [ids[i] for i in chosen]


def _ranges(values: np.ndarray) -> list[list[int]]:
    """[start, end) runs of sorted unique ints."""
    if len(values) == 0:
        return []
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    return [[int(run[0]), int(run[-1]) + 1] for run in np.split(values, breaks)]


def _by_shard(data_dir: str | Path, rows: np.ndarray) -> dict[str, list[list[int]]]:
    data = DataDir(data_dir)
    shards = [s for s in data.manifest["splits"]["train"]["shards"] if int(s["rows"])]
    starts = np.cumsum([0] + [int(s["rows"]) for s in shards])
    out: dict[str, list[list[int]]] = {}
    for i, shard in enumerate(shards):
        mine = rows[(rows >= starts[i]) & (rows < starts[i + 1])] - starts[i]
        if len(mine):
            out[shard["path"]] = _ranges(mine)
    return out


def consumed(checkpoint_dir: str | Path, data_dir: str | Path,
             sft_files: list[str | Path] | None = None) -> dict[str, Any]:
    """The checkpoint's consumed data: trained batch ranges and, per token shard, row ranges;
    for a fine-tuning checkpoint also the SFT examples (from `sft_files`, else the data dir's
    sft/train.jsonl)."""
    seen = record(checkpoint_dir, data_dir)
    rows = rows_of(seen, data_dir)
    out = {"checkpoint": str(checkpoint_dir), **_derivation(seen), "batches": seen["batches"],
           "samples": sum(b - a for a, b in seen["batches"]) * int(seen["global_batch"]),
           "unique_rows": int(len(rows)), "rows": _by_shard(data_dir, rows)}
    if seen.get("kind") == "sft":
        out["examples"] = examples_of(seen, sft_files or [DataDir(data_dir).sft_path("train")],
                                      checkpoint_dir)
    return out


def _derivation(seen: dict[str, Any]) -> dict[str, Any]:
    """`derived_from` where the record was derived rather than recorded, for the answer to say so."""
    return {"derived_from": seen["derived_from"]} if "derived_from" in seen else {}


def diff(a: str | Path, b: str | Path, data_dir: str | Path) -> dict[str, Any]:
    """Rows only `a` trained on and rows only `b` trained on (e.g. a fork and its parent); with
    `derived_from` ({"a": ..., "b": ...}) where either record was derived."""
    seen = {"a": record(a, data_dir), "b": record(b, data_dir)}
    ra, rb = rows_of(seen["a"], data_dir), rows_of(seen["b"], data_dir)
    only_a, only_b = np.setdiff1d(ra, rb), np.setdiff1d(rb, ra)
    derived = {k: r["derived_from"] for k, r in seen.items() if "derived_from" in r}
    return {"only_a": _by_shard(data_dir, only_a), "only_b": _by_shard(data_dir, only_b),
            "only_a_rows": int(len(only_a)), "only_b_rows": int(len(only_b)),
            "common_rows": int(len(np.intersect1d(ra, rb))),
            **({"derived_from": derived} if derived else {})}


def document_rows(data_dir: str | Path, doc_id: str) -> list[tuple[int, int]]:
    """Global train row ranges [first, last + 1) of every occurrence of the document in the
    packed rows (more than one where its source's mix weight repeats it; none where it went to
    val, where a weight below 1 left it out, or into the tail that did not fill a row). KeyError
    if no kept document has that id."""
    import pyarrow.parquet as pq
    from tasks.data.split import mix_repeats, split_score

    data = DataDir(data_dir)
    config = data.manifest["config"]
    weights = [float(w) for w in config.get("input_weights") or []]
    sources = data.manifest["documents"].get("sources")
    if any(w != 1.0 for w in weights) and sources is None:
        raise ValueError(f"{data_dir} was prepared with input_weights {weights} before data prep "
                         "recorded each documents file's source: prepare it again to map a "
                         "document to its rows.")
    tokenizer = _tokenizer(data)
    seed, row_len = int(config["seed"]), int(data.manifest["row_len"])
    offset, found, spans = 0, False, []
    for name in data.manifest["documents"]["files"]:
        table = pq.read_table(data.path / name, columns=["id", "text", "split"]).to_pydict()
        train = [i for i, s in enumerate(table["split"]) if s == "train"]
        found = found or doc_id in table["id"]
        order = sorted(train, key=lambda i: split_score(table["id"][i], seed))
        weight = weights[sources[name]] if weights else 1.0   # its source's mix weight
        repeats = [mix_repeats(table["id"][i], weight, seed) for i in order]
        lengths = [len(e.ids) + 1 for e in tokenizer.encode_batch_fast(
            [table["text"][i] for i in order], add_special_tokens=False)] if order else []
        for k in range(max(repeats, default=0)):  # as tasks.data.tokens.encode_stream repeats
            for i, n, r in zip(order, lengths, repeats):
                if r > k and table["id"][i] == doc_id:
                    spans.append((offset, offset + n))
                offset += n if r > k else 0
    if not found:
        raise KeyError(f"No kept document in {data_dir} has id {doc_id!r}.")
    rows = TokenRows(data.path, data.manifest, "train")
    out = []
    for start, end in spans:
        end = min(end, rows.rows * row_len)
        if start >= end:
            continue  # in the tail that did not fill a row
        _check_tokens(rows, tokenizer, data, doc_id, start, end)
        out.append((start // row_len, (end - 1) // row_len + 1))
    return out


def _tokenizer(data: DataDir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(data.tokenizer_path))


def _check_tokens(rows: TokenRows, tokenizer, data: DataDir, doc_id: str, start: int, end: int) -> None:
    import pyarrow.parquet as pq

    text = None
    for name in data.manifest["documents"]["files"]:
        t = pq.read_table(data.path / name, columns=["id", "text"], filters=[("id", "==", doc_id)])
        if t.num_rows:
            text = t.column("text")[0].as_py()
            break
    expected = tokenizer.encode(text, add_special_tokens=False).ids + [data.eos_id]
    row_len = rows.row_len
    first, last = start // row_len, (end - 1) // row_len
    flat = np.concatenate([rows.shards[s][i - rows.starts[s]] for s, i in
                           ((int(np.searchsorted(rows.starts, r, side="right") - 1), r)
                            for r in range(first, last + 1))])
    actual = flat[start - first * row_len: end - first * row_len].astype(np.int64).tolist()
    if actual != expected[: end - start]:
        raise ValueError(f"Replaying data prep's packing put {doc_id!r} at tokens {start}..{end} "
                         "of the train rows, but the rows there hold other tokens; the data dir "
                         "does not match its manifest's config.")


def saw(checkpoint_dir: str | Path, data_dir: str | Path, doc_id: str) -> bool:
    """Did the checkpoint train on any row holding (part of) the document?"""
    return _holds(consumed_rows(checkpoint_dir, data_dir), document_rows(data_dir, doc_id))


def _holds(rows: np.ndarray, spans: list[tuple[int, int]]) -> bool:
    return any(np.any((rows >= a) & (rows < b)) for a, b in spans)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.train.seen", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--doc", help="a document id: print whether the checkpoint saw it")
    parser.add_argument("--diff", help="another checkpoint: rows only one of them trained on")
    parser.add_argument("--example", help="an SFT example id: print whether a fine-tuning "
                                          "checkpoint trained on it")
    parser.add_argument("--sft-file", action="append", default=None,
                        help="the SFT file(s) it read, in order (default: the data dir's sft/train.jsonl)")
    args = parser.parse_args(argv)
    sft_files = args.sft_file or [DataDir(args.data_dir).sft_path("train")]
    if args.example is not None:
        ids = example_ids(sft_files)
        if args.example not in ids:
            raise SystemExit(f"No SFT example in {sft_files} has id {args.example!r}.")
        result = {"example": args.example,
                  "saw": args.example in consumed_examples(args.checkpoint, sft_files)}
    elif args.doc is not None:
        spans = document_rows(args.data_dir, args.doc)
        seen = record(args.checkpoint, args.data_dir)
        result = {"doc": args.doc, "saw": _holds(rows_of(seen, args.data_dir), spans),
                  "rows": [list(s) for s in spans], **_derivation(seen)}
    elif args.diff is not None:
        result = diff(args.checkpoint, args.diff, args.data_dir)
    else:
        result = consumed(args.checkpoint, args.data_dir, sft_files)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
