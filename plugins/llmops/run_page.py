"""The run page: one HTML page per lifecycle DAG run, served by the Airflow API server.

    /llmops/runs/{dag_id}/{run_id}               the page (a tab "LLM run" on the DAG run page)
    /llmops/runs/{dag_id}/{run_id}/summary.json  the same figures as JSON (llmops.run_summary)

The figures are MLflow's; the run's state and, for a failed run, the task that failed first and
what the scheduler reported (llmops.run_note, the same line as the run's note) are Airflow's. A
run whose first task died before it ran has no MLflow run at all: the page then shows only that.

Rendered on the server with inline SVG charts: no JavaScript build, no CDN, nothing fetched by the
browser but the page itself. While Airflow has the run queued or running, a few lines of inline
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
import html
import math
from typing import Any, Callable

from llmops import run_note, run_summary

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
STATE_COLOURS = {"FINISHED": "#2ca02c", "RUNNING": "#1f77b4", "FAILED": "#d62728",
                 "KILLED": "#7f7f7f", "SCHEDULED": "#bcbd22"}


# -- formatting --------------------------------------------------------------------------------

def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value.is_integer() and abs(value) < 1e12:
            return f"{int(value):,}"
        return f"{value:.{digits}g}"
    return str(value)


def _raw(value: Any) -> str:
    return "" if value is None else repr(float(value)) if isinstance(value, (int, float)) else str(value)


def figure(key: str, value: Any, digits: int = 4, shown: str | None = None) -> str:
    """A number with its exact value attached for machines: <span data-key data-value>."""
    text = shown if shown is not None else fmt(value, digits)
    return f'<span data-key="{_e(key)}" data-value="{_e(_raw(value))}">{_e(text)}</span>'


def percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds >= 7200:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _time(ms: int | None) -> str:
    if not ms:
        return "–"
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# -- SVG charts -------------------------------------------------------------------------------

def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if raw <= step * m)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


def _legend_rows(names: list[str], width: int, left: int) -> list[list[tuple[str, float]]]:
    """Long legend labels in rows under the chart: [(name, x)] per row, wrapped at `width`."""
    rows: list[list[tuple[str, float]]] = [[]]
    x = float(left)
    for name in names:
        w = 14 + 6.5 * len(name) + 16
        if rows[-1] and x + w > width:
            rows.append([])
            x = float(left)
        rows[-1].append((name, x))
        x += w
    return rows


def line_chart(series: dict[str, list[list[float]]], *, title: str, x_label: str = "step",
               y_label: str = "loss", width: int = 460, height: int = 260,
               style: dict[str, tuple[str, bool]] | None = None,
               marks: dict[float, str] | None = None) -> str:
    """Lines (with a dot per point) sharing one pair of axes, and a legend. `style` gives a
    series its colour and whether it is dashed; `marks` draws a labelled vertical line at a
    step. Each series is a <g data-series data-first-step data-last-step> for machines."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return f'<div class="empty">{_e(title)}: no points logged</div>'
    style, marks = style or {}, marks or {}
    left, right, top, bottom = 56, 12, 28, 40
    # short labels sit on the title's line; long ones in rows under the chart
    legend = _legend_rows(list(series), width - right, left) \
        if any(len(name) > 8 for name in series) else None
    extra = 18 * len(legend) if legend else 0
    height += extra
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.08 or abs(y1) * 0.05 or 1.0
    y0, y1 = y0 - pad, y1 + pad
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pw, ph = width - left - right, height - top - bottom - extra

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [f'<svg class="chart" role="img" aria-label="{_e(title)}" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="{left}" y="16" class="title">{_e(title)}</text>']
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>'
                   f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" class="tick" text-anchor="end">{t:.3g}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{top + ph + 16}" class="tick" text-anchor="middle">{t:g}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6 - extra}" class="axis" text-anchor="middle">{_e(x_label)}</text>')
    out.append(f'<text transform="translate(14 {top + ph / 2}) rotate(-90)" class="axis" '
               f'text-anchor="middle">{_e(y_label)}</text>')
    for step, label in marks.items():
        if x0 <= step <= x1:
            out.append(f'<line x1="{sx(step):.1f}" x2="{sx(step):.1f}" y1="{top}" y2="{top + ph}" '
                       f'class="mark" data-mark-step="{_e(_raw(step))}"/>'
                       f'<text x="{sx(step) + 3:.1f}" y="{top + 11}" class="tick">{_e(label)}</text>')
    at = {name: (x, top + ph + bottom + 12 + 18 * r) for r, row in enumerate(legend or []) for name, x in row}
    for i, (name, pts) in enumerate(series.items()):
        colour, dashed = style.get(name, (PALETTE[i % len(PALETTE)], False))
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        first, last = (_raw(pts[0][0]), _raw(pts[-1][0])) if pts else ("", "")
        out.append(f'<g class="series" data-series="{_e(name)}" data-first-step="{_e(first)}" '
                   f'data-last-step="{_e(last)}">')
        if len(pts) > 1:
            dash = ' stroke-dasharray="6 4"' if dashed else ""
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in pts]
        lx, ly = at.get(name, (width - right - 70 * (len(series) - i), 16))  # on the title's line
        swatch = (f'<line x1="{lx}" x2="{lx + 11}" y1="{ly - 4}" y2="{ly - 4}" stroke="{colour}" '
                  f'stroke-width="2" stroke-dasharray="3 2"/>') if dashed else \
            f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{colour}"/>'
        out.append(f'{swatch}<text x="{lx + 14}" y="{ly}" class="legend">{_e(name)}</text></g>')
    out.append("</svg>")
    return "".join(out)


