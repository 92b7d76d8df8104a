"""Does the promotion gate promote noise? The paired gate (plugins/llmops/policy/paired.py, on by
default) beside the point-estimate gate it replaced, on the same challengers, in one run.

    .venv/bin/python -m benchmarks.gate_noise [--recipes tiny demo] [--seeds 5] [--improved 5]
        [--work DIR] [--out benchmarks/results/gate_noise.json]

With --work, a rerun after an interruption reads back every job that finished there with the same
config instead of running it again.

Per recipe: data prep once; a champion run (pretrain -> finetune -> distill -> evaluate) with the
recipe's seeds; `--seeds` challengers that differ from it only in their seeds (Params
pretrain_seed, finetune_seed, distill_seed); `--improved` challengers with a real but modest
improvement (RECIPE_IMPROVEMENT: more training steps, and their own seeds too, as any real
challenger has). Each run's configs are resolved from Params by the DAG's own code
(llmops.stages.lifecycle.resolve) and its stages run as the DAG's local jobs do (`python -m
tasks.<stage> --config --result`). Every challenger is judged against the same champion (the model
the gate promoted from the champion run: the student), on an evaluation that scores both on the same
data, as the DAG's evaluate does:

  paired gate        promotion.challenger + promotion.judge with the recipe's GateConfig
                     (held-out text per document, superior by GateConfig.margin at 95%; every
                     other item-level metric a guard)
  point-estimate     the gate as of commit a331722 with its defaults: thresholds, then each
  gate               candidate within champion_margins {task_accuracy: 0.02, bits_per_byte: 0.02}
                     of the champion's point estimates, the preferred passing one promoted

What is not the DAG: the sweep is skipped (pretraining takes the recipe's learning rate, the same
for every run, so only what the challenger changes differs), and nothing is registered: the
verdicts are computed from the evaluations. Reported per recipe and gate: promotions among the
seed challengers (false promotions) and the improved ones (power), and each challenger's change
in held-out bits per byte against the champion with its interval.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]

# What makes a challenger better, per recipe: more of its own training, "a few percent of loss,
# not a landslide" (measured: benchmarks/results/gate_noise.json, `improved` rows).
RECIPE_IMPROVEMENT: dict[str, dict[str, Any]] = {
    "tiny": {"pretrain_steps": 30, "distill_steps": 15},
    "demo": {"pretrain_steps": 900, "distill_steps": 5000},
}
SEED_STEP = 101   # challenger k adds k * SEED_STEP to each of the recipe's seeds
# The point-estimate gate's defaults at a331722 (tasks/configs/gate_config.py then).
OLD_MARGINS = {"task_accuracy": 0.02, "bits_per_byte": 0.02}


def _seeds(cfg: Any, k: int) -> dict[str, int]:
    return {"pretrain_seed": cfg.pretrain.seed + k * SEED_STEP,
            "finetune_seed": cfg.finetune.seed + k * SEED_STEP,
            "distill_seed": cfg.distill.seed + k * SEED_STEP}


def _job(stage: str, config: dict[str, Any], work: Path, env: dict[str, str]) -> dict[str, Any]:
    """One stage's job as the local backend runs it; its result. A job that already finished in
    `work` with this very config (a rerun with the same --work after an interruption) is read back,
    not run again: its seconds are from its files (config.json written at its start, result.json
    by the job at its end)."""
    work.mkdir(parents=True, exist_ok=True)
    config_file, result_file = work / "config.json", work / "result.json"
    if (result_file.exists() and config_file.exists()
            and json.loads(config_file.read_text()) == json.loads(json.dumps(config))):
        result = json.loads(result_file.read_text())
        result["seconds"] = result_file.stat().st_mtime - config_file.stat().st_mtime
        result["reused"] = True
        return result
    result_file.unlink(missing_ok=True)
    config_file.write_text(json.dumps(config))
    started = time.monotonic()
    with open(work / "output.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", f"tasks.{stage}", "--config",
                               str(work / "config.json"), "--result", str(work / "result.json")],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{stage} failed ({proc.returncode}); see {work / 'output.log'}")
    result = json.loads((work / "result.json").read_text())
    result["seconds"] = time.monotonic() - started
    return result


def _lifecycle(params: dict[str, Any], data_dir: str, out: Path, env: dict[str, str]
               ) -> dict[str, Any]:
    """pretrain -> finetune -> distill -> evaluate (teacher and student), configs resolved from
    Params by the DAG's code and filled in as llmops.stages.specs fills them."""
    from llmops.stages import lifecycle, specs
    from tasks import configs

    config = configs.to_dict(lifecycle.resolve(params))
    # no sweep: its best is the recipe's own rate (every run gets pretrain_lr anyway)
    best = {"params": {"optim.lr": config["pretrain"]["optim"]["lr"]}}
    pretrain = {**specs.pretrain_config(config, best), "data_dir": data_dir,
                "output_dir": str(out / "pretrain")}
    base = _job("pretrain", pretrain, out / "pretrain", env)
    teacher = _job("finetune", {**config["finetune"], "base_model": base["outputs"]["model_dir"],
                                "data_dir": data_dir, "output_dir": str(out / "finetune")},
                   out / "finetune", env)
    student = _job("distill", {**config["distill"], "teacher_model": teacher["outputs"]["model_dir"],
                               "data_dir": data_dir, "output_dir": str(out / "distill")},
                   out / "distill", env)
    models = {"teacher": teacher["outputs"]["model_dir"], "student": student["outputs"]["model_dir"]}
    evaluation = _job("evaluate", {**config["evaluate"], "models": models, "data_dir": data_dir,
                                   "output_dir": str(out / "evaluate")}, out / "evaluate", env)
    return {"params": params, "config": config, "evaluation": evaluation,
            "seconds": {s: r["seconds"] for s, r in (("pretrain", base), ("finetune", teacher),
                                                     ("distill", student), ("evaluate", evaluation))}}


