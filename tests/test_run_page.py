"""The run page and the run summary, on an MLflow store the test fills the way the lifecycle's jobs
do: one parent run, child runs per stage, metric histories under both the old names (`loss`,
`val_loss`) and the new prefixed ones (`loss/train`, `loss/val`), and a registered version."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest

DAG_ID = "llm_lifecycle"


def _child(client, exp_id, parent_id, run_id, stage, task_id, *, map_index=-1, tags=None,
           params=None, metrics=None, history=None, status="FINISHED", start_time=None):
    run = client.create_run(exp_id, run_name=task_id, start_time=start_time, tags={
        "mlflow.parentRunId": parent_id, "stage": stage, "dag_id": DAG_ID, "run_id": run_id,
        "task_id": task_id, "map_index": str(map_index), "try_number": "1", **(tags or {})})
    rid = run.info.run_id
    for k, v in (params or {}).items():
        client.log_param(rid, k, v)
    for k, v in (metrics or {}).items():
        client.log_metric(rid, k, v)
    for k, points in (history or {}).items():
        for step, value in points:
            client.log_metric(rid, k, value, step=step)
    if status != "RUNNING":
        client.set_terminated(rid, status)
    return rid


@pytest.fixture()
def lifecycle_run():
    """A finished lifecycle run as MLflow holds it; returns (run_id, ids of its MLflow runs)."""
    from llmops.infra import tracking

    client = tracking.client()
    exp_id = tracking.ensure_experiment(DAG_ID)
    run_id = f"manual__{uuid.uuid4().hex[:8]}"
    parent = tracking.start_parent_run(experiment=DAG_ID, dag_id=DAG_ID, run_id=run_id,
                                       config={"recipe_test": True})
    client.log_metric(parent, "sweep.best_val_loss", 5.03)
    for k, v in {"sweep.trials_complete": 1, "sweep.trials_pruned": 1, "sweep.trials_failed": 0}.items():
        client.log_metric(parent, k, v)
    client.set_tag(parent, "sweep.best_trial", "0")
    ids = {"parent": parent}
    ids["data_prep"] = _child(client, exp_id, parent, run_id, "data_prep", "data_prep", metrics={
        "documents_in": 300, "documents_kept": 191, "documents_dropped": 109, "train_tokens": 81510,
        "dropped/too_few_sentences": 42, "dropped.exact_duplicate": 4})
    ids["trial0"] = _child(client, exp_id, parent, run_id, "sweep", "sweep_trial", map_index=0,
                           tags={"trial": "0", "trial_state": "complete"},
                           params={"optim.lr": "0.0035"}, metrics={"trial_steps_run": 10},
                           history={"val_loss": [(5, 5.24), (10, 5.03)]})
    ids["trial1"] = _child(client, exp_id, parent, run_id, "sweep", "sweep_trial", map_index=1,
                           tags={"trial": "1", "trial_state": "pruned"},
                           params={"optim.lr": "0.03"}, metrics={"trial_steps_run": 5},
                           history={"loss/val": [(5, 6.1)]})
    # old names and the new prefixed ones side by side: both must read the same
    ids["pretrain"] = _child(client, exp_id, parent, run_id, "pretrain", "pretrain", metrics={
        "resilience/goodput": 0.8, "resilience/goodput_excluding_hang_wait": 0.9,
        "resilience/productive_s": 8.0, "resilience/badput_startup_s": 1.5,
        "resilience/badput_checkpoint_save_s": 0.5, "resilience/restarts": 0}, history={
        "loss": [(1, 5.7), (10, 5.5), (20, 4.88)], "val_loss": [(10, 5.38), (20, 4.66)]})
    ids["finetune"] = _child(client, exp_id, parent, run_id, "finetune", "finetune", history={
        "loss/train": [(1, 5.6), (10, 5.5)], "loss/val": [(5, 5.85), (10, 5.49)]})
    ids["evaluate"] = _child(client, exp_id, parent, run_id, "evaluate", "evaluate", metrics={
        "teacher.task_accuracy": 0.25, "teacher.perplexity": 110.0, "teacher.params": 23392,
        "student/task_accuracy": 0.125, "student/perplexity": 228.9, "student/params": 8624,
        "student/suite.prose_cloze.accuracy": 0.15})
    name = f"llm-test-{uuid.uuid4().hex[:6]}"
    client.create_registered_model(name)
    mv = client.create_model_version(name, source="file:///nonexistent/model", tags={
        "lifecycle_run_id": parent, "candidate": "student", "gate.passed": "true",
        "gate.reasons": "none", "gate.compared_to": "no champion yet",
        "gate.paired.task_accuracy": "+0.1250 [+0.0875, +0.1650] n=400 p=8e-10 superior: pass"})
    client.set_registered_model_alias(name, "champion", mv.version)
    client.set_tag(parent, "gate", "passed")
    client.set_tag(parent, "champion", f"{name}/{mv.version}")
    tracking.end_run(parent, "FINISHED")
    ids.update(model_name=name, version=str(mv.version))
    return run_id, ids


def test_collect_reads_every_section_and_both_metric_namings(lifecycle_run):
    from llmops.stages import run_summary

    run_id, ids = lifecycle_run
    s = run_summary.collect(DAG_ID, run_id)
    assert s["mlflow_run_id"] == ids["parent"] and s["status"] == "FINISHED"
    assert [st["task_id"] for st in s["stages"]] == [
        "data_prep", "sweep_trial", "sweep_trial", "pretrain", "finetune", "evaluate"]
    assert s["curves"]["pretrain"]["train"] == [[1.0, 5.7], [10.0, 5.5], [20.0, 4.88]]
    assert s["curves"]["pretrain"]["val"] == [[10.0, 5.38], [20.0, 4.66]]
    assert s["curves"]["finetune"]["train"] == [[1.0, 5.6], [10.0, 5.5]]
    assert s["curves"]["finetune"]["val"] == [[5.0, 5.85], [10.0, 5.49]]
    assert [(t["number"], t["lr"], t["state"], t["val_loss"]) for t in s["trials"]] == [
        (0, 0.0035, "complete", 5.03), (1, 0.03, "pruned", 6.1)]
    assert s["data"]["drop_reasons"] == {"too_few_sentences": 42.0, "exact_duplicate": 4.0}
    assert s["goodput"]["goodput"] == 0.8 and s["goodput"]["productive_s"] == 8.0
    assert s["goodput"]["badput_s"] == {"startup": 1.5, "checkpoint_save": 0.5}
    assert s["goodput"]["resilience"] == {"restarts": 0.0}
    assert s["evaluation"]["columns"] == ["params", "perplexity", "task_accuracy",
                                          "suite.prose_cloze.accuracy"]
    assert s["evaluation"]["models"] == ["teacher", "student"]
    assert s["evaluation"]["table"]["student"]["task_accuracy"] == 0.125
    gate = s["gate"]
    assert (gate["outcome"], gate["candidate"], gate["model_name"], gate["version"], gate["aliases"]) == (
        "passed", "student", ids["model_name"], ids["version"], ["champion"])
    assert run_summary.collect(DAG_ID, "no_such_run") is None


def test_the_terminal_account_of_the_newest_run_shows_stages_figures_evaluation_and_model(lifecycle_run):
    """What `make demo` prints at its end (and `python -m llmops.stages.run_summary`): one reader of
    MLflow for the run page, the parent run's summary and the terminal alike."""
    from llmops.stages import run_summary

    run_id, ids = lifecycle_run
    assert run_summary.latest(DAG_ID) == run_id
    out = run_summary.text(run_summary.collect(DAG_ID, run_id))
    lines = out.splitlines()
    assert lines[0] == f"Lifecycle run {run_id}: FINISHED (MLflow run {ids['parent']})"
    assert [line.split()[:3] for line in lines if line.startswith("  pretrain ")] == [
        ["pretrain", "pretrain", "FINISHED"]]
    assert any(line.split() == ["documents_kept", "191"] for line in lines)
    assert any(line.split() == ["pretrain_goodput", "0.8"] for line in lines)
    student = next(line.split() for line in lines if line.strip().startswith("student "))
    assert student[1:] == ["8624", "228.9", "0.125", "0.15"]   # params, perplexity, accuracy, suite
    assert lines[-1] == (f"Registered model: {ids['model_name']} version {ids['version']} (alias "
                         f"'champion'), the student: models:/{ids['model_name']}@champion")
    assert run_summary.latest("no_such_dag") is None
    assert run_summary.latest_text(DAG_ID) == out   # what make demo prints
    assert run_summary.latest_text("no_such_dag").startswith("No lifecycle run of 'no_such_dag'")