def bar_chart(values: dict[str, float], *, title: str, unit: str = "", width: int = 460,
              colour: str = "#1f77b4", key_prefix: str = "") -> str:
    """Horizontal bars, largest first, each labelled with its value."""
    if not values:
        return f'<div class="empty">{_e(title)}: nothing recorded</div>'
    label_w, row, top = 170, 20, 26
    height = top + row * len(values) + 8
    top_value = max(values.values()) or 1.0
    bar_w = width - label_w - 70
    out = [f'<svg class="chart" role="img" aria-label="{_e(title)}" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="4" y="16" class="title">{_e(title)}</text>']
    for i, (name, value) in enumerate(values.items()):
        y = top + i * row
        w = max(1.0, value / top_value * bar_w) if value > 0 else 0
        out.append(f'<text x="{label_w - 6}" y="{y + 13}" class="tick" text-anchor="end">{_e(name)}</text>'
                   f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row - 6}" fill="{colour}"/>'
                   f'<text x="{label_w + w + 4:.1f}" y="{y + 13}" class="tick" data-key="{_e(key_prefix + name)}" '
                   f'data-value="{_e(_raw(value))}">{_e(fmt(value, 3))}{unit}</text>')
    out.append("</svg>")
    return "".join(out)


def timeline_chart(stages: list[dict[str, Any]], *, width: int = 940) -> str:
    """A Gantt chart of the stage runs: one bar per task (mapped trials included), coloured by state."""
    rows = [s for s in stages if s["start_ms"]]
    if not rows:
        return '<div class="empty">No stage has started yet.</div>'
    t0 = min(s["start_ms"] for s in rows)
    t1 = max((s["end_ms"] or s["start_ms"]) for s in rows)
    span = max(t1 - t0, 1)
    label_w, row, top = 150, 22, 8
    bar_w = width - label_w - 90
    height = top + row * len(rows) + 26
    out = [f'<svg class="chart" role="img" aria-label="stage timeline" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">']
    for i, s in enumerate(rows):
        y = top + i * row
        x = label_w + (s["start_ms"] - t0) / span * bar_w
        w = max(2.0, ((s["end_ms"] or t1) - s["start_ms"]) / span * bar_w)
        name = s["task_id"] + (f"[{s['map_index']}]" if s["map_index"] >= 0 else "")
        colour = STATE_COLOURS.get(s["status"], "#7f7f7f")
        out.append(f'<text x="{label_w - 6}" y="{y + 15}" class="tick" text-anchor="end">{_e(name)}</text>'
                   f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" rx="3" fill="{colour}">'
                   f'<title>{_e(name)}: {_e(s["status"])}, {_e(_duration(s["duration_s"]))}</title></rect>'
                   f'<text x="{x + w + 4:.1f}" y="{y + 15}" class="tick">{_e(_duration(s["duration_s"]))}</text>')
    for t in _ticks(0, span / 1000):
        x = label_w + t * 1000 / span * bar_w
        out.append(f'<text x="{x:.1f}" y="{height - 8}" class="tick" text-anchor="middle">{t:g} s</text>')
    out.append("</svg>")
    return "".join(out)


