"""Spike guard: false alarms on healthy runs and detection of injected spikes (issues 12, 23).

    python benchmarks/spike_guard.py [--seeds 8] [--held-out-seeds 8] [--steps 400]
        [--work /tmp/spike_guard_bench] [--out benchmarks/results/spike_guard.json]

Clean runs: 2 models (the tiny recipe's, and a wider, deeper one) x seeds x dropout 0 / 0.1 x lr
1x / 2x the recipe's, trained in this process through tasks.train.loop.train (no MLflow, no
subprocess) with the new guard at the aggressive settings (window 30, sigma 6). Each run records
its per-step (loss, pre-clip grad norm); the recorded sequences are then replayed through
  - old: the detector before issue 12 (mean + k*std over the window, pre-clip grad norm), kept
    here verbatim for the comparison,
  - mad_only: the new guard's median + k*MAD rule on the loss without its min_ratio floor,
  - ratio_1.5: the new guard with min_ratio 1.5 (what a x2 spike needs to be seen),
  - new: tasks.train.guard.SpikeGuard as the loop builds it (min_ratio 3),
each at the aggressive settings and at the defaults (window 100, sigma 6). A replay counts the
steps a detector would reject (a rejected step stays out of its window, as in the loop).

Calibration and held-out seeds (issue 23). The guard's settings (min_ratio 3 above the 2.2x
healthy spikes) were chosen on the clean runs of seeds 0..N-1 (--seeds, 8: 64 runs). Seeds
N..N+H-1 (--held-out-seeds, 8: another 64 runs) are trained and replayed the same way but were
never looked at when choosing; every false-alarm, detection and excursion figure is reported
separately for the two sets (keys ending in _calibration and _held_out). The calibration keys
are what the keys without a suffix measured before (seeds 0..7).

Detection: the same replays with step N's loss and pre-clip grad norm multiplied by F (a loss
x F has gradients x F), F in 2, 5, 20, 100, N in 100, 200, 300: caught means the detector fires
at step N. One replay per run and detector serves every (N, F): the detectors' check() does not
change their state, so step N's spiked value is checked against the window of the clean steps
before it, and the clean step then goes on as recorded (what a replay cut at N would give). At
the aggressive and at the default settings, on both sets. Steps count from 1 (the loop checks
optimizer step `done`), and a detector checks nothing until its window holds `window` accepted
steps (and, for the new guard, until the lr warm-up is over): SpikeGuard.check() and the old
detector return None then, the step is accepted and enters the window. At window 100 a spike at
step 100 comes with 99 steps in the window, so no detector catches it: it is a miss, counted in
the rates (the table by step shows it apart); in the loop the guard would train on it.

Then real loop runs with `spike@N*F` injected (tasks/train/faults.py) and the new guard at the
aggressive settings, calibration seeds 0 and 1: caught, rollbacks and skipped batches (only the
spike's batch should be skipped); and 3 or 4 spikes on consecutive steps (the weights, not a
batch: lr halved twice, then a failure).

Writes --out (benchmarks/results/spike_guard.json) with the machine (commit and load at start
and end, torch version) and the wall time. Runs on one torch thread.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]

from benchmarks.pretrain_common import machine  # noqa: E402 - at start: the load then

import torch  # noqa: E402

from tasks.configs import ModelConfig, TrainConfig, from_dict, tiny, to_dict  # noqa: E402
from tasks.train.guard import SpikeGuard, UnrecoverableAnomaly  # noqa: E402

AGGRESSIVE = {"window": 30, "sigma": 6.0}
DEFAULT = {"window": 100, "sigma": 6.0}
SIZES = (2.0, 5.0, 20.0, 100.0)
SPIKE_STEPS = (100, 200, 300)


class OldSpikeDetector:
    """The detector before issue 12 (tasks/train/guard.py at 432ea6f), for the comparison."""

    def __init__(self, sigma: float, window: int) -> None:
        self.sigma, self.window = sigma, window
        self.history: deque[tuple[int, float, float]] = deque(maxlen=window)

    def check(self, step: int, loss: float, grad_norm: float) -> str | None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "nan"
        if self.sigma <= 0 or len(self.history) < self.window:
            return None
        for kind, index, value in (("loss_spike", 1, loss), ("grad_spike", 2, grad_norm)):
            values = [h[index] for h in self.history]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            if value > mean + self.sigma * max(std, 0.01 * abs(mean)):
                return kind
        return None

    def add(self, step: int, loss: float, grad_norm: float) -> None:
        self.history.append((step, loss, grad_norm))


class RecordingGuard(SpikeGuard):
    """The loop's guard, also keeping every accepted step's loss and pre-clip grad norm."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trace: dict[int, tuple[float, float]] = {}

    def add(self, step: int, loss: float, grad_norm: float) -> None:
        super().add(step, loss, grad_norm)
        self.trace[step] = (loss, grad_norm)  # a replayed step overwrites its earlier try