def test_publish_mirrors_headline_figures_onto_the_parent_run(lifecycle_run):
    from llmops.infra import tracking
    from llmops.stages import run_summary

    run_id, ids = lifecycle_run
    note = run_summary.record(DAG_ID, run_id, recipe="tiny")
    assert note == (f"recipe tiny | student: task accuracy 0.125, perplexity 228.9 | "
                    f"gate passed: {ids['model_name']} v{ids['version']} champion")
    client = tracking.client()
    parent = client.get_run(ids["parent"])
    assert parent.data.tags["recipe"] == "tiny" and parent.data.tags["summary"] == note
    m = parent.data.metrics
    assert m["summary/documents_kept"] == 191 and m["summary/pretrain_goodput"] == 0.8
    assert m["summary/pretrain_val_loss"] == 4.66 and m["summary/finetune_val_loss"] == 5.49
    assert m["summary/candidate_task_accuracy"] == 0.125
    assert m["summary/registered_version"] == float(ids["version"]) and m["summary/gate_passed"] == 1
    assert {a.path for a in client.list_artifacts(ids["parent"])} >= {"summary.json", "summary.md"}
    local = client.download_artifacts(ids["parent"], "summary.json")
    with open(local) as fh:
        assert json.load(fh)["note"] == note


def _page_figures(text: str) -> dict[str, str]:
    return dict(re.findall(r'data-key="([^"]+)" data-value="([^"]*)"', text))


