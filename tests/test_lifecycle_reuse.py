"""Reuse and replay through Airflow on the tiny recipe (issue 15), building on the session's
tiny lifecycle run (tests/lifecycle_run.py, cache off: every stage ran its job and was recorded
in the step cache under the session's storage root).

- the same recipe again: no stage submits a job, each reuses the recorded one, in a fraction of
  its time; evaluate too unless the first run compared with a champion of other weights;
- and a third time (issue 24): no job at all, evaluation included (it keys on the champion's
  weights, which are this run's own model's), and no new model version;
- one fine-tuning knob changed: fine-tune and everything after it run, nothing before;
- a run that starts at fine-tune from the first run's outputs (from_run + start_at), checked
  before any job, with lineage tags naming the first run's MLflow runs;
- a replay of the first run from its MLflow record (python -m llmops.stages.replay): pretraining's
loss
  curves and weights bitwise equal; a tampered data manifest or another code version refused.

The runs here register their models as `llm-reuse`, so the `llm-lifecycle` champion that
test_lifecycle_e2e checks never moves; the model name is no part of any stage's identity.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lifecycle_run import mlflow_runs, run_lifecycle

CONF = {"recipe": "tiny", "registered_model_name": "llm-reuse"}
BEFORE_FINETUNE = ("data_prep", "sweep", "pretrain")
JOB_STAGES = ("data_prep", "sweep", "pretrain", "finetune", "distill", "evaluate")


def by_task(run: dict) -> dict[tuple[str, str], object]:
    """The run's child runs by (stage, map_index)."""
    return {(c.data.tags["stage"], c.data.tags["map_index"]): c for c in run["children"]}


def ledger_events(run: dict) -> dict[str, set[tuple[str, str]]]:
    """event -> {(stage, job_name)} of the DAG run's tasks in the job ledger."""
    from llmops.infra import ledger

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
def third(again):
    """The same conf a third time, once `again` registered its model (and crowned it)."""
    before = registered_versions()
    return {**run_lifecycle(CONF), "versions_before": before}


@pytest.fixture(scope="module")
def new_lr(third):
    return run_lifecycle({**CONF, "finetune_lr": 3e-3})


def registered_versions() -> list[str]:
    from llmops.infra import tracking

    found = tracking.client().search_model_versions(f"name = '{CONF['registered_model_name']}'")
    return sorted(str(mv.version) for mv in found)


def test_the_same_recipe_again_submits_no_job_and_takes_a_fraction_of_the_time(first, again):
    earlier, now = by_task(first), by_task(again)
    assert set(now) == set(earlier)
    evaluate = now[("evaluate", "-1")]
    # The first run (registered as llm-lifecycle) compared with that name's champion when an
    # earlier test of the session crowned one of other weights; this one has none to compare with.
    reran_evaluate = any(k.startswith("champion/") for k in earlier[("evaluate", "-1")].data.metrics)
    assert ("cached_from" not in evaluate.data.tags) == reran_evaluate
    events = ledger_events(again)
    submitted = {stage for stage, _ in events.get("submitted", set())}
    assert submitted == ({"evaluate"} if reran_evaluate else set()), events
    if reran_evaluate:
        assert "Step cache miss for evaluate" in again["output"]
        assert "differs in config.models.champion" in again["output"], again["output"][-4000:]

    cached = {k: c for k, c in now.items() if k[0] != "evaluate" or not reran_evaluate}
    for (stage, index), child in cached.items():
        tags = child.data.tags
        # the first run's identity; its job, or an earlier test's of the same identity (the
        # index keeps the newest record of a key)
        assert tags["cache_key"] == earlier[(stage, index)].data.tags["cache_key"], (stage, index)
        producer = first["client"].get_run(tags["cached_from"])
        assert producer.data.tags["cache_key"] == tags["cache_key"] and tags["reuse"] == "cache"
        assert tags["cached_from_job"] == tags["job_name"] == producer.data.tags["job_name"]
        assert tags["cached_from_run"] == producer.data.tags["run_id"] != again["run_id"]
        assert child.info.status == producer.info.status == "FINISHED"
        assert child.data.metrics == producer.data.metrics, "the reused job's metrics, as they were"
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