def fork_series(fork: dict[str, Any]) -> tuple[dict[str, list[list[float]]], dict[str, tuple[str, bool]]]:
    """A fork's curves as chart series: its parent's up to the fork step (dashed), this run's
    from that step on; train in one colour, val in another."""
    parent = f"parent {fork['parent']} to step {fork['step']}"
    series: dict[str, list[list[float]]] = {}
    style: dict[str, tuple[str, bool]] = {}
    for who, label, dashed in (("parent", parent, True), ("fork", "this run", False)):
        for i, name in enumerate(("train", "val")):
            points = (fork["segments"].get(name) or {}).get(who) or []
            if points:
                series[f"{label} · {name}"] = points
                style[f"{label} · {name}"] = (PALETTE[i], dashed)
    return series, style


def fork_chart(stage: str, curve: dict[str, Any]) -> str:
    """One chart: the parent's loss to the fork step, and this run's continuing from it."""
    fork = curve["fork"]
    series, style = fork_series(fork)
    if not series:  # the parent is gone from MLflow: this run's own curves, said so
        series = {"this run · train": curve["train"], "this run · val": curve["val"]}
    title = f"{stage}: loss, forked from {fork['parent']} at step {fork['step']}"
    return (f'<div class="fork" data-key="{_e(stage)}.fork_step" data-value="{_e(fork["step"])}" '
            f'data-parent-run-id="{_e(fork["parent_run_id"])}">'
            + line_chart(series, title=title, width=620, style=style,
                         marks={float(fork["step"]): f"fork at step {fork['step']}"}) + "</div>")


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
    return (f'<div class="card"><div class="label">{_e(label)}</div>'
            f'<div class="value">{figure(key, value, digits)}</div></div>')


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    out = [f'<table class="{cls}"><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr></thead><tbody>"]
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
            f'{_e(airflow["state"])}</div>')


def _page(title: str, body: str, live: bool = False) -> str:
    script = f"<script>{REFRESH_JS % REFRESH_S}</script>" if live else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{CSS}</style>{script}</head><body>{body}</body></html>")


def _failure(airflow: dict[str, Any] | None) -> str:
    """The run's failure line (llmops.run_note), when Airflow has one."""
    if not airflow or not airflow.get("failure"):
        return ""
    return f'<div class="failure" data-key="failure">{_e(airflow["failure"])}</div>'


