"""Pause a running pretraining from the Airflow UI (issue 24, point 2), served by the API server.

    GET  /llmops-pause/runs/{dag_id}/{run_id}   a page: the pretrain task's state, its job, where
                                                the marker goes, and a "Pause pretraining" button
    POST /llmops-pause/runs/{dag_id}/{run_id}   writes the marker (form or JSON: optional at_step)

The pretrain task's extra link "Pause pretraining" opens the page (a link cannot POST). The POST
writes the job's PAUSE marker (tasks/train/pause.py): the job checkpoints the step, exits with
PAUSED_EXIT, and the task ends skipped saying "paused at step N"
(llmops.airflow.operators.job_pause).

Where the marker goes is never taken from the request: JobOperator records it (XCom XCOM_KEY on
the pretrain task instance) when it starts or reattaches to the job, and it is checked again here
(a local `<dir>/checkpoints/PAUSE` or an s3:// `.../PAUSE`, inside the allowed storage roots).
A run whose pretrain task is not running (nor deferred) is refused, with the reason.

Authorization is the run page's (llmops.airflow.run_page.make_app): Airflow's own DAG access check,
the UI's JWT cookie or a bearer token; reading the page needs read access to the DAG's task
instances, pausing needs edit access (PUT) to them. Built on the first request (run_page.LazyApp).
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations (Request,
# imported inside make_app) at run time.
import datetime as dt
import html
import json
import os
import tempfile
from typing import Any, Callable
from urllib.parse import parse_qs

from llmops.airflow.run_page import LazyApp
from llmops.core import paths, settings
from llmops.infra.aws import s3
from llmops.jobs import backends

URL_PREFIX = "/llmops-pause"
# Relative (no leading slash), like the run page's tab: resolved against the UI's base URL.
PAGE_PATH = "llmops-pause/runs/{dag_id}/{run_id}"
LINK_NAME = "Pause pretraining"
TASK_ID = "pretrain"            # the lifecycle's pretraining task (dags/llm_lifecycle.py)
XCOM_KEY = "llmops_pause"       # {"marker", "why_not", "job_name", "backend", ...} (job_pause)
MARKER = "PAUSE"                # tasks.train.pause.MARKER (tasks.train is the job's side: torch)
RUNNING = ("running", "deferred")  # a deferred task waits for its remote job in the triggerer


class PauseRefused(Exception):
    """The pause cannot be asked for; `status` is the HTTP code, the message says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# -- where the job reads its marker (the operator's side) ------------------------------------

def marker_place(backend: str, output_dir: str, handle: dict[str, Any]) -> tuple[str, str]:
    """(where the running job looks for its PAUSE marker, "") or ("", why it can't be paused)."""
    if backend == "local":
        if not output_dir or "://" in output_dir:
            return "", f"its config's output_dir {output_dir!r} is not a local directory"
        return os.path.join(output_dir, "checkpoints", MARKER), ""
    if backends.entry(backend).no_pause:
        return "", backends.entry(backend).no_pause
    uri = str(handle.get("checkpoint_uri") or "")
    if s3.is_s3(uri):
        return s3.join(uri, MARKER), ""
    return "", (f"its {backend} job handle names no s3:// checkpoint_uri, where the job would "
                "look for the marker")


def check_marker(location: str) -> str:
    """The recorded marker location, normalised; PauseRefused unless it is a PAUSE marker next to
    checkpoints, inside the allowed storage roots (llmops.core.settings.allowed_storage_roots)."""
    allowed = settings.allowed_storage_roots()
    where = f"the pretrain task's recorded marker {location!r}"
    if s3.is_s3(location):
        normal = location.rstrip("/")
        bad = normal.rsplit("/", 1)[-1] != MARKER or "/../" in normal + "/"
    elif os.path.isabs(location) and ".." not in location.split(os.sep):
        parent = os.path.dirname(location)
        normal = os.path.join(os.path.realpath(parent), MARKER)
        bad = os.path.basename(location) != MARKER or os.path.basename(parent) != "checkpoints"
    else:
        raise PauseRefused(409, f"{where} is neither an absolute path nor s3://: pause refused.")
    if bad:
        raise PauseRefused(409, f"{where} is not a {MARKER} marker beside checkpoints: refused.")
    if not paths.under(normal, allowed):
        raise PauseRefused(409, f"{where} is outside the allowed storage roots {allowed} (set "
                                f"{settings.ALLOWED_STORAGE_ROOTS_ENV} to allow it): refused.")
    return normal