def test_a_third_identical_run_submits_no_job_at_all_and_registers_nothing(again, third):
    """Issue 24: `again` registered its model as version 1 of llm-reuse and crowned it, so this
    run starts with a champion: the weights its own student (or teacher) holds. Evaluation keys
    on the champion's content, not its version, so it is `again`'s evaluation, reused."""
    from llmops.infra import tracking

    client = tracking.client()
    champion = client.get_model_version_by_alias(CONF["registered_model_name"], "champion")
    assert third["versions_before"] == registered_versions() == [str(champion.version)], \
        "no new model version"
    events = ledger_events(third)
    assert "submitted" not in events, events
    assert {stage for stage, _ in events["cached"]} == set(JOB_STAGES), events
    for stage in JOB_STAGES:
        assert f"Step cache hit for {stage}: reusing the outputs of job" in third["output"], stage
    earlier, now = by_task(again), by_task(third)
    evaluate = now[("evaluate", "-1")].data.tags
    assert evaluate["cache_key"] == earlier[("evaluate", "-1")].data.tags["cache_key"]
    assert evaluate["champion_run_id"] == champion.tags["training_run_id"], \
        "the evaluation stood for the champion this run started with"
    gate = third["parent"].data.tags
    assert gate["gate"] == f"already registered as version {champion.version}"
    assert gate["champion"] == f"{CONF['registered_model_name']}/{champion.version}"
    crowned = champion.tags["candidate"]   # the same weights in this run, scored once
    assert champion.tags["lineage.content_sha256"] == \
        client.get_run(now[("distill" if crowned == "student" else "finetune", "-1")]
                       .data.tags["cached_from"]).data.tags["lineage.content_sha256"]


def test_a_changed_finetuning_knob_reruns_finetune_and_what_follows_only(first, new_lr):
    events = ledger_events(new_lr)
    assert {stage for stage, _ in events["submitted"]} == {"finetune", "distill", "evaluate"}, events
    assert {stage for stage, _ in events["cached"]} == set(BEFORE_FINETUNE)
    assert "differs in config.optim.lr" in new_lr["output"]
    earlier, now = by_task(first), by_task(new_lr)
    pretrain = now[("pretrain", "-1")]
    assert pretrain.data.tags["cache_key"] == earlier[("pretrain", "-1")].data.tags["cache_key"]
    finetune = now[("finetune", "-1")]
    assert "cached_from" not in finetune.data.tags and finetune.data.params["optim.lr"] == "0.003"
    # fine-tuned from the reused pretrained model: lineage names the run that trained it
    assert finetune.data.tags["base_run_id"] == pretrain.data.tags["cached_from"]


# -- start from another run ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def from_first(first, new_lr):
    """Starts at fine-tune from the first run, with new_lr's fine-tuning knob: that fine-tuning
    job (of the first run's pretrained model) already ran in new_lr, so the step cache reuses it,
    and this run costs seconds; the taking itself is from_run's."""
    return run_lifecycle({**CONF, "from_run": first["run_id"], "start_at": "finetune",
                          "finetune_lr": 3e-3})