def render_missing(dag_id: str, run_id: str, airflow: dict[str, Any] | None = None) -> str:
    state = (f"<div class='sub'>Airflow: <span class='state-{_e(airflow['state'])}' data-key='state'>"
             f"{_e(airflow['state'])}</span></div>") if airflow else ""
    return _page(f"{dag_id} {run_id}",
                 f"<h1>{_e(dag_id)} · {_e(run_id)}</h1>{state}{_live_line(airflow)}{_failure(airflow)}"
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
            head = (f'<span class="stale">MLflow still marks {_e(name)} RUNNING, but the Airflow run is '
                    f'{_e(airflow["state"])}: its last logged figures</span>')
        else:
            eta = r["eta_s"]
            shown = (f"{_duration(eta)} (about {_time(r['eta_ms'])[11:]})" if eta is not None
                     else "–")
            cards.append(f'<div class="card"><div class="label">ETA</div><div class="value">'
                         f'{figure(f"{key}.eta_s", eta, shown=shown)}</div></div>')
            rate = (f", {fmt(r['steps_per_s'], 2)} steps/s since it started "
                    f"{_duration(r['elapsed_s'])} ago (the ETA's rate)" if r["steps_per_s"] else "")
            head = f"{_e(name)} is running{rate}"
        out.append(f'<div class="now" data-stage="{_e(name)}"><div>{head}</div>'
                   f'<div class="cards">{"".join(cards)}</div></div>')
    return "".join(out)


def render(summary: dict[str, Any], airflow: dict[str, Any] | None = None) -> str:
    s = summary
    gate, data, goodput, evaluation = s["gate"], s.get("data"), s.get("goodput"), s.get("evaluation")
    body = [f'<h1>{_e(s["dag_id"])} · {_e(s["run_id"])}</h1>',
            f'<div class="sub">MLflow run <code data-key="mlflow_run_id" data-value="{_e(s["mlflow_run_id"])}">'
            f'{_e(s["mlflow_run_id"])}</code> (experiment {_e(s["experiment_id"])}) · '
            f'<span class="state-{_e(s["status"])}">{_e(s["status"])}</span> · started {_e(_time(s["start_ms"]))}'
            f' · {_e(_duration(s["duration_s"]))}</div>',
            _live_line(airflow, dt.datetime.fromtimestamp(s["as_of_ms"] / 1000, dt.timezone.utc)
                       if s.get("as_of_ms") else None),
            f'<div class="note" data-key="note">{_e(s.get("note") or run_summary.note_line(s))}</div>',
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
        rows.append([_e(st["stage"]), _e(name), f'<span class="state-{_e(st["status"])}">{_e(st["status"])}</span>',
                     figure(f"stage.{name}.duration_s", st["duration_s"]), _e(st["try_number"]),
                     f"<code>{_e(st['mlflow_run_id'])}</code>"])
    body.append(_table(["stage", "task", "state", "seconds", "try", "MLflow run"], rows, "stages"))

    # data prep
    body.append("<h2>Data prep</h2>")
    if data:
        body.append('<div class="charts">' + _table(
            ["count", "value"], [[_e(k.replace("_", " ")), figure(f"data.{k}", v)] for k, v in data["counts"].items()],
            "data-counts") + bar_chart(data["drop_reasons"], title="documents dropped, by reason",
                                      colour="#dd6b20", key_prefix="data.dropped.") + "</div>")
    else:
        body.append('<div class="empty">data prep has not logged yet</div>')

    # sweep
    body.append("<h2>Sweep</h2>")
    if s["trials"]:
        rows = [[figure(f"trial.{t['number']}.number", t["number"]), figure(f"trial.{t['number']}.lr", t["lr"]),
                 _e(t["state"]) + (" ★" if str(t["number"]) == str(s["sweep"].get("best_trial")) else ""),
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
        body.append(f'<p>Goodput {_e(percent(goodput["goodput"]))} '
                    f'({figure("goodput_excluding_hang_wait", excl, shown=percent(excl))} '
                    f'without the hang wait): the share of wall time spent on steps whose progress survived.</p>')
        body.append('<div class="charts">' + bar_chart(buckets, title="time by bucket", unit=" s", colour="#805ad5")
                    + _table(["bucket", "seconds"], [[_e(k), figure(f"badput.{k}", v)] for k, v in buckets.items()],
                             "badput") + "</div>")
    else:
        body.append('<div class="empty">pretraining has not reported goodput yet</div>')

    # evaluation
    body.append("<h2>Evaluation</h2>")
    if evaluation:
        rows = [[_e(m)] + [figure(f"eval.{m}.{c}", evaluation["table"][m].get(c)) for c in evaluation["columns"]]
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
            ["decision", f'<span class="{_e(outcome)}" data-key="gate.outcome" data-value="{_e(outcome)}">{_e(outcome)}</span>'],
            ["candidate", figure("gate.candidate", gate.get("candidate"))],
            ["registered model", f"{figure('gate.model_name', gate.get('model_name'))} version "
                                 f"{figure('gate.version', gate.get('version'))}"],
            ["aliases", _e(", ".join(gate.get("aliases") or []) or "none")],
            ["reasons", _e(gate.get("reasons") or "none")],
            ["compared to", _e(gate.get("compared_to") or "–")],
            *([["forked from", f"run {figure('gate.fork.from_run', gate['fork'].get('from_run'))} "
                               f"at step {figure('gate.fork.step', gate['fork'].get('step'))}"]]
              if (gate.get("fork") or {}).get("step") else []),
            # paired against the champion: difference [interval] items p policy: verdict
            *[[f"paired: {_e(metric)}", figure(f"gate.paired.{metric}", verdict)]
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
