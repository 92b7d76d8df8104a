"""The contamination audit (tasks/data/contamination.py) on a real data prep output, and what the
gate does with it (plugins/llmops/policy/promotion.py): items seen in training are found, named and
left out of the scores; past the allowed share every candidate is refused. It counts as the
published definition does: a planted set is audited item for item against lm-evaluation-harness's
own code."""

from __future__ import annotations

import hashlib
import json
import random
import re
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
    from llmops.policy import promotion
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
    lenient = GateConfig(min_task_accuracy=0.0, metrics=["task_accuracy"], max_contaminated_share=0.5)
    clean = promotion.clean_metrics(lenient, evaluation)
    assert clean["challenger.task_accuracy"] == pytest.approx(4 / 7)     # 0.7 with the leak
    assert clean["champion.task_accuracy"] == pytest.approx(6 / 7)
    reasons, compared = promotion.judge(lenient, evaluation, ("challenger",))
    scored = compared["challenger"]["task_accuracy"]
    # the paired comparison drops the seen items from both models: 7 items, not 10
    assert (scored.n, scored.challenger, scored.champion) == (7, pytest.approx(4 / 7), pytest.approx(6 / 7))
    assert reasons["challenger"] == [scored.reason()] and "over 7 items" in scored.reason()
    counted = GateConfig(min_task_accuracy=0.0, metrics=["task_accuracy"], max_contaminated_share=0.5,
                         exclude_contaminated=False)
    scored = promotion.judge(counted, evaluation, ("challenger",))[1]["challenger"]["task_accuracy"]
    assert (scored.n, scored.challenger) == (10, pytest.approx(0.7))

    strict = GateConfig(min_task_accuracy=0.0, metrics=["task_accuracy"])    # default share: 25%
    reason = promotion.gate_decisions(strict, evaluation, ("challenger",))["challenger"][-1]
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