def test_a_run_started_at_finetune_takes_the_earlier_outputs_with_lineage(first, new_lr, from_first):
    from llmops.stages import reuse

    parent = from_first["parent"].data.tags
    assert (parent["from_run"], parent["from_parent_run_id"], parent["start_at"]) == \
        (first["run_id"], first["parent"].info.run_id, "finetune")
    earlier, now = by_task(first), by_task(from_first)
    assert {stage for stage, _ in now} == {"data_prep", "pretrain", "finetune", "distill", "evaluate"}, \
        "the sweep's trial task is skipped: its outcome is the earlier run's"
    assert "from_run: the sweep is run" in from_first["output"]
    for stage in ("data_prep", "pretrain"):
        tags = now[(stage, "-1")].data.tags
        assert tags["cached_from"] == earlier[(stage, "-1")].info.run_id and tags["reuse"] == "from_run"
        assert tags["cached_from_run"] == first["run_id"]
        assert f"from_run: taking {stage}: reusing the outputs of job" in from_first["output"]
    events = ledger_events(from_first)
    assert {s for s, _ in events["cached"]} >= {"data_prep", "pretrain", "finetune", "distill"}
    assert {s for s, _ in events.get("submitted", set())} <= {"evaluate"}
    # fine-tuning of the first run's pretrained model, on its data (the job new_lr ran)
    finetune = now[("finetune", "-1")].data.tags
    assert finetune["base_run_id"] == earlier[("pretrain", "-1")].info.run_id
    assert finetune["data_hash"] == earlier[("data_prep", "-1")].data.tags["data_hash"]
    assert finetune["cached_from"] == by_task(new_lr)[("finetune", "-1")].info.run_id
    assert now[("pretrain", "-1")].data.tags["sweep_best_run_id"] == \
        earlier[("pretrain", "-1")].data.tags["sweep_best_run_id"]
    pretrained = reuse.stage_record(first["parent"], "pretrain")["outputs"]["model_dir"]["uri"]
    assert by_task(new_lr)[("finetune", "-1")].data.params["base_model"] == pretrained


def _start(params: dict, run_id: str) -> dict:
    from llmops.stages import lifecycle

    return lifecycle.start_run({"registered_model_name": "llm-reuse", **params},
                               dag_id="llm_lifecycle", run_id=run_id)


def test_from_run_is_checked_before_any_job_and_refused_naming_the_param(first):
    """Every refusal comes from start_run before the parent run exists: no MLflow run, no job."""
    from llmops.stages import reuse

    cases = [({"recipe": "tiny", "from_run": first["run_id"]}, "'from_run' and 'start_at' go together"),
             ({"recipe": "tiny", "from_run": "manual__1999", "start_at": "finetune"},
              "MLflow has no llm_lifecycle run 'manual__1999'"),
             ({"recipe": "tiny", "from_run": first["run_id"], "start_at": "finetune", "pretrain_steps": 30},
              "pretrain.max_steps (Param 'pretrain_steps', 20 there, 30 here)")]
    for i, (params, message) in enumerate(cases):
        with pytest.raises(reuse.FromRunError, match=re.escape(message)):
            _start(params, f"refused__{i}")
    model = Path(reuse.stage_record(first["parent"], "finetune")["outputs"]["model_dir"]["uri"])
    aside = model.with_name("model.aside")
    model.rename(aside)
    try:
        with pytest.raises(reuse.FromRunError, match=r"the finetune outputs of run .* cannot be used: "
                                                     r"output 'model_dir' \(.*\) is gone"):
            _start({"recipe": "tiny", "from_run": first["run_id"], "start_at": "distill"}, "refused__3")
    finally:
        aside.rename(model)
    from llmops.infra import tracking
    from llmops.stages.run_summary import find_parent

    assert all(find_parent(tracking.client(), "llm_lifecycle", f"refused__{i}") is None for i in range(4))


# -- fork a pretraining from a step (issue 24, point 1) ------------------------------------------

FORK = {"recipe": "tiny", "start_at": "pretrain", "fork_step": 10}


