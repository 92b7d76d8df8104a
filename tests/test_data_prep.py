"""Data prep on small inputs made here: what a user of the prepared data set would notice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.common.io import sha256_file
from tasks.configs import DataPrepConfig
from tasks.data.prep import EOS, load_manifest, normalize_text, open_token_rows, prepare, split_score

REPO = Path(__file__).resolve().parents[1]
MANIFEST_KEYS = {"config", "tokenizer", "tokenizer_sha256", "vocab_size", "eos_id", "dtype",
                 "seq_len", "row_len", "splits", "sft", "counts", "content_hash"}
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


def small_config(tmp_path: Path, inputs: list[Path], **overrides) -> DataPrepConfig:
    settings = dict(inputs=[str(p) for p in inputs], output_dir=str(tmp_path / "out"),
                    demo_sft_examples=30, vocab_size=280, seq_len=8, min_chars=20, engine="local")
    return DataPrepConfig(**{**settings, **overrides})


def dropped_by_id(out_dir: str | Path) -> dict[str, dict]:
    lines = (Path(out_dir) / "dropped.jsonl").read_text().splitlines()
    return {r["id"]: r for r in map(json.loads, lines)}


def output_files(out_dir: Path) -> dict[str, float]:
    return {str(p.relative_to(out_dir)): p.stat().st_mtime_ns for p in out_dir.rglob("*") if p.is_file()}


def test_normalize_text():
    assert normalize_text("Cafe\u0301") == "Caf\u00e9"  # NFC composes e + combining accent
    assert normalize_text("  a \t\u00a0 b\r\nc  ") == "a b\nc"
    assert normalize_text("bell\x07 and\x00 null\x1b") == "bell and null"
    assert normalize_text("tab\tand\x0cfeed") == "tab and feed"  # whitespace controls separate words
    assert normalize_text("one\n\n\n\n two") == "one\n\ntwo"


def test_bad_input_is_quarantined_with_its_reason(tmp_path):
    good = [{"id": f"good-{i}", "text": text} for i, text in enumerate(PROSE)]
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
        fh.write(b'{"id": "controls-only", "text": "\\u0000\\u0007\\u001b"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    text_file = tmp_path / "notes.txt"
    text_file.write_bytes(b"A plain text paragraph that is long enough to keep.\n\n"
                          b"Another block, \xff\xfe broken bytes inside.\n")

    config = small_config(tmp_path, [jsonl, empty, text_file])
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
        "controls-only": "empty_after_normalize",
        "empty.jsonl": "empty_file",
        "notes.txt:3": "invalid_utf8",
    }
    assert dropped["short"]["step"] == "drop_short" and dropped["mixed.jsonl:7"]["step"] == "parse"
    counts = manifest["counts"]
    assert counts["kept_documents"] == len(PROSE) + 1  # + the good text paragraph
    assert counts["kept_documents"] + sum(counts["dropped"].values()) == counts["input_documents"]


def test_exact_duplicates_across_shards_are_dropped(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [{"id": f"a{i}", "text": t} for i, t in enumerate(PROSE)])
    # Same text up to whitespace: a duplicate once normalized.
    second = write_jsonl(tmp_path / "b.jsonl", [{"id": "b0", "text": "  " + PROSE[2].replace(" ", "   ")},
                                                {"id": "b1", "text": "Something new, never seen before in a."}])
    config = small_config(tmp_path, [first, second])
    manifest = prepare(config).manifest

    dropped = dropped_by_id(config.output_dir)
    assert dropped == {"b0": {"id": "b0", "line": 1, "shard": 1, "step": "dedup",
                              "reason": "exact_duplicate", "duplicate_of": "a2"}}
    assert manifest["counts"] == {"input_documents": 8, "kept_documents": 7,
                                  "dropped": {"exact_duplicate": 1}}


def test_split_is_deterministic_and_seeded(tmp_path):
    docs = [{"id": f"doc-{i}", "text": f"Document number {i} says: {PROSE[i % len(PROSE)]}"}
            for i in range(200)]
    source = write_jsonl(tmp_path / "docs.jsonl", docs)

    def run(name: str, seed: int) -> tuple[set[str], dict]:
        config = small_config(tmp_path / name, [source], val_fraction=0.2, seed=seed)
        manifest = prepare(config).manifest
        val = {d["id"] for d in docs if split_score(d["id"], seed) < 0.2}
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
    # The content hash covers every file the stage wrote (markers and the manifest aside).
    import hashlib

    files = sorted(p for p in tiny_data_dir.rglob("*") if p.is_file()
                   and p.name != "manifest.json" and "completions" not in p.parts)
    listing = "".join(f"{p.relative_to(tiny_data_dir)}\t{sha256_file(p)}\n" for p in files)
    assert manifest["content_hash"] == hashlib.sha256(listing.encode()).hexdigest()


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
    # Decoded rows read as the corpus: documents separated by EOS.
    train = np.concatenate(open_token_rows(tiny_data_dir, "train")).ravel().tolist()
    text = tokenizer.decode(train, skip_special_tokens=False)
    kept = [json.loads(line)["text"] for line in (tiny_data_dir / "shards/00000.docs.jsonl").open()]
    assert sum(doc in text.split(EOS) for doc in kept) > len(kept) // 2
    # Numbers are spelled one digit per token, so the instruction task can be learned.
    assert tokenizer.encode(" 4173").tokens == ["Ġ", "4", "1", "7", "3"]
    # The SFT task shapes the tokenizer but never appears in the pretraining rows.
    assert "What number comes" not in text


def test_rerun_is_a_noop_and_crash_resume_redoes_only_unfinished_steps(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"id": f"d{i}", "text": t * 3} for i, t in enumerate(PROSE)])
    config = small_config(tmp_path, [source])
    out = Path(config.output_dir)
    first = prepare(config)
    before = output_files(out)

    again = prepare(config)
    assert again.reused and again.manifest == first.manifest
    assert output_files(out) == before  # nothing rewritten

    # A crash while writing tokens: the manifest and the tokens marker never got written.
    (out / "manifest.json").unlink()
    (out / "completions/tokens.json").unlink()
    (out / "tokens/val_00000.bin").unlink()
    resumed = prepare(config)
    assert resumed.manifest["content_hash"] == first.manifest["content_hash"]
    after = output_files(out)
    assert after["shards/00000.docs.jsonl"] == before["shards/00000.docs.jsonl"]
    assert after["tokenizer.json"] == before["tokenizer.json"]
    assert after["tokens/train_00000.bin"] != before["tokens/train_00000.bin"]

    # A crash, then the input changes before the rerun: every step that read it is redone, and
    # the result is what a fresh run on the new input gives.
    (out / "manifest.json").unlink()
    with open(source, "a") as fh:
        fh.write(json.dumps({"id": "late", "text": "A document added after the crash, before the rerun."}) + "\n")
    resumed_on_new_input = prepare(config).manifest
    fresh = prepare(small_config(tmp_path / "fresh", [source])).manifest
    assert resumed_on_new_input["content_hash"] == fresh["content_hash"] != first.manifest["content_hash"]
    assert resumed_on_new_input["counts"]["input_documents"] == len(PROSE) + 1

    changed = small_config(tmp_path, [source], seq_len=16)
    with pytest.raises(ValueError, match=r"different config \(fields \['seq_len'\] differ\)"):
        prepare(changed)


def test_too_little_data_for_a_val_row_fails_clearly(tmp_path):
    source = write_jsonl(tmp_path / "one.jsonl", [{"id": "only", "text": PROSE[0]}])
    with pytest.raises(ValueError, match="Add more input data or lower DataPrepConfig.seq_len"):
        prepare(small_config(tmp_path, [source], seq_len=512))


def test_tiny_inputs_still_get_a_val_row(tmp_path):
    source = write_jsonl(tmp_path / "few.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(PROSE)])
    manifest = prepare(small_config(tmp_path, [source], val_fraction=0.0)).manifest
    assert manifest["splits"]["val"]["rows"] >= 1 and manifest["splits"]["train"]["rows"] >= 1


def test_missing_input_names_the_pattern(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here/\\*.jsonl"):
        prepare(small_config(tmp_path, [tmp_path / "nothing-here/*.jsonl"]))


def test_ray_engine_writes_the_same_data_as_local(tmp_path):
    pytest.importorskip("ray")
    docs = [{"id": f"d{i}", "text": f"{i}: {PROSE[i % len(PROSE)]}"} for i in range(60)]
    inputs = [write_jsonl(tmp_path / f"part{k}.jsonl", docs[k::3]) for k in range(3)]
    local = prepare(small_config(tmp_path / "local", inputs, engine="local")).manifest
    on_ray = prepare(small_config(tmp_path / "ray", inputs, engine="ray", workers=2)).manifest
    assert on_ray["content_hash"] == local["content_hash"]


def test_cli_writes_result_and_logs_to_mlflow(tmp_path):
    config = {"output_dir": str(tmp_path / "out"), "demo_corpus_docs": 200, "demo_sft_examples": 30,
              "vocab_size": 280, "seq_len": 16, "engine": "local"}
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
    assert result["outputs"] == {"data_dir": str(tmp_path / "out"),
                                 "manifest": str(tmp_path / "out" / "manifest.json")}
    assert result["metrics"]["documents_in"] == 200
    assert result["metrics"]["train_tokens"] == manifest["splits"]["train"]["tokens"] > 0
    assert not (tmp_path / "mlflow.db").exists()  # conftest points MLflow at a temp dir

    import mlflow

    [run] = mlflow.search_runs(experiment_names=["llmops"], output_format="list",
                               filter_string=f"params.output_dir = '{tmp_path / 'out'}'")
    assert run.data.metrics["documents_in"] == 200
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"manifest.json", "config.json", "data_prep.png"} <= artifacts


@pytest.mark.parametrize("bad, field", [({"vocab_size": 10}, "vocab_size"),
                                        ({"egnine": "local"}, "egnine")])
def test_cli_refuses_an_invalid_config_with_exit_code_2(tmp_path, bad, field):
    (tmp_path / "config.json").write_text(json.dumps({"output_dir": str(tmp_path / "out"), **bad}))
    proc = subprocess.run([sys.executable, "-m", "tasks.data.prep", "--config", str(tmp_path / "config.json"),
                           "--result", str(tmp_path / "result.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert field in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "result.json").exists()
