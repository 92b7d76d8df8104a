"""The run page: one HTML page per lifecycle DAG run, served by the Airflow API server.

    /llmops/runs/{dag_id}/{run_id}               the page (a tab "LLM run" on the DAG run page)
    /llmops/runs/{dag_id}/{run_id}/summary.json  the same figures as JSON (llmops.run_summary)

The figures are MLflow's; the run's state and, for a failed run, the task that failed first and
what the scheduler reported (llmops.run_note, the same line as the run's note) are Airflow's. A
run whose first task died before it ran has no MLflow run at all: the page then shows only that.

Rendered on the server with inline SVG charts (llmops.run_charts): no JavaScript build, no CDN,
nothing fetched by the browser but the page itself. While Airflow has the run queued or running, a few lines of inline
script fetch the page again every REFRESH_S seconds and swap its body in (the page says when it
was drawn: "live: updated HH:MM:SS UTC"); the first page drawn after the run ended has no script,
so the refreshing stops. A training run MLflow marks RUNNING gets a "Now" card: its latest step
of max_steps, train loss, tokens/s, goodput so far, and an ETA (llmops.run_summary._live). Every figure shown carries `data-key`/`data-value` attributes with the
exact number MLflow holds, so a test (or a script) can read the page and compare.

`app` is a small ASGI shim that builds the FastAPI app on its first request: the plugin is
imported by every Airflow process (scheduler, workers, DAG processor), and only the API server
should pay for FastAPI and Airflow's security module.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Callable

from llmops import run_note, run_summary, run_summary_text
from llmops.run_charts import (bar_chart, duration, esc, figure, fmt, fork_chart, line_chart,
                               percent, timeline_chart, utc_time)


def kept_checkpoints(checkpoints: dict[str, Any] | None) -> str:
    """The pretraining's kept checkpoint steps (what a fork or a rollback can start from), with
    the retention policy that kept them."""
    if not checkpoints:
        return ""
    kept, keep_last, every = checkpoints["kept"], checkpoints["keep_last"], checkpoints["keep_every"]
    policy = " plus ".join(([f"the newest {keep_last}"] if keep_last else [])
                           + ([f"every multiple of {every}"] if every else []))
    more = checkpoints["count"] - len(kept)
    listed = ", ".join(map(str, kept)) or "none"
    return (f'<p class="kept">Pretraining kept {checkpoints["count"]} checkpoint'
            f'{"" if checkpoints["count"] == 1 else "s"}{f" ({policy})" if policy else ""}, '
            f'to fork or roll back from: steps {"… " if more > 0 else ""}'
            f'{figure("pretrain.kept_steps", ",".join(map(str, kept)), shown=listed)}'
            f'{f" (the {more} oldest not listed)" if more > 0 else ""}.</p>')


# -- the page ---------------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:16px 20px;color:#1a202c;
     background:#fff;font-size:14px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:22px 0 8px;border-bottom:1px solid #e2e8f0;
     padding-bottom:4px}
.sub{color:#4a5568;margin-bottom:12px} .note{background:#f7fafc;border-left:4px solid #3182ce;
     padding:8px 12px;margin:8px 0 4px;font-weight:600}
.failure{background:#fff5f5;border-left:4px solid #c53030;padding:8px 12px;margin:8px 0 4px;
     overflow-wrap:anywhere}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0}
.card{border:1px solid #e2e8f0;border-radius:6px;padding:8px 12px;min-width:130px}
.card .label{color:#4a5568;font-size:12px} .card .value{font-size:18px;font-weight:600}
table{border-collapse:collapse;margin:4px 0;align-self:flex-start} th,td{border-bottom:1px solid #e2e8f0;
     padding:4px 10px;text-align:right} th:first-child,td:first-child{text-align:left}
table.stages td:nth-child(-n+3),table.stages th:nth-child(-n+3){text-align:left} th{background:#f7fafc;font-weight:600}
.charts{display:flex;flex-wrap:wrap;gap:16px} .chart .title{font-weight:600;font-size:13px}
.chart .tick{font-size:11px;fill:#4a5568} .chart .axis{font-size:11px;fill:#4a5568}
.chart .legend{font-size:11px} .chart .grid{stroke:#edf2f7} .chart .frame{fill:none;stroke:#cbd5e0}
.chart .mark{stroke:#718096;stroke-dasharray:3 3}
.empty{color:#718096;font-style:italic;padding:6px 0}
.passed{color:#276749;font-weight:600} .refused{color:#c53030;font-weight:600}
.live{color:#2b6cb0;font-size:12px;margin:2px 0 6px} .now{border-left:4px solid #1f77b4;padding:2px 10px;margin:8px 0}
.now .stale{color:#c05621}
.state-FINISHED{color:#276749} .state-FAILED{color:#c53030} .state-RUNNING{color:#2b6cb0}
code{font-size:12px;color:#4a5568}
"""