def test_the_page_shows_mlflows_numbers(lifecycle_run, airflow_db):
    # (airflow_db: the page also asks Airflow's metadata DB for the run, which it has not got)
    from fastapi.testclient import TestClient

    from llmops.airflow import run_page
    from llmops.infra import tracking

    run_id, ids = lifecycle_run
    api = TestClient(run_page.make_app(authorize=lambda: None))
    resp = api.get(f"/runs/{DAG_ID}/{run_id}")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    figures = _page_figures(resp.text)
    client = tracking.client()
    data = client.get_run(ids["data_prep"]).data.metrics
    assert float(figures["data.documents_kept"]) == data["documents_kept"]
    assert float(figures["data.dropped.too_few_sentences"]) == data["dropped/too_few_sentences"]
    evaluation = client.get_run(ids["evaluate"]).data.metrics
    assert float(figures["eval.student.task_accuracy"]) == evaluation["student/task_accuracy"]
    assert float(figures["eval.teacher.perplexity"]) == evaluation["teacher.perplexity"]
    assert float(figures["trial.1.val_loss"]) == 6.1 and float(figures["trial.0.lr"]) == 0.0035
    assert float(figures["goodput"]) == 0.8
    assert figures["gate.outcome"] == "passed" and figures["gate.version"] == ids["version"]
    assert figures["gate.paired.task_accuracy"] == ("+0.1250 [+0.0875, +0.1650] n=400 p=8e-10 "
                                                    "superior: pass")   # as the version's tag says
    assert resp.text.count("<svg") >= 6  # timeline, drops, trials, two loss charts, goodput
    # nothing for the browser to fetch (links to MLflow are only followed when clicked)
    assert "<script" not in resp.text and " src=" not in resp.text and "<link" not in resp.text
    # and each of those opens MLflow's training view, not its GenAI view (issue 48)
    mlflow_links = re.findall(r'href="(http://localhost:\d+/#/experiments/[^"]+)"', resp.text)
    assert mlflow_links and all(link.endswith("?workflowType=machine_learning") for link in mlflow_links)
    as_json = api.get(f"/runs/{DAG_ID}/{run_id}/summary.json").json()
    assert as_json["gate"]["version"] == ids["version"]
    assert 'data-key="failure"' not in resp.text and as_json["airflow"] is None
    missing = api.get(f"/runs/{DAG_ID}/manual__never")
    assert missing.status_code == 404 and "start_run" in missing.text


def test_the_plugin_adds_a_tab_to_the_dag_run_page():
    import llmops_plugins
    from llmops.airflow import run_note, run_page

    plugin = llmops_plugins.RunPagePlugin
    assert plugin.external_views == [{"name": "LLM run", "href": "llmops/runs/{DAG_ID}/{RUN_ID}",
                                      "destination": "dag_run", "url_route": "llm-run"}]
    assert plugin.fastapi_apps[0]["url_prefix"] == "/llmops"
    assert isinstance(plugin.fastapi_apps[0]["app"], run_page.LazyApp)
    assert plugin.listeners == [run_note]