@pytest.mark.parametrize("missing", ["bucketing", "words"])
def test_an_index_of_the_old_layout_is_rebuilt_not_misread(tiny_data_dir, tmp_path, missing):
    """Versions before range buckets wrote no "bucketing"; versions that split words on `\\w+`
    wrote no "words": either index is rebuilt, never read with this version's map or words."""
    root = tiny_data_dir / "ngrams"
    assert not (root / "parts").exists()              # the merge's input is gone once the index is
    assert len(list(root.rglob("*.npy"))) == 2 * contamination.BUCKETS
    old = tmp_path / "old"
    shutil.copytree(tiny_data_dir, old)
    meta = json.loads((old / "ngrams" / "index.json").read_text())
    del meta[missing]
    (old / "ngrams" / "index.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="older version"):
        NgramIndex(old)
    index = contamination.open_index(old, tmp_path / "scratch")
    assert index.root == tmp_path / "scratch" / "ngrams"
    assert json.loads((index.root / "index.json").read_text())["words"] == contamination.WORDS
    train = next(t for t in _documents(old, "train") if len(t.split()) > 60)
    assert index.hits(" ".join(train.split()[:30]))["pretrain"] >= 10
    # data prep run again over the old data dir (nothing else to redo) rebuilds its index in place
    from tasks.configs import tiny
    from tasks.data.prep import prepare

    config = tiny().data
    config.output_dir, config.engine = str(old), "local"
    assert prepare(config).reused
    assert json.loads((old / "ngrams" / "index.json").read_text())["words"] == contamination.WORDS
    assert NgramIndex(old).hits(" ".join(train.split()[:30]))["pretrain"] >= 10


def test_on_the_tiny_recipe_the_audit_finds_2_of_20_cloze_items(tiny_data_dir, tmp_path):
    """The figure docs/researchers.md quotes: the tiny recipe's evaluation items (its EvalConfig,
    the demo suites evaluation writes), audited as evaluation audits them. The demo corpus is
    Python docstrings; `bytes` and `bytearray` document the same methods in the same words."""
    from tasks.configs import tiny
    from tasks.evaluate import item_texts, load_suites

    cfg = tiny().evaluate
    cfg.data_dir, cfg.output_dir = str(tiny_data_dir), str(tmp_path)
    index = NgramIndex(tiny_data_dir)
    found = {s.name: audit(index, item_texts([], s)) for s in load_suites(cfg)}
    cloze = found["prose_cloze"]
    assert (cloze["contaminated"], cloze["items"], cloze["too_short"]) == (2, 20, 0)
    assert [e["item"] for e in cloze["seen"]] == [18, 19]
    # the held-out SFT questions with their answers are all shorter than 13 words: unchecked
    assert (found["sft_choice"]["items"], found["sft_choice"]["too_short"]) == (20, 20)


# -- the published definition, on a planted set ------------------------------------------------

# Tokens that lm-evaluation-harness counts as one word and `\\w+` as two or three.
SPLIT_BY_OLD = ["i.e.", "I/O", "os.stat", "test's", "dbm-like", "e.g.", "read/write", "sys.path",
                "it's", "non-blocking", "utf-8", "don't", "str.join", "x-axis", "end-of-file"]
PLAIN = ("the a of to in is for on with as by file object return value if not be this that it "
         "path name mode data buffer line string bytes list module function method class call "
         "error raise set default open close read write new given when from are an or each "
         "which all more than one may will can number size first last time into directory "
         "process system user option argument result byte text type encoding socket stream "
         "handle window key item table index field entry record block page memory lock queue "
         "thread signal timer event loop task job worker server client request response header "
         "body cache store load save copy move delete create update match search sort filter "
         "map reduce split join format parse print check test run start stop wait retry").split()


def _normalize_reference():
    """lm-evaluation-harness's own code: Janitor.normalize_string and word_ngrams (its import
    prints a warning and a traceback: its C++ extension is not installed, nor needed here)."""
    from lm_eval.decontamination.janitor import Janitor, word_ngrams

    janitor = Janitor()                              # ngram_n=13, delete_chars=string.punctuation
    return janitor, lambda text: set(word_ngrams(janitor.normalize_string(text), 13))


def _disguise(words: list[str], rng: random.Random) -> str:
    """The same words as the definition reads them, written differently: case, punctuation
    added or dropped, other whitespace."""
    out = []
    for word in words:
        pick = rng.random()
        if pick < 0.2:
            word = word.upper()
        elif pick < 0.35:
            word = word.title()
        elif pick < 0.45:
            word = re.sub(r"[./'-]", "", word)       # os.stat -> osstat: the same word to them
        if rng.random() < 0.25:
            word = rng.choice(["(", '"', "'"]) + word + rng.choice([",", ".", "?!", ")", ";", ":", '"'])
        out.append(word)
    return "".join(w + rng.choice([" ", " ", "  ", "\n", "\t"]) for w in out).strip()


def _novel(rng: random.Random, count: int) -> list[str]:
    """Words the training text never holds."""
    return [f"zq{rng.randrange(10**6)}" for _ in range(count)]


def _planted_set(seed: int = 0):
    """Training documents and (kind, prompt, answer) evaluation items: 80 planted (13 to 30 words
    copied from training, disguised), 40 decoys (a 12-word training run holding tokens like
    `I/O`, between words training never holds), 214 clean (training's words in a new order, and
    12-word training runs of plain words), 6 too short."""
    rng = random.Random(seed)
    docs = []
    for _ in range(60):
        docs.append([rng.choice(SPLIT_BY_OLD) if rng.random() < 0.15 else rng.choice(PLAIN)
                     for _ in range(rng.randint(120, 200))])
    items = []

    def window(size: int, need_split: bool | None) -> list[str]:
        while True:
            doc = rng.choice(docs)
            start = rng.randrange(len(doc) - size)
            run = doc[start:start + size]
            if need_split is None or any(w in SPLIT_BY_OLD for w in run) == need_split:
                return run

    def item(kind: str, words: list[str]) -> None:
        cut = rng.randint(len(words) // 2, len(words) - 1)   # the gold answer ends the text
        items.append((kind, " ".join(words[:cut]), " " + " ".join(words[cut:])))

    for i in range(80):
        run = window(13 if i < 10 else rng.randint(14, 30), None)
        item("planted", _novel(rng, rng.randint(0, 5)) + _disguise(run, rng).split(" ")
             + _novel(rng, rng.randint(0, 5)))
    for _ in range(40):
        item("decoy", _novel(rng, rng.randint(1, 5)) + window(12, True) + _novel(rng, rng.randint(1, 5)))
    for i in range(214):
        if i < 40:
            item("clean", _novel(rng, 1) + window(12, False) + _novel(rng, 1))
        else:
            item("clean", [rng.choice(PLAIN + SPLIT_BY_OLD) for _ in range(rng.randint(13, 40))])
    for _ in range(6):
        item("short", window(rng.randint(3, 12), None))
    rng.shuffle(items)
    return [" ".join(d) for d in docs], items


def _planted_data_dir(root: Path, docs: list[str]) -> Path:
    """A data dir as data prep leaves it, as far as the index reads one: the manifest and the
    documents in two files (two map jobs), with one held-out document the index must not hold."""
    import pyarrow as pa

    (root / "documents").mkdir(parents=True)
    files = []
    for i, chunk in enumerate((docs[:30], docs[30:])):
        texts = chunk + ["held out " * 20] if i == 0 else chunk
        pq.write_table(pa.table({"text": texts, "split": ["train"] * len(chunk) + ["val"] * (len(texts) - len(chunk))}),
                       root / "documents" / f"part-{i:05d}.parquet")
        files.append(f"documents/part-{i:05d}.parquet")
    (root / "manifest.json").write_text(json.dumps({"content_hash": "planted", "documents": {"files": files}}))
    return root


def _audit_planted_suite(data_dir: Path, out: Path, items: list) -> tuple[list[str], dict, NgramIndex]:
    """Build the index and audit the items as evaluation does: a suite file of generation items,
    each item's text the prompt with its gold answer (tasks.evaluate.item_texts)."""
    from tasks.eval.suites import load_suite
    from tasks.evaluate import item_texts

    build_index(data_dir, out_dir=out)
    suite_file = out / "planted.jsonl"
    suite_file.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for _, p, a in items))
    texts = item_texts([], load_suite(suite_file))
    index = NgramIndex(out)
    return texts, audit(index, texts), index


