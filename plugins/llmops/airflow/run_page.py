"""The run page: one HTML page per lifecycle DAG run, served by the Airflow API server.

    /llmops/runs/{dag_id}/{run_id}               the page (a tab "LLM run" on the DAG run page)
    /llmops/runs/{dag_id}/{run_id}/summary.json  the same figures as JSON
    (llmops.stages.run_summary)

The figures are MLflow's; the run's state and, for a failed run, the task that failed first and
what the scheduler reported (llmops.airflow.run_note, the same line as the run's note) are
Airflow's. A run whose first task died before it ran has no MLflow run at all: the page then shows
only that.

Rendered on the server with inline SVG charts (llmops.airflow.run_charts): no JavaScript build, no
CDN, nothing fetched by the browser but the page itself. While Airflow has the run queued or
running, a few lines of inline script fetch the page again every REFRESH_S seconds and swap its body
in (the page says when it was drawn: "live: updated HH:MM:SS UTC"); the first page drawn after the
run ended has no script, so the refreshing stops. A training run MLflow marks RUNNING gets a "Now"
card: its latest step of max_steps, train loss, tokens/s, goodput so far, and an ETA
(llmops.stages.run_summary._live). Every figure shown carries `data-key`/`data-value` attributes
with the exact number MLflow holds, so a test (or a script) can read the page and compare.

`app` is a small ASGI shim that builds the FastAPI app on its first request: the plugin is
imported by every Airflow process (scheduler, workers, DAG processor), and only the API server
should pay for FastAPI and Airflow's security module.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Callable, Iterator
from urllib.parse import quote

from llmops.airflow import run_note
from llmops.infra import tracking
from llmops.stages import run_summary, run_summary_text
from llmops.airflow.run_charts import (bar_chart, esc, figure, fmt, fork_chart, line_chart, percent,
                                       timeline_chart, utc_time)
from llmops.stages.run_summary_text import duration


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
.state-KILLED{color:#718096} .reused{color:#6b46c1;font-weight:600} .waiting{color:#b7791f;font-weight:600}
code{font-size:12px;color:#4a5568} a code{color:#2b6cb0}
.banner{padding:8px 12px;margin:8px 0 4px;border-left:4px solid #b7791f;background:#fffaf0}
.banner.paused{border-color:#718096;background:#f7fafc} .banner ol{margin:4px 0 0 18px;padding:0}
.refusal b{color:#c53030} .hint{color:#4a5568;font-size:13px;margin:4px 0}
.card .context{color:#4a5568;font-size:12px;max-width:220px}
.loading{color:#4a5568;font-style:italic;padding:6px 0}
.already_registered{color:#2b6cb0;font-weight:600} .decision{font-size:15px}
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
    return _page_start(title, live) + body + PAGE_END


def _page_start(title: str, live: bool = False) -> str:
    script = f"<script>{REFRESH_JS % REFRESH_S}</script>" if live else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{CSS}</style>{script}</head><body>")


PAGE_END = "</body></html>"


def streamed(dag_id: str, run_id: str, airflow: dict[str, Any] | None,
             collect: Callable[[str, str], dict[str, Any] | None]) -> Iterator[str]:
    """The page in two parts: at once its head and a line saying the run is being read, then,
    once MLflow has answered (seconds on a busy store, where the tab used to stay blank), the
    page itself, with a style that hides that line. A failure to read MLflow is said on the page."""
    yield (_page_start(f"{dag_id} {run_id}", _is_live(airflow))
           + f'<div id="loading" class="loading"><h1>{esc(dag_id)} · {esc(run_id)}</h1>'
             f'Reading this run from MLflow…</div>')
    try:
        summary = collect(dag_id, run_id)
        body = render_body(summary, airflow) if summary else _missing_body(dag_id, run_id, airflow)
    except Exception as exc:  # noqa: BLE001 - the status line was sent: say it on the page
        body = (f"{_head(dag_id, run_id, airflow)}{_live_line(airflow)}"
                f'<div class="failure" data-key="read_error">Could not read this run from MLflow '
                f'({esc(tracking.tracking_uri())}): {esc(type(exc).__name__)}: {esc(exc)}</div>')
    yield "<style>#loading{display:none}</style>" + body + PAGE_END


def _failure(airflow: dict[str, Any] | None) -> str:
    """The run's failure line (llmops.airflow.run_note), when Airflow has one."""
    if not airflow or not airflow.get("failure"):
        return ""
    return f'<div class="failure" data-key="failure">{esc(airflow["failure"])}</div>'


