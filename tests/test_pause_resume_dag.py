"""Pause, resume and fork a pretraining through the lifecycle DAG, as a researcher does (issue 47):
`airflow dags test llm_lifecycle -c CONF` with the documented Params, building on the session's
tiny lifecycle run (tests/lifecycle_run.py: the same recipe, unpaused, cache off).

- The paused run keeps more than its newest checkpoint through the Params `checkpoint_interval`
  5, `keep_checkpoints` 1 and `keep_every` 10. While it runs, the test writes the PAUSE marker
  where the docs say (`<pretrain output_dir>/checkpoints/PAUSE`, `{"at_step": 15}`) before its
  pretraining starts; the job pauses after step 15 of 20, keeping steps 10 and 15. The DAG run
  ends with the note "paused at step 15 of 20" and the resume; its MLflow parent run is tagged
  `paused_at_step` and `resume` and ended KILLED; every later stage is skipped.
- The resume printed in that note, triggered as printed, runs end to end, and its pretrained
  weights (model.safetensors' sha256) and loss curves equal the unpaused tiny run's: the pause,
  and the checkpoint Params, changed nothing the model learnt.
- A fork at step 10 (kept only because of keep_every) works through Params; a fork_step the run
  did not keep is refused by start_run, naming the steps it kept.
- start_run's refusals of what cannot be resumed (start_at after the paused stage, another
  config, checkpoints gone or changed) say how to resume, or why not.

Data prep and the sweep's trials are the tiny run's, reused through the step cache (the
checkpoint Params are not part of a trial's identity); only pretraining and what follows it run.

Minutes of DAG runs (four, besides the tiny run), so `make test-slow` runs it (LLMOPS_SLOW_TESTS=1)
and the suite skips it. One test drives the whole story in order: `make test-slow` spreads tests
over two workers one by one, and each would otherwise build the runs again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from tests.lifecycle_run import DAG_ID, run_lifecycle

PAUSE_AT, STEPS, KEPT_AT_PAUSE = 15, 20, [10, 15]
RETENTION = {"checkpoint_interval": 5, "keep_checkpoints": 1, "keep_every": 10}
CONF = {"recipe": "tiny", **RETENTION, "registered_model_name": "llm-pause"}
LATER_STAGES = ("finetune", "distill", "evaluate", "promote")


def dag_runs() -> dict[str, tuple[str, str | None, dict[str, str]]]:
    """run_id -> (state, note, {task_id: state}) of every llm_lifecycle run in Airflow's DB."""
    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        return {r.run_id: (str(r.state), r.note,
                           {ti.task_id: str(ti.state) for ti in r.get_task_instances(session=session)})
                for r in session.scalars(select(DagRun).where(DagRun.dag_id == DAG_ID))}


class PauseMarker(threading.Thread):
    """Writes the PAUSE marker of the next llm_lifecycle run's pretraining as soon as Airflow has
    the run, long before its pretraining starts: `<output_dir>/checkpoints/PAUSE` with
    {"at_step": N}, written atomically (docs/researchers.md, "Pause and resume")."""

    def __init__(self, at_step: int):
        super().__init__(daemon=True)
        self.at_step, self.known = at_step, set(dag_runs())
        self.run_id: str | None = None
        self.marker: Path | None = None
        self.done = threading.Event()

    def run(self) -> None:
        from llmops.core import settings
        from llmops.core.paths import run_root
        from tasks.train.pause import marker_path

        while not self.done.wait(0.2):
            try:
                new = set(dag_runs()) - self.known
            except Exception:  # noqa: BLE001 - SQLite busy while the run writes: look again
                continue
            if new:
                self.run_id = new.pop()
                output_dir = Path(run_root(settings.storage_root(), DAG_ID, self.run_id)) / "pretrain"
                self.marker = marker_path(output_dir)
                self.marker.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.marker.with_name(".PAUSE.tmp")
                tmp.write_text(json.dumps({"at_step": self.at_step, "by": "test"}))
                tmp.rename(self.marker)
                return


def by_stage(run: dict) -> dict[str, object]:
    return {c.data.tags["task_id"]: c for c in run["children"] if c.data.tags["map_index"] == "-1"}


def curve(client, run, key: str) -> list[tuple[int, float]]:
    source = run.data.tags.get("cached_from") or run.info.run_id
    return sorted((m.step, m.value) for m in client.get_metric_history(source, key))


def weights_sha256(run: dict) -> str:
    """The sha256 of the run's pretrained model.safetensors, read from the file itself."""
    from llmops.stages import reuse

    record = reuse.stage_record(run["parent"], "pretrain")
    path = Path(record["outputs"]["model_dir"]["uri"]) / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resume_of(note: str) -> dict:
    """The conf the note gives for the resume (its JSON, after the Params it names)."""
    return json.loads(note[note.index("{"):])


