"""Checkpoint cost as a user feels it: a training segment's wall time with no save, with
synchronous saves and with asynchronous saves; and how long each save blocks training; per model
size.

GPTs of --sizes (default ~5M, ~19M and ~85M parameters; with AdamW's two moments a checkpoint is
~12 bytes a parameter: 60 MB to 1 GB) train on one CPU thread. A segment is --saves x
--steps-between steps; with saves, the loop's Checkpointer saves before each group of steps (and
the segment ends when the last save is committed). Synchronous: serialize, sha256, fsync,
manifest and rename all block. Asynchronous: training waits only for the previous save (if still
in flight; at most one) and, at the next optimizer step, for the copy of the state to shared
memory, which runs beside that step's forward and backward passes; the writer process writes the
files while the next steps train, and competes with them for the machine (caches,
memory bandwidth, the kernel's writeback): the blocked time alone hides that cost, the
segment's wall time shows it. Each mode keeps one Checkpointer for the whole run, as a job does:
its first save, untimed, lays out the buffers and starts the writer process (once per job). Per
size, the three modes run in --rounds rounds, each in another order (a burst of load on a shared
machine falls on all of them); medians are reported, and each round's async and sync segments
against the same round's no-save segment (the paired median and range). The last line is one
JSON object.

    python benchmarks/pretrain_checkpoint_stall.py [--sizes 5M 19M 85M] [--saves 5] [--steps-between 4] [--rounds 3]
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
MODES = ("none", "sync", "async")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--steps-between", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
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
    print(f"\n{'':10}{'params':>8}{'ckpt MB':>9}{'no save s':>11}{'sync s':>9}{'async s':>9}"
          f"{'sync +':>9}{'async +':>9}{'async + paired':>16}{'blocked sync/async s':>24}")
    for name, r in per_size.items():
        n, s, a = r["no_save"], r["sync"], r["async"]
        print(f"{name:10}{r['params'] / 1e6:>7.1f}M{a['checkpoint_mb']:>9.0f}{n['segment_s']:>11.2f}"
              f"{s['segment_s']:>9.2f}{a['segment_s']:>9.2f}"
              f"{s['segment_slowdown_vs_no_save']:>9.1%}{a['segment_slowdown_vs_no_save']:>9.1%}"
              f"{a['segment_slowdown_paired_median']:>16.1%}"
              f"{s['blocked_median_s']:>16.3f} / {a['blocked_median_s']:.3f}")
    last_json_line({"benchmark": "pretrain_checkpoint_stall", "saves": args.saves,
                    "steps_between": args.steps_between, "rounds": args.rounds,
                    "sizes": per_size}, args.out)


def measure(model_cfg: ModelConfig, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One model size: the three modes in args.rounds rotated rounds; medians and each round."""
    import torch

    from tasks.model import GPT
    from tasks.train.checkpoint import Checkpointer
    from tasks.train.data import DataDir, PretrainBatches
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
        saver = savers.get(mode)
        blocked, step_s = [], []
        t_start = time.perf_counter()
        for _ in range(args.saves):
            if saver is not None:
                blocked.append(saver.save(step, state(), copy_in_background=True))
            per_step, waited = train_steps(args.steps_between, saver)
            step_s.append(per_step)
            if saver is not None:  # blocked: in save() and until its copy let the step go on
                blocked[-1] += waited
        trained = time.perf_counter()
        if saver is not None:
            saver.wait()
        out = {"segment_s": time.perf_counter() - t_start,
               "step_s_between_saves": statistics.median(step_s),
               "final_wait_s": time.perf_counter() - trained}  # for the last save's write
        if saver is not None:
            out.update(blocked_s=blocked, blocked_median_s=statistics.median(blocked),
                       checkpoint_mb=sum(f.stat().st_size for f in saver.last.iterdir()) / 1e6)
        return out

    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            rounds[mode].append(segment(mode))
            print(f"round {r + 1} {mode}: segment {rounds[mode][-1]['segment_s']:.2f} s", flush=True)
    shutil.rmtree(args.work / "checkpoints-sync", ignore_errors=True)
    shutil.rmtree(args.work / "checkpoints-async", ignore_errors=True)
    results = {}
    for mode, runs in rounds.items():
        med = {k: statistics.median(run[k] for run in runs)
               for k in ("segment_s", "step_s_between_saves")}
        if mode != "none":
            med.update(blocked_median_s=statistics.median(b for run in runs for b in run["blocked_s"]),
                       checkpoint_mb=runs[-1]["checkpoint_mb"])
        results[mode] = {**med, "rounds": runs}
    n, s, a = results["none"], results["sync"], results["async"]
    for side in (s, a):
        side["segment_slowdown_vs_no_save"] = side["segment_s"] / n["segment_s"] - 1
        # each round against the no-save segment of the same round (the rounds rotate the order,
        # so a burst of load falls on a round's three segments alike): the median, and the range
        paired = sorted(run["segment_s"] / none["segment_s"] - 1 for run, none in zip(side["rounds"], n["rounds"]))
        side["segment_slowdown_paired_median"] = statistics.median(paired)
        side["segment_slowdown_paired_range"] = [paired[0], paired[-1]]
    return {"params": model.num_params(), "model": to_dict(model_cfg), "no_save": n, "sync": s,
            "async": a, "blocked_ratio_sync_over_async":
                s["blocked_median_s"] / max(a["blocked_median_s"], 1e-9),
            "segment_ratio_sync_over_async": s["segment_s"] / a["segment_s"]}


if __name__ == "__main__":
    main()