def _refusal(airflow: dict[str, Any] | None) -> str:
    """A run its first task refused: the task's own message (the Param and the fix)."""
    refusal = (airflow or {}).get("refusal")
    if not refusal:
        return ""
    return (f'<div class="failure refusal" data-key="refusal" data-value="{esc(refusal["message"])}">'
            f'<b>Refused at {esc(refusal["task"])}</b>: {esc(refusal["message"])}</div>'
            f'<p class="hint">{esc(refusal["task"])} checks every Param before any job starts, so '
            f'nothing ran and MLflow has no run for this DAG run. Trigger again with the Param '
            f'fixed.</p>')


def _head(dag_id: str, run_id: str, airflow: dict[str, Any] | None) -> str:
    """The page's title and the run's Airflow state: what it shows before MLflow is read."""
    state = (f"<div class='sub'>Airflow: <span class='state-{esc(airflow['state'])}' data-key='state'>"
             f"{esc(airflow['state'])}</span></div>") if airflow else ""
    return f"<h1>{esc(dag_id)} · {esc(run_id)}</h1>{state}"


def render_missing(dag_id: str, run_id: str, airflow: dict[str, Any] | None = None) -> str:
    return _page(f"{dag_id} {run_id}", _missing_body(dag_id, run_id, airflow), live=_is_live(airflow))


def _missing_body(dag_id: str, run_id: str, airflow: dict[str, Any] | None) -> str:
    if (airflow or {}).get("refusal"):
        return _head(dag_id, run_id, airflow) + _live_line(airflow) + _refusal(airflow)
    return (f"{_head(dag_id, run_id, airflow)}{_live_line(airflow)}{_failure(airflow)}"
            f"<p class='empty'>MLflow has no lifecycle run for this DAG run"
            f"{'' if airflow and airflow.get('failure') else ' yet'}: it appears once the task "
            f"<code>start_run</code> has run.</p>")


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


def _task(stage: dict[str, Any]) -> str:
    return stage["task_id"] + (f"[{stage['map_index']}]" if stage["map_index"] >= 0 else "")


def _run_link(run_id: str) -> str:
    """Another run of the same DAG: its page, in this frame (the Airflow UI's tab is a sandboxed
    iframe that may not navigate the window around it), next to this one's URL."""
    return f'<a href="./{esc(quote(run_id, safe=""))}" data-run="{esc(run_id)}">{esc(run_id)}</a>'


# The Airflow UI shows this page in an iframe sandboxed without allow-popups or
# allow-top-navigation: a plain target=_blank link does nothing there. The frame may script its
# same-origin parent, whose window.open opens the tab; on its own the page needs no script.
OPEN_OUTSIDE = "if(window.top!==window){window.top.open(this.href,'_blank');return false}"


def _mlflow_link(run_id: str, experiment_id: str, text: str | None = None) -> str:
    return (f'<a href="{esc(tracking.ui_route(tracking.mlflow_ui_url(), experiment_id, run_id))}" '
            f'target="_blank" rel="noopener" onclick="{esc(OPEN_OUTSIDE)}"><code>{esc(text or run_id)}</code></a>')


