"""The sweep under Airflow (`airflow dags test`): a killed sweep resumes with its finished trials
kept, and a trial that fails for good is retried, then marked failed without sinking the sweep.

The DAG is llm_lifecycle's sweep alone (start_run -> plan_trials -> sweep_trial x slots ->
pick_best, the same library calls), on the session's prepared tiny data, so each run takes
seconds instead of a full lifecycle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.isolated_env import airflow_cli

SWEEP_DAG = '''
import pendulum
from airflow.sdk import dag, get_current_context, task

from llmops.airflow.operators.trial_operator import TrialOperator
from llmops.airflow.sweep_pool import POOL
from llmops.policy.params import lifecycle_params
from llmops.stages import lifecycle, specs
from llmops.stages import sweep_stage as stage

DATA = {data!r}


@dag(dag_id="sweep_only", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
     params=lifecycle_params(),
     default_args={{"retries": 1, "retry_delay": pendulum.duration(seconds=1)}})
def sweep_only():
    @task
    def start_run() -> dict:
        ctx = get_current_context()
        return lifecycle.start_run(ctx["params"], dag_id=ctx["dag"].dag_id, run_id=ctx["run_id"])

    @task(trigger_rule="all_done")
    def pick_best(run: dict) -> dict:
        return stage.pick_best(run)

    run = start_run()
    trials = TrialOperator.partial(task_id="sweep_trial", build_spec=specs.trial_spec,
                                   pool=POOL).expand(
        op_kwargs=task(specs.sweep_trials, task_id="plan_trials")(run, DATA))
    trials >> pick_best(run)


sweep_only()
'''


@pytest.fixture(scope="module")
def sweep_dags(airflow_db, tiny_data_dir, tmp_path_factory) -> Path:
    from tasks.train.prepared_data import DataDir

    folder = tmp_path_factory.mktemp("sweep_dags")
    data = {"outputs": {"data_dir": str(tiny_data_dir)},
            "data_hash": DataDir(tiny_data_dir).content_hash}
    (folder / "sweep_only.py").write_text(SWEEP_DAG.format(data=data))
    return folder


def storage() -> str:
    return f"sqlite:///{Path(os.environ['LLMOPS_HOME']) / 'optuna.db'}"


def trials_of(study_name: str) -> list:
    import optuna

    from llmops.policy.sweep_study import open_storage

    # opened as the DAG's tasks open it: the test reads while the plan task may be creating it
    return optuna.load_study(study_name=study_name, storage=open_storage(storage())).get_trials()


def job_dirs(study: str, number: int) -> list[Path]:
    """A trial's local job directories, one per job submitted for it (its spec's tags name the
    study and the trial)."""
    out = []
    for spec in Path(os.environ["LLMOPS_HOME"], "jobs").glob("*/spec.json"):
        tags = json.loads(spec.read_text())["tags"]
        if tags.get("study") == study and int(tags["trial"]) == number:
            out.append(spec.parent)
    return out


def test_a_killed_sweep_resumes_keeping_finished_trials_and_survives_a_failing_one(sweep_dags):
    """One sweep, two slots of a grid over n_head: with 2 heads the trial completes; 3 heads
    cannot split the tiny model's 32 dimensions, so that trial's job fails on every try. The
    sweep is killed while the failing trial is running, then run again."""
    from llmops.infra import tracking

    study = "resume-test"
    conf = json.dumps({"recipe": "tiny", "sweep_sampler": "grid", "sweep_trials": 1,
                       "sweep_steps": 10, "sweep_evals": 2, "sweep_pruner": "none",
                       "sweep_study": study,
                       "sweep_search_space": {"model.n_head": {"choices": [2, 3]}}})
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "AIRFLOW__CORE__DAGS_FOLDER": str(sweep_dags),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    first = subprocess.Popen([str(bin_dir / "airflow"), "dags", "test", "sweep_only", "-c", conf],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.time() + 400
    states: dict = {}
    try:
        # kill it once one trial has finished and the next one is running
        # (a trial is RUNNING in the study a moment before its sampler has set its params)
        while not ("COMPLETE" in states and "RUNNING" in states
                   and "model.n_head" in states["RUNNING"].params):
            assert time.time() < deadline, "the sweep did not get that far in time"
            assert first.poll() is None, "the sweep ended before it could be killed"
            time.sleep(0.3)
            if Path(os.environ["LLMOPS_HOME"], "optuna.db").exists():
                try:
                    states = {t.state.name: t for t in trials_of(study)}
                except KeyError:  # the study does not exist yet
                    pass
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the whole `airflow dags test`, mid-sweep
        first.wait()
    finished, running = states["COMPLETE"], states["RUNNING"]
    assert (finished.params["model.n_head"], running.params["model.n_head"]) == (2, 3)

    proc = airflow_cli("dags", "test", "sweep_only", "-c", conf, dags_folder=sweep_dags)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "state=success" in output, output[-5000:]

    # the finished trial was kept: reported again, its job not run again
    final = {t.number: t for t in trials_of(study)}
    assert sorted(final) == sorted([finished.number, running.number]), \
        "no new trial was asked: the interrupted one went on under its number"
    assert (final[finished.number].state.name, final[finished.number].value) == \
        ("COMPLETE", finished.value)
    assert f"already complete in study {study}: kept, not run again" in output
    kept_jobs = job_dirs(study, finished.number)
    assert len(kept_jobs) == 1 and not list(kept_jobs[0].glob("output.log.attempt*"))

    # the failing trial was retried, then marked failed; the sweep still picked the best
    failed = final[running.number]
    assert failed.state.name == "FAIL" and "exited with code 2" in failed.user_attrs["error"]
    rerun_job = max(job_dirs(study, failed.number), key=lambda d: (d / "spec.json").stat().st_mtime)
    assert (rerun_job / "output.log.attempt1").exists(), "the task's retry ran its job again"
    assert "n_embd (32) must be a multiple of n_head (3)" in (rerun_job / "output.log").read_text()

    # MLflow: each trial's run says how it ended (the killed attempt's run says nothing)
    client = tracking.client()
    exp = client.get_experiment_by_name("sweep_only")
    runs = {r.data.tags["trial"]: r for r in client.search_runs(
        [exp.experiment_id], f"tags.study = '{study}'") if "trial_state" in r.data.tags}
    assert runs[str(failed.number)].data.tags["trial_state"] == "failed"
    assert runs[str(failed.number)].info.status == "FAILED"
    assert runs[str(finished.number)].data.tags["trial_state"] == "complete"
    parent = client.get_run(runs[str(failed.number)].data.tags["mlflow.parentRunId"])
    assert parent.data.metrics["sweep.trials_failed"] == 1
    assert parent.data.metrics["sweep.best_val_loss"] == pytest.approx(finished.value)
    assert "sweep/best_config.json" in {a.path for a in client.list_artifacts(
        parent.info.run_id, "sweep")}
