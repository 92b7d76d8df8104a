"""`make up` as a user runs it, on ports other than the defaults, then the Airflow UI in a real
browser.

First, on the fresh deployment, a run triggered from the command line exactly as the README says
(`scripts/airflow dags trigger llm_lifecycle -c ...`, nothing unpaused by anyone) must reach
success: on other ports every task used to die before it ran (the execution API address stayed
on 8080), and a CLI trigger of a paused DAG waited in "queued" for ever. Then the browser: log
in, trigger `llm_lifecycle` from its Trigger form with the same Params (the step cache makes
this second run quick), watch the runs in the grid, open the first run's "LLM run" tab (the
llmops_run_page plugin: that run computed every stage, so its numbers are checked against
MLflow's) and check that each run's note is its summary line.

SETUP: `make up` with AIRFLOW_PORT / MLFLOW_PORT on free ports, LLMOPS_HOME in the test's tmp dir
(so AIRFLOW_HOME and the step cache are fresh), the session's MLflow store, free log-server ports
(other Airflows may run on this machine); Debian's Chromium driven by Playwright (`make test`
installs it when missing; Playwright's own browser download cannot work here). TEARDOWN: SIGINT
to make's process group, as Ctrl-C in a terminal, always. Screenshots: the test's tmp dir and
`.llmops/test-artifacts/browser/`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DAG_ID = "llm_lifecycle"
CONF = {"recipe": "tiny", "sweep_trials": 1}
ARTIFACTS = ROOT / ".llmops" / "test-artifacts" / "browser"
RUN_TIMEOUT_S = 600  # the tiny recipe takes ~2-3 min on 2 cores, 7 min under a load of 10

pytestmark = pytest.mark.timeout(900)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MakeUp:
    """`make up` in its own LLMOPS_HOME, on free ports; `stop()` is Ctrl-C (SIGINT to its group)."""

    def __init__(self, workdir: Path):
        self.llmops_home = workdir / "home"
        self.home = self.llmops_home / "airflow"  # the Makefile's AIRFLOW_HOME under LLMOPS_HOME
        self.port, self.mlflow_port = free_port(), free_port()
        assert 8080 not in (self.port, self.mlflow_port)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "make-up.log"  # make's and up.py's own output (the block)
        # As a user's shell: none of the session's Airflow settings (the Makefile sets its own,
        # AIRFLOW_HOME included); the session's MLflow store, so the test reads the runs.
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")},
            "LLMOPS_HOME": str(self.llmops_home),
            "AIRFLOW_PORT": str(self.port),
            "MLFLOW_PORT": str(self.mlflow_port),
            "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"],
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            # The step cache keys on the code version, which in a checkout being edited (by
            # anyone, during the run) is a hash of the edits: pinned, the form's run reuses the
            # CLI run's stages as it would in a clean checkout, instead of computing them again.
            "LLMOPS_GIT_COMMIT": "test-browser",
        }
        self.proc: subprocess.Popen | None = None

    def start(self) -> "MakeUp":
        venv = ROOT / ".venv"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                # -o: the venv this test runs in is installed; a requirements file touched since
                # must not make `make up` reinstall it under the running suite.
                ["make", "--no-print-directory", "-C", str(ROOT), "-o", str(venv / ".installed"), "up"],
                stdout=log, stderr=subprocess.STDOUT, env=self.env,
                # SIGINT is how it stops; a background start may inherit it ignored
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                start_new_session=True)
        self.wait_for("the API server", lambda: self.request("GET", "/api/v2/monitor/health"), 300)
        self.token = self.wait_for("the admin password", self._token, 60)
        self.wait_for("up.py's start-up block", lambda: "Stop         Ctrl-C" in self.output(), 300)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def airflow_cli(self, *args: str) -> subprocess.CompletedProcess:
        """`scripts/airflow ARGS` from the repository root, as the README writes it."""
        return subprocess.run(["scripts/airflow", *args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=300)

    def credentials(self) -> tuple[str, str]:
        creds = json.loads((self.home / "simple_auth_manager_passwords.json.generated").read_text())
        return next(iter(creds.items()))

    def _token(self) -> str:
        user, password = self.credentials()
        return self.request("POST", "/auth/token", {"username": user, "password": password},
                            auth=False)["access_token"]

    def request(self, method: str, path: str, body: dict | None = None, auth: bool = True):
        headers = {"Content-Type": "application/json"}
        if auth and getattr(self, "token", None):
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.base + path, method=method, headers=headers,
                                     data=json.dumps(body).encode() if body is not None else None)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read() or b"null")

    def wait_for(self, what: str, probe, timeout: float):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"make up exited while waiting for {what}:\n" + self.output()[-4000:])
            try:
                result = probe()
                if result:
                    return result
            except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError):
                pass
            time.sleep(1)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; see {self.log_path} "
                           f"and {self.llmops_home / 'up.log'}")

    def wait_for_run(self, run_id: str) -> str:
        return self.wait_for(f"run {run_id} to finish", lambda: _finished(self, run_id), RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    deployment = MakeUp(tmp_path_factory.mktemp("make-up"))
    try:
        yield deployment.start()
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def cli_run(airflow) -> dict:
    """The first run of the fresh deployment, triggered with the README's command line: its id,
    final state and seconds from trigger to finish."""
    assert f"scripts/airflow dags trigger {DAG_ID} -c" in (ROOT / "README.md").read_text()
    started = time.time()
    proc = airflow.airflow_cli("dags", "trigger", DAG_ID, "-c", json.dumps(CONF))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # (a poll, not one request: on 2 busy cores one API call can take longer than its timeout)
    run = airflow.wait_for("the CLI's run in the API", lambda: airflow.request(
        "GET", f"/api/v2/dags/{DAG_ID}/dagRuns?limit=10")["dag_runs"], 120)
    assert len(run) == 1 and run[0]["conf"] == CONF, run
    run_id = run[0]["dag_run_id"]
    state = airflow.wait_for_run(run_id)
    return {"run_id": run_id, "state": state, "seconds": time.time() - started}


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    """screenshot(page, name): a PNG in the test's tmp dir, copied to .llmops/test-artifacts/."""
    out = tmp_path_factory.mktemp("screenshots")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    def screenshot(page, name: str, full_page: bool = False) -> Path:
        path = out / f"{name}.png"
        page.screenshot(path=str(path), full_page=full_page)
        shutil.copy(path, ARTIFACTS / path.name)
        return path

    return screenshot


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield instance
        finally:
            instance.close()