# -- a fork (issue 24): its curve continues its parent's; the kept checkpoints are listed ---------

@pytest.fixture()
def forked_run(lifecycle_run):
    """A second lifecycle run whose pretraining forked the first's at step 10, as the fork's job
    tags it (tasks/train/fork.py, tasks/train/pretraining.py): it logs from step 11 on, keeps
    steps 10, 20 and 30 (keep_checkpoints 2, keep_every 10), and its registered version names the
    parent."""
    from llmops.infra import tracking

    parent_run_id, first = lifecycle_run
    client = tracking.client()
    exp_id = tracking.ensure_experiment(DAG_ID)
    # the parent's pretraining goes on past the fork step: those points are not the fork's past
    for step, value in ((15, 5.2), (30, 4.5)):
        client.log_metric(first["pretrain"], "loss", value, step=step)
    client.log_metric(first["pretrain"], "val_loss", 4.4, step=30)
    run_id = f"manual__fork_{uuid.uuid4().hex[:8]}"
    parent = tracking.start_parent_run(experiment=DAG_ID, dag_id=DAG_ID, run_id=run_id,
                                       config={"recipe_test": True})
    pretrain = _child(client, exp_id, parent, run_id, "pretrain", "pretrain", tags={
        "fork.parent_run_id": first["pretrain"], "fork.step": "10",
        "checkpoints.kept": "10,20,30", "checkpoints.kept_count": "3"},
        params={"keep_checkpoints": "2", "keep_every": "10"},
        history={"loss/train": [(11, 5.45), (20, 5.0), (30, 4.7)], "loss/val": [(20, 4.9), (30, 4.6)]})
    name = f"llm-fork-{uuid.uuid4().hex[:6]}"
    client.create_registered_model(name)
    client.create_model_version(name, source="file:///nonexistent/model", tags={
        "lifecycle_run_id": parent, "candidate": "student", "gate.passed": "true",
        "fork.parent_run_id": first["pretrain"], "fork.step": "10", "fork.from_run": parent_run_id})
    tracking.end_run(parent, "FINISHED")
    return run_id, {"parent": parent, "pretrain": pretrain, "parent_pretrain": first["pretrain"],
                    "from_run": parent_run_id}


def test_a_fork_s_curve_continues_its_parent_s_from_the_fork_step(forked_run, airflow_db):
    from fastapi.testclient import TestClient

    from llmops.airflow import run_page
    from llmops.stages import run_summary

    run_id, ids = forked_run
    s = run_summary.collect(DAG_ID, run_id)
    curve = s["curves"]["pretrain"]
    fork = curve["fork"]
    assert (fork["step"], fork["parent_run_id"], fork["parent"]) == (
        10, ids["parent_pretrain"], ids["from_run"])
    train, val = fork["segments"]["train"], fork["segments"]["val"]
    # the parent's segment ends at the fork step (its steps 15, 20 and 30 are not this run's past)
    assert train["parent"] == [[1.0, 5.7], [10.0, 5.5]] and val["parent"] == [[10.0, 5.38]]
    # the fork's starts there, from the state it took over, then its own points
    assert train["fork"] == [[10.0, 5.5], [11.0, 5.45], [20.0, 5.0], [30.0, 4.7]]
    assert val["fork"] == [[10.0, 5.38], [20.0, 4.9], [30.0, 4.6]]
    assert curve["train"][0] == [11.0, 5.45]  # the run's own curve stays its own
    assert s["checkpoints"] == {"kept": [10, 20, 30], "count": 3, "keep_last": 2, "keep_every": 10,
                                "mlflow_run_id": ids["pretrain"]}
    assert s["gate"]["fork"] == {"parent_run_id": ids["parent_pretrain"], "step": "10",
                                 "from_run": ids["from_run"]}

    html = TestClient(run_page.make_app(authorize=lambda: None)).get(f"/runs/{DAG_ID}/{run_id}").text
    series = {name: (first, last) for name, first, last in re.findall(
        r'data-series="([^"]+)" data-first-step="([^"]*)" data-last-step="([^"]*)"', html)}
    label = f"parent {ids['from_run']} to step 10"
    assert series == {f"{label} · train": ("1.0", "10.0"), f"{label} · val": ("10.0", "10.0"),
                      "this run · train": ("10.0", "30.0"), "this run · val": ("10.0", "30.0")}
    assert f"forked from {ids['from_run']} at step 10" in html and 'data-mark-step="10.0"' in html
    figures = _page_figures(html)
    assert figures["pretrain.fork_step"] == "10" and figures["pretrain.kept_steps"] == "10,20,30"
    assert "kept 3 checkpoints (the newest 2 plus every multiple of 10)" in html
    assert 'data-key="pretrain.kept_steps" data-value="10,20,30">10, 20, 30</span>' in html
    assert figures["gate.fork.from_run"] == ids["from_run"] and figures["gate.fork.step"] == "10"

    # the parent's own page: one chart of its own curves, nothing kept recorded, no fork
    parent_html = TestClient(run_page.make_app(authorize=lambda: None)).get(
        f"/runs/{DAG_ID}/{ids['from_run']}").text
    assert "this run · train" not in parent_html and "pretrain.kept_steps" not in parent_html
    assert 'data-series="train" data-first-step="1.0" data-last-step="30.0"' in parent_html