def test_the_audit_agrees_item_for_item_with_lm_evaluation_harness_on_a_planted_set(tmp_path, monkeypatch):
    """80 planted items, 40 twelve-word decoys, 214 clean ones, 6 too short: our index and audit
    against lm-evaluation-harness's Janitor.normalize_string + word_ngrams over the same training
    text and items. Then the same set under the old word split (lower-cased `\\w+` runs, what
    this module did before): it flags all 40 decoys and one item of 12 whitespace words (too
    short to check), yet misses 3 planted items whose `os.stat` reads `osstat` (one word to the
    definition, two to `\\w+`): 118 of 340 items (35%), and the gate would refuse every
    candidate; the definition flags the 80 planted (24%, under the 25% allowed)."""
    from llmops.policy import promotion
    from tasks.configs import GateConfig

    docs, items = _planted_set()
    kinds = [kind for kind, _, _ in items]
    assert [kinds.count(k) for k in ("planted", "decoy", "clean", "short")] == [80, 40, 214, 6]
    data_dir = _planted_data_dir(tmp_path / "data", docs)
    texts, found, index = _audit_planted_suite(data_dir, tmp_path / "index", items)

    janitor, grams_of = _normalize_reference()
    for text in docs + texts:                        # the same words, text for text
        assert contamination.words(text) == janitor.normalize_string(text).split(), text[:200]
    training = set().union(*(grams_of(d) for d in docs))
    expected = [None if not grams_of(t) else len(grams_of(t) & training) for t in texts]
    assert [None if (hits := index.hits(t)) is None else hits.get("pretrain", 0)
            for t in texts] == expected              # how many of each item's 13-grams, item for item
    seen = {entry["item"] for entry in found["seen"]}
    assert seen == {i for i, count in enumerate(expected) if count}
    assert found["too_short"] == sum(count is None for count in expected) == 6
    assert index.hits("held out " * 10) == {}        # the val split is evaluation's, not training's

    assert {kinds[i] for i in seen} == {"planted"} and len(seen) == 80   # 0 decoys, every planted
    metric = {"contamination": {"suite.planted.accuracy": found}}
    assert promotion.contamination_reasons(GateConfig(max_contaminated_share=0.25), metric) == []

    monkeypatch.setattr(contamination, "words", lambda text: re.findall(r"\w+", text.lower()))
    _, old, _ = _audit_planted_suite(data_dir, tmp_path / "old-index", items)
    flagged = [kinds[entry["item"]] for entry in old["seen"]]
    assert [flagged.count(k) for k in ("planted", "decoy", "clean", "short")] == [77, 40, 0, 1]
    (reason,) = promotion.contamination_reasons(GateConfig(max_contaminated_share=0.25),
                                                {"contamination": {"suite.planted.accuracy": old}})
    assert reason.startswith("suite.planted.accuracy: 118 of 340 items (35%) appear in the training data")


def test_words_are_lm_evaluation_harness_words_on_awkward_text():
    """ASCII case and punctuation only, as theirs: other scripts keep their case and marks."""
    janitor, _ = _normalize_reference()
    awkward = ["I/O, i.e. os.stat() -- test's dbm-like", "Ünïcödé ÉCOLE — “quoted” it’s", "tab\tnew\nline\r\n",
               "non\u00a0breaking\u2003spaces", "___init___ x86_64 $HOME ~/.bashrc [a]{b}<c>", "...", "",
               "ＡＢＣ full-width", "émigré ß ǅ"]
    for text in awkward:
        assert contamination.words(text) == janitor.normalize_string(text).split(), text[:200]
    assert contamination.words("I/O, i.e. os.stat") == ["io", "ie", "osstat"]