def test_a_fork_is_checked_before_any_job_and_refused_naming_the_param(first):
    """The tiny pretraining (20 steps, a checkpoint every 10, the newest 2 kept) keeps 10 and 20."""
    from llmops.infra import tracking
    from llmops.stages import lifecycle, reuse, specs
    from llmops.stages.run_summary import find_parent

    ours = {**FORK, "from_run": first["run_id"]}
    cases = [({**ours, "start_at": "finetune"}, "Param 'fork_step' forks from_run's pretraining"),
             ({**FORK}, "Param 'fork_step' forks from_run's pretraining"),
             ({**ours, "fork_step": 5}, f"Param 'fork_step': step 5 is not a kept checkpoint of run "
                                        f"{first['run_id']}'s pretraining; it keeps steps 10, 20."),
             ({**ours, "n_layer": 2}, "pretrain.model.n_layer (Param 'n_layer', 1 there, 2 here)"),
             ({**ours, "batch_size": 4}, "pretrain.batch_size (Param 'batch_size', 8 there, 4 here)")]
    for i, (params, message) in enumerate(cases):
        with pytest.raises(reuse.FromRunError, match=re.escape(message)):
            _start(params, f"fork_refused__{i}")
    assert all(find_parent(tracking.client(), "llm_lifecycle", f"fork_refused__{i}") is None
               for i in range(len(cases)))
    # knobs of the declared set may change: the fork goes on to step 30 from the kept step 10,
    # at a learning rate of its own instead of the sweep's best
    run = _start({**ours, "pretrain_steps": 30, "pretrain_lr": 0.0042}, "fork_checked__1")
    record = reuse.stage_record(first["parent"], "pretrain")
    fork = run["from_run"]["fork"]
    assert (fork["step"], fork["parent_run_id"]) == (10, record["mlflow_run_id"])
    assert fork["checkpoints"] == str(Path(record["result"]["outputs"]["checkpoint"]).parent)
    data = {"outputs": {"data_dir": "/data"}, "data_hash": "h"}
    spec = specs.pretrain_spec(run, data, run["from_run"]["sweep_best"])
    assert (spec["config"]["fork_from"], spec["config"]["fork_step"], spec["config"]["max_steps"]) \
        == (fork["checkpoints"], 10, 30)
    assert run["from_run"]["sweep_best"]["lr"] != 0.0042 and spec["config"]["optim"]["lr"] == 0.0042
    assert spec["tags"]["fork.step"] == "10"


@pytest.fixture(scope="module")
def forked(first):
    return run_lifecycle({**FORK, "registered_model_name": "llm-reuse-fork",
                          "from_run": first["run_id"]})


def test_a_dag_run_forks_the_pretraining_at_a_kept_step_and_ends_bitwise_where_it_ended(first, forked):
    """Nothing changed: the fork restores step 10 of the first run's pretraining (weights,
    optimizer, RNG, data cursor) and its step 20 is the first run's, tensor by tensor."""
    import torch

    from llmops.stages import reuse
    from tasks.train import checkpoint as ckpt

    earlier, now = by_task(first), by_task(forked)
    pretrain = now[("pretrain", "-1")]
    assert "cached_from" not in pretrain.data.tags, "the fork ran a pretraining job"
    assert pretrain.data.tags["fork.step"] == "10"
    assert pretrain.data.tags["fork.parent_run_id"] == earlier[("pretrain", "-1")].info.run_id
    assert forked["parent"].data.tags["fork_step"] == "10"
    parent_final = Path(reuse.stage_record(first["parent"], "pretrain")["result"]["outputs"]["checkpoint"])
    fork_final = Path(reuse.stage_record(forked["parent"], "pretrain")["result"]["outputs"]["checkpoint"])
    assert fork_final != parent_final and fork_final.name == parent_final.name == "step_000020"
    assert (fork_final.parent / "step_000010").is_dir(), "the parent's step 10, copied"
    ours, theirs = ckpt.load_checkpoint(fork_final), ckpt.load_checkpoint(parent_final)
    for part in ("model", "optimizer"):
        flat_ours, flat_theirs = _tensors(ours[part]), _tensors(theirs[part])
        assert flat_ours.keys() == flat_theirs.keys()
        assert all(torch.equal(flat_ours[k], flat_theirs[k]) for k in flat_theirs), part
    assert ours["trainer"]["data_cursor"] == theirs["trainer"]["data_cursor"]
    # the run page: the parent's curve to step 10, the fork's from there; the steps it kept
    from llmops.stages import run_summary

    kept = [int(s) for s in pretrain.data.tags["checkpoints.kept"].split(",")]
    assert 10 in kept and kept[-1] == 20
    summary = run_summary.collect("llm_lifecycle", forked["run_id"])
    fork = summary["curves"]["pretrain"]["fork"]
    assert (fork["step"], fork["parent"]) == (10, first["run_id"])
    for segment in fork["segments"].values():
        assert segment["parent"] and all(step <= 10 for step, _ in segment["parent"])
        assert segment["fork"][0] == segment["parent"][-1]
        assert segment["fork"][-1][0] == 20 and all(step > 10 for step, _ in segment["fork"][1:])
    assert summary["checkpoints"]["kept"] == kept