def banners(s: dict[str, Any], airflow: dict[str, Any] | None) -> str:
    """What a reader must see first: a paused pretraining and how to resume it, a job waiting
    for capacity (the service's own words, the time queued), a chain of attempts."""
    out = []
    paused = s.get("paused")
    if paused:
        r = paused["resume"]
        conf = json.dumps({"from_run": r.get("from_run"), "start_at": r.get("start_at"),
                           "fork_step": r.get("fork_step")})
        out.append(f'<div class="banner paused" data-key="paused_at_step" data-value="{esc(paused["step"])}">'
                   f'<b>Paused</b>: {esc(paused["task"])} checkpointed step {esc(paused["step"])} and '
                   f'stopped on request; the stages after it were skipped. To resume from that step, '
                   f'trigger {esc(s["dag_id"])} with <code data-key="resume" data-value="{esc(conf)}">'
                   f'{esc(conf)}</code> and nothing else changed.</div>')
    now_ms = s.get("as_of_ms") or 0
    for st in s["stages"]:
        w = st.get("waiting")
        if w and w["queued_s"] is None and w["reason"] and st["status"] == "RUNNING":
            queued = max(0.0, now_ms / 1000 - w["since_s"]) if now_ms else None
            out.append(f'<div class="banner waiting" data-key="waiting.{esc(_task(st))}" '
                       f'data-value="{esc(w["reason"])}"><b>{esc(_task(st))} is waiting</b> in its '
                       f'service\'s queue: <q>{esc(w["reason"])}</q>; queued '
                       f'{figure(f"waiting.{_task(st)}.queued_s", queued, shown=duration(queued))} '
                       f'(since {esc(utc_time(int(w["since_s"] * 1000)))}). Nothing is billed while '
                       f'it waits; the stage\'s max_queue_seconds bounds the wait.</div>')
    for st in s["stages"]:
        if st.get("attempts"):
            items = "".join(
                f'<li data-attempt="{esc(a.get("attempt"))}">attempt {esc(a.get("attempt"))} '
                f'(<code>{esc(a.get("job"))}</code>) {esc(a.get("state") or "ended")}'
                + (f', ended by <b>{esc(a["why"])}</b>' if a.get("why") else "")
                + (f": {esc(a['message'])}" if a.get("message") else "")
                + (f' <i>The chain stopped: {esc(a["stopped_chain"])}</i>' if a.get("stopped_chain") else "")
                + "</li>" for a in st["attempts"])
            last = st["attempts"][-1]
            after = ("" if last.get("stopped_chain") else
                     f'<li>attempt {esc(int(last.get("attempt") or 0) + 1)}: {esc(st["status"]).lower()}, '
                     f'from the newest checkpoint</li>')
            out.append(f'<div class="banner attempts" data-key="attempts.{esc(_task(st))}" '
                       f'data-value="{len(st["attempts"])}"><b>{esc(_task(st))}: a chain of '
                       f'{len(st["attempts"]) + (0 if last.get("stopped_chain") else 1)} attempts</b>'
                       f'<ol>{items}{after}</ol></div>')
    return "".join(out)


def stages_section(s: dict[str, Any]) -> str:
    """The timeline (a running stage's bar grows to now), a row per stage task with its state,
    where a reused stage's outputs come from (linked) and a waiting one's queue time; how much
    time the reused stages saved."""
    rows = []
    for st in s["stages"]:
        name = _task(st)
        state = f'<span class="state-{esc(st["status"])}">{esc(st["status"])}</span>'
        reused, waited = st.get("reused"), st.get("waiting")
        if reused:
            then = reused["source_duration_s"]
            state = (f'<span class="reused" data-key="stage.{esc(name)}.reused_from" '
                     f'data-value="{esc(reused["run_id"])}">reused</span> from run '
                     + (_run_link(reused["run_id"]) if reused["run_id"] else "?")
                     + (f" (took {esc(duration(then))} there)" if then is not None else ""))
        elif waited and waited["queued_s"] is None and st["status"] == "RUNNING":
            state = '<span class="waiting">waiting in the queue</span>'
        if waited and waited["queued_s"] is not None:
            queued = figure(f"stage.{name}.queued_s", waited["queued_s"], shown=duration(waited["queued_s"]))
            state += f", queued {queued} first"
        if st.get("paused_at_step") is not None:
            state += f', paused at step {esc(st["paused_at_step"])}'
        if st.get("attempts"):
            state += f', {len(st["attempts"])} earlier attempt{"s" if len(st["attempts"]) > 1 else ""}'
        mlflow = _mlflow_link(st["mlflow_run_id"], s["experiment_id"])
        if reused and reused["mlflow_run_id"]:
            mlflow += " ← " + _mlflow_link(reused["mlflow_run_id"], s["experiment_id"], "its job's")
        rows.append([esc(st["stage"]), esc(name), state,
                     figure(f"stage.{name}.duration_s", st["duration_s"]), esc(st["try_number"]), mlflow])
    out = ['<section id="stages"><h2>Stages</h2>', timeline_chart(s["stages"], now_ms=s.get("as_of_ms")),
           _table(["stage", "task", "state", "seconds", "try", "MLflow run"], rows, "stages")]
    reuse = s.get("reuse")
    if reuse:
        runs = ", ".join(_run_link(r) for r in reuse["runs"]) or "earlier runs"
        saved = (f"; those jobs took {esc(duration(reuse['then_s']))} when they ran, these stages "
                 f"{esc(duration(reuse['here_s']))} here: the cache saved "
                 f"{figure('reuse.saved_s', reuse['saved_s'], shown=duration(reuse['saved_s']))}"
                 if reuse["saved_s"] is not None else "")
        out.append(f'<p class="reuse" data-key="reuse.stages" data-value="{reuse["stages"]}">'
                   f'{reuse["stages"]} of {len(s["stages"])} stage tasks ran no job: their inputs, '
                   f'config and code were unchanged, so they reused the outputs of run {runs}{saved}.</p>')
    return "".join(out) + "</section>"