def pause_a_run() -> dict:
    """A lifecycle run paused at step PAUSE_AT by its marker."""
    marker = PauseMarker(PAUSE_AT)
    marker.start()
    try:
        run = run_lifecycle(CONF)
    finally:
        marker.done.set()
        marker.join()
    assert marker.run_id == run["run_id"], "the marker went to this run's pretraining"
    state, note, tasks = dag_runs()[run["run_id"]]
    return {**run, "state": state, "note": note, "tasks": tasks, "marker": marker.marker}


@pytest.mark.skipif(not os.environ.get("LLMOPS_SLOW_TESTS"),
                    reason="four lifecycle DAG runs (minutes on 2 cores): make test-slow runs it "
                           "(LLMOPS_SLOW_TESTS=1)")
def test_pause_then_resume_and_fork_through_the_dag(tiny_lifecycle_run):
    unpaused = tiny_lifecycle_run
    paused = pause_a_run()
    check_the_paused_run(paused)
    # the resume exactly as the paused run's note prints it
    conf = resume_of(paused["note"])
    resumed = {**run_lifecycle(conf), "conf": conf}
    resumed["airflow"] = dag_runs()[resumed["run_id"]]
    check_the_resume(unpaused, paused, resumed)
    forked = run_lifecycle({**CONF, "from_run": paused["run_id"], "start_at": "pretrain",
                            "fork_step": 10})
    check_the_fork(unpaused, paused, forked)
    refused = check_an_unkept_fork_step_is_refused(paused)
    check_what_cannot_be_resumed_is_refused(paused)
    print(f"\nairflow dags test, seconds: unpaused (the session's) {unpaused['seconds']:.0f}, paused "
          f"{paused['seconds']:.0f}, resumed {resumed['seconds']:.0f}, forked {forked['seconds']:.0f}, "
          f"refused {refused:.0f}")


def check_the_paused_run(paused: dict) -> None:
    """Success to Airflow (its tasks were skipped, none failed), but the note says paused."""
    run_id = paused["run_id"]
    assert paused["state"] == "success"
    resume = {"from_run": run_id, "start_at": "pretrain", "fork_step": PAUSE_AT}
    # the DAG run: its note says it paused, where, and how to resume
    note = paused["note"] or ""
    assert note.startswith(f"paused at step {PAUSE_AT} of {STEPS}: pretrain checkpointed that "
                           "step and stopped on request"), note
    assert f"Resume with from_run={run_id}, start_at=pretrain, fork_step={PAUSE_AT}" in note
    assert resume_of(note) == {**CONF, **resume}, "the run's own Params, plus the resume's"
    assert paused["tasks"]["pretrain"] == "skipped"
    assert all(paused["tasks"][t] == "skipped" for t in LATER_STAGES), paused["tasks"]
    assert f"paused at step {PAUSE_AT} on request" in paused["output"]
    assert f"To resume, trigger llm_lifecycle with from_run={run_id}, start_at=pretrain, " \
           f"fork_step={PAUSE_AT} and nothing else changed: {json.dumps(resume_of(note))}" \
        in paused["output"]
    assert not paused["marker"].exists(), "the job consumed its marker"
    # MLflow: the parent run is tagged for the run page, and no longer RUNNING
    parent = paused["client"].get_run(paused["parent"].info.run_id)
    assert parent.info.status == "KILLED"
    assert parent.data.tags["paused_at_step"] == str(PAUSE_AT)
    assert json.loads(parent.data.tags["resume"]) == resume
    pretrain = by_stage(paused)["pretrain"]
    assert pretrain.info.status == "KILLED" and pretrain.data.tags["paused_at_step"] == str(PAUSE_AT)
    # keep_every 10 kept step 10 besides the newest (keep_checkpoints 1)
    assert pretrain.data.tags["checkpoints.kept"] == ",".join(map(str, KEPT_AT_PAUSE))
    assert pretrain.data.params["checkpoint_interval"] == "5"
    # the sweep's trials and data prep were the tiny run's: the checkpoint Params are pretraining's
    assert "Step cache hit for data_prep" in paused["output"]
    assert "Step cache hit for sweep" in paused["output"]


def check_the_resume(unpaused: dict, paused: dict, resumed: dict) -> None:
    assert resumed["conf"]["fork_step"] == PAUSE_AT and resumed["conf"]["from_run"] == paused["run_id"]
    state, note, tasks = resumed["airflow"]
    assert state == "success" and not (note or "").startswith("paused"), note
    assert tasks["promote"] in ("success", "skipped") and tasks["evaluate"] == "success", tasks
    client = resumed["client"]
    now, before = by_stage(resumed), by_stage(paused)
    pretrain = now["pretrain"]
    assert "cached_from" not in pretrain.data.tags, "the resume ran a pretraining job"
    assert pretrain.data.tags["fork.step"] == str(PAUSE_AT)
    assert pretrain.data.tags["fork.parent_run_id"] == before["pretrain"].info.run_id
    assert resumed["parent"].data.tags["fork_step"] == str(PAUSE_AT)
    # weights: byte for byte the unpaused run's
    assert weights_sha256(resumed) == weights_sha256(unpaused)
    # loss curves: the paused run's to step 15, then the resume's, are the unpaused run's
    reference = by_stage(unpaused)["pretrain"]
    for key in ("loss/train", "loss/val"):
        joined = [p for p in curve(client, before["pretrain"], key) if p[0] <= PAUSE_AT] + \
                 [p for p in curve(client, pretrain, key) if p[0] > PAUSE_AT]
        assert joined == curve(client, reference, key), key
        assert len(joined) >= 2, key
    # and the later stages ran from the resumed model
    assert now["finetune"].data.tags["base_run_id"] == pretrain.info.run_id


