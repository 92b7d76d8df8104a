"""docker/job_entry.py as the platforms start it: several copies on one host (one per local rank,
as SageMaker's toolkit runs it under torchrun) sharing one work dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.aws_fixtures import ENTRY, ROOT


def test_ranks_on_one_host_keep_their_own_config_and_result(tmp_path):
    workdir, checkpoints = tmp_path / "work", tmp_path / "checkpoints"
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "LLMOPS_WORKDIR": str(workdir),
               "LLMOPS_CHECKPOINT_DIR": str(checkpoints), "LOCAL_RANK": str(rank), "RANK": str(rank),
               "WORLD_SIZE": "2"}
        config = {"seconds": 0.3 + rank * 0.2, "marker_dir": str(tmp_path / "markers")}
        procs.append(subprocess.Popen(
            [sys.executable, str(ENTRY), "--entrypoint", "tests.sample_job",
             "--config-json", json.dumps(config), "--result", str(tmp_path / "result.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    # Each copy read its own config: rank 1's (0.5 s) did not overwrite rank 0's (0.3 s).
    assert json.loads((workdir / "rank-0" / "config.json").read_text())["seconds"] == 0.3
    assert json.loads((workdir / "rank-1" / "config.json").read_text())["seconds"] == 0.5
    assert not (workdir / "config.json").exists()
    # Shared: one output dir with one checkpoints link; the leader alone writes the result.
    assert os.path.realpath(workdir / "output" / "checkpoints") == str(checkpoints)
    assert json.loads((tmp_path / "result.json").read_text())["metrics"] == {"answer": 42.0}
    assert "llmops.entry: result written" in outputs[0] and "llmops.entry: result written" not in outputs[1]
    assert len((tmp_path / "markers" / "starts").read_text().split()) == 2


def _entry():
    import importlib
    import sys as _sys

    _sys.path.insert(0, str(ENTRY.parent))
    return importlib.import_module("job_entry")


def test_the_result_names_the_newest_complete_checkpoint_not_the_one_the_stage_reported(tmp_path):
    """A step whose manifest (written last) is missing is an unfinished checkpoint: the result
    names the newest complete one instead, by step number, not by name order."""
    entry = _entry()
    root = tmp_path / "checkpoints"
    for step, complete in ((900_000, True), (1_000_000, True), (1_000_050, False)):
        path = root / f"step_{step:06d}"
        path.mkdir(parents=True)
        (path / "model.pt").write_bytes(b"w")
        if complete:
            (path / "manifest.json").write_text("{}")
    model = tmp_path / "model"
    model.mkdir()
    result = {"outputs": {"checkpoint": str(root / "step_1000050"), "model_dir": str(model)}}
    assert entry.settle_outputs(result, str(root)) == []
    assert result["outputs"]["checkpoint"] == str(root / "step_1000000")


def test_a_result_naming_a_missing_output_is_refused_and_no_checkpoint_is_none(tmp_path):
    entry = _entry()
    result = {"outputs": {"checkpoint": str(tmp_path / "checkpoints" / "step_000010"),
                          "model_dir": str(tmp_path / "model")}}
    missing = entry.settle_outputs(result, str(tmp_path / "checkpoints"))
    assert missing == [f"model_dir: {tmp_path / 'model'}"]
    assert "checkpoint" not in result["outputs"]   # none complete: the result names none
