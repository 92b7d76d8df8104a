"""The scaling ladder's fit: its rungs' final losses in, the law and a recommended size out.

    python -m tasks.ladder --config CONFIG.json --result RESULT.json   (a LadderFitConfig)

Fits L(N, D) = E + A/N^alpha + B/D^beta to every rung but the `held_out` ones of largest compute
(tasks/scaling/law.py), reports the fit's relative error on those, and the compute-optimal N and D
for `target_flops` with a runnable model shape of the ladder's family. Writes fit.json to
output_dir and logs it, the constants and a plot (loss against tokens per size, with the fitted
curves and the held-out points; the compute-optimal frontier) to the job's MLflow run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tasks.common.entry import run_stage
from tasks.common.io import write_json
from tasks.configs import LadderFitConfig

log = logging.getLogger("tasks.ladder")


def fit_ladder(cfg: LadderFitConfig) -> dict[str, Any]:
    """The fit and the recommendation as plain JSON (no MLflow, no files)."""
    from tasks.scaling.rungs import recommend, split_held_out
    from tasks.scaling.law import fit

    points = [p for p in cfg.points if p["loss"] == p["loss"]]  # NaN: a rung that reported none
    train, held = split_held_out(points, cfg.ladder.held_out)
    if len(train) < 5:
        raise ValueError(f"{len(train)} finished rungs to fit (of {len(cfg.points)}, {len(held)} held "
                         "out): the law has 5 constants. Check the failed rungs' logs, or add rungs.")
    law = fit([p["n_params"] for p in train], [p["tokens"] for p in train],
              [p["loss"] for p in train], delta=cfg.ladder.huber_delta)
    errors = [{**p, "predicted": float(law.loss(p["n_params"], p["tokens"])),
               "relative_error": abs(float(law.loss(p["n_params"], p["tokens"])) - p["loss"]) / p["loss"]}
              for p in held]
    n_opt, d_opt = law.compute_optimal(cfg.ladder.target_flops)
    return {
        "law": law.as_dict(),
        "warnings": fit_warnings(law, train),
        "train_points": train,
        "held_out": errors,
        "held_out_relative_error": max((e["relative_error"] for e in errors), default=None),
        "fit_rms_log_error": _rms_log_error(law, train),
        "target_flops": cfg.ladder.target_flops,
        "compute_optimal": {"n_params": n_opt, "tokens": d_opt, "tokens_per_param": d_opt / n_opt},
        "recommendation": {**recommend(n_opt, d_opt, cfg.model, cfg.tokens_per_step),
                           "target_flops": cfg.ladder.target_flops},
    }


def fit_warnings(law, points: list[dict]) -> list[str]:
    """What makes a fit untrustworthy, in words: exponents far outside what language models
    show (0.05-1.5), or an irreducible loss that is no floor."""
    out = []
    sizes, tokens = {p["n_params"] for p in points}, {p["tokens"] for p in points}
    for name, value, varied in (("alpha", law.alpha, sizes), ("beta", law.beta, tokens)):
        if not 0.05 <= value <= 1.5:
            out.append(f"{name} = {value:.3g} is outside 0.05-1.5: the ladder has {len(varied)} "
                       f"distinct {'sizes' if name == 'alpha' else 'token counts'}; add rungs that "
                       "vary it more (or longer ones) before trusting the recommendation.")
    if law.E < 0.1 * min(p["loss"] for p in points):
        out.append(f"E = {law.E:.3g} is far below every loss: the data does not pin the floor down.")
    return out


def _rms_log_error(law, points: list[dict]) -> float:
    import math

    sq = [(math.log(float(law.loss(p["n_params"], p["tokens"]))) - math.log(p["loss"])) ** 2
          for p in points]
    return math.sqrt(sum(sq) / len(sq))


def plot(report: dict[str, Any]):
    """Left: loss against tokens, one colour per model size, fitted curves through the points
    (held-out points hollow). Right: the compute-optimal N and D against the FLOP budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from tasks.scaling.law import Law

    law = Law(**report["law"])
    points = report["train_points"] + report["held_out"]
    sizes = sorted({p["n_params"] for p in points})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(sizes)))
    d_all = [p["tokens"] for p in points]
    d_grid = np.geomspace(min(d_all) / 1.5, max(d_all) * 1.5, 100)
    held_keys = {(p["n_params"], p["tokens"]) for p in report["held_out"]}
    for n, color in zip(sizes, colors):
        left.plot(d_grid, law.loss(n, d_grid), color=color, lw=1, label=f"N={n:.3g}")
        for p in (p for p in points if p["n_params"] == n):
            held = (p["n_params"], p["tokens"]) in held_keys
            left.scatter(p["tokens"], p["loss"], color=color, s=36, zorder=3,
                         facecolors="none" if held else color)
    left.set(xscale="log", xlabel="training tokens D", ylabel="final validation loss",
             title=f"L = {law.E:.3g} + {law.A:.3g}/N^{law.alpha:.3f} + {law.B:.3g}/D^{law.beta:.3f}")
    left.legend(fontsize=7)
    left.grid(alpha=0.3, which="both")
    target = report["target_flops"]
    c_grid = np.geomspace(target / 1e4, target * 1e2, 100)
    opt = np.array([law.compute_optimal(c) for c in c_grid])
    right.plot(c_grid, opt[:, 0], label="N_opt (parameters)")
    right.plot(c_grid, opt[:, 1], label="D_opt (tokens)")
    right.axvline(target, color="grey", ls="--", lw=1, label=f"C = {target:.3g} FLOPs")
    right.set(xscale="log", yscale="log", xlabel="compute C = 6ND (FLOPs)",
              title="compute-optimal split")
    right.legend(fontsize=7)
    right.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def main(cfg: LadderFitConfig) -> dict[str, Any]:
    import mlflow

    from tasks.common.job_tracking import log_figure, log_json_artifact, stage_run

    with stage_run("ladder", cfg) as run:
        report = fit_ladder(cfg)
        law, rec = report["law"], report["recommendation"]
        log.info("fit on %d rungs: %s; held-out relative error %s", len(report["train_points"]),
                 ", ".join(f"{k}={v:.4g}" for k, v in law.items()), report["held_out_relative_error"])
        log.info("compute-optimal at C=%.3g: N=%.4g D=%.4g (%.1f tokens/parameter); runnable: %s",
                 report["target_flops"], report["compute_optimal"]["n_params"],
                 report["compute_optimal"]["tokens"], report["compute_optimal"]["tokens_per_param"], rec)
        metrics = {f"law.{k}": v for k, v in law.items() if k != "points"}
        metrics.update({"fit_rms_log_error": report["fit_rms_log_error"],
                        "n_opt": report["compute_optimal"]["n_params"],
                        "d_opt": report["compute_optimal"]["tokens"],
                        "tokens_per_param_opt": report["compute_optimal"]["tokens_per_param"]})
        if report["held_out_relative_error"] is not None:
            metrics["held_out_relative_error"] = report["held_out_relative_error"]
        mlflow.log_metrics(metrics)
        for warning in report["warnings"]:
            log.warning("fit: %s", warning)
        mlflow.set_tag("fit_warnings", " | ".join(report["warnings"])[:5000] or "none")
        os.makedirs(cfg.output_dir, exist_ok=True)
        path = os.path.join(cfg.output_dir, "fit.json")
        write_json(path, report)
        log_json_artifact(report, "fit.json")
        log_figure(plot(report), "scaling_law.png")
        return {"metrics": metrics, "fit": report, "outputs": {"fit": path},
                "mlflow_run_id": run.info.run_id}


if __name__ == "__main__":
    run_stage("ladder", LadderFitConfig, main)
