"""Data prep at scale, on inputs made here: the near-dedup sharded by key range decides exactly
what the one-process step decides, one large file split into shards gives the data set the same
documents give in several files, and the engine is chosen by input size."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.configs import DataPrepConfig
from tasks.data.dedup import (MinHasher, bucket_pairs, content_hash, find_duplicates, hashes_to_array,
                              resolve_pairs, shard_index)
from tasks.data import planning
from tasks.data.planning import choose_engine
from tasks.data.prep import prepare
from tasks.data.readers import plan_splits
from tasks.data.pipeline import build_pipeline
from tasks.data.steps import Doc, run_steps
from tests.test_data_prep import PROSE, read_rows, small_config, write_jsonl


# --------------------------------------------------------------------------------------------
# Sharded dedup against the one-process step


def _planted_keys(rng: np.random.Generator, n: int, bands: int) -> tuple[np.ndarray, np.ndarray]:
    """Random content hashes and band keys with planted exact copies (of copies too), pairs that
    share one band, chains joined through different bands (a~b in one band, b~c in another, a and c
    share nothing), and documents too short to have a signature."""
    hashes = rng.integers(1, 1 << 64, size=(n, 2), dtype=np.uint64)  # the whole 64-bit space, as
    keys = rng.integers(1, 1 << 64, size=(n, bands), dtype=np.uint64)  # blake2b and _mix fill it
    for _ in range(n // 10):  # exact copies of an earlier document (which may be a copy)
        a, b = sorted(rng.choice(n, 2, replace=False))
        hashes[b], keys[b] = hashes[a], keys[a]
    for _ in range(n // 10):  # near pairs: one band in common, either order
        a, b = rng.choice(n, 2, replace=False)
        band = rng.integers(bands)
        keys[b, band] = keys[a, band]
    for _ in range(n // 30):  # chains across bands
        a, b, c = rng.choice(n, 3, replace=False)
        keys[b, 1] = keys[a, 1]
        keys[c, bands - 1] = keys[b, bands - 1]
    keys[rng.choice(n, n // 20, replace=False)] = 0  # too short: no signature
    return hashes, keys


def test_sharded_dedup_decides_as_the_one_process_step_on_clusters_across_shards():
    rng = np.random.default_rng(16)
    n, bands = 4000, 6
    hashes, keys = _planted_keys(rng, n, bands)
    duplicate_of, kind, stats = find_duplicates(hashes, keys)
    assert stats["exact_duplicates"] > 300 and stats["near_duplicates"] > 300 and stats["clusters"] > 200

    bounds = [0, 500, 1400, 1401, 2900, n]  # five shards, one of a single document
    shards = []
    for lo, hi in zip(bounds, bounds[1:]):
        exact, near, starts = shard_index(hashes[lo:hi], keys[lo:hi])
        shards.append((lo, exact, near, starts))
    spanning = [(duplicate_of[i], i) for i in np.flatnonzero(kind)
                if np.searchsorted(bounds, duplicate_of[i], "right") != np.searchsorted(bounds, i, "right")]
    assert len(spanning) > 0.5 * int(np.count_nonzero(kind))  # most clusters straddle shards

    records = n + int(np.count_nonzero(keys[:, 0]) * bands)
    for buckets in (1, 2, 7, 50):
        exact_pairs, near_pairs, held = [], [], []
        for bucket in range(buckets):
            e, p = bucket_pairs(shards, bucket, buckets, bands)
            exact_pairs.append(e)
            near_pairs.append(p)
            held.append(sum(_held(s, bucket, buckets, bands) for s in shards))
        removed, kept_of, kinds, sharded_stats = resolve_pairs(n, np.concatenate(exact_pairs),
                                                               np.concatenate(near_pairs))
        assert np.array_equal(removed, np.flatnonzero(kind)), buckets
        assert np.array_equal(kept_of, duplicate_of[removed]) and np.array_equal(kinds, kind[removed])
        assert sharded_stats == stats
        # Each bucket reads its own key range: about 1/B of all the keys, never all of them.
        assert sum(held) == records and max(held) < 1.3 * records / buckets + 50


def _held(shard: tuple, bucket: int, buckets: int, bands: int) -> int:
    """Records (hashes and band keys) of one shard that a bucket reads."""
    from tasks.data.dedup import KEY_SPACE, _slice, bucket_range

    _, exact, near, starts = shard
    lo, hi = bucket_range(bucket, buckets, KEY_SPACE)
    count = _slice(exact[0], lo, hi)
    total = count.stop - count.start
    lo, hi = bucket_range(bucket, buckets, bands * KEY_SPACE)
    for band in range(bands):
        part = _slice(near[0, starts[band]:starts[band + 1]], lo - band * KEY_SPACE, hi - band * KEY_SPACE)
        total += max(0, part.stop - part.start)
    return total


def _near_copy(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    for pos in rng.sample(range(len(words)), max(1, len(words) // 60)):
        words[pos] = rng.choice(["really", "quite", "often"])
    return " ".join(words)


def test_sharded_dedup_in_the_pipeline_matches_the_one_process_step(tmp_path, prose_documents):
    """Real prose with planted copies and near copies spread over two files and the byte-range
    splits of a third: what prepare drops as duplicates (9 buckets, each split its own shard) is
    what find_duplicates decides over every document at once."""
    rng = random.Random(3)
    base = [t for t in prose_documents if len(t.split()) > 120][:60]
    docs = [{"id": f"doc{i}", "text": t} for i, t in enumerate(base)]
    for k in range(40):
        source = rng.choice(docs[:60 + k])["text"]
        docs.append({"id": f"copy{k}", "text": source if k % 3 == 0 else _near_copy(source, rng)})
    rng.shuffle(docs)
    files = [write_jsonl(tmp_path / "a.jsonl", docs[:30]), write_jsonl(tmp_path / "b.jsonl", docs[30:45]),
             write_jsonl(tmp_path / "c.jsonl", docs[45:])]
    config = small_config(tmp_path, files, split_bytes=20_000, dedup_buckets=9)
    assert len(plan_splits(str(files[2]), files[2].stat().st_size, config.split_bytes)) >= 3
    prepare(config)

    steps, hasher = build_pipeline(config), MinHasher(seed=config.seed)
    kept = []
    for record in docs:
        doc = Doc(record["id"], record["text"])
        assert run_steps(steps, doc) is None
        kept.append((record["id"], doc.text))
    duplicate_of, kind, _ = find_duplicates(hashes_to_array([content_hash(t) for _, t in kept]),
                                            np.stack([hasher.band_keys(t) for _, t in kept]))
    expected = {kept[i][0]: ("exact_duplicate" if kind[i] == 1 else "near_duplicate", kept[duplicate_of[i]][0])
                for i in np.flatnonzero(kind)}
    got = {r["id"]: (r["reason"], r["duplicate_of"]) for r in read_rows(config.output_dir, "dropped")}
    assert got == expected
    reasons = [reason for reason, _ in expected.values()]
    assert reasons.count("exact_duplicate") >= 10 and reasons.count("near_duplicate") >= 10


# --------------------------------------------------------------------------------------------
# One big file split into shards


def _data_set(out_dir: str, skip: tuple = ("source",)) -> dict:
    """What a user reads back, minus the `skip` columns (which input file, where in it):
    documents and dropped records in order, counts, and the packed token rows."""
    manifest = json.loads(Path(out_dir, "manifest.json").read_text())
    return {
        "documents": [{k: v for k, v in r.items() if k not in skip} for r in read_rows(out_dir, "documents")],
        "dropped": [{k: v for k, v in r.items() if k not in skip} for r in read_rows(out_dir, "dropped")],
        "counts": manifest["counts"], "steps": manifest["steps"],
        "tokens": {p: h for p, h in manifest["files"].items() if p.startswith("tokens/")},
        "shards": len(manifest["documents"]["files"]),
    }


def _records(n: int) -> list[dict]:
    rng = random.Random(n)
    out = []
    for i in range(n):
        text = f"{PROSE[i % 6]} Note {i}: {PROSE[rng.randrange(6)]} {PROSE[rng.randrange(6)]}"
        out.append({"id": f"r{i}", "text": text, "topic": i % 4})
    out[7]["text"] = out[3]["text"]  # an exact copy in the first split
    out[-2]["text"] = out[5]["text"]  # and one in the last
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_one_big_file_split_gives_the_data_set_of_its_parts_as_files(tmp_path, fmt):
    """A file larger than split_bytes becomes several shards; the data set equals the one made
    from the same documents written as one file per shard."""
    records = _records(240)
    big = tmp_path / "big" / f"all.{fmt}"
    big.parent.mkdir()
    if fmt == "jsonl":
        write_jsonl(big, records)
    else:
        pq.write_table(pa.Table.from_pylist(records), big, row_group_size=20)
    split_bytes = big.stat().st_size // 4
    splits = plan_splits(str(big), big.stat().st_size, split_bytes)
    assert len(splits) >= 3

    starts = np.cumsum([0] + [len(line) + 1 for line in big.read_bytes().split(b"\n")])
    parts = []
    for k, split in enumerate(splits):  # the documents of each split, as a file of their own
        if fmt == "jsonl":  # the lines that start in the split's byte range
            mine = [r for r, at in zip(records, starts) if split["start"] <= at < split["end"]]
            parts.append(write_jsonl(tmp_path / f"part{k}.jsonl", mine))
        else:
            table = pq.ParquetFile(big).read_row_groups(list(range(*split["row_groups"])))
            parts.append(tmp_path / f"part{k}.parquet")
            pq.write_table(table, parts[-1])

    split_run = small_config(tmp_path / "split", [big], split_bytes=split_bytes, near_dedup=False)
    parts_run = small_config(tmp_path / "parts", parts, near_dedup=False)
    one, several = prepare(split_run).manifest, prepare(parts_run).manifest
    # The same documents, ids, splits, drops and token rows; only the line numbers are per file.
    assert _data_set(split_run.output_dir, ("source", "line")) == _data_set(parts_run.output_dir, ("source", "line"))
    assert one["counts"]["input_documents"] == 240 and one["counts"]["dropped"] == {"exact_duplicate": 2}
    [source] = one["sources"]  # one input, one file, counted once however many shards it makes
    assert source["files"] == 1 and source["documents_in"] == 240 == sum(s["documents_in"] for s in several["sources"])
    assert source["train_tokens"] == sum(s["train_tokens"] for s in several["sources"]) > 0
    assert one["documents"]["files"] == [f"documents/{k:05d}.parquet" for k in range(len(splits))]


@pytest.mark.parametrize("fmt", ["txt", "jsonl"])
def test_split_file_keeps_file_lines_and_default_ids(tmp_path, fmt):
    """Documents without ids are named by file and line: split or whole, every document and
    dropped record has the same id and line, and the line is where the document starts."""
    lines = []
    for i in range(150):
        text = f"{PROSE[i % 6]} Item {i}."
        if fmt == "txt":
            lines += [text, PROSE[(i + 1) % 6]] + ([""] if i % 5 else ["", "  ", ""])
        else:
            lines.append(json.dumps({"text": text}) if i % 17 else '{"text": "broken')
            lines += [""] if i % 11 == 0 else []
    path = tmp_path / f"notes.{fmt}"
    path.write_text("\n".join(lines) + "\n")
    split = small_config(tmp_path / "split", [path], split_bytes=2048, near_dedup=False)
    whole = small_config(tmp_path / "whole", [path], near_dedup=False)
    assert len(plan_splits(str(path), path.stat().st_size, split.split_bytes)) >= 4
    prepare(split)
    prepare(whole)
    split_set, whole_set = _data_set(split.output_dir), _data_set(whole.output_dir)
    assert split_set["shards"] >= 4 and whole_set["shards"] == 1
    for key in ("documents", "dropped", "counts", "steps"):
        assert split_set[key] == whole_set[key], key
    file_lines = path.read_text().split("\n")
    for row in split_set["documents"]:
        assert row["id"] == f"notes.{fmt}:{row['line']}"
        start = file_lines[row["line"] - 1]
        assert (json.loads(start)["text"] if fmt == "jsonl" else start) == row["text"].split("\n")[0]
    if fmt == "jsonl":
        assert {r["id"]: r["reason"] for r in split_set["dropped"]} == {
            f"notes.jsonl:{n}": "malformed_json" for n in
            [i + 1 + sum(1 for j in range(i) if j % 11 == 0) for i in range(150) if i % 17 == 0]}


def test_a_file_below_split_bytes_is_cut_so_that_every_worker_gets_some():
    """Up to 16 splits of at least MIN_SPLIT_BYTES a file, split_bytes the most: by the file's
    size alone, never by the workers."""
    mb = 1_000_000
    assert planning.MIN_SPLIT_BYTES == 4 << 20 and planning.SPLITS_PER_FILE == 16
    cut = {size: -(-size // planning.split_bytes_for(size, 64 << 20)) for size in (46 * mb, 100 * mb, 3 * mb)}
    assert cut == {46 * mb: 11, 100 * mb: 16, 3 * mb: 1}   # the 46 MB file: 11 splits of 4.2 MB
    assert planning.split_bytes_for(10_000 * mb, 64 << 20) == 64 << 20   # a big file: split_bytes
    assert planning.split_bytes_for(46 * mb, 4096) == 4096   # a smaller split_bytes still wins


def test_one_file_makes_the_same_data_set_on_one_worker_and_on_two(tmp_path, monkeypatch):
    """One JSONL file under split_bytes, cut into splits (the rule at a small scale: a split of at
    least 4 KiB here, 4 MiB in use); one worker in this process, and two (this process and a pool
    of one): the same shards, documents, dedup decisions, train/val split, token rows and
    manifest content_hash."""
    monkeypatch.setattr(planning, "MIN_SPLIT_BYTES", 4096)
    records = _records(400)
    path = write_jsonl(tmp_path / "one.jsonl", records)
    assert path.stat().st_size < DataPrepConfig(output_dir="x").split_bytes
    configs = (small_config(tmp_path / "one", [path], workers=1, engine="auto"),
               small_config(tmp_path / "two", [path], workers=2, engine="auto", processes_above_bytes=0))
    one, two = (prepare(config) for config in configs)
    assert (one.engine, two.engine) == ("local", "processes")
    assert len(one.manifest["documents"]["files"]) == 16   # not one shard, one worker's
    assert _data_set(configs[0].output_dir) == _data_set(configs[1].output_dir)
    assert one.manifest["content_hash"] == two.manifest["content_hash"]
    dropped = one.manifest["counts"]["dropped"]   # decided across the splits, alike on both
    assert dropped["exact_duplicate"] == 2 and dropped["near_duplicate"] > 0


def test_two_hosts_then_finalize_with_a_split_file_and_near_dedup(tmp_path, monkeypatch):
    """The SageMaker contract with a split file and the sharded near dedup: each host does its
    shards (splits included), the finalize host the buckets; the data set is one machine's."""
    import shutil

    docs = [{"id": f"d{i}", "text": f"{PROSE[i % 6]} Case {i}: {PROSE[(i * 5) % 6]} {PROSE[(i * 7) % 6]}"}
            for i in range(120)]
    inputs = [write_jsonl(tmp_path / "big.jsonl", docs[:90]), write_jsonl(tmp_path / "small.jsonl", docs[90:])]
    settings = dict(split_bytes=4096, dedup_buckets=5)
    single = prepare(small_config(tmp_path / "single", inputs, **settings)).manifest
    assert single["counts"]["dropped"].get("near_duplicate", 0) > 0

    merged = tmp_path / "merged" / "out"
    for rank in (0, 1):
        monkeypatch.setenv("DATA_PREP_HOST_RANK", str(rank))
        monkeypatch.setenv("DATA_PREP_NUM_HOSTS", "2")
        prepare(small_config(tmp_path / f"host{rank}", inputs, **settings), stage="shards")
        shutil.copytree(tmp_path / f"host{rank}" / "out", merged, dirs_exist_ok=True)
    monkeypatch.delenv("DATA_PREP_HOST_RANK")
    monkeypatch.delenv("DATA_PREP_NUM_HOSTS")
    final = prepare(small_config(tmp_path / "merged", inputs, **settings, workers=3), stage="finalize").manifest
    assert final["content_hash"] == single["content_hash"]
    assert len(single["documents"]["files"]) > len(inputs)


