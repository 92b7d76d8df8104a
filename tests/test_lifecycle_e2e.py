"""The whole lifecycle DAG through Airflow on the tiny recipe: every stage leaves a tagged child
run in MLflow under one parent run, and a model is registered with the alias `champion`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.isolated_env import SESSION_DIR

STAGES = ("data_prep", "sweep", "pretrain", "finetune", "distill", "evaluate")


@pytest.fixture(scope="module")
def lifecycle_run(tiny_lifecycle_run):
    """The session's tiny lifecycle run (tests/lifecycle_run.py): cache off, so every stage ran
    its job; planted secrets in the worker's environment."""
    return tiny_lifecycle_run


def test_every_stage_has_a_finished_child_run_with_the_tracking_tags(lifecycle_run):
    parent, children = lifecycle_run["parent"], lifecycle_run["children"]
    assert parent.info.status == "FINISHED"
    by_stage: dict[str, list] = {}
    for run in children:
        by_stage.setdefault(run.data.tags["stage"], []).append(run)
    assert set(by_stage) == set(STAGES)
    assert len(by_stage["sweep"]) == 2, "the tiny recipe runs two trials, one child run each"
    data_hash = by_stage["data_prep"][0].data.tags.get("data_hash") or None
    for stage, runs in by_stage.items():
        for run in runs:
            tags = run.data.tags
            assert run.info.status == "FINISHED", (stage, run.info.status)
            for key in ("dag_id", "run_id", "task_id", "map_index", "try_number", "backend",
                        "git_commit", "job_name"):
                assert tags.get(key), (stage, key)
            assert tags["dag_id"] == "llm_lifecycle" and tags["backend"] == "local"
            assert tags["run_id"] == parent.data.tags["run_id"]
            if stage != "data_prep":
                assert len(tags["data_hash"]) == 64, (stage, "data manifest hash")
                data_hash = data_hash or tags["data_hash"]
                assert tags["data_hash"] == data_hash
            assert run.data.params, f"{stage}: the resolved config is logged as params"


def test_training_stages_log_step_wise_metrics_and_their_config(lifecycle_run):
    client = lifecycle_run["client"]
    for run in lifecycle_run["children"]:
        stage = run.data.tags["stage"]
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert "config.json" in artifacts, stage
        if stage in ("pretrain", "finetune", "distill"):
            history = client.get_metric_history(run.info.run_id, "loss/train")
            assert len(history) >= 2 and history[0].step < history[-1].step, stage
            for key in ("optim/lr", "optim/grad_norm", "perf/tokens_per_s"):
                assert key in run.data.metrics, (stage, key)


def test_a_model_is_registered_as_champion_with_its_lineage(lifecycle_run):
    client, parent = lifecycle_run["client"], lifecycle_run["parent"]
    mv = client.get_model_version_by_alias("llm-lifecycle", "champion")
    assert parent.data.tags["champion"] == f"llm-lifecycle/{mv.version}"
    assert mv.tags["run_id"] == parent.data.tags["run_id"]
    assert mv.tags["candidate"] in ("teacher", "student")
    assert len(mv.tags["data_hash"]) == 64
    assert mv.tags["evaluation_run_id"] and mv.tags["training_run_id"]
    assert f"{mv.tags['candidate']}.task_accuracy" in mv.tags


def test_evaluation_reports_both_candidates(lifecycle_run):
    evaluation = next(r for r in lifecycle_run["children"] if r.data.tags["stage"] == "evaluate")
    for name in ("pretrained", "teacher", "student"):
        assert f"{name}/perplexity" in evaluation.data.metrics
        assert f"{name}/task_accuracy" in evaluation.data.metrics
    assert evaluation.data.metrics["student/params"] < evaluation.data.metrics["teacher/params"]


def test_no_planted_secret_reaches_disk_logs_or_mlflow(lifecycle_run):
    """Every file of the session's state (job dirs, stage outputs, MLflow store and artifacts,
    Airflow's DB and task logs), every MLflow param and tag, and the task logs printed by the
    run: none holds the planted AWS secret key or database password."""
    client, planted = lifecycle_run["client"], lifecycle_run["planted"]
    values = {planted["AWS_SECRET_ACCESS_KEY"], planted["WAREHOUSE_PASSWORD"]}
    home = Path(os.environ["LLMOPS_HOME"]).resolve()
    runs = [lifecycle_run["parent"], *lifecycle_run["children"]]
    for experiment_id in {run.info.experiment_id for run in runs}:
        # Artifacts are files under the state directory, so the file scan below reads them.
        location = client.get_experiment(experiment_id).artifact_location
        assert Path(location.removeprefix("file://")).resolve().is_relative_to(home), location
    for run in runs:
        fields = {**run.data.params, **run.data.tags}
        for key, value in fields.items():
            assert not any(v in value for v in values), (run.info.run_name, key)
    roots = [home, Path(os.environ["AIRFLOW_HOME"]), SESSION_DIR]
    scanned = 0
    for path in {p for root in roots for p in root.rglob("*") if p.is_file()}:
        data = path.read_bytes()
        scanned += 1
        assert not any(v.encode() in data for v in values), path
    assert scanned > 50 and (home / "jobs").is_dir()
    assert not any(v in lifecycle_run["output"] for v in values)


def test_the_job_ledger_holds_every_job_of_the_run_with_its_times_and_state(lifecycle_run):
    """Issue 14: every job the run started is in the ledger (SQLite under LLMOPS_HOME), ended
    and succeeded, with submit <= start <= end, the run's dag_id / run_id, and local cost 0."""
    from llmops.infra import ledger

    run_id = lifecycle_run["parent"].data.tags["run_id"]
    rows = [r for r in ledger.read_events(0, source="sqlite") if r["run_id"] == run_id]
    ends = {r["job_name"]: r for r in rows if r["event"] == "ended"}
    jobs = {run.data.tags["job_name"]: run for run in lifecycle_run["children"]}
    assert set(ends) == set(jobs), "one ended attempt per job of the run"
    for name, end in ends.items():
        assert end["state"] == "succeeded" and end["dag_id"] == "llm_lifecycle", (name, end["state"])
        assert end["stage"] == jobs[name].data.tags["stage"] and end["backend"] == "local"
        assert end["submitted_at"] <= end["started_at"] < end["ended_at"], name
        assert end["queue_seconds"] >= 0 and end["estimated_cost_usd"] == 0.0
        assert end["mlflow_run_id"] == jobs[name].info.run_id
    assert {r["job_name"] for r in rows if r["event"] == "submitted"} == set(jobs)


def test_the_champion_is_a_transformers_model_that_mlflow_serves(lifecycle_run):
    """Issue 13: what the registry holds is a Hugging Face model (our GPT as GPT-2) that
    transformers generates with and mlflow.pyfunc serves as text."""
    from tests.test_lifecycle_hf import assert_champion_serves

    assert assert_champion_serves("llm-lifecycle")["architecture"] == "GPT2LMHeadModel"
