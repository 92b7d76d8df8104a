"""Extra links of job tasks (plugins/llmops/airflow/operators/links.py): the URL of every backend,
and a real DAG run whose links are read back the way Airflow's API server reads them. Also how runs
read in MLflow (training view, run names, chart names, the Airflow run's URL) and the progress
lines (share, elapsed, ETA; MFU only on a GPU whose peak is known)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from llmops.airflow.operators import links
from llmops.airflow.operators.job_operator import JobOperator
from llmops.infra import tracking
from llmops.jobs.backends import consoles

REGION = "eu-west-1"
CONSOLE = "https://console.aws.amazon.com"


def _links(handle):
    return links.backend_links(handle, REGION)


def test_sagemaker_training_job_links_to_its_console_page_and_log_streams():
    got = _links({"backend": "sagemaker", "job_name": "pretrain-ab12-1"})
    assert got == {
        "SageMaker job": f"{CONSOLE}/sagemaker/home?region={REGION}#/jobs/pretrain-ab12-1",
        "CloudWatch logs": (f"{CONSOLE}/cloudwatch/home?region={REGION}#logsV2:log-groups/"
                            "log-group/$252Faws$252Fsagemaker$252FTrainingJobs"
                            "$3FlogStreamNameFilter$3Dpretrain-ab12-1$252F"),
    }


def test_sagemaker_processing_job_links_to_the_processing_console():
    got = _links({"backend": "sagemaker_processing", "job_name": "data-prep-1"})
    assert got["SageMaker job"] == f"{CONSOLE}/sagemaker/home?region={REGION}#/processing-jobs/data-prep-1"
    assert "$252Faws$252Fsagemaker$252FProcessingJobs" in got["CloudWatch logs"]


def test_batch_job_links_to_the_job_by_id():
    got = _links({"backend": "batch", "job_name": "pretrain-1", "job_id": "0f1e-42"})
    assert got["Batch job"] == f"{CONSOLE}/batch/home?region={REGION}#jobs/detail/0f1e-42"
    assert got["CloudWatch logs"].endswith("log-group/$252Faws$252Fbatch$252Fjob")


def test_hyperpod_job_links_to_its_eks_cluster_and_container_insights():
    got = _links({"backend": "hyperpod", "job_name": "pretrain-1", "k8s_name": "pretrain-1",
                  "eks_cluster_name": "hp-eks"})
    assert got["HyperPod (EKS) workload"] == (
        f"{CONSOLE}/eks/home?region={REGION}#/clusters/hp-eks?selectedTab=cluster-resources-tab")
    assert got["CloudWatch logs"].endswith(
        "$252Faws$252Fcontainerinsights$252Fhp-eks$252Fapplication$3FlogStreamNameFilter$3Dpretrain-1")
    # a cluster reached through a Kubernetes connection has no console to link to
    assert _links({"backend": "hyperpod", "job_name": "x", "kubernetes_conn_id": "k8s"}) == {}


def test_ray_job_links_to_the_dashboard_of_its_connection():
    from airflow.models.connection import Connection

    conn = Connection(conn_id="ray_links", conn_type="http", host="ray-head.internal", port=8265)
    with mock.patch.dict(os.environ, {"AIRFLOW_CONN_RAY_LINKS": conn.get_uri()}):
        got = links.links_for({"backend": "ray", "job_name": "sweep-3-1", "ray_conn_id": "ray_links"})
    assert got == {"Ray job": "http://ray-head.internal:8265/#/jobs/sweep-3-1"}


def test_other_partitions_and_a_missing_region():
    got = links.backend_links({"backend": "batch", "job_id": "j"}, "cn-north-1")
    assert got["Batch job"].startswith("https://console.amazonaws.cn/batch/home?region=cn-north-1")
    assert links.backend_links({"backend": "sagemaker", "job_name": "j"}, "") == {}
    assert links.links_for({"backend": "local", "job_name": "j"}, "http://mlflow/#/r") == {
        "MLflow run": "http://mlflow/#/r"}


def test_region_comes_from_the_aws_connection_when_the_settings_have_none(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_AWS_LINKS", '{"conn_type": "aws", "extra": {"region_name": "ap-south-1"}}')
    assert consoles.handle_region({"aws_conn_id": "aws_links", "region_name": ""}) == "ap-south-1"
    assert consoles.handle_region({"aws_conn_id": "aws_links", "region_name": "us-west-2"}) == "us-west-2"


def test_mlflow_ui_url_prefers_the_setting_then_a_server_then_make_up(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/x/mlflow.db")
    monkeypatch.delenv("LLMOPS_MLFLOW_UI_URL", raising=False)
    monkeypatch.delenv("MLFLOW_PORT", raising=False)
    assert tracking.mlflow_ui_url() == "http://localhost:5000"
    monkeypatch.setenv("MLFLOW_PORT", "5001")
    assert tracking.mlflow_ui_url() == "http://localhost:5001"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com/")
    assert tracking.mlflow_ui_url() == "https://mlflow.example.com"
    monkeypatch.setenv("LLMOPS_MLFLOW_UI_URL", "https://ui.example.com/mlflow/")
    assert tracking.mlflow_ui_url() == "https://ui.example.com/mlflow"
    # MLflow 3's classic training view, not its GenAI one (issue 48)
    assert tracking.run_url("abc", "7") == \
        "https://ui.example.com/mlflow/#/experiments/7/runs/abc?workflowType=machine_learning"


def test_get_link_reads_its_entry_of_the_pushed_links():
    key = mock.Mock()
    pushed = {"MLflow run": "http://localhost:5000/#/experiments/1/runs/r", "Ray job": ""}
    with mock.patch.object(links.XCom, "get_value", return_value=pushed) as get_value:
        assert links.MLflowRunLink().get_link(None, ti_key=key) == pushed["MLflow run"]
        assert links.link_named("Ray job").get_link(None, ti_key=key) == ""
        assert links.link_named("Batch job").get_link(None, ti_key=key) == ""
    get_value.assert_called_with(ti_key=key, key=links.LINKS_KEY)
    with mock.patch.object(links.XCom, "get_value", side_effect=RuntimeError("no XCom here")):
        assert links.MLflowRunLink().get_link(None, ti_key=key) == ""


def test_every_job_task_has_the_links():
    from llmops.airflow.operators.trial_operator import TrialOperator

    names = {link.name for link in JobOperator.operator_extra_links}
    assert names == {"MLflow run", "SageMaker job", "CloudWatch logs", "Batch job",
                     "HyperPod (EKS) workload", "Ray job", "Pause pretraining"}
    assert TrialOperator.operator_extra_links == JobOperator.operator_extra_links


def test_a_dag_run_shows_the_mlflow_link_as_the_api_server_reads_it(airflow_db):
    """SETUP a parent run; BODY `airflow dags test`; then read the links through the serialized
    DAG from the metadata DB, as the API server's extra links endpoint does."""
    from tests.isolated_env import airflow_cli

    parent = tracking.start_parent_run(experiment="links-test", dag_id="job_links_local",
                                       run_id="setup", config={})
    env_var = "AIRFLOW_VAR_LINKS_PARENT_RUN"
    os.environ[env_var] = parent
    try:
        proc = airflow_cli("dags", "test", "job_links_local",
                           dags_folder=Path(__file__).parent / "dags")
    finally:
        os.environ.pop(env_var)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "MLflow run: http://localhost:5000/#/experiments/" in output

    # The API server runs in a process of its own: read the links there, from the DB alone.
    script = r"""
import json
from sqlalchemy import select
from airflow.models.dag_version import DagVersion
from airflow.models.serialized_dag import SerializedDagModel
from airflow.models.taskinstance import TaskInstance
from airflow.utils.session import create_session
with create_session() as session:
    ti = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == "job_links_local")
                         .order_by(TaskInstance.start_date.desc())).first()
    dag = SerializedDagModel.get_dag("job_links_local", session=session)
    task = dag.get_task("sample")
    print(json.dumps({name: task.get_extra_links(ti, name) for name in task.extra_links}))
"""
    read = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=os.environ, timeout=120)
    assert read.returncode == 0, read.stderr[-3000:]
    import json

    shown = json.loads(read.stdout.strip().splitlines()[-1])
    client = tracking.client()
    [child] = client.search_runs([client.get_experiment_by_name("links-test").experiment_id],
                                 f"tags.`mlflow.parentRunId` = '{parent}'")
    assert shown["MLflow run"] == tracking.run_url(child.info.run_id)
    assert child.info.run_name == "sample"  # named after its stage
    assert not shown["SageMaker job"] and not shown["Ray job"]  # a local job has none