def models() -> dict[str, ModelConfig]:
    base = tiny().pretrain.model
    wide = from_dict(ModelConfig, {**to_dict(base), "n_layer": 2, "n_embd": 64, "n_head": 4})
    return {"tiny": base, "tiny_wide": wide}


def prepared_data(work: Path) -> Path:
    out = work / "data"
    if not (out / "manifest.json").exists():
        from tasks.data.prep import prepare

        cfg = tiny().data
        cfg.output_dir, cfg.engine = str(out), "local"
        prepare(cfg)
    return out


def loop_run(data_dir: Path, out: Path, *, model: ModelConfig, seed: int, dropout: float,
             lr_factor: float, steps: int, faults: str = "") -> dict[str, Any]:
    """One in-process training run with the new guard at the aggressive settings."""
    from tasks.model.gpt import GPT
    from tasks.train.prepared_data import DataDir, PretrainBatches
    from tasks.train.faults import FaultInjector, parse_faults
    from tasks.train.losses import cross_entropy
    from tasks.train.loop import LoopOptions, train
    from tasks.train.scoring import shard_loss
    from tasks.train.runtime import seed_everything

    shutil.rmtree(out, ignore_errors=True)
    recipe = tiny().pretrain
    cfg = from_dict(TrainConfig, {
        **to_dict(recipe), "data_dir": str(data_dir), "output_dir": str(out), "seed": seed,
        "max_steps": steps, "checkpoint_interval": 50, "keep_checkpoints": 3,
        "eval_interval": steps, "log_interval": steps, "async_checkpoint": False,
        "spike_window": AGGRESSIVE["window"], "spike_sigma": AGGRESSIVE["sigma"],
        "max_rollbacks": 20, "model": {**to_dict(model), "dropout": dropout},
        "optim": {**to_dict(recipe.optim), "lr": recipe.optim.lr * lr_factor}})
    guard = RecordingGuard(sigma=cfg.spike_sigma, window=cfg.spike_window,
                           min_ratio=cfg.spike_min_ratio, warmup_steps=cfg.optim.warmup_steps,
                           max_rollbacks=cfg.max_rollbacks)
    data = DataDir(data_dir)
    val = data.split("val")
    seed_everything(seed)
    (out / "resilience").mkdir(parents=True)
    skipped_file = out / "resilience" / "skipped_batches.json"
    t0 = time.perf_counter()
    failure = None
    try:
        result = train(
        model=GPT(cfg.model), cfg=cfg, device=torch.device("cpu"), resolved_config=to_dict(cfg),
            get_batch=PretrainBatches(data.split("train"), cfg.batch_size, seed),
            loss_fn=cross_entropy, tracking=False,
            evaluate=lambda m: {"val_loss": shard_loss(m, val, 8, 2, torch.device("cpu"))},
            options=LoopOptions(spike_sigma=cfg.spike_sigma, spike_window=cfg.spike_window,
                                max_rollbacks=cfg.max_rollbacks, skipped_file=skipped_file,
                                guard=guard, faults=FaultInjector(parse_faults(faults), 0, None)
                                if faults else None))
        val_loss = result.val["val_loss"]
    except UnrecoverableAnomaly as exc:  # the guard gave up: an outcome to report, not a crash
        failure, val_loss = str(exc), math.nan
    records = json.loads(skipped_file.read_text())["records"] if skipped_file.exists() else []
    shutil.rmtree(out, ignore_errors=True)
    return {"trace": [(s, *guard.trace[s]) for s in sorted(guard.trace)],
            "rollbacks": guard.rollbacks, "skipped": len({b for r in records for b in r["batches"]}),
            "anomaly_steps": [r["step"] for r in records], "val_loss": val_loss, "failure": failure,
            "seconds": time.perf_counter() - t0, "warmup_steps": cfg.optim.warmup_steps}


DETECTORS = ("old", "mad_only", "ratio_1.5", "new")