THRESHOLD_WORDS = {"min_task_accuracy": ("task accuracy", "≥", "task_accuracy"),
                   "max_perplexity": ("perplexity", "≤", "perplexity")}


def _threshold_source(name: str, t: dict[str, Any], recipe: str | None) -> str:
    if recipe and t["recipe"] is not None and t["recipe"] == t["value"]:
        return f"recipe {recipe}'s value"
    return "this run's Param" if recipe else ""


def _change(value: float, unit: str | None) -> str:
    """A comparison's change in its unit: relative as a percentage, accuracy points as a number."""
    return f"{value:+.2%}" if unit == "relative" else f"{value:+.3f}"


def _size(c: dict[str, Any]) -> str:
    """What a comparison was made on: documents and their tokens, or items (in passages)."""
    n, clusters = c.get("n"), c.get("clusters")
    if c.get("kind") == "continuous":
        return f"{clusters} documents" + (f" ({c['tokens']:,} tokens)" if c.get("tokens") else "")
    return f"{n} items" + (f" in {clusters} passages" if clusters and n and clusters < n else "")


def gate_section(s: dict[str, Any]) -> str:
    """The decision, then what it was decided on: each threshold (and where its value comes
    from) against the candidate's figure, and each comparison with the champion: its policy,
    test, interval, p-value and the smallest difference it could detect."""
    gate, evaluation = s["gate"], s.get("evaluation")
    out = ['<section id="gate"><h2>Promotion gate</h2>']
    if not (gate.get("outcome") or gate.get("version")):
        out.append('<div class="empty">' + ("the gate did not run: pretraining was paused"
                                           if s.get("paused") else "the gate has not decided yet")
                   + "</div></section>")
        return "".join(out)
    outcome = gate.get("outcome") or "undecided"
    name, version = gate.get("model_name"), gate.get("version")
    if gate.get("already_registered"):
        said = (f"same weights as {esc(name or 'the model')} version "
                f"{figure('gate.version', version)}; nothing registered"
                + (", and that version is the champion already" if gate.get("already_champion") else ""))
    elif version:
        alias = "champion" if "champion" in (gate.get("aliases") or []) else "challenger"
        said = (f"{esc(outcome)}: {figure('gate.model_name', name)} version {figure('gate.version', version)} "
                f"registered, alias <b>{alias}</b>")
    else:
        said = esc(outcome)
    compared = gate.get("compared_to")
    out.append(f'<p class="decision"><span class="{esc(outcome)}" data-key="gate.outcome" '
               f'data-value="{esc(outcome)}">{said}</span> · candidate '
               f'{figure("gate.candidate", gate.get("candidate"))}'
               + (f' · compared with {esc(compared)}' if compared else "") + "</p>")
    # thresholds against the candidate's figures
    row = ((evaluation or {}).get("table") or {}).get(gate.get("candidate") or "", {})
    rows = []
    for key, t in (gate.get("thresholds") or {}).items():
        label, sign, metric = THRESHOLD_WORDS.get(key, (key.replace("_", " "), "", ""))
        got = row.get(metric) if metric else None
        met = "" if got is None else \
            "✓" if (got >= t["value"] if sign == "≥" else got <= t["value"]) else "✗"
        value = percent(t["value"]) if key == "max_contaminated_share" else \
            ("yes" if t["value"] is True else "no" if t["value"] is False else fmt(t["value"]))
        rows.append([esc(f"{label} {sign}".strip()), figure(f"gate.threshold.{key}", t["value"], shown=value),
                     esc(_threshold_source(key, t, s.get("recipe"))),
                     figure(f"gate.candidate.{metric or key}", got) + f" {met}" if metric else "–"])
    if rows:
        out.append(_table(["threshold", "value", "set by", gate.get("candidate") or "candidate"], rows,
                          "thresholds"))
    if any(t["value"] == 0 for k, t in (gate.get("thresholds") or {}).items() if k == "min_task_accuracy"):
        out.append(f'<p class="hint">A task accuracy of 0 passes: the {esc(s.get("recipe") or "run")} '
                   f'setting refuses only what is far worse than guessing (a tiny model that trained '
                   f'for seconds cannot answer). Set <code>min_task_accuracy</code> to demand more.</p>')
    # against the champion
    comparisons, paired = gate.get("comparisons") or {}, gate.get("paired") or {}
    rules = gate.get("rules") or {}
    if comparisons:
        rows = []
        for metric, c in comparisons.items():
            unit = c.get("unit")
            policy = c.get("policy") if c.get("decides", True) else "guard"
            rows.append([
                esc(metric),
                esc(policy + (f" (margin {_change(c['margin'], unit)[1:]})" if c.get("margin") else "")),
                esc(c.get("test")), esc(_size(c)), f"{fmt(c.get('challenger'))} vs {fmt(c.get('champion'))}",
                figure(f"gate.diff.{metric}", c.get("diff"),
                       shown=f"{_change(c['diff'], unit)} [{_change(c['low'], unit)}, "
                             f"{_change(c['high'], unit)}] at {percent(c.get('confidence'))}"),
                esc(f"{c['p_value']:.3g}" if c.get("p_value") is not None else "–"),
                figure(f"gate.mde.{metric}", c.get("mde"),
                       shown=(_change(c["mde"], unit)[1:]
                              + (f" ({percent(c['power'])} power)" if c.get("power") else ""))
                       if c.get("mde") is not None else "–"),
                f'<span data-key="gate.verdict.{esc(metric)}" data-value="{esc(c.get("verdict"))}">'
                f'{esc(c.get("verdict"))}</span>' + (f" — {esc(c['reason'])}" if c.get("reason") else "")])
        out.append(_table(["metric", "policy", "test", "compared on", "challenger vs champion",
                           "change [interval]", "p", "smallest detectable", "verdict"], rows, "comparisons"))
    elif paired:
        out.append(_table(["metric", "difference [interval] n p policy: verdict"],
                          [[esc(m), figure(f"gate.paired.{m}", v)] for m, v in paired.items()], "comparisons"))
    elif rules:
        out.append(f'<p class="hint">Rules against a champion: '
                   + esc("; ".join(f"{m} {r.get('policy', '')}"
                                  + (f" (margin {r['margin']:g})" if r.get("margin") is not None else "")
                                  for m, r in rules.items()))
                   + (". There was no champion to compare with: only the thresholds applied."
                      if "no champion" in str(compared) else ".")
                   + "</p>")
    contamination = gate.get("contamination") or {}
    if contamination:
        out.append(_table(["metric", "items seen in training"], [
            [esc(m), esc(f"{c.get('contaminated')} of {c.get('items')}")] for m, c in contamination.items()],
            "contamination"))
    extra = [["reasons", esc(gate.get("reasons") or "none")],
             ["aliases", esc(", ".join(gate.get("aliases") or []) or "none")]]
    if (gate.get("fork") or {}).get("step"):
        extra.append(["forked from", f"run {figure('gate.fork.from_run', gate['fork'].get('from_run'))} "
                                     f"at step {figure('gate.fork.step', gate['fork'].get('step'))}"])
    out.append(_table(["", ""], extra, "gate"))
    return "".join(out) + "</section>"