def against(challenger: dict[str, Any], champion: dict[str, Any], name: str) -> dict[str, Any]:
    """The evaluation the gate would read: the challenger run's models beside the champion model
    `name` of the champion run, all scored on the same data by the same evaluation code."""
    ours, theirs = challenger["evaluation"], champion["evaluation"]
    metrics = {k: v for k, v in ours["metrics"].items() if k.split(".", 1)[0] in ("teacher", "student")}
    metrics.update({f"champion.{k.split('.', 1)[1]}": v for k, v in theirs["metrics"].items()
                    if k.startswith(f"{name}.")})
    return {"metrics": metrics, "contamination": ours.get("contamination") or {},
            "models": {**{n: ours["models"][n] for n in ("teacher", "student")},
                       "champion": theirs["models"][name]}}


def point_estimate_gate(gate: Any, evaluation: dict[str, Any]) -> dict[str, Any]:
    """The gate as it was (a331722): thresholds, then no worse than the champion's point
    estimates beyond OLD_MARGINS, the preferred passing candidate promoted."""
    from llmops.policy import promotion

    metrics = evaluation["metrics"]
    reasons = {}
    for name in ("student", "teacher"):
        why = promotion.threshold_reasons(gate, metrics, name)
        for metric, margin in OLD_MARGINS.items():
            ours, theirs = metrics.get(f"{name}.{metric}"), metrics.get(f"champion.{metric}")
            lower = metric == "bits_per_byte"
            if theirs is not None and ours is not None and (
                    (lower and ours > theirs + margin) or (not lower and ours < theirs - margin)):
                why.append(f"{metric} {ours:.4g} vs {theirs:.4g}")
        reasons[name] = why
    order = sorted(("teacher", "student"), key=lambda n: n != gate.prefer)
    passing = [n for n in order if not reasons[n]]
    return {"promoted": bool(passing), "candidate": passing[0] if passing else None,
            "reasons": reasons}