def detector(name: str, settings: dict[str, float], run: dict[str, Any]) -> Any:
    if name == "old":
        return OldSpikeDetector(settings["sigma"], int(settings["window"]))
    ratio = {"mad_only": {"min_ratio": 1.0}, "ratio_1.5": {"min_ratio": 1.5}, "new": {}}[name]
    return SpikeGuard(sigma=settings["sigma"], window=int(settings["window"]),
                      warmup_steps=run["warmup_steps"], **ratio)


def replay(det: Any, trace: list[tuple[int, float, float]], spike: tuple[int, float] | None = None,
           until: int | None = None) -> list[int]:
    """The steps `det` rejects on a recorded sequence (optionally step N's values x F)."""
    fired = []
    for step, loss, norm in trace:
        if until is not None and step > until:
            break
        if spike is not None and step == spike[0]:
            loss, norm = loss * spike[1], norm * spike[1]
        if det.check(step, loss, norm):
            fired.append(step)
            continue
        det.add(step, loss, norm)
    return fired


def replay_with_spikes(det: Any, trace: list[tuple[int, float, float]], spike_steps: tuple[int, ...],
                       sizes: tuple[float, ...]) -> tuple[list[int], dict[tuple[int, float], bool]]:
    """The steps `det` rejects on the clean sequence, and for every (N, F) whether step N x F
    would be rejected: the same as replay(det, trace, (N, F), until=N) for each, in one pass
    (check() does not change the detector)."""
    fired, caught = [], {}
    for step, loss, norm in trace:
        if step in spike_steps:
            for size in sizes:
                caught[(step, size)] = bool(det.check(step, loss * size, norm * size))
        if det.check(step, loss, norm):
            fired.append(step)
            continue
        det.add(step, loss, norm)
    return fired, caught


def false_alarm_row(runs: list[dict[str, Any]], fired: list[list[int]]) -> dict[str, Any]:
    return {"runs": len(runs), "runs_with_alarms": sum(bool(f) for f in fired),
            "alarms": sum(map(len, fired)), "steps": sum(len(r["trace"]) for r in runs),
            "run_rate": sum(bool(f) for f in fired) / len(runs) if runs else math.nan,
            "first_alarm_steps": sorted(f[0] for f in fired if f)}


