"""Checkpoint cost as a user feels it: the wall time of the steps between two saves with no
save, with a synchronous save and with an asynchronous save; and how long each save blocks
training; per model size.

GPTs of --sizes (default ~5M, ~19M and ~85M parameters; with AdamW's two moments a checkpoint is
~12 bytes a parameter: 60 MB to 1 GB) train on one CPU thread. A segment is --steps-between
steps (a job saving every 4 steps, the default, saves far more often than any real one: the
worst case). A save segment starts with a save and ends when that save is committed:
synchronous, serialize, sha256, fsync, manifest and rename all block; asynchronous, training
waits only, at the first optimizer step, for the copy of the state to shared memory, which runs
beside that step's forward and backward passes, and the writer process writes the files while
the steps train, competing with them for the machine (caches, memory bandwidth, the kernel's
writeback): the blocked time alone hides that cost, the segment's wall time shows it.

Paired, adjacent segments: this machine's speed drifts by 10-15% over minutes (a no-save
20-step segment took 27.5-32.2 s across 9 rounds of the last design, which compared segments
minutes apart), more than the cost measured. So each cycle runs a no-save segment, an async
save segment, a settling segment (not the save's: what a save leaves behind falls on it, and
its slowdown is reported beside), a no-save segment, a sync save segment and another settling segment;
each save segment is compared with the no-save segment right before it, seconds apart. Reported
per mode: the mean of those per-cycle slowdowns with its standard error, the median and the
range, over --cycles cycles. Each mode keeps one Checkpointer for the whole run, as a job does:
its first save, untimed, lays out the buffers and starts the writer process (once per job).
The last line is one JSON object.

    python benchmarks/pretrain_checkpoint_stall.py [--sizes 5M 19M 85M] [--steps-between 4] [--cycles 20]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from pretrain_common import RESULTS, isolate, last_json_line, prepared_data, train_config

from tasks.configs import ModelConfig, to_dict

# GPT-2 small's shape (85M without its 50k-token embedding) and two smaller ones; a 512-token
# vocabulary and 64-token rows keep a step at seconds on one CPU thread
SIZES = {"5M": ModelConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=320),
         "19M": ModelConfig(vocab_size=512, block_size=64, n_layer=6, n_head=8, n_embd=512),
         "85M": ModelConfig(vocab_size=512, block_size=64, n_layer=12, n_head=12, n_embd=768)}
SAVE_MODES = ("async", "sync")  # each measured against its own no-save segments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--steps-between", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--modes", nargs="+", default=list(SAVE_MODES), choices=SAVE_MODES,
                        help="The save modes measured (each against its own no-save segments).")
    parser.add_argument("--out", type=Path, default=RESULTS / "pretrain_checkpoint_stall.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmops-bench-ckpt"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    isolate(args.work)
    data = prepared_data(args.work)
    per_size = {}
    for name in args.sizes:
        print(f"\n== {name}", flush=True)
        per_size[name] = measure(SIZES[name], data, args)
    print(f"\n{'':6}{'params':>8}{'mode':>6}{'ckpt MB':>9}{'no save s':>11}{'saved s':>9}"
          f"{'+ (mean +- 2 SE)':>20}{'next seg. +':>13}{'commit wait s':>15}{'blocked s':>11}")
    for name, r in per_size.items():
        for mode in args.modes:
            m = r[mode]
            print(f"{name:6}{r['params'] / 1e6:>7.1f}M{mode:>6}{m['checkpoint_mb']:>9.0f}"
                  f"{r['no_save']['segment_s']:>11.3f}{m['segment_s']:>9.3f}"
                  f"{m['slowdown_mean']:>10.2%} +- {2 * m['slowdown_standard_error']:.2%}"
                  f"{m['next_segment_slowdown_mean']:>13.2%}{m['commit_wait_median_s']:>15.3f}"
                  f"{m['blocked_median_s']:>11.3f}")
    last_json_line({"benchmark": "pretrain_checkpoint_stall", "design": "paired adjacent segments",
                    "steps_between": args.steps_between, "cycles": args.cycles, "modes": args.modes,
                    "sizes": per_size}, args.out)


def measure(model_cfg: ModelConfig, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One model size: args.cycles cycles of paired adjacent segments (module docstring)."""
    import torch

    from tasks.model.gpt import GPT
    from tasks.train.checkpoint import Checkpointer
    from tasks.train.prepared_data import DataDir, PretrainBatches
    from tasks.train.losses import cross_entropy
    from tasks.train.loop import build_optimizer
    from tasks.train.runtime import rng_state

    torch.set_num_threads(1)
    # Denormal floats (the AdamW moments decay towards them) make CPU arithmetic slower step by
    # step: a 5M model's step went 0.098 -> 0.123 s over 300 steps without this, and stayed at
    # 0.097-0.101 s with it (measured); a drift that size swamps what a save costs, and it would
    # fall unevenly on the modes. A GPU does not slow down on them.
    torch.set_flush_denormal(True)
    cfg = train_config(data, args.work / "run", model=to_dict(model_cfg), batch_size=4)
    model = GPT(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
    batches = PretrainBatches(DataDir(data).split("train"), cfg.batch_size, cfg.seed)
    step = 0

    def train_steps(n: int, saver: Checkpointer | None = None) -> tuple[float, float]:
        """Seconds per step, and the seconds the optimizer steps waited for a save's copy."""
        nonlocal step
        t0, waited = time.perf_counter(), 0.0
        for _ in range(n):
            loss = cross_entropy(model, batches(step))
            loss.backward()
            if saver is not None:  # as the training loop does (tasks/train/loop.py)
                waited += saver.wait_for_snapshot()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        return (time.perf_counter() - t0) / n, waited

    train_steps(2)  # optimizer state exists from here on: checkpoints have their full size

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "trainer": {"step": step, "rng": rng_state()}}

    # one saver per mode for the whole run, as a job has one: its first save (untimed) lays out
    # the snapshot buffers and, async, starts the writer process, once per job
    savers = {}
    for mode in ("sync", "async"):
        root = args.work / f"checkpoints-{mode}"
        shutil.rmtree(root, ignore_errors=True)
        savers[mode] = Checkpointer(root, keep=2, config={}, asynchronous=mode == "async")
        savers[mode].save(step, state())
        savers[mode].wait()
    time.sleep(3)  # the writer process has started (it imports torch) before any timing

    def segment(mode: str) -> dict:
        """--steps-between steps; with a save of `mode` first, committed before it ends."""
        saver = savers.get(mode)
        t_start = time.perf_counter()
        blocked = saver.save(step, state(), copy_in_background=True) if saver is not None else 0.0
        per_step, waited = train_steps(args.steps_between, saver)
        trained = time.perf_counter()
        if saver is not None:
            saver.wait()
        out = {"segment_s": time.perf_counter() - t_start, "step_s": per_step,
               "commit_wait_s": time.perf_counter() - trained}  # for a write the steps did not hide
        if saver is not None:  # blocked: in save() and until its copy let the step go on
            out.update(blocked_s=blocked + waited,
                       checkpoint_mb=sum(f.stat().st_size for f in saver.last.iterdir()) / 1e6)
        return out

    for _ in range(2):
        segment("none")  # warm: the first steps after setting up are slower
    pairs: dict[str, list[tuple[dict, dict]]] = {mode: [] for mode in args.modes}
    for cycle in range(args.cycles):
        for mode in args.modes:
            reference = segment("none")
            saved = segment(mode)
            # settling: not the save's segment, but reported, so that a cost it passes on shows
            saved["next_segment_s"] = segment("none")["segment_s"]
            pairs[mode].append((reference, saved))
        print(f"cycle {cycle + 1}: " + ", ".join(
            f"{mode} {pairs[mode][-1][1]['segment_s']:.3f} s (commit wait {pairs[mode][-1][1]['commit_wait_s']:.3f}) "
            f"against {pairs[mode][-1][0]['segment_s']:.3f}" for mode in args.modes), flush=True)
    shutil.rmtree(args.work / "checkpoints-sync", ignore_errors=True)
    shutil.rmtree(args.work / "checkpoints-async", ignore_errors=True)
    references = [ref for mode in pairs for ref, _ in pairs[mode]]
    results: dict[str, Any] = {"no_save": {"segment_s": statistics.median(r["segment_s"] for r in references),
                                           "step_s": statistics.median(r["step_s"] for r in references)}}
    for mode, runs in pairs.items():
        slowdowns = [saved["segment_s"] / ref["segment_s"] - 1 for ref, saved in runs]
        results[mode] = {
            "segment_s": statistics.median(saved["segment_s"] for _, saved in runs),
            "step_s": statistics.median(saved["step_s"] for _, saved in runs),
            "slowdown_mean": statistics.mean(slowdowns),
            "slowdown_standard_error": statistics.stdev(slowdowns) / len(slowdowns) ** 0.5,
            "slowdown_median": statistics.median(slowdowns),
            "slowdown_range": [min(slowdowns), max(slowdowns)],
            "next_segment_slowdown_mean": statistics.mean(saved["next_segment_s"] / ref["segment_s"] - 1
                                                          for ref, saved in runs),
            "blocked_median_s": statistics.median(saved["blocked_s"] for _, saved in runs),
            "commit_wait_median_s": statistics.median(saved["commit_wait_s"] for _, saved in runs),
            "checkpoint_mb": runs[-1][1]["checkpoint_mb"],
            "pairs": [{"no_save_s": ref["segment_s"], "saved_s": saved["segment_s"],
                       "blocked_s": saved["blocked_s"], "commit_wait_s": saved["commit_wait_s"],
                       "next_segment_s": saved["next_segment_s"]}
                      for ref, saved in runs]}
    out = {"params": model.num_params(), "model": to_dict(model_cfg), **results}
    if "sync" in results and "async" in results:
        out["blocked_ratio_sync_over_async"] = \
            results["sync"]["blocked_median_s"] / max(results["async"]["blocked_median_s"], 1e-9)
    return out


if __name__ == "__main__":
    main()