def goodput_card(goodput: dict[str, Any]) -> str:
    """Goodput with its context: a tiny run's seconds of training against its start-up read
    as a small share that is no fault."""
    productive = goodput["productive_s"] or 0.0
    total = productive + sum(goodput["badput_s"].values())
    biggest = max(goodput["badput_s"].items(), key=lambda kv: kv[1], default=None)
    context = (f"{duration(productive)} of {duration(total)} trained"
               + (f"; {biggest[0].replace('_', ' ')} {duration(biggest[1])}"
                  if biggest and biggest[1] > 0 else ""))
    return (f'<div class="card"><div class="label">pretrain goodput</div><div class="value">'
            f'{figure("goodput", goodput["goodput"], shown=percent(goodput["goodput"]))}</div>'
            f'<div class="context" data-key="goodput.context">{esc(context)}</div></div>')


def render(summary: dict[str, Any], airflow: dict[str, Any] | None = None) -> str:
    return _page(f"{summary['dag_id']} {summary['run_id']}", render_body(summary, airflow),
                 live=_is_live(airflow))


def render_body(summary: dict[str, Any], airflow: dict[str, Any] | None = None) -> str:
    s = summary
    gate, data, goodput, evaluation = s["gate"], s.get("data"), s.get("goodput"), s.get("evaluation")
    body = [f'<h1>{esc(s["dag_id"])} · {esc(s["run_id"])}</h1>',
            f'<div class="sub">MLflow run <code data-key="mlflow_run_id" data-value="{esc(s["mlflow_run_id"])}">'
            f'{esc(s["mlflow_run_id"])}</code> (experiment {esc(s["experiment_id"])}, '
            f'{_mlflow_link(s["mlflow_run_id"], s["experiment_id"], "open in MLflow")}) · '
            f'<span class="state-{esc(s["status"])}">{esc(s["status"])}</span> · started {esc(utc_time(s["start_ms"]))}'
            f' · {esc(duration(s["duration_s"]))}</div>',
            _live_line(airflow, dt.datetime.fromtimestamp(s["as_of_ms"] / 1000, dt.timezone.utc)
                       if s.get("as_of_ms") else None),
            f'<div class="note" data-key="note">{esc(s.get("note") or run_summary_text.note_line(s))}</div>',
            _failure(airflow), banners(s, airflow)]

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
        cards.append(goodput_card(goodput))
    if gate.get("version"):
        cards.append(_card(f"{gate['model_name']} version", "gate.version", gate["version"]))
    body.append('<div class="cards">' + "".join(cards) + "</div>")
    body.append(now_cards(s.get("live") or [], airflow))
    body.append(stages_section(s))

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

    body.append(gate_section(s))
    return "".join(body)


# -- the FastAPI app, built on first request -------------------------------------------------

def make_app(authorize: Callable | None = None,
             airflow_run: Callable[[str, str], dict[str, Any] | None] | None = None):
    """The FastAPI app. `authorize` is a FastAPI dependency; by default Airflow's own check that
    the caller may read this DAG's runs (the UI's JWT cookie or a bearer token). `airflow_run`
    reads the run's state and failure line; by default from the API server's metadata DB."""
    from fastapi import Depends, FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

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
        if airflow is not None:
            # A run Airflow knows has a page to show (its state, why it failed), streamed: its
            # head at once, MLflow's figures when read.
            return StreamingResponse(streamed(dag_id, run_id, airflow, run_summary.collect),
                                     media_type="text/html; charset=utf-8")
        summary = run_summary.collect(dag_id, run_id)
        if summary is None:   # 404 only for a run neither Airflow nor MLflow knows
            return HTMLResponse(render_missing(dag_id, run_id, airflow), status_code=404)
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
