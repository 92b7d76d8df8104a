"""The run a DAG's tasks hand each other (llmops.core.run.Run): its XCom is the dict start_run has
always returned, and a dict that is not a run is refused by the key that is wrong, where it is
read, rather than turning into a KeyError or a silent default stages later."""

from __future__ import annotations

import json

import pytest

from llmops.core.run import Run
from llmops.stages import lifecycle, specs


@pytest.fixture(scope="module")
def started(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("store")
    return lifecycle.start_run({"recipe": "tiny", "storage_root": str(root), "team": "nlp",
                                "priority": 70}, dag_id="llm_lifecycle", run_id="manual__typed")


def test_the_xcom_of_start_run_is_a_run_and_back_unchanged(started):
    run = Run.from_dict(started)
    assert run.to_dict() == started and list(run.to_dict()) == list(started)
    assert json.loads(json.dumps(run.to_dict())) == started   # XCom stays JSON
    assert (run.root, run.team, run.priority, run.cache) == (
        started["root"], "nlp", 70, True)
    assert Run.of(run) is run and Run.of(started) == run


def test_a_key_no_run_has_or_a_missing_one_is_refused_by_name(started):
    with pytest.raises(ValueError, match="unknown key 'storage_rot'"):
        Run.from_dict({**started, "storage_rot": "/x"})
    missing = {k: v for k, v in started.items() if k != "parent_run_id"}
    with pytest.raises(ValueError, match="missing key 'parent_run_id'"):
        Run.from_dict(missing)


def test_older_xcoms_and_the_other_dags_runs_keep_their_shape(started):
    """A run from before champions were pinned has no `champion` key (evaluation reads the
    current one); the retraining DAG's has `data`: neither gains nor loses a key."""
    unpinned = {k: v for k, v in started.items() if k != "champion"}
    run = Run.from_dict(unpinned)
    assert not run.champion_pinned and run.to_dict() == unpinned
    retrain = {k: started[k] for k in ("dag_id", "run_id", "root", "config", "backends",
                                       "experiment", "parent_run_id", "model_name", "champion")}
    retrain["data"] = {"outputs": {"data_dir": "/curated"}, "data_hash": "h"}
    assert Run.from_dict(retrain).data == retrain["data"]


def test_a_spec_builder_builds_the_same_spec_from_the_dict_and_from_the_run(started):
    data = {"outputs": {"data_dir": "/out/data"}, "data_hash": "abc"}
    model = {"outputs": {"model_dir": "/out/model"}, "mlflow_run_id": "r"}
    run = Run.from_dict(started)
    assert specs.data_prep_spec(run) == specs.data_prep_spec(started)
    assert specs.finetune_spec(run, data, model) == specs.finetune_spec(started, data, model)
    assert specs.evaluate_spec(run, data, model, model, model) == \
        specs.evaluate_spec(started, data, model, model, model)