def paired_gate(gate: Any, evaluation: dict[str, Any]) -> dict[str, Any]:
    from llmops.policy import promotion

    reasons, comparisons = promotion.judge(gate, evaluation)
    chosen = promotion.challenger(gate, evaluation)
    primary = comparisons[chosen].get(gate.metrics[0])
    return {"promoted": not reasons[chosen], "candidate": chosen, "reasons": reasons[chosen],
            "primary": primary.to_dict() if primary else None}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per gate: promotions among the seed challengers (false) and the improved ones (power)."""
    summary = {}
    noise = [r for r in rows if r["kind"] == "seed"]
    better = [r for r in rows if r["kind"] == "improved"]
    for gate_name in ("paired", "point_estimate"):
        summary[gate_name] = {
            "false_promotions": sum(r[gate_name]["promoted"] for r in noise), "seed_challengers": len(noise),
            "false_promotion_rate": sum(r[gate_name]["promoted"] for r in noise) / max(len(noise), 1),
            "true_promotions": sum(r[gate_name]["promoted"] for r in better),
            "improved_challengers": len(better),
            "power": sum(r[gate_name]["promoted"] for r in better) / max(len(better), 1)}
    return summary


def bench_recipe(recipe: str, seeds: int, improved: int, work: Path, env: dict[str, str],
                 save: Any = None) -> dict[str, Any]:
    """One recipe's champion and challengers; `save(partial)` after each challenger, so an
    interrupted run keeps what it measured (marked complete: false)."""
    from llmops.stages import lifecycle
    from tasks import configs

    started = time.monotonic()
    base = lifecycle.resolve({"recipe": recipe})
    data_cfg = {**configs.to_dict(base.data), "output_dir": str(work / "data")}
    data = _job("data.prep", data_cfg, work / "data_job", env)
    data_dir = data["outputs"]["data_dir"]
    # the same learning rate for every run: what the sweep would pick is not what is compared
    common = {"recipe": recipe, "pretrain_lr": base.pretrain.optim.lr}
    print(f"[{recipe}] champion run", flush=True)
    champion = _lifecycle(common, data_dir, work / "champion", env)
    gate = base.gate
    first = promotion_of_first(gate, champion)
    # seed and improved challengers in turn: a run cut short still has some of each
    runs = sorted([("seed", k, {**common, **_seeds(base, k)}) for k in range(1, seeds + 1)]
                  + [("improved", k, {**common, **_seeds(base, 100 + k), **RECIPE_IMPROVEMENT[recipe]})
                     for k in range(1, improved + 1)], key=lambda run: (run[1], run[0] != "seed"))
    head = {"recipe": recipe, "gate": configs.to_dict(gate), "champion_model": first,
            "improvement": RECIPE_IMPROVEMENT[recipe], "seed_step": SEED_STEP,
            "champion_seconds": champion["seconds"],
            "champion_bits_per_byte": champion["evaluation"]["metrics"][f"{first}.bits_per_byte"]}
    rows = []
    for kind, k, params in runs:
        print(f"[{recipe}] {kind} challenger {k}: {params}", flush=True)
        run = _lifecycle(params, data_dir, work / f"{kind}-{k}", env)
        evaluation = against(run, champion, first)
        new, old = paired_gate(gate, evaluation), point_estimate_gate(gate, evaluation)
        primary = new["primary"] or {}
        rows.append({"kind": kind, "k": k, "params": params, "seconds": run["seconds"],
                     "paired": new, "point_estimate": old,
                     "student_bits_per_byte": run["evaluation"]["metrics"]["student.bits_per_byte"],
                     "teacher_bits_per_byte": run["evaluation"]["metrics"]["teacher.bits_per_byte"]})
        print(f"[{recipe}] {kind} {k}: change {primary.get('diff', float('nan')):+.2%} "
              f"[{primary.get('low', float('nan')):+.2%}, {primary.get('high', float('nan')):+.2%}] "
              f"MDE {primary.get('mde', float('nan')):.2%} | paired "
              f"{'PROMOTED' if new['promoted'] else 'kept champion'} | point estimate "
              f"{'PROMOTED ' + str(old['candidate']) if old['promoted'] else 'kept champion'}",
              flush=True)
        if save is not None and len(rows) < len(runs):
            save({**head, "rows": rows, "summary": summarize(rows), "complete": False,
                  "seconds": time.monotonic() - started})
    return {**head, "rows": rows, "summary": summarize(rows), "complete": True,
            "seconds": time.monotonic() - started}


def promotion_of_first(gate: Any, champion: dict[str, Any]) -> str:
    """The model the champion run's own gate promotes (no champion before it): the challenger."""
    from llmops.policy import promotion

    evaluation = champion["evaluation"]
    chosen = promotion.challenger(gate, evaluation)
    reasons, _ = promotion.judge(gate, evaluation)
    if reasons[chosen]:
        raise RuntimeError(f"the champion run's {chosen} does not pass the gate: {reasons[chosen]}")
    return chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["tiny", "demo"], choices=["tiny", "demo"])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--improved", type=int, default=5)
    parser.add_argument("--work", default="", help="Keep the runs here (default: a temp dir).")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/gate_noise.json"))
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="gate-noise-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
           "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}",
           "MLFLOW_EXPERIMENT_NAME": "gate_noise", "LLMOPS_HOME": str(work / "home")}
    os.environ.update({k: env[k] for k in ("MLFLOW_TRACKING_URI", "LLMOPS_HOME")})
    from benchmarks.pretrain_common import write_result

    results: list[dict[str, Any]] = []

    def save(partial: dict[str, Any]) -> None:   # after every challenger: a crash keeps what ran
        write_result({"benchmark": "gate_noise", "recipes": [*results, partial]}, Path(args.out))

    for recipe in args.recipes:
        results.append(bench_recipe(recipe, args.seeds, args.improved, work / recipe, env, save))
        write_result({"benchmark": "gate_noise", "recipes": results}, Path(args.out))
    print("\n| recipe | gate | seed challengers promoted (false) | improved promoted (power) |")
    print("| --- | --- | --- | --- |")
    for r in results:
        for name, label in (("paired", "paired (new)"), ("point_estimate", "point estimate (before)")):
            s = r["summary"][name]
            print(f"| {r['recipe']} | {label} | {s['false_promotions']} of {s['seed_challengers']} "
                  f"({s['false_promotion_rate']:.0%}) | {s['true_promotions']} of "
                  f"{s['improved_challengers']} ({s['power']:.0%}) |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