# --------------------------------------------------------------------------------------------
# The engine by input size


def test_engine_is_chosen_by_input_size(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = DataPrepConfig(output_dir=str(tmp_path), processes_above_bytes=1_000_000, workers=2)
    assert config.engine == "auto"
    engine, why = choose_engine(config, 999_999)
    assert engine == "local" and "1.0 MB of input < processes_above_bytes = 1.0 MB" in why
    assert choose_engine(config, 1_000_000) == ("processes", "1.0 MB of input >= processes_above_bytes "
                                                             "= 1.0 MB: 2 worker processes")
    # Without a cluster, Ray on this one machine is never chosen: it only adds its start-up.
    assert choose_engine(config, 10**12)[0] == "processes"
    one_worker = DataPrepConfig(output_dir=str(tmp_path), workers=1, processes_above_bytes=0, ray_above_bytes=0)
    assert choose_engine(one_worker, 10**9) == ("local", "1000.0 MB of input, one worker: in-process")
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # a cluster: Ray even with one local worker
    assert choose_engine(one_worker, 10**9)[0] == "ray"
    assert choose_engine(DataPrepConfig(output_dir=str(tmp_path), ray_above_bytes=10**9), 10**9 - 1)[0] == \
        "processes"   # a cluster, but below ray_above_bytes
    assert choose_engine(DataPrepConfig(output_dir=str(tmp_path), engine="local", ray_above_bytes=0), 10**9) == \
        ("local", "engine='local' in the config")
    assert choose_engine(DataPrepConfig(output_dir=str(tmp_path), engine="ray"), 10)[0] == "ray"
    monkeypatch.delenv("RAY_ADDRESS")

    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": t * 3} for i, t in enumerate(PROSE)])
    with caplog.at_level(logging.INFO, logger="tasks.data.prep"):
        prepared = prepare(small_config(tmp_path, [source], engine="auto", workers=2))
    assert prepared.engine == "local" and "< processes_above_bytes" in prepared.engine_reason
    assert f"data prep engine: local ({prepared.engine_reason})" in caplog.text


def test_engine_param_reaches_the_config():
    from llmops.policy.params import lifecycle_params
    from llmops.stages.lifecycle import LifecycleParamError, resolve

    assert lifecycle_params()["data_engine"].schema["enum"] == [None, "auto", "processes", "ray", "local"]
    assert resolve({"recipe": "tiny"}).data.engine == "auto"
    assert resolve({"recipe": "tiny", "data_engine": "ray"}).data.engine == "ray"
    with pytest.raises(LifecycleParamError, match="Param 'data_engine'"):
        resolve({"recipe": "tiny", "data_engine": "spark"})
