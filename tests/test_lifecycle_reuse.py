"""Reuse and replay through Airflow on the tiny recipe (issue 15), building on the session's
tiny lifecycle run (tests/lifecycle_run.py, cache off: every stage ran its job and was recorded
in the step cache under the session's storage root).

- the same recipe again: no stage submits a job, each reuses the recorded one, in a fraction of
  its time; evaluate too unless the champion it compares with is another one;
- one fine-tuning knob changed: fine-tune and everything after it run, nothing before.

The runs here register their models as `llm-reuse`, so the `llm-lifecycle` champion that
test_lifecycle_e2e checks never moves; the model name is no part of any stage's identity.
"""

from __future__ import annotations

import pytest

from tests.lifecycle_run import run_lifecycle

CONF = {"recipe": "tiny", "registered_model_name": "llm-reuse"}
BEFORE_FINETUNE = ("data_prep", "sweep", "pretrain")
JOB_STAGES = ("data_prep", "sweep", "pretrain", "finetune", "distill", "evaluate")


def by_task(run: dict) -> dict[tuple[str, str], object]:
    """The run's child runs by (stage, map_index)."""
    return {(c.data.tags["stage"], c.data.tags["map_index"]): c for c in run["children"]}


def ledger_events(run: dict) -> dict[str, set[tuple[str, str]]]:
    """event -> {(stage, job_name)} of the DAG run's tasks in the job ledger."""
    from llmops import ledger

    out: dict[str, set] = {}
    for row in ledger.read_events(0, source="sqlite"):
        if row["run_id"] == run["run_id"]:
            out.setdefault(row["event"], set()).add((row["stage"], row["job_name"]))
    return out


def task_seconds(run: dict) -> dict[tuple[str, str], float]:
    """(task_id, map_index) -> seconds the task took, from `airflow dags test`'s log."""
    import datetime as dt
    import re

    starts, took = {}, {}
    for when, what, task, index in re.findall(
            r"^(\S+)Z \[info\s*\] \[DAG TEST\] (starting|end task) task_id=(\w+) map_index=(-?\d+)",
            run["output"], re.M):
        t = dt.datetime.fromisoformat(when).timestamp()
        if what == "starting":
            starts[(task, index)] = t
        else:
            took[(task, index)] = t - starts[(task, index)]
    return took


@pytest.fixture(scope="module")
def first(tiny_lifecycle_run):
    return tiny_lifecycle_run


@pytest.fixture(scope="module")
def again(first):
    return run_lifecycle(CONF)


@pytest.fixture(scope="module")
def new_lr(again):
    return run_lifecycle({**CONF, "finetune_lr": 3e-3})


def test_the_same_recipe_again_submits_no_job_and_takes_a_fraction_of_the_time(first, again):
    earlier, now = by_task(first), by_task(again)
    assert set(now) == set(earlier)
    evaluate = now[("evaluate", "-1")]
    reran_evaluate = "cached_from" not in evaluate.data.tags
    events = ledger_events(again)
    submitted = {stage for stage, _ in events.get("submitted", set())}
    assert submitted == ({"evaluate"} if reran_evaluate else set()), events
    if reran_evaluate:  # the champion of the first run's start is not the one of this run's
        assert "Step cache miss for evaluate" in again["output"]
        assert "differs in config.models.champion" in again["output"], again["output"][-4000:]

    cached = {k: c for k, c in now.items() if k[0] != "evaluate" or not reran_evaluate}
    for (stage, index), child in cached.items():
        tags, was = child.data.tags, earlier[(stage, index)]
        assert tags["cached_from"] == was.info.run_id and tags["reuse"] == "cache", (stage, index)
        assert tags["cached_from_job"] == tags["job_name"] == was.data.tags["job_name"]
        assert tags["cached_from_run"] == first["run_id"] and child.info.status == "FINISHED"
        assert child.data.metrics == was.data.metrics, "the reused job's metrics, as they were"
        assert (stage, tags["job_name"]) in events["cached"]
    assert {s for s, _ in events["cached"]} >= set(BEFORE_FINETUNE) | {"finetune", "distill"}
    for stage in BEFORE_FINETUNE + ("finetune", "distill"):
        assert f"Step cache hit for {stage}: reusing the outputs of job" in again["output"]

    # The tasks of the reused stages, start to end, against the same tasks computing them.
    tasks = {(c.data.tags["task_id"], index) for (stage, index), c in cached.items()}
    spent = sum(task_seconds(again)[t] for t in tasks)
    computed = sum(task_seconds(first)[t] for t in tasks)
    print(f"\n{len(tasks)} reused stage tasks: {spent:.1f} s vs {computed:.1f} s computing them; "
          f"whole run {again['seconds']:.0f} s vs {first['seconds']:.0f} s (CLI included)")
    assert spent < 0.15 * computed, (spent, computed)
    assert again["seconds"] < 0.6 * first["seconds"]


def test_a_changed_finetuning_knob_reruns_finetune_and_what_follows_only(first, new_lr):
    events = ledger_events(new_lr)
    assert {stage for stage, _ in events["submitted"]} == {"finetune", "distill", "evaluate"}, events
    assert {stage for stage, _ in events["cached"]} == set(BEFORE_FINETUNE)
    assert "differs in config.optim.lr" in new_lr["output"]
    earlier, now = by_task(first), by_task(new_lr)
    pretrain = now[("pretrain", "-1")]
    assert pretrain.data.tags["cached_from"] == earlier[("pretrain", "-1")].info.run_id
    finetune = now[("finetune", "-1")]
    assert "cached_from" not in finetune.data.tags and finetune.data.params["optim.lr"] == "0.003"
    # fine-tuned from the first run's pretrained model (the reused outputs)
    assert finetune.data.tags["base_run_id"] == earlier[("pretrain", "-1")].info.run_id