def _card(label: str, key: str, value: Any, digits: int = 4) -> str:
    return (f'<div class="card"><div class="label">{esc(label)}</div>'
            f'<div class="value">{figure(key, value, digits)}</div></div>')


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    out = [f'<table class="{cls}"><thead><tr>' + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    out += ["<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows]
    return "".join(out) + "</tbody></table>"


# Airflow states in which the run may still change: the page refreshes itself in these.
LIVE_STATES = ("queued", "running")
REFRESH_S = 20
# Fetch the page again (the UI's cookie goes with it) and swap its body in; stop once the new body
# is no longer live (no data-key="live"). A failed fetch is said on the page and tried again.
REFRESH_JS = """(function(){var every=%d*1000;function again(){setTimeout(tick,every)}
function tick(){fetch(location.href,{credentials:"same-origin",cache:"no-store"}).then(function(r){
if(!r.ok&&r.status!==404)throw new Error("HTTP "+r.status);return r.text()}).then(function(text){
var doc=new DOMParser().parseFromString(text,"text/html");
document.documentElement.replaceChild(document.adoptNode(doc.body),document.body);
if(document.querySelector('[data-key="live"]'))again()
}).catch(function(err){var el=document.querySelector('[data-key="live"]');
if(el)el.textContent=el.textContent.split(" · update failed")[0]+" · update failed ("+err.message+
"), trying again";again()})}again()})();"""


def _is_live(airflow: dict[str, Any] | None) -> bool:
    return bool(airflow) and str(airflow.get("state")) in LIVE_STATES


def _live_line(airflow: dict[str, Any] | None, at: dt.datetime | None = None) -> str:
    """'live: updated HH:MM:SS UTC' while the run is queued or running; nothing after."""
    if not _is_live(airflow):
        return ""
    at = at or dt.datetime.now(dt.timezone.utc)
    return (f'<div class="live" data-key="live" data-value="{REFRESH_S}">live: updated '
            f'{at.strftime("%H:%M:%S")} UTC · refreshes every {REFRESH_S} s while the run is '
            f'{esc(airflow["state"])}</div>')


def _page(title: str, body: str, live: bool = False) -> str:
    script = f"<script>{REFRESH_JS % REFRESH_S}</script>" if live else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{CSS}</style>{script}</head><body>{body}</body></html>")


def _failure(airflow: dict[str, Any] | None) -> str:
    """The run's failure line (llmops.run_note), when Airflow has one."""
    if not airflow or not airflow.get("failure"):
        return ""
    return f'<div class="failure" data-key="failure">{esc(airflow["failure"])}</div>'


def render_missing(dag_id: str, run_id: str, airflow: dict[str, Any] | None = None) -> str:
    state = (f"<div class='sub'>Airflow: <span class='state-{esc(airflow['state'])}' data-key='state'>"
             f"{esc(airflow['state'])}</span></div>") if airflow else ""
    return _page(f"{dag_id} {run_id}",
                 f"<h1>{esc(dag_id)} · {esc(run_id)}</h1>{state}{_live_line(airflow)}{_failure(airflow)}"
                 f"<p class='empty'>MLflow has no lifecycle run for this DAG run"
                 f"{'' if airflow and airflow.get('failure') else ' yet'}: it appears once the task "
                 f"<code>start_run</code> has run.</p>", live=_is_live(airflow))


def now_cards(live: list[dict[str, Any]], airflow: dict[str, Any] | None) -> str:
    """One "Now" block per training run MLflow marks RUNNING: latest step of max_steps, train
    loss, tokens/s, goodput so far and the ETA. Once Airflow says the run ended, a run MLflow
    still marks RUNNING was never closed (its job was killed): its last figures, no ETA."""
    if not live:
        return ""
    ended = bool(airflow) and not _is_live(airflow)
    out = ["<h2>Now</h2>"]
    for r in live:
        name = r["task_id"] + (f"[{r['map_index']}]" if r["map_index"] >= 0 else "")
        key = f"now.{name}"
        step = figure(f"{key}.step", r["step"]) if r["step"] is not None else "no step logged yet"
        of = f" of {figure(f'{key}.max_steps', r['max_steps'])}" if r["max_steps"] is not None else ""
        cards = [f'<div class="card"><div class="label">step</div><div class="value">{step}{of}</div></div>',
                 _card("train loss", f"{key}.train_loss", r["train_loss"]),
                 _card("tokens/s", f"{key}.tokens_per_s", r["tokens_per_s"], digits=5)]
        if r["goodput"] is not None:
            cards.append(f'<div class="card"><div class="label">goodput so far</div><div class="value">'
                         f'{figure(f"{key}.goodput", r["goodput"], shown=percent(r["goodput"]))}</div></div>')
        if ended:
            head = (f'<span class="stale">MLflow still marks {esc(name)} RUNNING, but the Airflow run is '
                    f'{esc(airflow["state"])}: its last logged figures</span>')
        else:
            eta = r["eta_s"]
            shown = (f"{duration(eta)} (about {utc_time(r['eta_ms'])[11:]})" if eta is not None
                     else "–")
            cards.append(f'<div class="card"><div class="label">ETA</div><div class="value">'
                         f'{figure(f"{key}.eta_s", eta, shown=shown)}</div></div>')
            rate = (f", {fmt(r['steps_per_s'], 2)} steps/s since it started "
                    f"{duration(r['elapsed_s'])} ago (the ETA's rate)" if r["steps_per_s"] else "")
            head = f"{esc(name)} is running{rate}"
        out.append(f'<div class="now" data-stage="{esc(name)}"><div>{head}</div>'
                   f'<div class="cards">{"".join(cards)}</div></div>')
    return "".join(out)


def render(summary: dict[str, Any], airflow: dict[str, Any] | None = None) -> str:
    s = summary
    gate, data, goodput, evaluation = s["gate"], s.get("data"), s.get("goodput"), s.get("evaluation")
    body = [f'<h1>{esc(s["dag_id"])} · {esc(s["run_id"])}</h1>',
            f'<div class="sub">MLflow run <code data-key="mlflow_run_id" data-value="{esc(s["mlflow_run_id"])}">'
            f'{esc(s["mlflow_run_id"])}</code> (experiment {esc(s["experiment_id"])}) · '
            f'<span class="state-{esc(s["status"])}">{esc(s["status"])}</span> · started {esc(utc_time(s["start_ms"]))}'
            f' · {esc(duration(s["duration_s"]))}</div>',
            _live_line(airflow, dt.datetime.fromtimestamp(s["as_of_ms"] / 1000, dt.timezone.utc)
                       if s.get("as_of_ms") else None),
            f'<div class="note" data-key="note">{esc(s.get("note") or run_summary_text.note_line(s))}</div>',
            _failure(airflow)]

    # headline cards
    cards = []
    counts = (data or {}).get("counts", {})
    if "documents_kept" in counts:
        cards.append(_card("documents kept", "data.documents_kept", counts["documents_kept"]))
    if "train_tokens" in counts:
        cards.append(_card("train tokens", "data.train_tokens", counts["train_tokens"]))
    if s["sweep"].get("best_val_loss") is not None:
        cards.append(_card("sweep best val loss", "sweep.best_val_loss", s["sweep"]["best_val_loss"]))
    if "pretrain" in s["curves"] and s["curves"]["pretrain"]["val"]:
        cards.append(_card("pretrain val loss", "pretrain.val_loss", s["curves"]["pretrain"]["val"][-1][1]))
    if goodput:
        cards.append(f'<div class="card"><div class="label">pretrain goodput</div><div class="value">'
                     f'{figure("goodput", goodput["goodput"], shown=percent(goodput["goodput"]))}</div></div>')
    if gate.get("version"):
        cards.append(_card(f"{gate['model_name']} version", "gate.version", gate["version"]))
    body.append('<div class="cards">' + "".join(cards) + "</div>")
    body.append(now_cards(s.get("live") or [], airflow))

    # stage timeline
    body.append("<h2>Stages</h2>" + timeline_chart(s["stages"]))
    rows = []
    for st in s["stages"]:
        name = st["task_id"] + (f"[{st['map_index']}]" if st["map_index"] >= 0 else "")
        rows.append([esc(st["stage"]), esc(name), f'<span class="state-{esc(st["status"])}">{esc(st["status"])}</span>',
                     figure(f"stage.{name}.duration_s", st["duration_s"]), esc(st["try_number"]),
                     f"<code>{esc(st['mlflow_run_id'])}</code>"])
    body.append(_table(["stage", "task", "state", "seconds", "try", "MLflow run"], rows, "stages"))

    # data prep
    body.append("<h2>Data prep</h2>")
    if data:
        body.append('<div class="charts">' + _table(
            ["count", "value"], [[esc(k.replace("_", " ")), figure(f"data.{k}", v)] for k, v in data["counts"].items()],
            "data-counts") + bar_chart(data["drop_reasons"], title="documents dropped, by reason",
                                      colour="#dd6b20", key_prefix="data.dropped.") + "</div>")
    else:
        body.append('<div class="empty">data prep has not logged yet</div>')

    # sweep
    body.append("<h2>Sweep</h2>")
    if s["trials"]:
        rows = [[figure(f"trial.{t['number']}.number", t["number"]), figure(f"trial.{t['number']}.lr", t["lr"]),
                 esc(t["state"]) + (" ★" if str(t["number"]) == str(s["sweep"].get("best_trial")) else ""),
                 figure(f"trial.{t['number']}.val_loss", t["val_loss"]), figure(f"trial.{t['number']}.steps", t["steps"])]
                for t in s["trials"]]
        curves = {f"trial {t['number']}": t["curve"] for t in s["trials"] if t.get("curve")}
        body.append('<div class="charts">' + _table(["trial", "lr", "state", "val loss", "steps"], rows, "trials")
                    + line_chart(curves, title="trials: validation loss", y_label="val loss") + "</div>")
    else:
        body.append('<div class="empty">no trials yet</div>')

    # training curves; a fork's continues its parent's
    body.append("<h2>Training</h2>")
    if s["curves"]:
        body.append('<div class="charts">' + "".join(
            fork_chart(stage, c) if c.get("fork") else
            line_chart({"train": c["train"], "val": c["val"]}, title=f"{stage}: loss")
            for stage, c in s["curves"].items()) + "</div>")
    else:
        body.append('<div class="empty">no training stage has logged yet</div>')
    body.append(kept_checkpoints(s.get("checkpoints")))

    # goodput
    body.append("<h2>Pretraining goodput</h2>")
    if goodput:
        buckets = {"productive": goodput["productive_s"], **goodput["badput_s"]}
        excl = goodput["goodput_excluding_hang_wait"]
        body.append(f'<p>Goodput {esc(percent(goodput["goodput"]))} '
                    f'({figure("goodput_excluding_hang_wait", excl, shown=percent(excl))} '
                    f'without the hang wait): the share of wall time spent on steps whose progress survived.</p>')
        body.append('<div class="charts">' + bar_chart(buckets, title="time by bucket", unit=" s", colour="#805ad5")
                    + _table(["bucket", "seconds"], [[esc(k), figure(f"badput.{k}", v)] for k, v in buckets.items()],
                             "badput") + "</div>")
    else:
        body.append('<div class="empty">pretraining has not reported goodput yet</div>')

    # evaluation
    body.append("<h2>Evaluation</h2>")
    if evaluation:
        rows = [[esc(m)] + [figure(f"eval.{m}.{c}", evaluation["table"][m].get(c)) for c in evaluation["columns"]]
                for m in evaluation["models"]]
        head = ["model"] + [c.removeprefix("suite.").replace(".accuracy", " accuracy").replace("_", " ")
                            for c in evaluation["columns"]]
        body.append(_table(head, rows, "evaluation"))
    else:
        body.append('<div class="empty">not evaluated yet</div>')

    # gate
    body.append("<h2>Promotion gate</h2>")
    if gate.get("outcome") or gate.get("version"):
        outcome = gate.get("outcome") or "undecided"
        body.append(_table(["", ""], [
            ["decision", f'<span class="{esc(outcome)}" data-key="gate.outcome" data-value="{esc(outcome)}">{esc(outcome)}</span>'],
            ["candidate", figure("gate.candidate", gate.get("candidate"))],
            ["registered model", f"{figure('gate.model_name', gate.get('model_name'))} version "
                                 f"{figure('gate.version', gate.get('version'))}"],
            ["aliases", esc(", ".join(gate.get("aliases") or []) or "none")],
            ["reasons", esc(gate.get("reasons") or "none")],
            ["compared to", esc(gate.get("compared_to") or "–")],
            *([["forked from", f"run {figure('gate.fork.from_run', gate['fork'].get('from_run'))} "
                               f"at step {figure('gate.fork.step', gate['fork'].get('step'))}"]]
              if (gate.get("fork") or {}).get("step") else []),
            # paired against the champion: difference [interval] items p policy: verdict
            *[[f"paired: {esc(metric)}", figure(f"gate.paired.{metric}", verdict)]
              for metric, verdict in (gate.get("paired") or {}).items()]], "gate"))
    else:
        body.append('<div class="empty">the gate has not decided yet</div>')
    return _page(f"{s['dag_id']} {s['run_id']}", "".join(body), live=_is_live(airflow))


# -- the FastAPI app, built on first request -------------------------------------------------

def make_app(authorize: Callable | None = None,
             airflow_run: Callable[[str, str], dict[str, Any] | None] | None = None):
    """The FastAPI app. `authorize` is a FastAPI dependency; by default Airflow's own check that
    the caller may read this DAG's runs (the UI's JWT cookie or a bearer token). `airflow_run`
    reads the run's state and failure line; by default from the API server's metadata DB."""
    from fastapi import Depends, FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse

    if airflow_run is None:
        airflow_run = run_note.airflow_run

    if authorize is None:
        from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
        from airflow.api_fastapi.core_api.security import requires_access_dag

        authorize = requires_access_dag("GET", DagAccessEntity.RUN)
    api = FastAPI(title="llmops run page", docs_url=None, redoc_url=None, openapi_url=None)

    @api.get("/runs/{dag_id}/{run_id:path}/summary.json", dependencies=[Depends(authorize)])
    def summary_json(dag_id: str, run_id: str):
        airflow = airflow_run(dag_id, run_id)
        summary = run_summary.collect(dag_id, run_id)
        if summary is None:
            return JSONResponse({"detail": f"no MLflow run for {dag_id} {run_id}", "airflow": airflow},
                                status_code=404)
        return JSONResponse({**summary, "airflow": airflow})

    @api.get("/runs/{dag_id}/{run_id:path}", response_class=HTMLResponse, dependencies=[Depends(authorize)])
    def page(dag_id: str, run_id: str):
        airflow = airflow_run(dag_id, run_id)
        summary = run_summary.collect(dag_id, run_id)
        if summary is None:
            # A run Airflow knows has a page to show (its state, why it failed); 404 only for neither.
            return HTMLResponse(render_missing(dag_id, run_id, airflow),
                                status_code=200 if airflow else 404)
        return HTMLResponse(render(summary, airflow))

    return api


class LazyApp:
    """An ASGI app that builds the real one (`factory()`) on its first request."""

    def __init__(self, factory: Callable[[], Any]):
        self._factory, self._app = factory, None

    async def __call__(self, scope, receive, send):
        if self._app is None:
            self._app = self._factory()
        await self._app(scope, receive, send)


app = LazyApp(make_app)
URL_PREFIX = "/llmops"
# Relative (no leading slash): the UI resolves it against its base URL, so a proxy prefix works.
RUN_PAGE_HREF = "llmops/runs/{DAG_ID}/{RUN_ID}"