# -- while the run runs (issue 24): the page refreshes itself, a "Now" card per training run ------

@pytest.fixture()
def running_run():
    """A lifecycle run in the middle of its pretraining: data prep finished; the pretrain job
    started 60 s ago, has logged up to step 30 of its max_steps 100 (the param its config
    logged) and has not ended its MLflow run."""
    from llmops.infra import tracking

    client = tracking.client()
    exp_id = tracking.ensure_experiment(DAG_ID)
    run_id = f"manual__live_{uuid.uuid4().hex[:8]}"
    parent = tracking.start_parent_run(experiment=DAG_ID, dag_id=DAG_ID, run_id=run_id,
                                       config={"recipe_test": True})
    _child(client, exp_id, parent, run_id, "data_prep", "data_prep", metrics={"documents_kept": 191})
    started = int(time.time() * 1000) - 60_000
    pretrain = _child(client, exp_id, parent, run_id, "pretrain", "pretrain", status="RUNNING",
                      start_time=started, params={"max_steps": "100", "batch_size": "8"}, history={
                          "loss/train": [(1, 5.7), (10, 5.4), (20, 5.1), (30, 4.93)],
                          "perf/tokens_per_s": [(10, 11800.0), (20, 12100.0), (30, 12345.0)],
                          "loss/val": [(20, 5.2)]})
    return run_id, {"parent": parent, "pretrain": pretrain, "started": started}


def _page_for(run_id, state, failure=None):
    from fastapi.testclient import TestClient

    from llmops.airflow import run_page

    airflow = {"state": state, "note": None, "failure": failure}
    api = TestClient(run_page.make_app(authorize=lambda: None, airflow_run=lambda d, r: airflow))
    resp = api.get(f"/runs/{DAG_ID}/{run_id}")
    assert resp.status_code == 200
    return resp.text


def _visible(html: str) -> str:
    """The page's text as a reader sees it (tags, styles and scripts dropped)."""
    body = re.sub(r"<(style|script)>.*?</\1>", "", html, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body))


def test_a_running_pretraining_has_a_now_card_with_an_eta(running_run):
    from llmops.stages import run_summary

    run_id, ids = running_run
    before = time.time()
    html = _page_for(run_id, "running")
    figures, text = _page_figures(html), _visible(html)
    assert 'data-stage="pretrain"' in html and "Now" in text
    assert (figures["now.pretrain.step"], figures["now.pretrain.max_steps"]) == ("30.0", "100.0")
    assert "step 30 of 100" in text
    assert float(figures["now.pretrain.train_loss"]) == 4.93      # the latest, not the first
    assert float(figures["now.pretrain.tokens_per_s"]) == 12345.0
    assert "12,345" in text and "now.pretrain.goodput" not in figures  # none logged yet
    # 30 steps in ~60 s: 0.5 steps/s, so the 70 steps left take ~140 s
    elapsed = time.time() - ids["started"] / 1000
    eta = float(figures["now.pretrain.eta_s"])
    assert 70 / (30 / (before - ids["started"] / 1000)) - 1 <= eta <= 70 / (30 / elapsed) + 1
    assert 120 < eta < 200 and re.search(r"ETA 2\.\d min \(about \d\d:\d\d:\d\d UTC\)", text)
    assert re.search(r"pretrain is running, 0\.[45]\d* steps/s since it started 6\d\.\d s ago", text)
    # the loss chart draws the partial history
    assert 'data-series="train" data-first-step="1.0" data-last-step="30.0"' in html
    assert 'data-series="val" data-first-step="20.0" data-last-step="20.0"' in html
    # it refreshes itself, and says when it was drawn
    assert "<script>" in html and "setTimeout" in html and "DOMParser" in html
    assert re.search(r"live: updated \d\d:\d\d:\d\d UTC · refreshes every 20 s while the run is running",
                     text)
    assert " src=" not in html and "<link" not in html  # no library fetched
    # the same figures in summary.json; a run that finished has no "Now"
    s = run_summary.collect(DAG_ID, run_id, now_ms=ids["started"] + 120_000)
    (live,) = s["live"]
    assert (live["task_id"], live["step"], live["max_steps"], live["mlflow_run_id"]) == (
        "pretrain", 30, 100, ids["pretrain"])
    assert live["steps_per_s"] == 0.25 and live["eta_s"] == 280.0   # 30 steps in 120 s


