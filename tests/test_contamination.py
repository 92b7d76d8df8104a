"""The contamination audit (tasks/data/contamination.py) on a real data prep output, and what the
gate does with it (plugins/llmops/promotion.py): items seen in training are found, named and left
out of the scores; past the allowed share every candidate is refused."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.data import contamination
from tasks.data.contamination import NgramIndex, audit, build_index, seen_mask


def _documents(data_dir: Path, split: str) -> list[str]:
    texts = []
    for path in sorted((data_dir / "documents").glob("*.parquet")):
        table = pq.read_table(path, columns=["text", "split"]).to_pydict()
        texts += [t for t, s in zip(table["text"], table["split"]) if s == split]
    return texts


def test_data_prep_indexes_the_training_text_and_the_audit_finds_what_it_holds(tiny_data_dir):
    meta = json.loads((tiny_data_dir / "ngrams" / "index.json").read_text())
    manifest = json.loads((tiny_data_dir / "manifest.json").read_text())
    assert meta["n"] == 13 and meta["data_content_hash"] == manifest["content_hash"]
    assert meta["sources"]["pretrain"]["unique_runs"] > 1000 and meta["sources"]["sft"]["documents"]
    index = NgramIndex(tiny_data_dir)

    train = next(t for t in _documents(tiny_data_dir, "train") if len(t.split()) > 60)
    span = " ".join(train.split()[20:45])
    leaked = f"Question: {span.upper()}?! Answer: yes"          # case and punctuation do not hide it
    val = next(t for t in _documents(tiny_data_dir, "val") if len(t.split()) > 60)
    held_out = " ".join(val.split()[20:45])                      # evaluation's own text
    novel = ("the violet kettle hummed eleven quiet sonnets beneath a borrowed lighthouse while "
             "seventeen patient otters audited the harbour")
    sft = json.loads((tiny_data_dir / "sft" / "train.jsonl").read_text().splitlines()[0])
    sft_text = f"{sft['prompt']} {sft['completion']}"
    texts = [leaked, held_out, novel, "too short to check", sft_text]
    found = audit(index, texts)
    assert found["items"] == 5
    hits = {entry["item"]: entry["found_in"] for entry in found["seen"]}
    assert set(hits) <= {0, 4} and 0 in hits and hits[0]["pretrain"] >= 10
    assert 1 not in hits and 2 not in hits
    assert found["too_short"] >= 1                   # counted, never passed as clean
    if len(contamination.words(sft_text)) >= 13:
        assert "sft" in hits[4]
    assert seen_mask(found)[0] == "1" and seen_mask(found)[2] == "0"


def test_the_index_is_rebuilt_only_for_other_data(tiny_data_dir, tmp_path):
    first = build_index(tiny_data_dir, out_dir=tmp_path)
    marker = tmp_path / "ngrams" / "index.json"
    stamp = marker.stat().st_mtime_ns
    assert build_index(tiny_data_dir, out_dir=tmp_path) == first and marker.stat().st_mtime_ns == stamp
    assert build_index(tiny_data_dir, n=8, out_dir=tmp_path)["n"] == 8   # another n: rebuilt
    # a build that crashed before its index.json left a part no documents file has now
    import numpy as np
    stale = np.array([2**63 + 12345], dtype=np.uint64)
    (tmp_path / "ngrams" / "parts" / "pretrain").mkdir(parents=True)
    np.save(tmp_path / "ngrams" / "parts" / "pretrain" / "gone.npy", stale)
    build_index(tiny_data_dir, n=7, out_dir=tmp_path)
    bucket = int(contamination._bucket_of(stale, contamination.BUCKETS)[0])
    assert stale[0] not in np.load(tmp_path / "ngrams" / "pretrain" / f"bucket-{bucket:03d}.npy")


def _results(correct: str, seen: str = "") -> dict:
    out = {"n": len(correct), "items": hashlib.sha256(b"suite").hexdigest()[:16], "correct": correct}
    return {**out, "seen": seen} if seen else out


def test_the_gate_scores_without_seen_items_and_refuses_past_the_share():
    from llmops import promotion
    from tasks.configs import GateConfig

    # 10 items; the challenger is right on 3 items the training data holds, and on 4 of the other 7
    seen = "1110000000"
    evaluation = {
        "metrics": {"challenger.task_accuracy": 0.7, "challenger.perplexity": 20.0,
                    "champion.task_accuracy": 0.6, "champion.perplexity": 20.0},
        "models": {"challenger": {"per_item": {"task_accuracy": _results("1111111000", seen)}},
                   "champion": {"per_item": {"task_accuracy": _results("0001111110", seen)}}},
        "contamination": {"task_accuracy": {"items": 10, "checked": 10, "too_short": 0,
                                            "contaminated": 3}}}
    lenient = GateConfig(min_task_accuracy=0.0, champion_margins={"task_accuracy": 0.0},
                         max_contaminated_share=0.5)
    clean = promotion.clean_metrics(lenient, evaluation)
    assert clean["challenger.task_accuracy"] == pytest.approx(4 / 7)     # 0.7 with the leak
    assert clean["champion.task_accuracy"] == pytest.approx(6 / 7)
    assert promotion.gate_decisions(lenient, evaluation, ("challenger",))["challenger"] == [
        "task_accuracy 0.5714 is worse than the champion's 0.8571 (at most -0 allowed)"]
    counted = GateConfig(min_task_accuracy=0.0, champion_margins={"task_accuracy": 0.0},
                         max_contaminated_share=0.5, exclude_contaminated=False)
    assert promotion.gate_decisions(counted, evaluation, ("challenger",))["challenger"] == []

    strict = GateConfig(min_task_accuracy=0.0, champion_margins={})    # default share: 25%
    (reason,) = promotion.gate_decisions(strict, evaluation, ("challenger",))["challenger"]
    assert reason.startswith("task_accuracy: 3 of 10 items (30%) appear in the training data, "
                             "more than max_contaminated_share 25%")


def test_buckets_are_hash_ranges_so_each_bucket_reads_one_slice_of_a_sorted_part():
    import numpy as np

    rng = np.random.default_rng(0)
    for buckets in (1, 3, 7, 16, 1000):
        starts = [-(-b * (1 << 32) // buckets) << 32 for b in range(1, buckets)]
        edges = [x + d for x in starts for d in (-1, 0, 1)] + [0, 2**64 - 1]
        hashes = np.unique(np.concatenate([rng.integers(0, 2**64 - 1, 20000, dtype=np.uint64, endpoint=True),
                                           np.array(edges, dtype=np.uint64)]))
        which = contamination._bucket_of(hashes, buckets)
        assert which.min() >= 0 and which.max() == buckets - 1 and (np.diff(which) >= 0).all()
        for b in range(buckets):
            assert np.array_equal(contamination._bucket_slice(hashes, b, buckets), hashes[which == b])


def test_an_index_of_the_old_layout_is_rebuilt_not_misread(tiny_data_dir, tmp_path):
    root = tiny_data_dir / "ngrams"
    assert not (root / "parts").exists()              # the merge's input is gone once the index is
    assert len(list(root.rglob("*.npy"))) == 2 * contamination.BUCKETS
    old = tmp_path / "old"
    shutil.copytree(tiny_data_dir, old)
    meta = json.loads((old / "ngrams" / "index.json").read_text())
    del meta["bucketing"]                             # as versions before range buckets wrote it
    (old / "ngrams" / "index.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="older version"):
        NgramIndex(old)
    index = contamination.open_index(old, tmp_path / "scratch")
    assert index.root == tmp_path / "scratch" / "ngrams"
    train = next(t for t in _documents(old, "train") if len(t.split()) > 60)
    assert index.hits(" ".join(train.split()[:30]))["pretrain"] >= 10