def log_in(page, airflow: MakeUp) -> None:
    user, password = airflow.credentials()
    page.goto(f"{airflow.base}/auth/login")
    page.locator("input[name=username]").fill(user)
    page.locator("input[name=password]").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r"^(?!.*/auth/login).*$"), timeout=60_000)


def page_figures(frame) -> dict[str, str]:
    """data-key -> data-value of every figure the run page shows."""
    return frame.evaluate("""() => Object.fromEntries([...document.querySelectorAll('[data-key]')]
        .map(e => [e.dataset.key, e.dataset.value ?? e.textContent]))""")


def mlflow_run(run_id: str):
    """What MLflow holds for DAG run `run_id`: the parent run and its child runs by task."""
    from llmops import run_summary, tracking

    client = tracking.client()
    parent = run_summary.find_parent(client, DAG_ID, run_id)
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'", max_results=100)
    by_task = {(r.data.tags["task_id"], int(r.data.tags.get("map_index", -1))): r for r in children}
    return client, parent, by_task


def test_make_up_on_other_ports_runs_a_run_triggered_from_the_cli(airflow, cli_run):
    block = airflow.output()
    # the block names the ports asked for, and only the scheduled DAGs start paused
    assert f"Airflow UI   http://localhost:{airflow.port}" in block, block[-3000:]
    assert f"MLflow UI    http://localhost:{airflow.mlflow_port}" in block
    assert "Paused       llm_platform_report, llm_retrain:" in block, block[-3000:]
    assert cli_run["state"] == "success", _task_states(airflow, cli_run["run_id"])
    print(f"CLI-triggered run: {cli_run['seconds']:.0f} s from trigger to success")


