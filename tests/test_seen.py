"""What each checkpoint saw (issue 25, point 3): a tiny pretraining on CPU keeps checkpoints 2
and 8; tasks.train.seen answers "did step N see document X" from the checkpoint's recorded
data cursor and data prep's manifest. The expected answers are derived independently here:
each document's rows by searching its tokens in the raw row files, each step's rows by asking
the training batch reader (PretrainBatches) for the rows of every batch. Copies of those
checkpoints as older trainers wrote them (no data_seen) must give the same record, derived from
their data cursor, and the same answers; or be refused, naming what they lack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from tasks.train import checkpoint as ckpt
from tasks.train import seen
from tasks.train.prepared_data import DataDir, PretrainBatches
from tests.test_resilience import REPO, run_pretrain, tiny_cfg

STEPS = 8


@pytest.fixture(scope="module")
def run(tiny_data_dir, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("seen")
    # in the global permutation, the order of every checkpoint older than block shuffling: its
    # checkpoints, stripped of what older trainers did not record, are those older checkpoints
    cfg = tiny_cfg(tiny_data_dir, work / "job", max_steps=STEPS, checkpoint_interval=2,
                   keep_checkpoints=10, eval_interval=STEPS, log_interval=4, hot_spare=False,
                   sample_order="global_permutation")
    proc, _ = run_pretrain(cfg, work)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return {"cfg": cfg, "checkpoints": work / "job" / "checkpoints"}


def _doc_rows_by_search(data_dir: Path) -> dict[str, set[int]]:
    """Each train document's rows, found by locating its tokens (+ EOS) in the flat row stream."""
    data = DataDir(data_dir)
    rows = data.split("train")
    flat = np.concatenate([np.asarray(s).ravel() for s in rows.shards]).astype(np.int64)
    tok = Tokenizer.from_file(str(data.tokenizer_path))
    out: dict[str, set[int]] = {}
    text = flat.tobytes()
    for name in data.manifest["documents"]["files"]:
        t = pq.read_table(data_dir / name, columns=["id", "text", "split"]).to_pydict()
        for doc_id, body, split in zip(t["id"], t["text"], t["split"]):
            if split != "train":
                continue
            ids = np.asarray(tok.encode(body, add_special_tokens=False).ids + [data.eos_id], np.int64)
            at = text.find(ids.tobytes())
            # whole occurrences only, aligned to a token, unique (short common texts are skipped)
            if at < 0 or at % 8 or text.find(ids.tobytes(), at + 8) >= 0:
                continue
            start = at // 8
            out[doc_id] = set(range(start // rows.row_len, (start + len(ids) - 1) // rows.row_len + 1))
    return out


def _cli(checkpoint: Path, data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """python -m tasks.train.seen, as a researcher runs it."""
    return subprocess.run([sys.executable, "-m", "tasks.train.seen", str(checkpoint), "--data-dir",
                           str(data_dir), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_saw_follows_the_data_cursor(run, tiny_data_dir):
    cfg, checkpoints = run["cfg"], run["checkpoints"]
    early, late = checkpoints / "step_000002", checkpoints / "step_000008"
    assert ckpt.verify_checkpoint(early) is None and ckpt.verify_checkpoint(late) is None

    data = DataDir(tiny_data_dir)
    reader = PretrainBatches(data.split("train"), cfg.batch_size, cfg.seed, order=cfg.sample_order)
    g = reader.global_batch
    assert ckpt.read_part(late, "trainer")["data_seen"]["global_batch"] == g
    rows_by_step = {s: set(reader.sampler.at(np.arange(s * g, (s + 1) * g)).tolist())
                    for s in range(STEPS)}
    before_2 = set().union(*(rows_by_step[s] for s in range(2)))
    before_8 = set().union(*(rows_by_step[s] for s in range(STEPS)))
    assert set(seen.consumed_rows(early, tiny_data_dir).tolist()) == before_2
    assert set(seen.consumed_rows(late, tiny_data_dir).tolist()) == before_8

    docs = _doc_rows_by_search(tiny_data_dir)
    in_first = [d for d, r in docs.items() if r & rows_by_step[0]]
    only_late = [d for d, r in docs.items() if not r & before_2 and r & before_8]
    unseen = [d for d, r in docs.items() if not r & before_8]
    assert in_first and only_late and unseen, (len(in_first), len(only_late), len(unseen))
    for d in in_first[:3]:
        assert set(range(*seen.document_rows(tiny_data_dir, d)[0])) == docs[d]
        assert seen.saw(early, tiny_data_dir, d) and seen.saw(late, tiny_data_dir, d)
    for d in only_late[:3]:
        assert not seen.saw(early, tiny_data_dir, d)
        assert seen.saw(late, tiny_data_dir, d)
    for d in unseen[:2]:
        assert not seen.saw(late, tiny_data_dir, d)
    with pytest.raises(KeyError):
        seen.document_rows(tiny_data_dir, "no-such-document")

    # the diff of the two: the late one read everything the early one did, and more
    d = seen.diff(late, early, tiny_data_dir)
    assert d["only_b_rows"] == 0 and d["only_a_rows"] == len(before_8 - before_2)
    assert d["common_rows"] == len(before_2)

    # the CLI, as a researcher runs it
    proc = _cli(early, tiny_data_dir, "--doc", only_late[0])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["saw"] is False


def test_a_tampered_trainer_state_is_refused(run, tiny_data_dir, tmp_path):
    import shutil

    copy = tmp_path / "step_000002"
    shutil.copytree(run["checkpoints"] / "step_000002", copy)
    with open(copy / "trainer.pt", "ab") as fh:
        fh.write(b"x")
    with pytest.raises(ValueError, match="does not verify"):
        seen.consumed(copy, tiny_data_dir)


def test_skipped_batches_are_not_counted_as_seen(tiny_data_dir):
    data = DataDir(tiny_data_dir)
    reader = PretrainBatches(data.split("train"), 2, 7)
    record = reader.seen(10, {0, 3, 4, 12})
    assert record["batches"] == [[1, 3], [5, 10]]
    assert record["seed"] == 7 and record["global_batch"] == 2 and record["rows"] == data.split("train").rows
    assert reader.seen(0)["batches"] == [] and reader.seen(3)["batches"] == [[0, 3]]


def _older(checkpoint: Path, root: Path, *, trainer_lacks: tuple[str, ...] = (),
           config_lacks: tuple[str, ...] = (), trainer_has: dict | None = None,
           config_has: dict | None = None) -> Path:
    """The checkpoint as an older trainer wrote it: no data_seen, nor the other trainer and
    config keys named (with the config keys `config_has` gives); re-saved by save_checkpoint, so
    its manifest hashes the parts as written and it verifies like any checkpoint."""
    state = ckpt.load_checkpoint(checkpoint)
    step, config = state.pop("step"), state.pop("config")
    gone = {"data_seen", *trainer_lacks}
    state["trainer"] = {**{k: v for k, v in state["trainer"].items() if k not in gone},
                        **(trainer_has or {})}
    config = {**{k: v for k, v in config.items() if k not in config_lacks}, **(config_has or {})}
    out = ckpt.save_checkpoint(root, step, state, config, keep=10)
    assert ckpt.verify_checkpoint(out) is None and "data_seen" not in ckpt.read_part(out, "trainer")
    return out


# what older pretraining checkpoints' trainer state (and config) lacked, by the commit that
# added it to tasks/train/loop.py `_state` (git log -p): data_seen e6522e0; global_batch (with
# the config's global_batch_tokens) f4a6254; skipped_batches and world_size 66bca62
ERAS = {
    "f4a6254": ((), ()),
    "66bca62": (("global_batch", "samples_seen"), ("global_batch_tokens",)),
    "a66eb92": (("global_batch", "samples_seen", "skipped_batches", "world_size",
                 "recent_batches", "guard"), ("global_batch_tokens",)),
}


@pytest.mark.parametrize("era", list(ERAS))
def test_an_older_checkpoint_s_record_is_derived_from_its_data_cursor(run, tiny_data_dir, tmp_path, era):
    trainer_lacks, config_lacks = ERAS[era]
    for step in (2, STEPS):
        new = run["checkpoints"] / f"step_{step:06d}"
        old = _older(new, tmp_path / era, trainer_lacks=trainer_lacks, config_lacks=config_lacks)
        derived = seen.record(old, tiny_data_dir)
        assert derived.pop("derived_from") == "data_cursor"
        assert derived == ckpt.read_part(new, "trainer")["data_seen"]
        assert np.array_equal(seen.consumed_rows(old, tiny_data_dir), seen.consumed_rows(new, tiny_data_dir))
        got, want = seen.consumed(old, tiny_data_dir), seen.consumed(new, tiny_data_dir)
        assert got.pop("derived_from") == "data_cursor" and "derived_from" not in want
        assert {**got, "checkpoint": None} == {**want, "checkpoint": None}

    # the CLI's answer for a document the early checkpoint did not see and the late one did
    docs = _doc_rows_by_search(tiny_data_dir)
    before_2 = set(seen.consumed_rows(run["checkpoints"] / "step_000002", tiny_data_dir).tolist())
    before_8 = set(seen.consumed_rows(run["checkpoints"] / "step_000008", tiny_data_dir).tolist())
    doc = next(d for d, r in docs.items() if not r & before_2 and r & before_8)
    answers = {}
    for name in ("step_000002", "step_000008"):
        for ckpt_dir in (run["checkpoints"] / name, tmp_path / era / name):
            proc = _cli(ckpt_dir, tiny_data_dir, "--doc", doc)
            assert proc.returncode == 0, proc.stderr[-3000:]
            answers[ckpt_dir] = json.loads(proc.stdout)
    for name, saw in (("step_000002", False), ("step_000008", True)):
        new, old = answers[run["checkpoints"] / name], answers[tmp_path / era / name]
        assert old.pop("derived_from") == "data_cursor"
        assert old == new and new["saw"] is saw


def test_an_older_checkpoint_s_skipped_batches_are_not_counted(run, tiny_data_dir, tmp_path):
    """A run that skipped batches 1 and 5 after loss spikes: its cursor is past them, they are
    not among the trained batches, and their rows only where another batch drew them too."""
    cfg = run["cfg"]
    old = _older(run["checkpoints"] / "step_000008", tmp_path, trainer_has={"skipped_batches": [1, 5]})
    assert seen.record(old, tiny_data_dir)["batches"] == [[0, 1], [2, 5], [6, STEPS]]
    reader = PretrainBatches(DataDir(tiny_data_dir).split("train"), cfg.batch_size, cfg.seed,
                             order=cfg.sample_order)
    g = reader.global_batch
    trained = set().union(*(set(reader.sampler.at(np.arange(s * g, (s + 1) * g)).tolist())
                            for s in range(STEPS) if s not in (1, 5)))
    assert set(seen.consumed_rows(old, tiny_data_dir).tolist()) == trained


@pytest.mark.parametrize("lacks, says", [
    ({"trainer_lacks": ("data_cursor",)}, "lacks data_cursor"),
    ({"config_lacks": ("seed",)}, "lacks config.json seed"),
    ({"config_lacks": ("seed", "batch_size"), "trainer_lacks": ("data_cursor",)},
     "lacks data_cursor, config.json seed, config.json batch_size"),
    # a global batch its config does not give: the cursor's batches cannot be turned into rows
    ({"trainer_has": {"global_batch": 3}}, "records a global batch of 3 rows"),
])
def test_an_older_checkpoint_without_what_its_record_needs_is_refused(run, tiny_data_dir, tmp_path,
                                                                      lacks, says):
    old = _older(run["checkpoints"] / "step_000002", tmp_path, **lacks)
    with pytest.raises(ValueError, match=says):
        seen.consumed(old, tiny_data_dir)
    proc = _cli(old, tiny_data_dir)
    assert proc.returncode != 0 and says in proc.stderr


def test_an_older_checkpoint_needs_the_data_dir_to_derive_its_record(run, tmp_path):
    old = _older(run["checkpoints"] / "step_000002", tmp_path)
    with pytest.raises(ValueError, match="pass the data dir it trained on"):
        seen.record(old)


def _other_prep_output(data_dir: Path, root: Path) -> Path:
    """A data dir with as many rows as `data_dir` but another prep output's content hash (what a
    second data prep of other text with the same row count writes): its manifest says so."""
    import shutil

    other = root / "other_data"
    shutil.copytree(data_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["content_hash"] = "f" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    return other


def test_a_data_dir_with_as_many_rows_but_other_content_is_refused(run, tiny_data_dir, tmp_path):
    """The record names its data by content hash: the row count alone would let another prep
    output of the same size answer, wrongly."""
    checkpoint = run["checkpoints"] / "step_000002"
    other = _other_prep_output(tiny_data_dir, tmp_path)
    assert DataDir(other).split("train").rows == DataDir(tiny_data_dir).split("train").rows
    assert seen.record(checkpoint)["data_hash"] == DataDir(tiny_data_dir).content_hash
    with pytest.raises(ValueError, match="is not the data the checkpoint trained on"):
        seen.consumed(checkpoint, other)
    proc = _cli(checkpoint, other)
    assert proc.returncode != 0 and "is not the data the checkpoint trained on" in proc.stderr


def test_an_older_checkpoint_s_data_is_its_config_s_data_dir(run, tiny_data_dir, tmp_path):
    """Derived, the record takes the content hash of the data dir its config names (readable
    here): the same data elsewhere answers alike, other data of as many rows is refused; where
    that dir is not readable only the row count is checked, and the record says no hash."""
    import shutil

    old = _older(run["checkpoints"] / "step_000002", tmp_path / "old")
    copy = tmp_path / "same_data"
    shutil.copytree(tiny_data_dir, copy)
    assert seen.record(old, copy)["data_hash"] == DataDir(tiny_data_dir).content_hash
    assert np.array_equal(seen.consumed_rows(old, copy), seen.consumed_rows(old, tiny_data_dir))
    with pytest.raises(ValueError, match="is not the data the checkpoint trained on"):
        seen.consumed_rows(old, _other_prep_output(tiny_data_dir, tmp_path))
    gone = _older(run["checkpoints"] / "step_000002", tmp_path / "gone",
                  config_has={"data_dir": str(tmp_path / "no_longer_here")})
    record = seen.record(gone, tiny_data_dir)
    assert "data_hash" not in record and record["derived_from"] == "data_cursor"