SETS = ("calibration", "held_out")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=8,
                        help="calibration seeds 0..N-1: the runs the guard's settings were chosen on")
    parser.add_argument("--held-out-seeds", type=int, default=8,
                        help="held-out seeds N..N+H-1: runs never looked at when choosing them")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--work", type=Path, default=Path("/tmp/spike_guard_bench"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "spike_guard.json")
    parser.add_argument("--spike-steps", default=",".join(map(str, SPIKE_STEPS)),
                        help="the steps N spiked (a short smoke run needs smaller ones)")
    parser.add_argument("--check-replay", action="store_true",
                        help="also check the one-pass detection replay against one replay per spike")
    args = parser.parse_args()
    spike_steps = tuple(int(n) for n in args.spike_steps.split(","))
    if max(spike_steps) > args.steps:
        parser.error(f"--spike-steps {args.spike_steps} past --steps {args.steps}")
    torch.set_num_threads(1)
    import logging

    logging.disable(logging.WARNING)  # the loop logs every checkpoint
    t_start = time.time()
    data_dir = prepared_data(args.work)
    seeds = {"calibration": list(range(args.seeds)),
             "held_out": list(range(args.seeds, args.seeds + args.held_out_seeds))}

    clean: dict[str, list[dict[str, Any]]] = {name: [] for name in SETS}
    for set_name in SETS:
        for model_name, model in models().items():
            for seed in seeds[set_name]:
                for dropout in (0.0, 0.1):
                    for lr_factor in (1.0, 2.0):
                        run = loop_run(data_dir, args.work / "run", model=model, seed=seed,
                                       dropout=dropout, lr_factor=lr_factor, steps=args.steps)
                        run.update(set=set_name, model=model_name, seed=seed, dropout=dropout,
                                   lr_factor=lr_factor)
                        clean[set_name].append(run)
                        print(f"clean ({set_name}) {model_name} seed {seed} dropout {dropout} "
                              f"lr x{lr_factor:g}: {run['rollbacks']} rollbacks, {run['skipped']} "
                              f"skipped ({run['seconds']:.1f}s)", flush=True)

    # every clean sequence through every detector at both settings, with the spikes checked on
    # the way: false alarms and detection by replay
    false_alarms: dict[str, dict[str, Any]] = {name: {} for name in SETS}
    detection: dict[tuple[str, str], dict[str, Any]] = {}
    for set_name in SETS:
        runs = clean[set_name]
        for settings_name, settings in (("aggressive", AGGRESSIVE), ("default", DEFAULT)):
            table = detection[(settings_name, set_name)] = {}
            for det_name in DETECTORS:
                results = [replay_with_spikes(detector(det_name, settings, r), r["trace"],
                                              spike_steps, SIZES) for r in runs]
                false_alarms[set_name][f"{det_name}/{settings_name}"] = false_alarm_row(
                    runs, [fired for fired, _ in results])
                for size in SIZES:
                    by_step = {f"step {n}": sum(c[(n, size)] for _, c in results) for n in spike_steps}
                    caught = sum(by_step.values())
                    total = len(runs) * len(spike_steps)
                    table[f"{det_name}/x{size:g}"] = {
                        "spikes": total, "caught": caught, "rate": caught / total if total else math.nan,
                        "caught_by_step": by_step, "spikes_per_step": len(runs)}
                if args.check_replay:  # the one pass agrees with a replay cut at each spike
                    for r, (_, caught) in zip(runs, results):
                        for (n, size), hit in caught.items():
                            fired = replay(detector(det_name, settings, r), r["trace"], (n, size), until=n)
                            assert hit == (n in fired), (det_name, settings_name, n, size)

    # how far above the window's median healthy steps go (after the lr warm-up): what a spike
    # of size F has to stand out of
    excursions: dict[str, dict[str, dict[str, float]]] = {name: {} for name in SETS}
    for set_name in SETS:
        for r in clean[set_name]:
            key = f"{r['model']}/lr x{r['lr_factor']:g}"
            row = excursions[set_name].setdefault(key, {"loss_max_ratio": 0.0, "grad_norm_max_ratio": 0.0})
            for index, name in ((1, "loss_max_ratio"), (2, "grad_norm_max_ratio")):
                values = [t[index] for t in r["trace"]]
                w = AGGRESSIVE["window"]
                ratios = [values[i] / statistics.median(values[i - w:i]) for i in range(w, len(values))
                          if r["trace"][i][0] > r["warmup_steps"]]
                row[name] = max([row[name], *ratios])

    # real loop runs with injected spikes: the tiny recipe, dropout 0.1
    injected = []
    for size in SIZES:
        for n in spike_steps:
            for seed in range(2):
                run = loop_run(data_dir, args.work / "run", model=models()["tiny"], seed=seed,
                               dropout=0.1, lr_factor=1.0, steps=args.steps,
                               faults=f"spike@{n}*{size:g}")
                row = {"size": size, "step": n, "seed": seed, "caught": n in run["anomaly_steps"],
                       "rollbacks": run["rollbacks"], "skipped": run["skipped"],
                       "anomaly_steps": run["anomaly_steps"], "val_loss": run["val_loss"]}
                injected.append(row)
                print(f"spike x{size:g} at {n} seed {seed}: caught {row['caught']}, "
                      f"{row['rollbacks']} rollbacks, {row['skipped']} skipped", flush=True)

    # an incident: spikes on consecutive steps, as when the weights (not a batch) are the problem
    incidents = []
    for count in (3, 4):
        spec = ",".join(f"spike@{150 + i}" for i in range(count))
        run = loop_run(data_dir, args.work / "run", model=models()["tiny"], seed=0, dropout=0.1,
                       lr_factor=1.0, steps=args.steps, faults=spec)
        incidents.append({"faults": spec, "rollbacks": run["rollbacks"], "skipped": run["skipped"],
                          "anomaly_steps": run["anomaly_steps"], "failure": run["failure"]})
        print(f"{spec}: {run['rollbacks']} rollbacks, {run['skipped']} skipped, "
              f"{'failed: ' + run['failure'] if run['failure'] else 'finished'}", flush=True)

    loop_clean = {name: {"runs": len(clean[name]), "rollbacks": sum(r["rollbacks"] for r in clean[name]),
                         "skipped_batches": sum(r["skipped"] for r in clean[name]),
                         "runs_with_rollbacks": sum(r["rollbacks"] > 0 for r in clean[name])}
                  for name in SETS}
    by_size = {}
    for size in SIZES:
        rows = [r for r in injected if r["size"] == size]
        by_size[f"x{size:g}"] = {
            "runs": len(rows), "caught": sum(r["caught"] for r in rows),
            "only_its_batch_skipped": sum(r["caught"] and r["rollbacks"] == 1 and r["skipped"] == 1
                                          for r in rows),
            "other_rollbacks": sum(r["rollbacks"] - r["caught"] for r in rows)}
    # the headline: runs with false alarms, calibration vs held-out, per detector and settings
    summary = {key: {name: f"{false_alarms[name][key]['runs_with_alarms']} of "
                           f"{false_alarms[name][key]['runs']} runs, {false_alarms[name][key]['alarms']} alarms"
                     for name in SETS}
               for key in false_alarms["calibration"]}

    print(f"\nfalse alarms on clean runs x {args.steps} steps (replayed): calibration seeds "
          f"{seeds['calibration']}, held-out seeds {seeds['held_out']}")
    print(f"{'detector/settings':24} {'calibration runs / alarms':>26} {'held-out runs / alarms':>24}")
    for key in false_alarms["calibration"]:
        c, h = false_alarms["calibration"][key], false_alarms["held_out"][key]
        print(f"{key:24} {c['runs_with_alarms']:>8} / {c['runs']:<4} {c['alarms']:>8} "
              f"{h['runs_with_alarms']:>8} / {h['runs']:<4} {h['alarms']:>8}")
    for name in SETS:
        v = loop_clean[name]
        print(f"new guard in the loop (aggressive), {name}: {v['rollbacks']} rollbacks, "
              f"{v['skipped_batches']} skipped batches over {v['runs']} runs")
    for (settings_name, set_name), table in detection.items():
        print(f"\ndetection rate (replayed, {settings_name} settings, {set_name} runs)")
        for key, v in table.items():
            steps = ", ".join(f"{k} {c}/{v['spikes_per_step']}" for k, c in v["caught_by_step"].items())
            print(f"{key:14} {v['caught']:>4} / {v['spikes']:<4} {v['rate']:.1%}  ({steps})")
    print("\ninjected spikes in the loop (new guard, aggressive)")
    for key, v in by_size.items():
        print(f"{key:6} caught {v['caught']}/{v['runs']}, only its batch skipped "
              f"{v['only_its_batch_skipped']}/{v['runs']}, other rollbacks {v['other_rollbacks']}")
    print(f"\nclean runs, the largest step / median of the {AGGRESSIVE['window']} steps before it")
    for set_name in SETS:
        for key, row in excursions[set_name].items():
            print(f"{set_name:12} {key:18} loss {row['loss_max_ratio']:.3f}x  pre-clip grad norm "
                  f"{row['grad_norm_max_ratio']:.1f}x")

    result = {
        "machine": {**machine(), "torch_threads": torch.get_num_threads()},  # commit, load at both ends
        "torch": torch.__version__,
        "settings": {"steps": args.steps, "seeds": args.seeds, "held_out_seeds": args.held_out_seeds,
                     "calibration_seed_list": seeds["calibration"],
                     "held_out_seed_list": seeds["held_out"],
                     "sets": "calibration: the seeds the guard's settings (min_ratio 3) were chosen "
                             "on; held_out: seeds never looked at when choosing them",
                     "models": {k: to_dict(v) for k, v in models().items()},
                     "dropout": [0.0, 0.1], "lr_factors": [1.0, 2.0], "recipe_lr": tiny().pretrain.optim.lr,
                     "aggressive": AGGRESSIVE, "default": DEFAULT, "spike_sizes": SIZES,
                     "spike_steps": spike_steps,
                     "spike_before_full_window": "not checked: the detectors check nothing until "
                     "`window` accepted steps are in their window (steps count from 1), so at "
                     "window 100 a spike at step 100 is accepted, enters the window and counts "
                     "as missed"},
        "false_alarms_summary": summary,
        "false_alarms_replayed_calibration": false_alarms["calibration"],
        "false_alarms_replayed_held_out": false_alarms["held_out"],
        "false_alarms_loop_new_aggressive_calibration": loop_clean["calibration"],
        "false_alarms_loop_new_aggressive_held_out": loop_clean["held_out"],
        **{f"detection_replayed_{settings_name}_{set_name}": table
           for (settings_name, set_name), table in detection.items()},
        "injected_loop_new_aggressive": {"by_size": by_size, "runs": injected},
        "consecutive_spikes_loop_new_aggressive": incidents,
        "clean_max_over_window_median_calibration": excursions["calibration"],
        "clean_max_over_window_median_held_out": excursions["held_out"],
        "clean_runs": [{k: v for k, v in r.items() if k != "trace"} for name in SETS for r in clean[name]],
        "wall_s": time.time() - t_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"\n{time.time() - t_start:.0f}s; wrote {args.out}")


if __name__ == "__main__":
    main()
