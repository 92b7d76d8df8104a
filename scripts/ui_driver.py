"""`make up` and its UI driven from Python, as a user would: what tests/test_browser.py and
`make screenshots` (scripts/screenshots.py) share.

    MakeUp(workdir, extra_env).start()   `make up` on free ports in its own LLMOPS_HOME; REST
                                         calls with the admin's token, `scripts/airflow` commands,
                                         waits for runs; stop() is Ctrl-C to make's process group
    chromium()                           Debian's Chromium under Playwright (its own browser
                                         download cannot work here)
    log_in, trigger_from_the_form, fill_trigger_form, page_figures
                                         the Airflow UI's login, the Trigger form, the run page's
                                         data-key/data-value figures
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
DAG_ID = "llm_lifecycle"
RUN_TIMEOUT_S = 900  # the tiny recipe takes ~2-3 min on 2 cores, 7 min under a load of 10, 11 at 15


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MakeUp:
    """`make up` in its own LLMOPS_HOME, on free ports; `stop()` is Ctrl-C (SIGINT to its group).
    `extra_env` is added to the user's shell (an MLflow store, AWS connections, Variables)."""

    def __init__(self, workdir: Path, extra_env: dict[str, str] | None = None):
        self.llmops_home = workdir / "home"
        self.home = self.llmops_home / "airflow"  # the Makefile's AIRFLOW_HOME under LLMOPS_HOME
        self.port, self.mlflow_port = free_port(), free_port()
        assert 8080 not in (self.port, self.mlflow_port)
        self.base = f"http://127.0.0.1:{self.port}"
        self.mlflow_base = f"http://127.0.0.1:{self.mlflow_port}"
        self.log_path = workdir / "make-up.log"  # make's and up.py's own output (the block)
        # As a user's shell: none of the caller's Airflow settings (the Makefile sets its own,
        # AIRFLOW_HOME included).
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")},
            "LLMOPS_HOME": str(self.llmops_home),
            "AIRFLOW_PORT": str(self.port),
            "MLFLOW_PORT": str(self.mlflow_port),
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            **(extra_env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.token: str | None = None

    def start(self) -> "MakeUp":
        venv = ROOT / ".venv"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                # -o: the venv is installed; a requirements file touched since must not make
                # `make up` reinstall it under a running suite.
                ["make", "--no-print-directory", "-C", str(ROOT), "-o", str(venv / ".installed"), "up"],
                stdout=log, stderr=subprocess.STDOUT, env=self.env,
                # SIGINT is how it stops; a background start may inherit it ignored
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                start_new_session=True)
        self.wait_for("the API server", lambda: self.request("GET", "/api/v2/monitor/health"), 600)
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
        if auth and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.base + path, method=method, headers=headers,
                                     data=json.dumps(body).encode() if body is not None else None)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code == 401 and auth and self.token:  # the token expired: a new one, once
                self.token = self._token()
                return self.request(method, path, body, auth)
            raise

    def wait_for(self, what: str, probe: Callable[[], Any], timeout: float):
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

    # -- DAG runs ---------------------------------------------------------------------------
    def runs(self, limit: int = 50) -> list[dict]:
        return self.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns?order_by=-run_after&limit={limit}")["dag_runs"]

    def run(self, run_id: str) -> dict:
        return self.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")

    def trigger_cli(self, conf: dict) -> str:
        """Trigger llm_lifecycle with the README's command line; the new run's id."""
        known = {r["dag_run_id"] for r in self.runs()}
        proc = self.airflow_cli("dags", "trigger", DAG_ID, "-c", json.dumps(conf))
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout + proc.stderr)
        # (a poll, not one request: on 2 busy cores one API call can take longer than its timeout)
        return self.wait_for("the CLI's run in the API", lambda: next(
            (r["dag_run_id"] for r in self.runs() if r["dag_run_id"] not in known), None), 120)

    def finished(self, run_id: str) -> str | None:
        state = self.run(run_id)["state"]
        return state if state in ("success", "failed") else None

    def wait_for_run(self, run_id: str, timeout: float = RUN_TIMEOUT_S) -> str:
        return self.wait_for(f"run {run_id} to finish", lambda: self.finished(run_id), timeout)

    def task_states(self, run_id: str) -> dict[str, str]:
        tis = self.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances?limit=100")
        return {f"{t['task_id']}[{t['map_index']}]": t["state"] for t in tis["task_instances"]}

    def task_state(self, run_id: str, task_id: str) -> str | None:
        return self.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}")["state"]


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Debian's Chromium, headless, under Playwright."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def log_in(page: Any, airflow: MakeUp) -> None:
    user, password = airflow.credentials()
    page.goto(f"{airflow.base}/auth/login")
    page.locator("input[name=username]").fill(user)
    page.locator("input[name=password]").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r"^(?!.*/auth/login).*$"), timeout=60_000)


def page_figures(frame: Any) -> dict[str, str]:
    """data-key -> data-value of every figure the run page shows."""
    return frame.evaluate("""() => Object.fromEntries([...document.querySelectorAll('[data-key]')]
        .map(e => [e.dataset.key, e.dataset.value ?? e.textContent]))""")


def trigger_from_the_form(page: Any, airflow: MakeUp, conf: dict,
                          shot: Callable[[Any, str], Any] | None = None,
                          empty_shot: str | None = None, filled_shot: str | None = None) -> dict:
    """Open llm_lifecycle's Trigger form, fill in `conf`, press Trigger: the new DAG run.
    `shot(page, name)` takes the named screenshots of the empty and the filled form."""
    known = {r["dag_run_id"] for r in airflow.runs()}
    page.goto(f"{airflow.base}/dags/{DAG_ID}")
    page.get_by_role("button", name=re.compile("^Trigger")).first.click()
    dialog = page.get_by_role("dialog")
    dialog.wait_for()
    if shot and empty_shot:
        shot(page, empty_shot)
    fill_trigger_form(page, dialog, conf)
    if shot and filled_shot:
        shot(page, filled_shot)
    trigger = dialog.get_by_role("button", name=re.compile("^Trigger"))
    assert trigger.is_enabled(), "the Trigger button is greyed out: a Param the form requires is empty"
    trigger.click()
    return airflow.wait_for("the triggered run", lambda: next(
        (r for r in airflow.runs(5) if r["dag_run_id"] not in known), None), 60)


def fill_trigger_form(page: Any, dialog: Any, values: dict) -> None:
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
