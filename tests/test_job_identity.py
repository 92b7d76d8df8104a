"""One identity, two projections (plugins/llmops/airflow/operators/job_identity.py): a fixed spec's
job name, ledger spec_hash and step-cache key are pinned to the values the code gave before the
operator was split (issue 22, point 3), so existing job names and cache records stay valid."""

from __future__ import annotations

from llmops.airflow.operators.job_identity import JobIdentity
from llmops.airflow.operators.job_operator import job_identity
from llmops.core import provenance
from llmops.infra import step_cache
from llmops.jobs.spec import JobSpec, job_name

SETTINGS = "settings-fingerprint"
TASK = ("llm_lifecycle", "manual__1", "finetune", "-1")


def fixed_spec() -> JobSpec:
    return JobSpec(
        stage="finetune", entrypoint="tasks.finetune", backend="sagemaker",
        image="123.dkr.ecr.us-east-1.amazonaws.com/llmops@sha256:" + "a" * 64,
        config={"base_model": "/store/r1/pretrain/model", "output_dir": "/store/r1/finetune",
                "max_steps": 10},
        argv=("--seed", "1"), output_uri="/store/r1/finetune",
        env={"MLFLOW_RUN_ID": "run-1", "OMP_NUM_THREADS": "1"}, tags={"team": "nlp"},
        mlflow_experiment="exp", mlflow_parent_run_id="parent-1",
        cache={"index": "/store/step_cache", "lookup": True,
               "inputs": {"base": {"uri": "/store/r1/pretrain/model", "hash": "base-hash"}}})


def test_the_name_and_the_cache_key_are_what_they_were_before_the_split(monkeypatch):
    monkeypatch.setattr(provenance, "code_version", lambda: "0123abc")
    identity = JobIdentity(fixed_spec(), SETTINGS)
    assert identity.spec_hash == job_identity(fixed_spec(), SETTINGS) == \
        "25341ffceaea143ac5c780e4ab6b51c98baaa0900bc64ccbceaedd9f8357d346"
    assert identity.job_name(*TASK, prefix="finetune") == "finetune-ef3442e7dd08"
    assert identity.job_name("llm_lifecycle", "manual__1", "finetune", "2", salt="rerun-1",
                             prefix="finetune-2") == "finetune-2-27c8dce234b9"
    assert identity.job_name(*TASK, prefix="finetune") == \
        job_name(*TASK, identity.spec_hash, prefix="finetune")
    assert identity.cache_key == step_cache.key_of(step_cache.identity(fixed_spec(), SETTINGS)) == \
        "4f91302e5f8fd5d2658fdc04cba7a9947b94dfb425c18201035ee79316510bec"


def test_what_addresses_a_try_changes_neither_projection(monkeypatch):
    monkeypatch.setattr(provenance, "code_version", lambda: "0123abc")
    base = JobIdentity(fixed_spec(), SETTINGS)
    tried = JobIdentity(fixed_spec().replace(
        name="finetune-ef3442e7dd08", tags={"team": "nlp", "dag_id": "d", "run_id": "r"},
        env={"MLFLOW_RUN_ID": "run-2", "MLFLOW_TRACKING_URI": "x", "OMP_NUM_THREADS": "1"}), SETTINGS)
    assert (tried.spec_hash, tried.cache_key) == (base.spec_hash, base.cache_key)
    other = JobIdentity(fixed_spec(), "other-settings")
    assert other.spec_hash != base.spec_hash and other.cache_key != base.cache_key
