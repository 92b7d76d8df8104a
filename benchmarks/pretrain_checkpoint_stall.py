"""Checkpoint cost as a user feels it: a training segment's wall time with no save, with
synchronous saves and with asynchronous saves; and how long each save blocks training.

A ~20M-parameter GPT (with AdamW's two moments, ~240 MB of state per checkpoint) trains on one
CPU thread. A segment is --saves x --steps-between steps; with saves, the loop's Checkpointer
saves before each group of steps (and the segment ends when the last save is committed).
Synchronous: serialize, sha256, fsync, manifest and rename all block. Asynchronous: training
waits only for the previous save (if still in flight; at most one) and for the copy of the state
to CPU memory; the rest runs on a background thread while the next steps train, and competes
with them for the cores: the blocked time alone hides that cost, the segment's wall time shows
it. The three modes run in --rounds rounds, each in another order (a burst of load on a shared
machine falls on all of them); medians are reported. The last line is one JSON object.

    python benchmarks/pretrain_checkpoint_stall.py [--saves 5] [--steps-between 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

from pretrain_common import RESULTS, isolate, last_json_line, prepared_data, train_config

from tasks.configs import ModelConfig, to_dict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--steps-between", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "pretrain_checkpoint_stall.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmops-bench-ckpt"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    isolate(args.work)
    data = prepared_data(args.work)

    import torch

    from tasks.model import GPT
    from tasks.train.checkpoint import Checkpointer
    from tasks.train.data import DataDir, PretrainBatches
    from tasks.train.losses import cross_entropy
    from tasks.train.loop import build_optimizer
    from tasks.train.runtime import rng_state

    torch.set_num_threads(1)
    model_cfg = ModelConfig(vocab_size=512, block_size=64, n_layer=6, n_head=8, n_embd=512)
    cfg = train_config(data, args.work / "run", model=to_dict(model_cfg), batch_size=4)
    model = GPT(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
    batches = PretrainBatches(DataDir(data).split("train"), cfg.batch_size, cfg.seed)
    step = 0

    def train_steps(n: int) -> float:
        nonlocal step
        t0 = time.perf_counter()
        for _ in range(n):
            loss = cross_entropy(model, batches(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        return (time.perf_counter() - t0) / n

    train_steps(2)  # optimizer state exists from here on: checkpoints have their full size

    def segment(mode: str) -> dict:
        root = args.work / f"checkpoints-{mode}"
        shutil.rmtree(root, ignore_errors=True)
        saver = Checkpointer(root, keep=2, config={}, asynchronous=mode == "async")
        blocked, step_s = [], []
        t_start = time.perf_counter()
        for _ in range(args.saves):
            if mode != "none":
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "trainer": {"step": step, "rng": rng_state()}}
                blocked.append(saver.save(step, state))
            step_s.append(train_steps(args.steps_between))
        saver.wait()
        out = {"segment_s": time.perf_counter() - t_start,
               "step_s_between_saves": statistics.median(step_s)}
        if mode != "none":
            out.update(blocked_s=blocked, blocked_median_s=statistics.median(blocked),
                       checkpoint_mb=sum(f.stat().st_size for f in saver.last.iterdir()) / 1e6)
        return out

    modes = ("none", "sync", "async")
    rounds: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % 3:] + modes[:r % 3]:
            rounds[mode].append(segment(mode))
            print(f"round {r + 1} {mode}: segment {rounds[mode][-1]['segment_s']:.2f} s", flush=True)
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
    print(f"\n{'':36}{'no save':>10}{'sync':>10}{'async':>10}")
    print(f"{'segment wall time (s, median)':36}{n['segment_s']:>10.2f}{s['segment_s']:>10.2f}"
          f"{a['segment_s']:>10.2f}")
    print(f"{'  slower than no save':36}{'':>10}{s['segment_slowdown_vs_no_save']:>10.1%}"
          f"{a['segment_slowdown_vs_no_save']:>10.1%}")
    print(f"{'step time between saves (s)':36}{n['step_s_between_saves']:>10.3f}"
          f"{s['step_s_between_saves']:>10.3f}{a['step_s_between_saves']:>10.3f}")
    print(f"{'training blocked per save (s)':36}{'':>10}{s['blocked_median_s']:>10.3f}"
          f"{a['blocked_median_s']:>10.3f}")
    print(f"{'checkpoint size (MB)':36}{'':>10}{s['checkpoint_mb']:>10.0f}{a['checkpoint_mb']:>10.0f}")
    last_json_line({"benchmark": "pretrain_checkpoint_stall", "params": model.num_params(),
                    "saves": args.saves, "steps_between": args.steps_between,
                    "rounds": args.rounds, "no_save": n, "sync": s, "async": a,
                    "blocked_ratio_sync_over_async":
                        s["blocked_median_s"] / max(a["blocked_median_s"], 1e-9),
                    "segment_ratio_sync_over_async": s["segment_s"] / a["segment_s"]}, args.out)


if __name__ == "__main__":
    main()
