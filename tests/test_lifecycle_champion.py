"""The lifecycle's evaluation compares challengers with the champion of the moment the DAG run
started, pinned by version: every try of evaluate builds the same spec (hence the same job name,
so a retry reattaches), even when the alias moves in between; the next run pins the new one."""

from __future__ import annotations

import pytest

from llmops.infra import tracking
from llmops.policy import promotion
from llmops.stages import lifecycle, specs

NAME = "lifecycle-champion-test"


def crown(version: str) -> None:
    tracking.client().set_registered_model_alias(NAME, promotion.CHAMPION, version)


@pytest.fixture()
def registry(tmp_path):
    client = tracking.client()
    client.create_registered_model(NAME)
    for _ in range(2):
        client.create_model_version(NAME, source=str(tmp_path / "model"))
    yield client
    client.delete_registered_model(NAME)


def results() -> tuple[dict, dict]:
    data = {"outputs": {"data_dir": "/out/data"}, "data_hash": "abc"}
    model = {"outputs": {"model_dir": "/out/model"}, "mlflow_run_id": "r"}
    return data, model


def start(run_id: str, tmp_path) -> dict:
    return lifecycle.start_run({"recipe": "tiny", "registered_model_name": NAME,
                                "storage_root": str(tmp_path)}, dag_id="llm_lifecycle", run_id=run_id)


def test_a_champion_crowned_mid_run_does_not_change_the_evaluate_spec(registry, tmp_path):
    crown("1")
    run = start("manual__1", tmp_path)
    assert run["champion"]["uri"] == f"models:/{NAME}/1"
    data, model = results()
    first_try = specs.evaluate_spec(run, data, model, model, model)
    assert first_try["config"]["models"]["champion"] == f"models:/{NAME}/1"
    crown("2")   # e.g. another DAG run promoted a model between two tries of evaluate
    assert specs.evaluate_spec(run, data, model, model, model) == first_try
    # A different DAG run compares with the champion of its own start.
    later = specs.evaluate_spec(start("manual__2", tmp_path), data, model, model, model)
    assert later["config"]["models"]["champion"] == f"models:/{NAME}/2"


def test_no_champion_at_the_start_means_none_in_any_try(registry, tmp_path):
    run = start("manual__3", tmp_path)
    assert run["champion"] is None
    data, model = results()
    before = specs.evaluate_spec(run, data, model, model, model)
    crown("1")
    after = specs.evaluate_spec(run, data, model, model, model)
    assert after == before and "champion" not in after["config"]["models"]
