"""What each checkpoint saw (issue 25, point 3): a tiny pretraining on CPU keeps checkpoints 2
and 8; tasks.train.seen answers "did step N see document X" from the checkpoint's recorded
data cursor and data prep's manifest. The expected answers are derived independently here:
each document's rows by searching its tokens in the raw row files, each step's rows by asking
the training batch reader (PretrainBatches) for the rows of every batch."""

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
from tasks.train.data import DataDir, PretrainBatches
from tests.test_resilience import REPO, run_pretrain, tiny_cfg

STEPS = 8


@pytest.fixture(scope="module")
def run(tiny_data_dir, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("seen")
    cfg = tiny_cfg(tiny_data_dir, work / "job", max_steps=STEPS, checkpoint_interval=2,
                   keep_checkpoints=10, eval_interval=STEPS, log_interval=4, hot_spare=False)
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


def test_saw_follows_the_data_cursor(run, tiny_data_dir):
    cfg, checkpoints = run["cfg"], run["checkpoints"]
    early, late = checkpoints / "step_000002", checkpoints / "step_000008"
    assert ckpt.verify_checkpoint(early) is None and ckpt.verify_checkpoint(late) is None

    data = DataDir(tiny_data_dir)
    reader = PretrainBatches(data.split("train"), cfg.batch_size, cfg.seed)
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
    proc = subprocess.run([sys.executable, "-m", "tasks.train.seen", str(early), "--data-dir",
                           str(tiny_data_dir), "--doc", only_late[0]], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
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