def _tensors(state: object, prefix: str = "") -> dict:
    import torch

    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) \
        if isinstance(state, (list, tuple)) else []
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}.{key}").items()}


# -- replay ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def replayed(first):
    """`python -m llmops.stages.replay` of the first run (from pretrain on: the recorded sweep
    outcome is kept, to spare the suite two trials; the default also recomputes the sweep)."""
    proc = subprocess.run([sys.executable, "-m", "llmops.stages.replay", first["parent"].info.run_id,
                           "--start-at", "pretrain"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    from llmops.stages import reuse

    run_id = reuse.find_parent(report["replay"], "llm_lifecycle").data.tags["run_id"]
    return {"report": report, "stdout": proc.stdout, **mlflow_runs(run_id), "run_id": run_id}


def test_a_replay_reproduces_pretraining_bitwise_on_cpu(first, replayed):
    report = replayed["report"]
    assert report["original"] == first["parent"].info.run_id and report["identical"], replayed["stdout"]
    pretrain = report["stages"]["pretrain"]
    assert pretrain["loss/train"]["identical"] and pretrain["loss/train"]["points"] >= 4
    assert pretrain["loss/val"]["identical"] and pretrain["loss/val"]["points"] >= 2
    assert pretrain["weights"]["identical"] and pretrain["weights"]["original"].startswith("sha256:")
    assert "pretrain: loss/train" in replayed["stdout"] and "weights bitwise equal" in replayed["stdout"]
    # recomputed, not reused: a job ran for pretraining, from the first run's data
    events = ledger_events(replayed)
    assert {s for s, _ in events["submitted"]} >= {"pretrain", "finetune", "distill", "evaluate"}
    assert {s for s, _ in events["cached"]} == {"data_prep"}
    tags = replayed["parent"].data.tags
    assert tags["replay_of"] == first["parent"].info.run_id and tags["replay_identical"] == "true"
    assert tags["from_run"] == first["run_id"]
    assert tags["code_version"] == first["parent"].data.tags["code_version"]


def test_a_replay_is_refused_when_the_data_or_the_code_cannot_be_matched(first, monkeypatch):
    from llmops.core import provenance
    from llmops.stages import replay, reuse

    record = reuse.stage_record(first["parent"], "data_prep")
    manifest = Path(record["outputs"]["data_dir"]["uri"]) / "manifest.json"
    original = manifest.read_bytes()
    tampered = json.loads(original)
    tampered["counts"]["kept_documents"] += 1
    manifest.write_text(json.dumps(tampered))
    try:
        proc = subprocess.run([sys.executable, "-m", "llmops.stages.replay", first["parent"].info.run_id],
                              capture_output=True, text=True, timeout=300)
    finally:
        manifest.write_bytes(original)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Replay refused: The recorded data hash" in proc.stderr and "cannot be matched" in proc.stderr
    assert f"{manifest} changed since the job finished" in proc.stderr
    planned = replay.plan(first["parent"].info.run_id)["conf"]
    assert (planned["from_run"], planned["start_at"], planned["cache"]) == (first["run_id"], "sweep", False)

    monkeypatch.setattr(provenance, "code_version", lambda: "0" * 40)
    with pytest.raises(replay.ReplayRefused, match="The code commit cannot be matched: run .* ran code "
                                                   "version .*, this checkout is 0{40}"):
        replay.plan(first["parent"].info.run_id)


def test_the_replay_dag_checks_triggers_the_lifecycle_and_compares():
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(Path(__file__).parents[1] / "dags")).dags["llm_replay"]
    trigger = dag.get_task("replay")
    assert trigger.trigger_dag_id == "llm_lifecycle" and trigger.wait_for_completion
    assert dag.get_task("check").downstream_task_ids == {"replay", "compare"}
    assert dag.get_task("replay").downstream_task_ids == {"compare"}
