"""A run summary (llmops.stages.run_summary.collect) in words: nothing is read here, only written
out.

    note_line(summary)   one line for the Airflow DAG run's note and the page's headline
    markdown(summary)    summary.md on the MLflow parent run
    text(summary)        the plain-text account a terminal shows (make demo)
"""

from __future__ import annotations

from typing import Any


def note_line(summary: dict[str, Any]) -> str:
    """'recipe tiny | student: task accuracy 0.000, perplexity 229 | gate passed (task accuracy
    >= 0, perplexity <= 600): llm-lifecycle v1 champion', plus what else a reader must know: a
    pause, reused stages, a wait for capacity, a chain of attempts."""
    parts = [f"recipe {summary.get('recipe') or '?'}"]
    gate, evaluation = summary["gate"], summary.get("evaluation")
    candidate = gate.get("candidate")
    if evaluation and candidate in evaluation["table"]:
        row = evaluation["table"][candidate]
        figures = [f"{name.replace('_', ' ')} {row[key]:{fmt}}"
                   for key, name, fmt in (("task_accuracy", "task_accuracy", ".3f"),
                                          ("perplexity", "perplexity", ".4g")) if key in row]
        parts.append(f"{candidate}: " + ", ".join(figures))
    elif summary["sweep"].get("best_val_loss") is not None:
        parts.append(f"sweep best val loss {summary['sweep']['best_val_loss']:.4g}")
    parts.append(gate_words(summary))
    paused = summary.get("paused")
    if paused:
        parts.append(f"paused at step {paused['step']} ({paused['task']})")
    reuse = summary.get("reuse")
    if reuse:
        saved = f", saved {duration(reuse['saved_s'])}" if reuse.get("saved_s") is not None else ""
        runs = ", ".join(reuse["runs"]) or "earlier runs"
        parts.append(f"{reuse['stages']} stages reused from {runs}{saved}")
    for stage in summary["stages"]:
        waited, attempts = stage.get("waiting"), stage.get("attempts")
        if waited and waited.get("queued_s"):
            parts.append(f"{_task_label(stage)} queued {duration(waited['queued_s'])}")
        if attempts:
            parts.append(f"{_task_label(stage)}: {len(attempts) + 1} attempts ("
                         + ", ".join(a.get("why") or a.get("state") or "ended" for a in attempts) + ", then "
                         + stage["status"].lower() + ")")
    return " | ".join(parts)


def gate_words(summary: dict[str, Any]) -> str:
    """The gate's decision in a few words, with the thresholds it applied."""
    gate = summary["gate"]
    outcome, version, name = gate.get("outcome"), gate.get("version"), gate.get("model_name")
    if gate.get("already_registered"):
        return f"gate: same weights as {name or 'the model'} v{version}, nothing registered"
    limits = thresholds_words(gate.get("thresholds") or {})
    limits = f" ({limits})" if limits else ""
    if outcome and version:
        alias = "champion" if "champion" in gate.get("aliases", []) else "challenger"
        return f"gate {outcome}{limits}: {name} v{version} {alias}"
    if outcome:
        return f"gate {outcome}{limits}"
    if summary.get("paused"):
        return "no gate decision (pretraining paused)"
    return "gate not reached yet" if summary.get("status") == "RUNNING" else "no gate decision"


def thresholds_words(thresholds: dict[str, dict[str, Any]]) -> str:
    """'task accuracy >= 0, perplexity <= 600'"""
    words = []
    for key, label, sign in (("min_task_accuracy", "task accuracy", ">="),
                             ("max_perplexity", "perplexity", "<=")):
        if key in thresholds and thresholds[key]["value"] is not None:
            words.append(f"{label} {sign} {thresholds[key]['value']:g}")
    return ", ".join(words)


def duration(seconds: float | None) -> str:
    """'12.3 s', '4.2 min', '3.1 h'; '–' for unknown."""
    if seconds is None:
        return "–"
    if seconds >= 7200:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _task_label(stage: dict[str, Any]) -> str:
    """A stage row's task: `sweep_trial[1]` for a mapped one."""
    return stage["task_id"] + (f"[{stage['map_index']}]" if stage["map_index"] >= 0 else "")


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"# {summary['dag_id']} {summary['run_id']}", "", note_line(summary), "",
             "| figure | value |", "| --- | --- |"]
    lines += [f"| {k.removeprefix('summary/')} | {v:.6g} |" for k, v in summary["headline"].items()]
    lines += ["", "| stage | task | status | seconds |", "| --- | --- | --- | --- |"]
    for s in summary["stages"]:
        secs = f"{s['duration_s']:.1f}" if s["duration_s"] is not None else ""
        lines.append(f"| {s['stage']} | {_task_label(s)} | {s['status']} | {secs} |")
    return "\n".join(lines) + "\n"


def text(summary: dict[str, Any]) -> str:
    """The run for a terminal: its note line, each stage task's status and time, the headline
    figures, the checkpoints its pretraining kept, a fork's parent, and where the model went."""
    lines = [f"Lifecycle run {summary['run_id']}: {summary['status']} "
             f"(MLflow run {summary['mlflow_run_id']})", f"  {note_line(summary)}", ""]
    for s in summary["stages"]:
        secs = f"{s['duration_s']:7.1f} s" if s["duration_s"] is not None else ""
        lines.append(f"  {s['stage']:<10} {_task_label(s):<16} {s['status']:<9} {secs}")
    if summary["headline"]:
        lines += [""] + [f"  {k.removeprefix('summary/'):<24} {v:.6g}"
                         for k, v in summary["headline"].items()]
    evaluation = summary.get("evaluation")
    if evaluation:
        names = {c: c.removeprefix("suite.") for c in evaluation["columns"]}
        widths = {c: max(10, len(name) + 2) for c, name in names.items()}
        lines += ["", "  " + f"{'model':<12}" + "".join(f"{names[c]:>{widths[c]}}" for c in names)]
        for model in evaluation["models"]:
            row = evaluation["table"][model]
            lines.append("  " + f"{model:<12}" + "".join(
                f"{row[c]:>{widths[c]}.4g}" if c in row else " " * widths[c] for c in names))
    fork = (summary["curves"].get("pretrain") or {}).get("fork")
    if fork:
        lines.append(f"  pretraining forked from run {fork['parent']} at step {fork['step']}")
    checkpoints = summary.get("checkpoints")
    if checkpoints:
        lines.append("  pretraining kept checkpoints at steps "
                     + ", ".join(str(step) for step in checkpoints["kept"]))
    gate = summary["gate"]
    if gate.get("version"):
        alias = "champion" if "champion" in gate["aliases"] else "challenger"
        lines.append(f"Registered model: {gate['model_name']} version {gate['version']} "
                     f"(alias '{alias}'), the {gate['candidate']}: "
                     f"models:/{gate['model_name']}@{alias}")
    else:
        lines.append("No model was registered in this run.")
    return "\n".join(lines)