def write_marker(location: str, request: dict[str, Any], place: dict[str, Any]) -> None:
    """Write the marker at once for every reader: a local file is written beside and renamed
    over; an S3 PUT is atomic (with the job's AWS connection, region and KMS key)."""
    body = json.dumps(request, sort_keys=True)
    if s3.is_s3(location):
        hook = s3.s3_hook(place.get("aws_conn_id"), place.get("region_name"),
                          place.get("kms_key_id"))
        s3.write_json(hook, location, request)
        return
    folder = os.path.dirname(location)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{MARKER}.", dir=folder)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, location)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# -- the pretrain task, as Airflow's metadata DB has it ------------------------------------

def pretrain_task(dag_id: str, run_id: str) -> dict[str, Any] | None:
    """{"state", "try_number", "place"} of the run's pretrain task (place: what the operator
    recorded under XCOM_KEY, or None), or None when the run has no such task."""
    from sqlalchemy import select

    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        ti = session.scalars(select(TI).where(TI.dag_id == dag_id, TI.run_id == run_id,
                                              TI.task_id == TASK_ID, TI.map_index == -1)).first()
        if ti is None:
            return None
        value = session.scalars(select(XComModel.value).where(
            XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.task_id == TASK_ID,
            XComModel.map_index == -1, XComModel.key == XCOM_KEY)).first()
        if isinstance(value, str):
            value = json.loads(value)
        return {"state": getattr(ti.state, "value", ti.state), "try_number": ti.try_number,
                "place": value if isinstance(value, dict) else None}


