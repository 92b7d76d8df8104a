"""Every training stage's checkpoints leave the node, whether or not its config names
checkpoint_uri: the stage decides (tasks.configs.CHECKPOINTED_STAGES), the image's entry
(docker/job_entry.py) writes them through to the job's checkpoint URI where nothing syncs the
node's disk (Batch, HyperPod), and a place that cannot hold them is refused: by the backends
before any job, by the entry before the stage runs. A node lost mid-run, on every backend and
for every stage, is tests/test_node_loss_every_stage.py (make test-slow).

What is real: the entry (as a Batch node starts it), S3 and Batch (moto), the Batch backend's
submit. Nothing is simulated here. The stages writing through for real, with configs that leave
the key out, and resuming on fresh disks: tests/test_node_loss_every_stage.py.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmops.jobs.backends import remote
from llmops.jobs.spec import JobSpec, JobSpecError, job_name
from tasks.configs import CHECKPOINTED_STAGES, tiny, to_dict
from tests.aws_fixtures import CONN_ID, ENTRY, IMAGE, ROOT

STAGING = "s3://llmops-wt/staging"


def test_every_stage_that_trains_through_the_loop_says_it_keeps_checkpoints():
    """A stage entrypoint that trains through the shared loop (tasks/train/loop.py, directly or
    through pretraining) must be in CHECKPOINTED_STAGES, with a checkpoint_uri in its config:
    else its progress would stay on the node wherever its config leaves the key out."""
    training = set()
    for path in sorted((ROOT / "tasks").glob("*.py")):
        imported = {node.module for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module}
        if "tasks.common.entry" in imported and imported & {"tasks.train.loop",
                                                            "tasks.train.pretraining"}:
            training.add(f"tasks.{path.stem}")
    assert training == set(CHECKPOINTED_STAGES) == {"tasks.pretrain", "tasks.sweep",
                                                    "tasks.finetune", "tasks.distill"}
    for stage, config in CHECKPOINTED_STAGES.items():
        assert "checkpoint_uri" in {f.name for f in dataclasses.fields(config)}, stage


def _post_training(stage: str, **changes) -> JobSpec:
    recipe = tiny()
    config = to_dict(recipe.finetune if stage == "finetune" else recipe.distill)
    config.update({"base_model" if stage == "finetune" else "teacher_model": "s3://models/base"},
                  data_dir="s3://data/prep", output_dir=f"s3://llmops-wt/out/{stage}")
    del config["checkpoint_uri"]
    spec = JobSpec(stage=stage, entrypoint=f"tasks.{stage}", name=job_name(stage, prefix=stage),
                   config=config, backend="batch", image=IMAGE)
    return spec.replace(**changes)


@pytest.mark.parametrize(("where", "value", "message"), [
    ("config", "/fsx/checkpoints", r"JobSpec\.config\.checkpoint_uri is '/fsx/checkpoints'.*only an "
                                   r"s3:// prefix.*leave it out: every checkpoint is then written "
                                   r"through to s3://llmops-wt/out/distill/checkpoints"),
    ("spec", "fsx://fs-1/ckpt", r"JobSpec\.checkpoint_uri is 'fsx://fs-1/ckpt'.*Set it to an "
                                r"s3://bucket/prefix, or leave it empty"),
    ("both", "s3://elsewhere/ck", r"JobSpec\.checkpoint_uri \(s3://llmops-wt/ck\) and "
                                  r"JobSpec\.config\.checkpoint_uri \(s3://elsewhere/ck\) name two places"),
])
def test_a_checkpoint_place_that_cannot_hold_them_is_refused_before_any_job(
        moto_server, where, value, message):
    """Through the Batch backend's submit, against moto: refused by name, nothing staged and no
    job submitted."""
    from llmops.jobs.backends.batch.batch_backend import BatchBackend
    from tests.chaos.multinode import batch_queue

    moto_server.bucket("llmops-wt")
    queue = "llmops-wt-queue"
    if not moto_server.client("batch").describe_job_queues(jobQueues=[queue])["jobQueues"]:
        batch_queue(moto_server.client("batch"), moto_server.client("iam"), queue)
    spec = _post_training("distill")
    if where in ("config", "both"):
        spec = spec.replace(config={**spec.config, "checkpoint_uri": value})
    if where == "spec":
        spec = spec.replace(checkpoint_uri=value)
    if where == "both":
        spec = spec.replace(checkpoint_uri="s3://llmops-wt/ck")
    backend = BatchBackend(settings={"batch": {"aws_conn_id": CONN_ID, "job_queue": queue,
                                               "image": IMAGE, "staging_uri": STAGING}})
    with pytest.raises(JobSpecError, match=message):
        backend.submit(spec)
    assert not moto_server.client("s3").list_objects_v2(Bucket="llmops-wt").get("Contents")
    assert not moto_server.client("batch").list_jobs(jobQueue=queue)["jobSummaryList"]


def test_the_configs_own_checkpoint_uri_is_where_every_attempt_looks():
    """A config naming its own s3:// checkpoint_uri is written through there; the handle (the
    next attempt's restore, the chain's progress, the pause marker) must look there too."""
    spec = _post_training("finetune")
    assert remote.plan(spec, spec.name, STAGING).checkpoint_uri == \
        "s3://llmops-wt/out/finetune/checkpoints"   # beside the outputs, without one
    own = spec.replace(config={**spec.config, "checkpoint_uri": "s3://ckpts/ft"})
    assert remote.plan(own, own.name, STAGING).checkpoint_uri == "s3://ckpts/ft"


def _entry(tmp_path: Path, stage: str, config: dict, *extra: str) -> subprocess.CompletedProcess:
    """The image's entry as a Batch node runs it: no synced checkpoint dir, a work dir of its own."""
    environ = {k: v for k, v in os.environ.items() if k != "LLMOPS_CHECKPOINT_DIR"}
    environ.update({"PYTHONPATH": str(ROOT), "LLMOPS_WORKDIR": str(tmp_path / "node")})
    return subprocess.run([sys.executable, str(ENTRY), "--entrypoint", f"tasks.{stage}",
                           "--config-json", json.dumps(config),
                           "--result", str(tmp_path / "result.json"), *extra],
                          env=environ, capture_output=True, text=True, timeout=600)


def test_the_entry_refuses_a_checkpointing_stage_with_nowhere_off_the_node(tmp_path):
    """Outputs uploaded only at the end, no checkpoint URI, no synced dir: the progress would
    live and die on the node. The entry says so and does not start the stage."""
    config = {k: v for k, v in _post_training("distill").config.items()}
    config.update(teacher_model=str(tmp_path / "teacher"), data_dir=str(tmp_path / "data"))
    proc = _entry(tmp_path, "distill", config)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("tasks.distill keeps its progress in checkpoints, and nothing would take them off "
            "this node") in proc.stdout
    assert "Set the config's checkpoint_uri to an s3:// prefix, or pass --checkpoint-uri" in proc.stdout
    assert "running" not in proc.stdout   # the stage never started
    assert not (tmp_path / "result.json").exists()