# -- MLflow that reads well: the training view, names, the Airflow run's URL ---------------------


def test_experiments_open_in_mlflows_training_view_new_and_old():
    client = tracking.client()
    old = client.create_experiment("made-before-the-tag")  # as earlier releases did
    assert tracking.ensure_experiment("made-before-the-tag") == old
    for name in ("made-before-the-tag", "made-now"):
        tracking.ensure_experiment(name)
        tags = client.get_experiment_by_name(name).tags
        assert tags["mlflow.experimentKind"] == "custom_model_development", name


def test_the_parent_run_links_to_its_airflow_run_and_children_are_named_by_stage(monkeypatch):
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.com")
    parent = tracking.start_parent_run(experiment="names-test", dag_id="llm_lifecycle",
                                       run_id="manual__2026-01-01T00:00:00+00:00", config={})
    client = tracking.client()
    assert client.get_run(parent).data.tags["airflow_run_url"] == (
        "https://airflow.example.com/dags/llm_lifecycle/runs/manual__2026-01-01T00%3A00%3A00%2B00%3A00")
    identity = {"dag_id": "llm_lifecycle", "run_id": "r", "task_id": "pretrain", "map_index": "-1"}
    child = tracking.start_child_run(experiment="names-test", parent_run_id=parent,
                                     stage="pretrain", tags={}, identity=identity)
    assert client.get_run(child).info.run_name == "pretrain"
    assert tracking.child_run_name("sweep", {**identity, "map_index": "3"}) == "sweep-3"


