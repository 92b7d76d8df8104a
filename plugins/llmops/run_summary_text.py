"""A run summary (llmops.run_summary.collect) in words: nothing is read here, only written out.

    note_line(summary)   one line for the Airflow DAG run's note and the page's headline
    markdown(summary)    summary.md on the MLflow parent run
    text(summary)        the plain-text account a terminal shows (make demo)
"""

from __future__ import annotations

from typing import Any


def note_line(summary: dict[str, Any]) -> str:
    """'recipe tiny | student: task accuracy 0.000, perplexity 229 | gate passed: llm-lifecycle v1 champion'"""
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
    outcome = gate.get("outcome")
    if outcome and gate.get("version"):
        alias = "champion" if "champion" in gate.get("aliases", []) else "challenger"
        parts.append(f"gate {outcome}: {gate['model_name']} v{gate['version']} {alias}")
    elif outcome:
        parts.append(f"gate {outcome}")
    else:
        parts.append("no gate decision")
    return " | ".join(parts)


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