def test_the_page_stops_refreshing_once_the_airflow_run_ended(running_run, lifecycle_run):
    run_id, ids = running_run
    queued = _page_for(run_id, "queued")
    assert "<script>" in queued and "live: updated" in queued
    for state in ("success", "failed"):
        html = _page_for(run_id, state, failure="pretrain failed: killed" if state == "failed" else None)
        text = _visible(html)
        assert "<script" not in html and "live: updated" not in text
        # MLflow still marks the pretraining RUNNING (its job was killed): its last figures, no ETA
        assert f"MLflow still marks pretrain RUNNING, but the Airflow run is {state}" in text
        assert "step 30 of 100" in text and "now.pretrain.eta_s" not in html and "ETA" not in text
    finished_id, _ = lifecycle_run
    finished = _page_for(finished_id, "success")
    assert "<script" not in finished and "data-stage=" not in finished and " Now " not in _visible(finished)
    # a run queued before start_run: the page without MLflow refreshes too, until the run appears
    from fastapi.testclient import TestClient

    from llmops.airflow import run_page

    api = TestClient(run_page.make_app(authorize=lambda: None,
                                       airflow_run=lambda d, r: {"state": "queued", "failure": None}))
    missing = api.get(f"/runs/{DAG_ID}/manual__not_started").text
    assert "<script>" in missing and "start_run" in missing


def test_in_a_browser_the_page_swaps_in_fresh_figures_and_stops_when_the_run_ends(
        running_run, monkeypatch):
    """The refresh script for real, in Chromium against the app served by uvicorn (refreshing
    every second here): a step logged meanwhile appears without a reload, and once Airflow says
    the run succeeded the page says so and fetches no more."""
    import os
    import socket
    import threading

    if not os.path.exists("/usr/bin/chromium"):
        pytest.skip("/usr/bin/chromium is missing: `apt-get install -y chromium`")
    sync_api = pytest.importorskip("playwright.sync_api")
    import uvicorn

    from llmops.airflow import run_page
    from llmops.infra import tracking

    run_id, ids = running_run
    monkeypatch.setattr(run_page, "REFRESH_S", 1)
    airflow = {"state": "running", "note": None, "failure": None}
    served: list[str] = []

    def airflow_run(dag_id, rid):
        served.append(airflow["state"])
        return dict(airflow)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(
        run_page.make_app(authorize=lambda: None, airflow_run=airflow_run), host="127.0.0.1",
        port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                        args=["--headless", "--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page()
                deadline = time.time() + 30
                while not server.started and time.time() < deadline:
                    time.sleep(0.1)
                page.goto(f"http://127.0.0.1:{port}/runs/{DAG_ID}/{run_id}")
                step = page.locator('[data-key="now.pretrain.step"]')
                assert step.inner_text() == "30"
                tracking.client().log_metric(ids["pretrain"], "loss/train", 4.8, step=40)
                step.filter(has_text="40").wait_for(timeout=20_000)  # no reload: swapped in
                assert page.locator('[data-key="now.pretrain.train_loss"]').inner_text() == "4.8"
                assert page.locator('[data-key="live"]').is_visible()
                airflow["state"] = "success"
                page.locator('[data-key="live"]').wait_for(state="detached", timeout=20_000)
                assert "but the Airflow run is success" in page.locator(".now").inner_text()
                fetched = len(served)
                time.sleep(3)   # three refresh periods: nothing more asked
                assert len(served) == fetched
            finally:
                browser.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