def check_the_fork(unpaused: dict, paused: dict, forked: dict) -> None:
    """A fork at step 10, kept only because of keep_every, through Params."""
    pretrain = by_stage(forked)["pretrain"]
    assert pretrain.data.tags["fork.step"] == "10" and forked["parent"].data.tags["fork_step"] == "10"
    assert pretrain.data.tags["fork.parent_run_id"] == by_stage(paused)["pretrain"].info.run_id
    steps = [s for s, _ in curve(forked["client"], pretrain, "loss/train")]
    assert steps and min(steps) > 10 and max(steps) == STEPS, steps
    assert weights_sha256(forked) == weights_sha256(unpaused), "nothing changed: the same model"


def check_an_unkept_fork_step_is_refused(paused: dict) -> float:
    """Through the DAG: start_run fails the run, naming the steps that exist. Its seconds."""
    from tests.isolated_env import airflow_cli

    conf = {**CONF, "from_run": paused["run_id"], "start_at": "pretrain", "fork_step": 5}
    started = time.monotonic()
    proc = airflow_cli("dags", "test", DAG_ID, "-c", json.dumps(conf), timeout=300)
    output = proc.stdout + proc.stderr
    assert "state=failed" in output, output[-4000:]
    assert (f"Param 'fork_step': step 5 is not a kept checkpoint of run {paused['run_id']}'s paused "
            f"pretraining; it keeps steps 10, 15.") in output, output[-4000:]
    return time.monotonic() - started


# -- what cannot be resumed: start_run's refusals, before any job --------------------------------

def _start(params: dict, run_id: str) -> dict:
    from llmops.stages import lifecycle

    return lifecycle.start_run(params, dag_id=DAG_ID, run_id=run_id)


def check_what_cannot_be_resumed_is_refused(paused: dict) -> None:
    """start_run's refusals, before any job: a pause is never thrown away."""
    from llmops.infra import tracking
    from llmops.stages import reuse
    from llmops.stages.run_summary import find_parent

    run_id = paused["run_id"]
    resume = {**CONF, "from_run": run_id, "start_at": "pretrain", "fork_step": PAUSE_AT}
    checkpoints = Path(reuse.pretraining_to_fork(paused["parent"])["checkpoints"])
    # starting after the paused stage: the refusal says how to resume, not "start earlier"
    with pytest.raises(reuse.FromRunError) as refused:
        _start({**CONF, "from_run": run_id, "start_at": "finetune"}, "resume_refused__0")
    said = str(refused.value)
    assert f"run {run_id}'s pretraining was paused at step {PAUSE_AT} on request. To resume it, " \
           f"trigger llm_lifecycle with from_run={run_id}, start_at=pretrain, fork_step={PAUSE_AT}" in said
    assert "Start at" not in said
    # another config: the architecture is no knob a resume may change
    with pytest.raises(reuse.FromRunError, match=re.escape(
            "pretrain.model.n_layer (Param 'n_layer', 1 there, 2 here)")):
        _start({**resume, "n_layer": 2}, "resume_refused__1")
    # a kept checkpoint changed since the pause, then the checkpoints gone
    manifest = checkpoints / f"step_{PAUSE_AT:06d}" / "manifest.json"
    original = manifest.read_bytes()
    manifest.write_bytes(original.replace(b"{", b"{ ", 1))
    try:
        with pytest.raises(reuse.FromRunError, match=re.escape(
                f"the checkpoint of step {PAUSE_AT} of run {run_id}'s paused pretraining "
                f"({manifest.parent}) cannot be used: its manifest changed since the pause")):
            _start(resume, "resume_refused__2")
    finally:
        manifest.write_bytes(original)
    aside = checkpoints.with_name("checkpoints.aside")
    checkpoints.rename(aside)
    try:
        with pytest.raises(reuse.FromRunError, match=re.escape(
                f"run {run_id}'s paused pretraining cannot be resumed: its checkpoints directory "
                f"{checkpoints} is gone")):
            _start(resume, "resume_refused__3")
    finally:
        aside.rename(checkpoints)
    assert all(find_parent(tracking.client(), DAG_ID, f"resume_refused__{i}") is None for i in range(4))
    # and, all back in place, the resume is accepted (checked only: no job here)
    run = _start(resume, "resume_checked__1")
    tracking.end_run(run["parent_run_id"], "KILLED")
    assert run["from_run"]["fork"]["step"] == PAUSE_AT
    assert run["from_run"]["fork"]["checkpoints"] == str(checkpoints)
