"""The run's Params for remote backends: team, priority and per-stage resources are checked by
the trigger form and reach every job's spec."""

from __future__ import annotations

import pytest

from llmops.jobs.spec import JobSpec
from llmops.policy.params import lifecycle_params
from llmops.stages import specs


@pytest.fixture()
def params():
    from airflow.sdk.definitions.param import ParamsDict

    return ParamsDict(lifecycle_params())


@pytest.mark.parametrize("name, value", [
    ("team", "ML Research"),                       # not a Batch share id nor a namespace part
    ("priority", 10000),                           # Batch takes 0-9999
    ("stage_resources", {"pretrain": {"instance_typ": "ml.p5.48xlarge"}}),
    ("stage_resources", {"pretrain": {"instance_count": 0}}),
    ("stage_resources", {"pretraining": {"instance_count": 2}}),
])
def test_the_trigger_form_refuses_bad_values(params, name, value):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match=name):
        params[name] = value


def test_team_priority_and_resources_reach_the_job_spec(params):
    params["team"] = "research"
    params["priority"] = 70
    params["stage_resources"] = {"pretrain": {"instance_type": "ml.p5.48xlarge", "instance_count": 2,
                                              "nproc_per_node": 8, "max_run_seconds": 432000}}
    params.validate()
    conf = {k: params[k] for k in params}
    run = {"dag_id": "llm_lifecycle", "run_id": "manual__resources",
           "config": {"pretrain": {"optim": {"lr": 1e-3}}}, "root": "/tmp/r", "experiment": "e",
           "parent_run_id": "p", "backends": {"pretrain": "batch"},
           "resources": conf["stage_resources"], "team": conf["team"], "priority": conf["priority"]}
    spec = JobSpec.from_dict(specs.pretrain_spec(
        run, {"outputs": {"data_dir": "/tmp/d"}, "data_hash": "h"}, {"lr": 0.01}))
    assert spec.backend == "batch" and spec.instance_type == "ml.p5.48xlarge"
    assert (spec.instance_count, spec.nproc_per_node, spec.max_run_seconds) == (2, 8, 432000)
    assert spec.tags["team"] == "research" and spec.tags["priority"] == "70"
    # Without them, nothing is added: local runs stay as they were.
    plain = JobSpec.from_dict(specs.pretrain_spec(
        {**run, "resources": {}, "team": "", "priority": None},
        {"outputs": {"data_dir": "/tmp/d"}, "data_hash": "h"}, {"lr": 0.01}))
    assert "team" not in plain.tags and plain.instance_count == 1 and plain.instance_type == "local"
