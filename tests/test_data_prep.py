"""Data prep end to end on inputs made here: what a user of the prepared data set would notice."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.common.io import sha256_file
from tasks.configs import DATA_QUALITY_FILTERS, DataPrepConfig
from tasks.data.dedup import MinHasher
from tasks.data.engine import host_share
from tasks.data.manifest import load_manifest, open_token_rows
from tasks.data.prep import EOS, normalize_text, prepare
from tasks.data.split import SplitCuts, plan_by_shard, plan_split, shard_candidates, split_score
from tasks.data.pipeline import build_pipeline
from tasks.data.steps import Doc, run_steps

REPO = Path(__file__).resolve().parents[1]
MANIFEST_KEYS = {"config", "tokenizer", "tokenizer_sha256", "vocab_size", "eos_id", "dtype",
                 "seq_len", "row_len", "splits", "sft", "counts", "content_hash", "steps", "sources",
                 "documents", "dropped", "length_histogram", "files"}
PROSE = [
    "The quick brown fox jumps over the lazy dog while the cat watches from the fence.",
    "A journey of a thousand miles begins with a single step, or so the proverb says.",
    "Data pipelines fail in the small hours, which is why every step writes atomically.",
    "Tokenizers split text into pieces; a byte-level tokenizer never meets an unknown character.",
    "Exact deduplication removes copies; near-duplicate removal is a later, fuzzier step.",
    "Validation data must never leak into training, or the loss curve tells a comforting lie.",
]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def small_config(tmp_path: Path, inputs: list, **overrides) -> DataPrepConfig:
    """One-sentence documents do not pass the web-text quality filters: they are off here unless
    a test turns them on."""
    settings = dict(inputs=[str(p) for p in inputs], output_dir=str(tmp_path / "out"), filters=[],
                    demo_sft_examples=30, vocab_size=280, seq_len=8, min_chars=20, engine="local")
    return DataPrepConfig(**{**settings, **overrides})


def read_rows(out_dir: str | Path, folder: str) -> list[dict]:
    return [row for path in sorted(Path(out_dir, folder).glob("*.parquet"))
            for row in pq.read_table(path).to_pylist()]


def dropped_by_id(out_dir: str | Path) -> dict[str, dict]:
    return {r["id"]: r for r in read_rows(out_dir, "dropped")}


def output_files(out_dir: Path) -> dict[str, float]:
    return {str(p.relative_to(out_dir)): p.stat().st_mtime_ns for p in out_dir.rglob("*") if p.is_file()}


def test_normalize_text():
    assert normalize_text("Cafe\u0301") == "Caf\u00e9"  # NFC composes e + combining accent
    assert normalize_text("  a \t\u00a0 b\r\nc  ") == "a b\nc"
    assert normalize_text("bell\x07 and\x00 null\x1b") == "bell and null"
    assert normalize_text("tab\tand\x0cfeed") == "tab and feed"  # whitespace controls separate words
    assert normalize_text("one\n\n\n\n two") == "one\n\ntwo"


def test_bad_input_is_quarantined_with_its_reason(tmp_path):
    good = [{"id": f"good-{i}", "text": text, "lang": "en"} for i, text in enumerate(PROSE)]
    jsonl = tmp_path / "mixed.jsonl"
    with open(jsonl, "wb") as fh:
        fh.write(b"".join(json.dumps(r).encode() + b"\n" for r in good))
        fh.write(b'{"id": "broken", "text": "no closing brace"\n')
        fh.write(b'{"id": "no-text", "body": "text is under the wrong key"}\n')
        fh.write(b'{"id": "null-text", "text": null}\n')
        fh.write(b'{"id": "blank", "text": "   \\n  "}\n')
        fh.write(b'{"id": "number", "text": 42}\n')
        fh.write(b'["a", "list"]\n')
        fh.write(b'{"id": "latin1", "text": "caf\xe9 au lait, which is not valid UTF-8 here"}\n')
        fh.write(b'{"id": "short", "text": "too short"}\n')
        fh.write(b'{"id": "controls", "text": "\\u0000\\u0007\\u001b and a few letters"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    text_file = tmp_path / "notes.txt"
    text_file.write_bytes(b"A plain text paragraph that is long enough to keep.\n\n"
                          b"Another block, \xff\xfe broken bytes inside.\n")
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet at all")
    (tmp_path / "truncated.jsonl.gz").write_bytes(gzip.compress(b'{"id": "x", "text": "y"}\n')[:20])
    pq.write_table(pa.table({"id": ["p1", None, "p3"], "text": [
        "Parquet rows carry their text in a column; the other columns become metadata.",
        "A row without an id is named after its file and row number, like a line in JSONL.", None],
                             "url": ["https://a.example", "https://b.example", "https://c.example"]}),
                   tmp_path / "table.parquet")

    config = small_config(tmp_path, [jsonl, empty, text_file, tmp_path / "*.parquet", tmp_path / "*.gz"])
    manifest = prepare(config).manifest

    dropped = dropped_by_id(config.output_dir)
    assert {doc_id: r["reason"] for doc_id, r in dropped.items()} == {
        "mixed.jsonl:7": "malformed_json",
        "no-text": "missing_text",
        "null-text": "missing_text",
        "blank": "empty_text",
        "number": "non_string_text",
        "mixed.jsonl:12": "not_an_object",
        "mixed.jsonl:13": "invalid_utf8",
        "short": "too_short",
        "controls": "binary_junk",
        "empty.jsonl": "empty_file",
        "notes.txt:3": "invalid_utf8",
        "corrupt.parquet": "unreadable_file",
        "truncated.jsonl.gz": "unreadable_file",
        "p3": "missing_text",
    }
    assert dropped["short"]["step"] == "min_chars" and dropped["mixed.jsonl:7"]["step"] == "parse"
    assert dropped["corrupt.parquet"]["detail"] and dropped["mixed.jsonl:7"]["line"] == 7
    documents = {r["id"]: r for r in read_rows(config.output_dir, "documents")}
    assert set(documents) == {*(r["id"] for r in good), "notes.txt:1", "p1", "table.parquet:2"}
    assert json.loads(documents["good-0"]["metadata"]) == {"lang": "en"}
    assert json.loads(documents["p1"]["metadata"]) == {"url": "https://a.example"}
    counts = manifest["counts"]
    assert counts["kept_documents"] == len(documents) == manifest["documents"]["rows"]
    assert counts["kept_documents"] + sum(counts["dropped"].values()) == counts["input_documents"] == 23


def test_filters_dedup_and_pii_end_to_end(tmp_path, prose_documents):
    """Real prose through the default steps: junk is dropped with the filter's reason, copies
    and near copies across files point at the document they copy, PII is redacted and counted."""
    steps = build_pipeline(DataPrepConfig(output_dir=str(tmp_path), redact_pii=False))
    passes = lambda text: run_steps(steps, Doc("x", text)) is None  # noqa: E731
    docs, shingle_sets = [], []
    for text in prose_documents[:150]:  # documents that pass, no two alike once cleaned
        doc = Doc("x", text)
        if run_steps(steps, doc) is not None:
            continue
        shingles = set(MinHasher().shingles(doc.text).tolist())
        if all(len(shingles & other) < 0.2 * len(shingles | other) for other in shingle_sets):
            docs.append(text)
            shingle_sets.append(shingles)
    docs = docs[:40]
    contact = "\n\nWrite to jane.doe@mail.example.org or call +1 202 555 0143 today."
    docs.insert(0, docs.pop(next(i for i, t in enumerate(docs) if passes(t + contact))))
    first = [{"id": f"a{i}", "text": text} for i, text in enumerate(docs[:20])]
    first[0]["text"] += contact
    second = [{"id": f"b{i}", "text": text} for i, text in enumerate(docs[20:])]
    second += [
        {"id": "copy", "text": "  " + docs[3].replace(" ", "   ")},  # equal once normalized
        {"id": "near", "text": docs[5].replace(" the ", " a ", 2) + " One more sentence at the end."},
        {"id": "stub", "text": "Click here. Home. About us."},
        {"id": "lorem", "text": docs[30] + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit."},
    ]
    a, b = write_jsonl(tmp_path / "a.jsonl", first), write_jsonl(tmp_path / "b.jsonl", second)
    config = small_config(tmp_path, [a, b], filters=list(DATA_QUALITY_FILTERS), seq_len=32)
    manifest = prepare(config).manifest

    dropped = dropped_by_id(config.output_dir)
    assert dropped["copy"]["reason"] == "exact_duplicate" and dropped["copy"]["duplicate_of"] == "a3"
    assert dropped["near"]["reason"] == "near_duplicate" and dropped["near"]["duplicate_of"] == "a5"
    assert (dropped["stub"]["step"], dropped["stub"]["reason"]) == ("gopher_repetition", "top_2_gram")
    assert dropped["lorem"]["reason"] == "lorem_ipsum" and dropped["lorem"]["step"] == "c4_quality"
    assert all(r["step"] in ("gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality", "dedup")
               for r in dropped.values())
    documents = {r["id"]: r["text"] for r in read_rows(config.output_dir, "documents")}
    assert "jane.doe" not in documents["a0"] and "email@example.com" in documents["a0"]
    assert "555-0100" in documents["a0"]
    steps = manifest["steps"]
    assert steps["pii"]["redacted.email"] == 1 and steps["pii"]["redacted.phone"] == 1
    assert steps["dedup"]["exact_duplicates"] == 1 and steps["dedup"]["near_duplicates"] >= 1
    counts = manifest["counts"]
    assert counts["kept_documents"] + sum(counts["dropped"].values()) == counts["input_documents"] == 44
    for step in ("gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality"):
        assert steps[step]["in"] == steps[step]["kept"] + sum(
            v for k, v in steps[step].items() if k.startswith("dropped."))


def _split_by_sorting(documents, seed, val_fraction, sample_docs, row_len):
    """The split as a driver holding every kept id would plan it: sorted lists."""
    ordered = sorted(documents, key=lambda d: split_score(d[2], seed))
    val = [d for d in ordered if split_score(d[2], seed) < val_fraction]
    train = [d for d in ordered if split_score(d[2], seed) >= val_fraction]
    sample = sorted(sorted(train, key=lambda d: split_score(d[2], seed + 1))[:sample_docs])
    return val, train, sample


@pytest.mark.parametrize("n, val_fraction", [(5000, 0.05), (300, 0.002), (40, 0.0)])
def test_split_plan_streams_what_sorting_every_id_decides(n, val_fraction):
    docs = [(i // 100, i % 100, f"doc-{i}") for i in range(n)] + [(99, 0, "doc-7")]  # a repeated id
    val, train, sample = _split_by_sorting(docs, 3, val_fraction, 64, 17)
    plan = plan_split(iter(docs), 3, val_fraction, sample_docs=64, row_len=17)
    assert (plan.kept, plan.train) == (len(docs), len(train))
    assert plan.sample == sample
    assert plan.lendable == train[:17]
    assert plan.val == (val if len(val) < 17 else None)


def _sharded_plan(docs, seed, val_fraction, sample_docs, row_len, cuts=None):
    """The plan as data prep makes it (plan_by_shard): each shard's candidates below the cuts,
    over JSON as an engine returns them, merged. Also the passes it took and the last parts."""
    shards = sorted({d[0] for d in docs})
    reports = []

    def report(cuts):
        reports.append([json.loads(json.dumps(shard_candidates((d for d in docs if d[0] == shard), seed,
                                                               val_fraction, sample_docs, row_len, cuts)))
                        for shard in shards])
        return reports[-1]

    plan = plan_by_shard(report, len(docs), val_fraction, sample_docs, row_len, cuts)
    return plan, len(reports), reports[-1]


@pytest.mark.parametrize("n, val_fraction, cuts", [
    (5000, 0.05, None),                          # cuts from the corpus: one pass
    (300, 0.02, None),                           # validation under a row: documents are lent
    (40, 0.0, None),                             # no validation at all
    # each cut far too narrow on its own: the merge must notice, and the pass run again
    (5000, 0.05, SplitCuts(sample_below=0.001)),
    (5000, 0.05, SplitCuts(lend_below=0.0501)),
    (300, 0.02, SplitCuts(lend_below=0.025)),
    (300, 0.02, SplitCuts(val_limit=0)),         # its validation documents went unreported
])
def test_split_plan_by_shard_equals_one_pass_over_every_id(n, val_fraction, cuts):
    docs = [(i // 100, i % 100, f"doc-{i}") for i in range(n)] + [(99, 0, "doc-7")]  # a repeated id
    expected = plan_split(iter(docs), 3, val_fraction, sample_docs=64, row_len=17)
    plan, passes, _ = _sharded_plan(docs, 3, val_fraction, 64, 17, cuts)
    assert plan == expected
    assert (passes == 1) == (cuts is None), passes


def test_split_candidates_do_not_grow_with_the_shards():
    """The driver merges about what the plan picks, not a sample's worth from every shard."""
    n, shards, sample_docs, row_len = 200_000, 40, 1000, 129
    docs = [(i * shards // n, i, f"document-{i:012d}") for i in range(n)]
    plan, passes, parts = _sharded_plan(docs, 1, 0.05, sample_docs, row_len)
    assert passes == 1 and plan == plan_split(iter(docs), 1, 0.05, sample_docs, row_len)
    sample = sum(len(p["sample"]) for p in parts)
    lendable = sum(len(p["lendable"]) for p in parts)
    assert sample_docs <= sample < 1.5 * sample_docs, sample        # not shards * sample_docs
    assert row_len <= lendable < 2.5 * row_len, lendable
    assert sum(len(p["val"]) for p in parts) == 0   # ~10,000 validation documents: none needed


def test_split_plan_memory_does_not_grow_with_the_corpus():
    """The driver's memory for the split is bounded by the sample and one row, not the corpus
    (benchmarks/data_prep_split_memory.py runs 10^8 ids)."""
    import tracemalloc

    def peak(n: int) -> int:
        ids = ((i // 1000, i % 1000, f"document-{i:012d}") for i in range(n))
        tracemalloc.start()
        plan = plan_split(ids, 1, 0.05, sample_docs=500, row_len=129)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert plan.kept == n and len(plan.sample) == 500
        return top

    small, large = peak(20_000), peak(200_000)
    assert large < 1.25 * small, (small, large)   # ten times the ids, not ten times the memory
    assert large < 2_000_000


def test_a_shards_duplicates_are_read_from_the_row_groups_that_hold_it(tmp_path):
    """staging/dedup.parquet is sorted by shard and, at scale, has many row groups: each shard
    gets exactly its own rows, wherever the row groups cut (here every 2 rows), and none when it
    has no duplicate."""
    from tasks.data.prep import _removed

    (tmp_path / "staging").mkdir()
    shards = [0, 0, 2, 2, 2, 5, 7]
    pq.write_table(pa.table({"shard": pa.array(shards, type=pa.int32()), "row": pa.array(range(7)),
                             "reason": [f"r{i}" for i in range(7)]}),
                   tmp_path / "staging" / "dedup.parquet", row_group_size=2)
    for index in range(9):
        expected = [i for i, s in enumerate(shards) if s == index]
        assert _removed(tmp_path, index, ["row", "reason"]) == {
            "row": expected, "reason": [f"r{i}" for i in expected]}, index


def test_split_is_deterministic_and_seeded(tmp_path):
    docs = [{"id": f"doc-{i}", "text": f"Document number {i} says: {PROSE[i % len(PROSE)]}"}
            for i in range(200)]
    source = write_jsonl(tmp_path / "docs.jsonl", docs)

    def run(name: str, seed: int) -> tuple[set[str], dict]:
        # Near dedup off: these differ only by a number, which shingles fold away.
        config = small_config(tmp_path / name, [source], val_fraction=0.2, seed=seed, near_dedup=False)
        manifest = prepare(config).manifest
        val = {d["id"] for d in docs if split_score(d["id"], seed) < 0.2}
        assert val == {r["id"] for r in read_rows(config.output_dir, "documents") if r["split"] == "val"}
        return val, manifest

    val, manifest = run("run1", seed=7)
    val_again, manifest_again = run("run2", seed=7)
    val_other_seed, _ = run("run3", seed=8)
    assert manifest["splits"]["val"]["documents"] == len(val)
    assert 20 <= len(val) <= 60  # about 20% of 200
    assert val == val_again and manifest["content_hash"] == manifest_again["content_hash"]
    assert val != val_other_seed


def test_manifest_keys_and_hashes_match_files(tiny_data_dir):
    manifest = load_manifest(tiny_data_dir)
    assert set(manifest) == MANIFEST_KEYS
    assert manifest["tokenizer_sha256"] == sha256_file(tiny_data_dir / manifest["tokenizer"])
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        assert entry["rows"] == sum(s["rows"] for s in entry["shards"]) > 0
        assert entry["tokens"] == entry["rows"] * manifest["row_len"]
        for shard in entry["shards"]:
            path = tiny_data_dir / shard["path"]
            assert sha256_file(path) == shard["sha256"]
            assert path.stat().st_size == shard["rows"] * manifest["row_len"] * itemsize
    for key in ("train", "eval"):
        lines = (tiny_data_dir / manifest["sft"][key]).read_text().splitlines()
        assert len(lines) == manifest["sft"][f"{key}_examples"] > 0
    index = json.loads((tiny_data_dir / "tokens/index.json").read_text())
    assert index["splits"] == manifest["splits"] and index["dtype"] == manifest["dtype"]
    # The content hash covers every file the stage left (markers, the manifest and the
    # contamination index derived from it aside: the index names the hash it was built from).
    files = sorted(p for p in tiny_data_dir.rglob("*") if p.is_file()
                   and p.name != "manifest.json" and "completions" not in p.parts
                   and "ngrams" not in p.parts)
    assert {str(p.relative_to(tiny_data_dir)): sha256_file(p) for p in files} == manifest["files"]
    listing = "".join(f"{p.relative_to(tiny_data_dir)}\t{sha256_file(p)}\n" for p in files)
    assert manifest["content_hash"] == hashlib.sha256(listing.encode()).hexdigest()
    assert not (tiny_data_dir / "staging").exists()


def test_every_input_document_is_kept_or_dropped_once(tiny_data_dir):
    inputs = [json.loads(line)["id"] for path in sorted((tiny_data_dir / "raw").glob("*.jsonl"))
              for line in path.read_text().splitlines()]
    kept = [r["id"] for r in read_rows(tiny_data_dir, "documents")]
    dropped = [r["id"] for r in read_rows(tiny_data_dir, "dropped")]
    assert sorted(kept + dropped) == sorted(inputs) and len(set(inputs)) == len(inputs)
    counts = load_manifest(tiny_data_dir)["counts"]
    assert (counts["input_documents"], counts["kept_documents"], sum(counts["dropped"].values())) \
        == (len(inputs), len(kept), len(dropped))
    assert len(kept) > len(inputs) / 2  # the demo corpus is prose: most of it passes


def test_rows_have_row_len_and_end_with_documents(tiny_data_dir):
    from tokenizers import Tokenizer

    manifest = load_manifest(tiny_data_dir)
    tokenizer = Tokenizer.from_file(str(tiny_data_dir / "tokenizer.json"))
    assert manifest["eos_id"] == tokenizer.token_to_id(EOS) == 0
    assert manifest["vocab_size"] == tokenizer.get_vocab_size() <= 300
    assert manifest["row_len"] == manifest["seq_len"] + 1 == 33
    for split in ("train", "val"):
        rows = np.concatenate(open_token_rows(tiny_data_dir, split))
        assert rows.shape[1] == manifest["row_len"] and rows.dtype == np.uint16
        assert (rows == 0).any() and rows.max() < manifest["vocab_size"]
    # Decoded rows read as the kept documents: documents separated by EOS.
    train = np.concatenate(open_token_rows(tiny_data_dir, "train")).ravel().tolist()
    text = tokenizer.decode(train, skip_special_tokens=False)
    kept = [r["text"] for r in read_rows(tiny_data_dir, "documents") if r["split"] == "train"]
    assert sum(doc in text.split(EOS) for doc in kept) > len(kept) // 2
    # Numbers are spelled one digit per token, so the instruction task can be learned.
    assert tokenizer.encode(" 4173").tokens == ["Ġ", "4", "1", "7", "3"]
    # The SFT task shapes the tokenizer but never appears in the pretraining rows.
    assert "What number comes" not in text


def test_rerun_is_a_noop_and_crash_resume_redoes_only_unfinished_steps(tmp_path, monkeypatch):
    import tasks.data.manifest as manifest

    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": t * 3} for i, t in enumerate(PROSE)])
    config = small_config(tmp_path, [source])
    out = Path(config.output_dir)

    # A crash while packing the validation rows: every earlier step finished, nothing after did.
    real_pack = manifest.pack_split

    def pack_then_crash(out_dir, split, *args):
        if split == "val":
            raise RuntimeError("simulated crash")
        return real_pack(out_dir, split, *args)

    monkeypatch.setattr(manifest, "pack_split", pack_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare(config)
    assert not (out / "manifest.json").exists() and (out / "staging").exists()
    before = output_files(out)
    monkeypatch.setattr(manifest, "pack_split", real_pack)

    resumed = prepare(small_config(tmp_path, [source], workers=1))  # layout fields may change
    after = output_files(out)
    for unchanged in ("documents/00000.parquet", "dropped/00000.parquet", "tokenizer.json",
                      "completions/shard_00000.json", "completions/final_00000.json"):
        assert after[unchanged] == before[unchanged], unchanged
    assert after["tokens/train_00000.bin"] != before["tokens/train_00000.bin"]  # packing is redone
    fresh = prepare(small_config(tmp_path / "fresh", [source]))
    assert resumed.manifest["content_hash"] == fresh.manifest["content_hash"]

    again = prepare(config)
    assert again.reused and again.manifest == resumed.manifest
    assert output_files(out) == after  # nothing rewritten

    # The manifest lost, then the input changes before the rerun: every step that read it is
    # redone, and the result is what a fresh run on the new input gives.
    (out / "manifest.json").unlink()
    with open(source, "a") as fh:
        fh.write(json.dumps({"id": "late", "text": "A document added after the crash, before the rerun."}) + "\n")
    resumed_on_new_input = prepare(config).manifest
    fresh_on_new_input = prepare(small_config(tmp_path / "fresh2", [source])).manifest
    assert resumed_on_new_input["content_hash"] == fresh_on_new_input["content_hash"] != fresh.manifest["content_hash"]
    assert resumed_on_new_input["counts"]["input_documents"] == len(PROSE) + 1

    changed = small_config(tmp_path, [source], seq_len=16)
    with pytest.raises(ValueError, match=r"different config \(fields \['seq_len'\] differ\)"):
        prepare(changed)


def test_restart_after_kill_mid_run(tmp_path, prose_documents):
    """SIGKILL the CLI once its first shard is done; the rerun keeps that shard's work, redoes
    the rest, and ends with exactly what an uninterrupted run writes."""
    inputs = []
    for k in range(4):
        records = [{"id": f"f{k}-{i}", "text": prose_documents[(k * 600 + i) % len(prose_documents)]}
                   for i in range(600)]
        inputs.append(write_jsonl(tmp_path / f"part{k}.jsonl", records))
    out = tmp_path / "out"
    (tmp_path / "config.json").write_text(json.dumps({"engine": "local", "seq_len": 32, "vocab_size": 300,
                                                      "demo_sft_examples": 30}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "plugins")])}
    env.pop("MLFLOW_TRACKING_URI", None)  # standalone CLI: no tracking store
    proc = subprocess.Popen([sys.executable, "-m", "tasks.data.prep", "--input", *map(str, inputs),
                             "--output", str(out), "--config", str(tmp_path / "config.json")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    first_marker = out / "completions" / "shard_00000.json"
    deadline = time.time() + 120
    while not first_marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert first_marker.exists(), proc.stdout.read().decode()[-3000:]
    assert not (out / "manifest.json").exists() and not (out / "completions/shard_00003.json").exists()
    kept_work = first_marker.stat().st_mtime_ns

    config = DataPrepConfig(inputs=[str(p) for p in inputs], output_dir=str(out), engine="local",
                            seq_len=32, vocab_size=300, demo_sft_examples=30)
    resumed = prepare(config)
    assert first_marker.stat().st_mtime_ns == kept_work  # the finished shard was not redone
    assert not list(out.rglob(".*.tmp"))  # what the kill left half-written is gone
    fresh = prepare(DataPrepConfig(**{**config.__dict__, "output_dir": str(tmp_path / "fresh")}))
    assert resumed.manifest["content_hash"] == fresh.manifest["content_hash"]
    assert resumed.manifest["counts"]["input_documents"] == 2400


def test_too_little_data_for_a_val_row_fails_clearly(tmp_path):
    source = write_jsonl(tmp_path / "one.jsonl", [{"id": "only", "text": PROSE[0]}])
    with pytest.raises(ValueError, match="Add more input data or lower DataPrepConfig.seq_len"):
        prepare(small_config(tmp_path, [source], seq_len=512))


def test_tiny_inputs_still_get_a_val_row(tmp_path):
    from tokenizers import Tokenizer

    source = write_jsonl(tmp_path / "few.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(PROSE)])
    config = small_config(tmp_path, [source], val_fraction=0.0)
    manifest = prepare(config).manifest
    assert manifest["splits"]["val"]["rows"] >= 1 and manifest["splits"]["train"]["rows"] >= 1
    # The lent documents are the training documents of lowest split score, and no more of them
    # than it takes to fill one row: without the last one lent, validation holds less than a row.
    documents = read_rows(config.output_dir, "documents")
    by_score = sorted(documents, key=lambda d: split_score(d["id"], config.seed))
    lent = [d for d in by_score if d["split"] == "val"]
    assert lent == by_score[:len(lent)]
    tokenizer = Tokenizer.from_file(str(Path(config.output_dir) / "tokenizer.json"))
    tokens = [len(tokenizer.encode(d["text"], add_special_tokens=False).ids) + 1 for d in lent]
    assert sum(tokens[:-1]) < config.seq_len + 1 <= sum(tokens)


def test_missing_input_names_the_pattern(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here/\\*.jsonl"):
        prepare(small_config(tmp_path, [tmp_path / "nothing-here/*.jsonl"]))


def test_s3_inputs_mix_weights_and_a_given_tokenizer(tmp_path, moto_s3, tiny_data_dir):
    moto_s3.create_bucket(Bucket="corpus")
    web = [{"id": f"web-{i}", "text": f"{i} {PROSE[i % 6]} {PROSE[(i + 1) % 6]}"} for i in range(40)]
    moto_s3.put_object(Bucket="corpus", Key="raw/web/part-0.jsonl",
                       Body="".join(json.dumps(r) + "\n" for r in web).encode())
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": [f"book-{i}" for i in range(30)],
                             "text": [f"Chapter {i}. {PROSE[(i + 2) % 6]} {PROSE[(i + 4) % 6]}" for i in range(30)]}), sink)
    moto_s3.put_object(Bucket="corpus", Key="raw/books/part-0.parquet", Body=sink.getvalue().to_pybytes())
    moto_s3.put_object(Bucket="corpus", Key="tok/tokenizer.json",
                       Body=(tiny_data_dir / "tokenizer.json").read_bytes())

    config = small_config(tmp_path, ["s3://corpus/raw/web/*.jsonl", "s3://corpus/raw/books/"],
                          input_weights=[1.0, 2.0], near_dedup=False, val_fraction=0.1,
                          tokenizer_path="s3://corpus/tok/tokenizer.json")
    manifest = prepare(config).manifest

    web_source, book_source = manifest["sources"]
    assert (web_source["documents_in"], book_source["documents_in"]) == (40, 30)
    assert web_source["train_tokens"] == web_source["unweighted_train_tokens"] > 0
    assert book_source["train_tokens"] == 2 * book_source["unweighted_train_tokens"] > 0
    assert manifest["tokenizer_sha256"] == sha256_file(tiny_data_dir / "tokenizer.json")
    sources = {r["source"] for r in read_rows(config.output_dir, "documents")}
    assert sources == {"s3://corpus/raw/web/part-0.jsonl", "s3://corpus/raw/books/part-0.parquet"}

    half_config = small_config(tmp_path / "half", config.inputs, input_weights=[0.5, 0.0], near_dedup=False,
                               val_fraction=0.1, tokenizer_path=config.tokenizer_path)
    half = prepare(half_config).manifest
    web_half, books_none = half["sources"]
    assert 0.2 < web_half["train_tokens"] / web_half["unweighted_train_tokens"] < 0.8
    assert books_none["train_tokens"] == 0 and books_none["documents_kept"] == 30

    # What a checkpoint saw, under a mix (issue 25.3): each training document's rows are found as
    # often as its source's weight put it in (tasks.train.seen replays the packing, and checks
    # every occurrence's tokens against the rows on disk); only the stream's unfilled tail, at
    # most one occurrence, is missing.
    from tasks.data.split import mix_repeats
    from tasks.train import seen

    for cfg in (config, half_config):
        weights = dict(zip(("web", "book"), cfg.input_weights))
        train = [r["id"] for r in read_rows(cfg.output_dir, "documents") if r["split"] == "train"]
        expected = {d: mix_repeats(d, weights[d.split("-")[0]], cfg.seed) for d in train}
        found = {d: len(seen.document_rows(cfg.output_dir, d)) for d in train}
        short = {d: (found[d], n) for d, n in expected.items() if found[d] != n}
        assert sum(n - f for f, n in short.values()) <= 1 and all(f <= n for f, n in short.values()), short
        assert {n for n in expected.values()} >= ({1, 2} if cfg is config else {0, 1})


def test_two_hosts_then_finalize_match_one_machine(tmp_path, monkeypatch):
    """The SageMaker contract: each host processes its share of the shards into its own output
    directory; the directories merged, one finalize job writes the same data set as one machine."""
    docs = [{"id": f"d{i}", "text": f"{PROSE[i % 6]} Case {i}: {PROSE[(i * 5) % 6]}"} for i in range(90)]
    inputs = [write_jsonl(tmp_path / f"part{k}.jsonl", docs[k::3]) for k in range(3)]
    single = prepare(small_config(tmp_path / "single", inputs, near_dedup=False)).manifest

    merged = tmp_path / "merged" / "out"
    for rank in (0, 1):
        monkeypatch.setenv("DATA_PREP_HOST_RANK", str(rank))
        monkeypatch.setenv("DATA_PREP_NUM_HOSTS", "2")
        host = prepare(small_config(tmp_path / f"host{rank}", inputs, near_dedup=False), stage="shards")
        assert host.manifest["shards_processed"] == (2 if rank == 0 else 1)
        shutil.copytree(tmp_path / f"host{rank}" / "out", merged, dirs_exist_ok=True)
    monkeypatch.delenv("DATA_PREP_HOST_RANK")
    monkeypatch.delenv("DATA_PREP_NUM_HOSTS")

    (merged / "completions" / "shard_00002.json").rename(tmp_path / "held_back.json")
    with pytest.raises(RuntimeError, match=r"1 shard\(s\) have no completion marker.*00002"):
        prepare(small_config(tmp_path / "merged", inputs, near_dedup=False), stage="finalize")
    (tmp_path / "held_back.json").rename(merged / "completions" / "shard_00002.json")
    final = prepare(small_config(tmp_path / "merged", inputs, near_dedup=False), stage="finalize").manifest
    assert final["content_hash"] == single["content_hash"]


def test_host_share_reads_sagemaker_resource_config(tmp_path, monkeypatch):
    monkeypatch.delenv("DATA_PREP_HOST_RANK", raising=False)
    monkeypatch.delenv("DATA_PREP_NUM_HOSTS", raising=False)
    config = tmp_path / "resourceconfig.json"
    config.write_text(json.dumps({"current_host": "algo-3", "hosts": ["algo-2", "algo-1", "algo-3"]}))
    assert host_share(str(config)) == (2, 3)
    assert host_share(str(tmp_path / "absent.json")) == (0, 1)
    monkeypatch.setenv("DATA_PREP_HOST_RANK", "3")
    monkeypatch.setenv("DATA_PREP_NUM_HOSTS", "3")
    with pytest.raises(ValueError, match="0 <= rank < hosts"):
        host_share(str(config))


def test_ray_and_process_engines_write_the_same_data_as_local(tmp_path):
    """Shards (one file in byte-range splits), dedup buckets and the documents-and-tokens step on
    two workers, in a process pool (what auto picks above processes_above_bytes) or on Ray Data,
    write byte for byte what the in-process engine writes."""
    pytest.importorskip("ray")
    docs = [{"id": f"d{i}", "text": f"{i}: {PROSE[i % len(PROSE)]} {PROSE[(i * 7) % 6]}"} for i in range(60)]
    inputs = [write_jsonl(tmp_path / f"part{k}.jsonl", docs[k::3]) for k in range(3)]
    layout = dict(split_bytes=2048, dedup_buckets=4)
    local = prepare(small_config(tmp_path / "local", inputs, engine="local", **layout)).manifest
    pooled = prepare(small_config(tmp_path / "pool", inputs, engine="auto", processes_above_bytes=0, workers=2,
                                  **layout))
    on_ray = prepare(small_config(tmp_path / "ray", inputs, engine="ray", workers=2, **layout))
    assert pooled.engine == "processes" and pooled.manifest["content_hash"] == local["content_hash"]
    assert on_ray.engine == "ray" and on_ray.manifest["content_hash"] == local["content_hash"]
    assert len(local["documents"]["files"]) > len(inputs)  # the files were split

    def contamination_index(folder):   # built by map jobs on the engine; outside content_hash
        return {p.relative_to(folder): sha256_file(p) for p in sorted((folder / "out" / "ngrams").rglob("*.*"))}

    assert contamination_index(tmp_path / "pool") == contamination_index(tmp_path / "local") != {}
    assert contamination_index(tmp_path / "ray") == contamination_index(tmp_path / "local")


def test_cli_writes_result_and_logs_to_mlflow(tmp_path):
    config = {"output_dir": str(tmp_path / "out"), "demo_corpus_docs": 200, "demo_sft_examples": 30,
              "vocab_size": 280, "seq_len": 16, "engine": "processes", "workers": 2, "split_bytes": 16384}
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "plugins")])}
    env.pop("MLFLOW_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-m", "tasks.data.prep", "--config", str(tmp_path / "config.json"),
                           "--result", str(tmp_path / "result.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    manifest = load_manifest(tmp_path / "out")
    assert result["data_hash"] == manifest["content_hash"]
    assert len(manifest["documents"]["files"]) > 1
    assert result["outputs"] == {"data_dir": str(tmp_path / "out"),
                                 "manifest": str(tmp_path / "out" / "manifest.json")}
    assert result["metrics"]["documents_in"] == 200
    assert result["metrics"]["train_tokens"] == manifest["splits"]["train"]["tokens"] > 0
    assert not (tmp_path / "mlflow.db").exists()  # conftest points MLflow at a temp dir

    import mlflow

    [run] = mlflow.search_runs(experiment_names=["llmops"], output_format="list",
                               filter_string=f"params.output_dir = '{tmp_path / 'out'}'")
    assert run.data.metrics["documents_in"] == 200
    assert run.data.metrics["documents_kept"] == manifest["counts"]["kept_documents"]
    assert run.data.tags["data_hash"] == manifest["content_hash"]
    # The shard functions live in __main__ here: the pool's workers import them by module name.
    assert run.data.tags["data_prep.engine"] == "processes"
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"manifest.json", "config.json", "data_prep.png"} <= artifacts


@pytest.mark.parametrize("bad, field", [({"vocab_size": 10}, "vocab_size"),
                                        ({"egnine": "local"}, "egnine"),
                                        ({"filter_params": {"c4_quality": {"min_sentences": 2}}}, "min_sentences")])
def test_cli_refuses_an_invalid_config_with_exit_code_2(tmp_path, bad, field):
    (tmp_path / "config.json").write_text(json.dumps({"output_dir": str(tmp_path / "out"), **bad}))
    proc = subprocess.run([sys.executable, "-m", "tasks.data.prep", "--config", str(tmp_path / "config.json"),
                           "--result", str(tmp_path / "result.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert field in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "result.json").exists()