def test_trigger_from_the_form_and_read_the_run_page(airflow, cli_run, browser, shots):
    assert cli_run["state"] == "success", _task_states(airflow, cli_run["run_id"])
    timings = {}
    started = time.time()
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        log_in(page, airflow)
        run = trigger_from_the_form(page, airflow, CONF, shots, "01-trigger-form", "02-trigger-form-filled")
        run_id = run["dag_run_id"]
        assert run["conf"].get("recipe") == "tiny" and run["conf"].get("sweep_trials") == 1, run["conf"]
        timings["triggered_s"] = time.time() - started

        page.goto(f"{airflow.base}/dags/{DAG_ID}")
        # the grid: a bar per run, linking to its run page
        page.wait_for_function("""runId => [...document.querySelectorAll('a[href]')].some(
            a => decodeURIComponent(a.getAttribute('href')).includes('/runs/' + runId))""",
                               arg=run_id, timeout=60_000)
        page.get_by_text("promote").first.wait_for()  # the grid's task names have loaded
        shots(page, "03-grid-running")
        # the same Params as the CLI run's: its stages come from the step cache
        state = airflow.wait_for_run(run_id)
        timings["run_s"] = time.time() - started - timings["triggered_s"]
        assert state == "success", _task_states(airflow, run_id)
        timings["stages_reused"] = sum(1 for r in mlflow_run(run_id)[2].values()
                                       if r.data.tags.get("cached_from"))
        page.reload()
        page.get_by_text("promote").first.wait_for()
        shots(page, "04-grid-finished")

        # The run page of the CLI run, as the tab on the DAG run page shows it: that run computed
        # every stage (the form's run reused them), so its numbers are each job's own.
        first = cli_run["run_id"]
        page.goto(f"{airflow.base}/dags/{DAG_ID}/runs/{first}")
        tab = page.get_by_role("link", name="LLM run").or_(page.get_by_role("tab", name="LLM run")).first
        tab.click()
        frame_el = page.locator("iframe[title='LLM run']")
        frame_el.wait_for()
        frame = frame_el.element_handle().content_frame()
        frame.wait_for_selector("h1")
        shots(page, "05-run-tab")
        check_numbers_against_mlflow(page_figures(frame), first)

        # the page on its own, full length, to read
        page.goto(f"{airflow.base}/llmops/runs/{DAG_ID}/{first}")
        shots(page, "06-run-page-full", full_page=True)
        figures = page_figures(page)
        check_numbers_against_mlflow(figures, first)
        assert "failure" not in figures  # a run that succeeded has no failure line

        # each run's note (copied from promote's XCom by the plugin's listener when it finished)
        from llmops import tracking  # noqa: F401  (the test session's MLflow store)

        for each in (first, run_id):
            _, parent, _ = mlflow_run(each)
            note = airflow.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{each}")["note"]
            assert note == parent.data.tags["summary"], (note, parent.data.tags.get("summary"))
            assert note.startswith("recipe tiny | ") and "gate " in note
    finally:
        timings["total_s"] = time.time() - started
        print(f"browser test timings: {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
        context.close()

    # without the UI's session cookie the page is refused, as Airflow's own API is
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{airflow.base}/llmops/runs/{DAG_ID}/{run_id}", timeout=30)
    assert refused.value.code in (401, 403)


FORK_STEP = 10        # the tiny pretraining (20 steps, a checkpoint every 10) keeps 10 and 20
FORK_LR = 0.0042      # outside the tiny sweep's grid of best learning rates: the fork's own


def test_fork_from_the_form_and_watch_both_curves(airflow, cli_run, browser, shots):
    """Tried as a researcher would (issue 24): fork the CLI run's pretraining at its kept step 10
    with a new learning rate, from the Trigger form, and read the fork's run page: one chart,
    the parent's curve (dashed) to step 10 and the fork's continuing from the very point where
    the parent's ends, a line at the fork step; the lineage against MLflow."""
    assert cli_run["state"] == "success", _task_states(airflow, cli_run["run_id"])
    first = cli_run["run_id"]
    conf = {**CONF, "from_run": first, "start_at": "pretrain", "fork_step": FORK_STEP,
            "pretrain_lr": FORK_LR}
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        log_in(page, airflow)
        run = trigger_from_the_form(page, airflow, conf, shots, None, "07-fork-form-filled")
        fork_id = run["dag_run_id"]
        assert {k: run["conf"].get(k) for k in conf} == conf, run["conf"]
        assert airflow.wait_for_run(fork_id) == "success", _task_states(airflow, fork_id)

        page.goto(f"{airflow.base}/llmops/runs/{DAG_ID}/{fork_id}")
        chart = page.locator("div.fork")
        chart.wait_for()
        chart.scroll_into_view_if_needed()
        shots(page, "08-fork-run-page")
        drawn = chart.evaluate("""div => ({
            step: div.dataset.value, parent: div.dataset.parentRunId,
            title: div.querySelector('svg').getAttribute('aria-label'),
            marks: [...div.querySelectorAll('[data-mark-step]')].map(m => m.dataset.markStep),
            series: Object.fromEntries([...div.querySelectorAll('g[data-series]')].map(g => [
                g.dataset.series, {first: g.dataset.firstStep, last: g.dataset.lastStep,
                    dashed: !!g.querySelector('polyline[stroke-dasharray]'),
                    points: [...g.querySelectorAll('circle')].map(
                        c => [c.getAttribute('cx'), c.getAttribute('cy')])}]))})""")
    finally:
        context.close()

    client, _, parent_tasks = mlflow_run(first)
    _, fork_parent, fork_tasks = mlflow_run(fork_id)
    parent_pretrain, pretrain = parent_tasks[("pretrain", -1)], fork_tasks[("pretrain", -1)]
    # the fork trained from the parent's step with its own learning rate, and says so
    assert "cached_from" not in pretrain.data.tags, "the fork ran no pretraining job"
    assert float(pretrain.data.params["optim.lr"]) == FORK_LR != float(parent_pretrain.data.params["optim.lr"])
    assert pretrain.data.tags["fork.step"] == str(FORK_STEP)
    assert pretrain.data.tags["fork.parent_run_id"] == parent_pretrain.info.run_id
    assert fork_parent.data.tags["from_run"] == first and fork_parent.data.tags["fork_step"] == str(FORK_STEP)
    # the page: that lineage, one chart, the parent's curve to the step and the fork's from it
    assert (drawn["step"], drawn["parent"]) == (str(FORK_STEP), parent_pretrain.info.run_id), drawn
    assert drawn["title"] == f"pretrain: loss, forked from {first} at step {FORK_STEP}", drawn["title"]
    assert drawn["marks"] == [f"{FORK_STEP}.0"], drawn["marks"]
    parent_train = drawn["series"][f"parent {first} to step {FORK_STEP} · train"]
    fork_train = drawn["series"]["this run · train"]
    assert parent_train["dashed"] and not fork_train["dashed"]
    assert parent_train["last"] == fork_train["first"] == f"{FORK_STEP}.0", drawn["series"]
    assert parent_train["points"][-1] == fork_train["points"][0], "the fork's curve does not start where its parent's ends"
    # as many points as MLflow holds: the parent's to the fork step, the fork's after it (+ the one taken over)
    from llmops import run_summary

    key = run_summary.metric_key(pretrain.data.metrics, "train_loss")
    parent_points = [m for m in client.get_metric_history(parent_pretrain.info.run_id, key) if m.step <= FORK_STEP]
    fork_points = client.get_metric_history(pretrain.info.run_id, key)
    assert len(parent_train["points"]) == len(parent_points)
    assert len(fork_train["points"]) == len(fork_points) + 1
    assert float(fork_train["last"]) == max(m.step for m in fork_points) == 20


def trigger_from_the_form(page, airflow: MakeUp, conf: dict, shots, empty_shot: str | None,
                          filled_shot: str) -> dict:
    """Open llm_lifecycle's Trigger form, fill in `conf`, press Trigger: the new DAG run."""
    known = {r["dag_run_id"] for r in airflow.request(
        "GET", f"/api/v2/dags/{DAG_ID}/dagRuns?limit=50")["dag_runs"]}
    page.goto(f"{airflow.base}/dags/{DAG_ID}")
    page.get_by_role("button", name=re.compile("^Trigger")).first.click()
    dialog = page.get_by_role("dialog")
    dialog.wait_for()
    if empty_shot:
        shots(page, empty_shot)
    fill_trigger_form(page, dialog, conf)
    shots(page, filled_shot)
    trigger = dialog.get_by_role("button", name=re.compile("^Trigger"))
    assert trigger.is_enabled(), "the Trigger button is greyed out: a Param the form requires is empty"
    trigger.click()
    return airflow.wait_for("the triggered run", lambda: next((r for r in airflow.request(
        "GET", f"/api/v2/dags/{DAG_ID}/dagRuns?order_by=-run_after&limit=5")["dag_runs"]
        if r["dag_run_id"] not in known), None), 60)


def fill_trigger_form(page, dialog, values: dict) -> None:
    """Set Params in the Trigger form one field at a time, as a user would: open the field's
    section, then type into it (an enum is a combobox: type and pick the option)."""
    for name, value in values.items():
        inc = dialog.locator(f'[id="number-input:element_{name}:inc"]')
        if inc.count():  # a number field: its input is the one the +/- buttons control
            field = dialog.locator(f'[id="{inc.get_attribute("aria-controls")}"]')
        else:
            # an enum's combobox is named after its Param; a text field is the input itself
            combo = dialog.get_by_role("combobox", name=name, exact=True)
            field = combo if combo.count() else dialog.locator(f'[name="element_{name}"]')
        section = field.locator('xpath=ancestor::*[@data-part="item-content"][1]')
        if section.count():
            trigger = dialog.locator(f'[aria-controls="{section.get_attribute("id")}"]')
            if trigger.get_attribute("aria-expanded") != "true":
                trigger.click()
        field.scroll_into_view_if_needed()
        if field.get_attribute("role") == "combobox":
            field.click()
            field.fill(str(value))
            page.get_by_role("option", name=str(value), exact=True).click()
            assert dialog.locator(f'[name="element_{name}"]').input_value() == str(value), name
        else:
            field.fill(str(value))
            field.press("Tab")


def _finished(airflow: MakeUp, run_id: str) -> str | None:
    try:
        state = airflow.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            airflow.token = airflow._token()
            return None
        raise
    return state if state in ("success", "failed") else None


def _task_states(airflow: MakeUp, run_id: str) -> dict:
    tis = airflow.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances?limit=100")
    return {f"{t['task_id']}[{t['map_index']}]": t["state"] for t in tis["task_instances"]}


def check_numbers_against_mlflow(figures: dict[str, str], run_id: str) -> None:
    """The page's numbers are the ones MLflow holds, read here straight from MLflow."""
    from llmops import run_summary

    client, parent, by_task = mlflow_run(run_id)
    assert figures["mlflow_run_id"] == parent.info.run_id
    data = by_task[("data_prep", -1)].data.metrics
    for key in ("documents_in", "documents_kept", "train_tokens"):
        assert float(figures[f"data.{key}"]) == data[key], key
    for reason, value in run_summary.family(data, "dropped.").items():
        assert float(figures[f"data.dropped.{reason}"]) == value, reason
    trial = by_task[("sweep_trial", 0)]
    number = trial.data.tags.get("trial_number", trial.data.tags.get("trial"))
    assert float(figures[f"trial.{number}.lr"]) == float(trial.data.params["optim.lr"])
    assert float(figures[f"trial.{number}.val_loss"]) == run_summary.metric(trial.data.metrics, "val_loss")
    assert float(figures["sweep.best_val_loss"]) == run_summary.metric(parent.data.metrics, "sweep.best_val_loss")
    pretrain = by_task[("pretrain", -1)]
    history = client.get_metric_history(pretrain.info.run_id,
                                        run_summary.metric_key(pretrain.data.metrics, "val_loss"))
    assert float(figures["pretrain.val_loss"]) == max(history, key=lambda m: m.step).value
    assert float(figures["goodput"]) == run_summary.metric(pretrain.data.metrics, "goodput")
    evaluation = by_task[("evaluate", -1)].data.metrics
    shown = [k for k in figures if k.startswith("eval.") and figures[k]]
    assert shown, "the evaluation table is empty"
    for key in shown:
        model, name = key[len("eval."):].split(".", 1)
        logged = evaluation.get(f"{model}/{name}", evaluation.get(f"{model}.{name}"))
        assert float(figures[key]) == logged, key
    version = parent.data.tags.get("champion", "").rpartition("/")[2]
    assert figures["gate.outcome"] == parent.data.tags["gate"]
    if version:
        assert figures["gate.version"] == version
