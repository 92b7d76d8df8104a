"""The run page's charts and number formatting: inline SVG, drawn on the server.

    line_chart      lines with a dot per point on shared axes (loss curves, trials), marks
    bar_chart       horizontal bars, largest first (drop reasons, badput buckets)
    timeline_chart  a Gantt chart of the stage runs, coloured by state
    fork_chart      a fork's loss curve continuing its parent's from the fork step

No JavaScript, no CDN, no plotting library: a chart is a string of SVG the page embeds, so the
API server needs nothing beyond the standard library to draw it. Every figure and series carries
`data-*` attributes with the exact value it was drawn from, for tests and scripts to read.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from typing import Any

from llmops.stages.run_summary_text import duration
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
STATE_COLOURS = {"FINISHED": "#2ca02c", "RUNNING": "#1f77b4", "FAILED": "#d62728",
                 "KILLED": "#7f7f7f", "SCHEDULED": "#bcbd22"}


# -- formatting --------------------------------------------------------------------------------

def esc(text: Any) -> str:
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


def raw(value: Any) -> str:
    return "" if value is None else repr(float(value)) if isinstance(value, (int, float)) else str(value)


def figure(key: str, value: Any, digits: int = 4, shown: str | None = None) -> str:
    """A number with its exact value attached for machines: <span data-key data-value>."""
    text = shown if shown is not None else fmt(value, digits)
    return f'<span data-key="{esc(key)}" data-value="{esc(raw(value))}">{esc(text)}</span>'


def percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def utc_time(ms: int | None) -> str:
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
        return f'<div class="empty">{esc(title)}: no points logged</div>'
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

    out = [f'<svg class="chart" role="img" aria-label="{esc(title)}" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="{left}" y="16" class="title">{esc(title)}</text>']
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>'
                   f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" class="tick" text-anchor="end">{t:.3g}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{top + ph + 16}" class="tick" text-anchor="middle">{t:g}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6 - extra}" class="axis" text-anchor="middle">{esc(x_label)}</text>')
    out.append(f'<text transform="translate(14 {top + ph / 2}) rotate(-90)" class="axis" '
               f'text-anchor="middle">{esc(y_label)}</text>')
    for step, label in marks.items():
        if x0 <= step <= x1:
            out.append(f'<line x1="{sx(step):.1f}" x2="{sx(step):.1f}" y1="{top}" y2="{top + ph}" '
                       f'class="mark" data-mark-step="{esc(raw(step))}"/>'
                       f'<text x="{sx(step) + 3:.1f}" y="{top + 11}" class="tick">{esc(label)}</text>')
    at = {name: (x, top + ph + bottom + 12 + 18 * r) for r, row in enumerate(legend or []) for name, x in row}
    for i, (name, pts) in enumerate(series.items()):
        colour, dashed = style.get(name, (PALETTE[i % len(PALETTE)], False))
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        first, last = (raw(pts[0][0]), raw(pts[-1][0])) if pts else ("", "")
        out.append(f'<g class="series" data-series="{esc(name)}" data-first-step="{esc(first)}" '
                   f'data-last-step="{esc(last)}">')
        if len(pts) > 1:
            dash = ' stroke-dasharray="6 4"' if dashed else ""
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in pts]
        lx, ly = at.get(name, (width - right - 70 * (len(series) - i), 16))  # on the title's line
        swatch = (f'<line x1="{lx}" x2="{lx + 11}" y1="{ly - 4}" y2="{ly - 4}" stroke="{colour}" '
                  f'stroke-width="2" stroke-dasharray="3 2"/>') if dashed else \
            f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{colour}"/>'
        out.append(f'{swatch}<text x="{lx + 14}" y="{ly}" class="legend">{esc(name)}</text></g>')
    out.append("</svg>")
    return "".join(out)


def bar_chart(values: dict[str, float], *, title: str, unit: str = "", width: int = 460,
              colour: str = "#1f77b4", key_prefix: str = "") -> str:
    """Horizontal bars, largest first, each labelled with its value."""
    if not values:
        return f'<div class="empty">{esc(title)}: nothing recorded</div>'
    label_w, row, top = 170, 20, 26
    height = top + row * len(values) + 8
    top_value = max(values.values()) or 1.0
    bar_w = width - label_w - 70
    out = [f'<svg class="chart" role="img" aria-label="{esc(title)}" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="4" y="16" class="title">{esc(title)}</text>']
    for i, (name, value) in enumerate(values.items()):
        y = top + i * row
        w = max(1.0, value / top_value * bar_w) if value > 0 else 0
        out.append(f'<text x="{label_w - 6}" y="{y + 13}" class="tick" text-anchor="end">{esc(name)}</text>'
                   f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row - 6}" fill="{colour}"/>'
                   f'<text x="{label_w + w + 4:.1f}" y="{y + 13}" class="tick" data-key="{esc(key_prefix + name)}" '
                   f'data-value="{esc(raw(value))}">{esc(fmt(value, 3))}{unit}</text>')
    out.append("</svg>")
    return "".join(out)


def timeline_chart(stages: list[dict[str, Any]], *, width: int = 940, now_ms: int | None = None) -> str:
    """A Gantt chart of the stage runs: one bar per task (mapped trials included), coloured by
    state. A stage still running (no end yet) has a bar to `now_ms`, labelled "running"."""
    rows = [s for s in stages if s["start_ms"]]
    if not rows:
        return '<div class="empty">No stage has started yet.</div>'

    def end(s: dict[str, Any]) -> int | None:
        return s["end_ms"] or (now_ms if s["status"] == "RUNNING" and now_ms else None)

    t0 = min(s["start_ms"] for s in rows)
    t1 = max((end(s) or s["start_ms"]) for s in rows)
    span = max(t1 - t0, 1)
    label_w, row, top = 150, 22, 8
    bar_w = width - label_w - 110
    height = top + row * len(rows) + 26
    out = [f'<svg class="chart" role="img" aria-label="stage timeline" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">']
    for i, s in enumerate(rows):
        y = top + i * row
        x = label_w + (s["start_ms"] - t0) / span * bar_w
        w = max(2.0, ((end(s) or t1) - s["start_ms"]) / span * bar_w)
        name = s["task_id"] + (f"[{s['map_index']}]" if s["map_index"] >= 0 else "")
        colour = STATE_COLOURS.get(s["status"], "#7f7f7f")
        running = s["end_ms"] is None and s["status"] == "RUNNING" and bool(now_ms)
        seconds = _seconds_between(s["start_ms"], end(s)) if running else s["duration_s"]
        label = f"running {duration(seconds)}" if running else duration(seconds)
        cls = ' class="running"' if running else ""
        out.append(f'<text x="{label_w - 6}" y="{y + 15}" class="tick" text-anchor="end">{esc(name)}</text>'
                   f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" rx="3" fill="{colour}"'
                   f'{cls} data-task="{esc(name)}">'
                   f'<title>{esc(name)}: {esc(s["status"])}, {esc(label)}</title></rect>'
                   f'<text x="{x + w + 4:.1f}" y="{y + 15}" class="tick">{esc(label)}</text>')
    for t in _ticks(0, span / 1000):
        x = label_w + t * 1000 / span * bar_w
        out.append(f'<text x="{x:.1f}" y="{height - 8}" class="tick" text-anchor="middle">{t:g} s</text>')
    out.append("</svg>")
    return "".join(out)


def _seconds_between(start_ms: int, end_ms: int | None) -> float | None:
    return max(0.0, (end_ms - start_ms) / 1000) if end_ms else None


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
    return (f'<div class="fork" data-key="{esc(stage)}.fork_step" data-value="{esc(fork["step"])}" '
            f'data-parent-run-id="{esc(fork["parent_run_id"])}">'
            + line_chart(series, title=title, width=620, style=style,
                         marks={float(fork["step"]): f"fork at step {fork['step']}"}) + "</div>")