def pausable(dag_id: str, run_id: str, task: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    """(what the operator recorded, the checked marker location) of a run's running
    pretraining; PauseRefused says why it cannot be paused."""
    if task is None:
        raise PauseRefused(404, f"DAG run {run_id} of {dag_id} has no task '{TASK_ID}': only a "
                                "lifecycle run's pretraining can be paused.")
    if task["state"] not in RUNNING:
        raise PauseRefused(409, f"task '{TASK_ID}' of run {run_id} is {task['state'] or 'not started'}"
                                ", not running: there is no pretraining job to pause.")
    place = task.get("place") or {}
    if not place:
        raise PauseRefused(409, f"task '{TASK_ID}' of run {run_id} is {task['state']} but has not "
                                "recorded its job yet (it is being submitted): try again in a "
                                "minute.")
    if place.get("why_not") or not place.get("marker"):
        raise PauseRefused(409, f"pretraining job {place.get('job_name', '?')} cannot be paused "
                                f"from here: {place.get('why_not') or 'no marker recorded'}.")
    return place, check_marker(str(place["marker"]))


def request_pause(dag_id: str, run_id: str, at_step: int | None, by: str,
                  lookup: Callable[[str, str], dict[str, Any] | None],
                  write: Callable[[str, dict[str, Any], dict[str, Any]], None]) -> dict[str, Any]:
    """Write the marker of the run's running pretraining; PauseRefused says why not."""
    place, location = pausable(dag_id, run_id, lookup(dag_id, run_id))
    request: dict[str, Any] = {"by": by, "requested_at": dt.datetime.now(dt.timezone.utc).isoformat(
        timespec="seconds")}
    if at_step is not None:
        request["at_step"] = at_step
    write(location, request, place)
    return {"requested": True, "dag_id": dag_id, "run_id": run_id, "job_name": place.get("job_name"),
            "marker": location, "request": request}


def parse_at_step(raw: Any) -> int | None:
    """The form's or JSON's at_step: empty = the next step; else a step number >= 1."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    try:
        step = int(str(raw).strip())
    except ValueError:
        step = 0
    if step < 1:
        raise PauseRefused(400, f"at_step {raw!r} is not a step number >= 1: leave it empty to "
                                "pause after the next step.")
    return step


# -- the page ---------------------------------------------------------------------------------

def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
            "<style>body{font:14px system-ui,sans-serif;margin:2em;max-width:52em}"
            ".refused{color:#b00}.done{color:#070}code{background:#f3f3f3;padding:0 .3em}</style>"
            f"</head><body><h1>{_e(title)}</h1>{body}</body></html>")


def render_form(dag_id: str, run_id: str, task: dict[str, Any] | None, refusal: str = "") -> str:
    place = (task or {}).get("place") or {}
    rows = [f"<p>DAG run <code>{_e(run_id)}</code> of <code>{_e(dag_id)}</code>, task "
            f"<code>{TASK_ID}</code>: <b data-key='state'>{_e((task or {}).get('state'))}</b></p>"]
    if place.get("job_name"):
        rows.append(f"<p>Job <code>{_e(place['job_name'])}</code> on backend "
                    f"<code>{_e(place.get('backend', '?'))}</code>; marker "
                    f"<code>{_e(place.get('marker') or '–')}</code></p>")
    if refusal:
        rows.append(f"<p class='refused' data-key='refused'>{_e(refusal)}</p>")
    else:
        rows.append("<form method='post'><p>Pause after step <input name='at_step' type='number' "
                    "min='1' placeholder='the next step'> (empty: after the next step).</p>"
                    f"<button type='submit'>{LINK_NAME}</button></form>"
                    "<p>The job saves a checkpoint of that step and exits; the task ends skipped "
                    "with <i>paused at step N</i> in its log, the later stages do not run, and the "
                    "DAG run's note says <i>paused at step N of M</i> with the resume. To "
                    "resume, trigger the DAG with from_run = this run, start_at = pretrain, "
                    "fork_step = N and its other Params unchanged.</p>")
    return _page(f"{LINK_NAME}: {run_id}", "".join(rows))


def make_app(authorize_read: Callable | None = None, authorize_pause: Callable | None = None,
             lookup: Callable[[str, str], dict[str, Any] | None] | None = None,
             write: Callable[[str, dict[str, Any], dict[str, Any]], None] | None = None):
    """The FastAPI app. The authorize_* are FastAPI dependencies; by default Airflow's own checks
    that the caller may read (GET) or edit (PUT) this DAG's task instances. `lookup` reads the
    pretrain task (default: pretrain_task), `write` writes the marker (default: write_marker)."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse

    if authorize_read is None or authorize_pause is None:
        from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
        from airflow.api_fastapi.core_api.security import requires_access_dag

        authorize_read = authorize_read or requires_access_dag("GET", DagAccessEntity.TASK_INSTANCE)
        authorize_pause = authorize_pause or requires_access_dag("PUT",
                                                                 DagAccessEntity.TASK_INSTANCE)
    lookup = lookup or pretrain_task
    write = write or write_marker
    api = FastAPI(title="llmops pause", docs_url=None, redoc_url=None, openapi_url=None)

    @api.get("/runs/{dag_id}/{run_id:path}", response_class=HTMLResponse,
             dependencies=[Depends(authorize_read)])
    def page(dag_id: str, run_id: str):
        task = lookup(dag_id, run_id)
        try:
            pausable(dag_id, run_id, task)
        except PauseRefused as exc:
            return HTMLResponse(render_form(dag_id, run_id, task, str(exc)),
                                status_code=exc.status)
        return HTMLResponse(render_form(dag_id, run_id, task))

    @api.post("/runs/{dag_id}/{run_id:path}", dependencies=[Depends(authorize_pause)])
    async def pause(dag_id: str, run_id: str, request: Request):
        raw = await request.body()
        is_json = request.headers.get("content-type", "").startswith("application/json")
        try:
            if is_json:
                fields = json.loads(raw or b"{}")
                fields = fields if isinstance(fields, dict) else {}
            else:
                fields = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
            done = request_pause(dag_id, run_id, parse_at_step(fields.get("at_step")),
                                 str(fields.get("by") or "airflow-ui")[:200], lookup, write)
        except (PauseRefused, ValueError) as exc:
            status = getattr(exc, "status", 400)
            if is_json:
                return JSONResponse({"detail": str(exc)}, status_code=status)
            return HTMLResponse(render_form(dag_id, run_id, lookup(dag_id, run_id), str(exc)),
                                status_code=status)
        if is_json:
            return JSONResponse(done)
        when = (f"after step {done['request']['at_step']}" if "at_step" in done["request"]
                else "after the next step")
        return HTMLResponse(_page(f"Pause requested: {run_id}", (
            f"<p class='done' data-key='requested'>Marker written to <code>{_e(done['marker'])}"
            f"</code>: job <code>{_e(done['job_name'])}</code> pauses {when}, saves that step's "
            "checkpoint and exits; the pretrain task then ends skipped, its log and the DAG "
            "run's note saying <i>paused at step N</i> and how to resume.</p>")))

    return api


app = LazyApp(make_app)