def test_trials_are_named_by_number_and_learning_rate():
    from llmops.airflow.operators.trial_operator import trial_run_name

    assert trial_run_name({"number": 3, "params": {"optim.lr": 0.0025}}) == "trial-3 lr=2.50e-03"
    assert trial_run_name({"number": 0, "params": {}}) == "trial-0"


def test_progress_lines_keep_what_sagemaker_parses_and_add_share_elapsed_eta():
    import re

    from llmops.jobs.backends.sagemaker.sagemaker_requests import METRICS
    from tasks.train.telemetry import Progress

    now = [0.0]
    progress = Progress(400, done=100, clock=lambda: now[0])  # resumed at step 100
    now[0] = 60.0
    assert progress.line(110) == "27.5% | elapsed 0:01:00 | eta 0:29:00"
    assert progress.line(400) == "100.0% | elapsed 0:01:00 | eta 0:00:00"
    line = ("step 110/400 | loss 4.1234 | lr 1.00e-03 | grad_norm 0.500 | 1234 tok/s | "
            + progress.line(110))
    assert [re.search(m["Regex"], line).group(1) for m in METRICS] == ["4.1234", "1234"]


def test_training_metrics_are_named_for_the_charts():
    from tasks.common.job_tracking import chart_metrics

    assert chart_metrics({"loss": 1, "val_loss": 2, "lr": 3, "grad_norm": 4, "tokens_per_s": 5,
                          "mfu": 6, "event.rollback": 7, "params": 8}) == {
        "loss/train": 1, "loss/val": 2, "optim/lr": 3, "optim/grad_norm": 4,
        "perf/tokens_per_s": 5, "perf/mfu": 6, "resilience/event_rollback": 7, "params": 8}
