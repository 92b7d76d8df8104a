"""Checkpoint stall: how long training is blocked per save, synchronous against asynchronous.

A ~20M-parameter GPT (with AdamW's two moments, ~240 MB of state per checkpoint) trains on one
CPU thread; every --steps-between steps the loop's Checkpointer saves. Synchronous: serialize,
sha256, fsync, manifest and rename all block. Asynchronous: training waits only for the previous
save (if still in flight; at most one) and for the copy of the state to CPU memory; the rest runs
on a background thread while the next steps train. Reported per save: the blocked time, and the
training steps' time while the background write runs (on a small shared machine the writer
competes with training for the cores). The last line is one JSON object.

    python benchmarks/pretrain_checkpoint_stall.py [--saves 5] [--steps-between 4]
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
    results = {}
    for mode in ("sync", "async"):
        root = args.work / f"checkpoints-{mode}"
        shutil.rmtree(root, ignore_errors=True)
        saver = Checkpointer(root, keep=2, config={}, asynchronous=mode == "async")
        blocked, step_s = [], []
        baseline_step = train_steps(args.steps_between)
        t_start = time.perf_counter()
        for _ in range(args.saves):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "trainer": {"step": step, "rng": rng_state()}}
            blocked.append(saver.save(step, state))
            step_s.append(train_steps(args.steps_between))
        saver.wait()
        total = time.perf_counter() - t_start
        size = sum(f.stat().st_size for f in saver.last.iterdir()) / 1e6
        results[mode] = {"blocked_s": blocked, "blocked_median_s": statistics.median(blocked),
                         "step_s_between_saves": statistics.median(step_s),
                         "step_s_without_saves": baseline_step, "segment_s": total,
                         "checkpoint_mb": size}
        print(f"{mode}: blocked {', '.join(f'{b:.3f}' for b in blocked)} s per save; steps "
              f"{statistics.median(step_s):.3f} s (vs {baseline_step:.3f} s without saves)",
              flush=True)

    s, a = results["sync"], results["async"]
    print(f"\n{'':36}{'sync':>10}{'async':>10}")
    print(f"{'checkpoint size (MB)':36}{s['checkpoint_mb']:>10.0f}{a['checkpoint_mb']:>10.0f}")
    print(f"{'training blocked per save (s)':36}{s['blocked_median_s']:>10.3f}{a['blocked_median_s']:>10.3f}")
    print(f"{'step time between saves (s)':36}{s['step_s_between_saves']:>10.3f}"
          f"{a['step_s_between_saves']:>10.3f}")
    print(f"{'segment wall time (s)':36}{s['segment_s']:>10.1f}{a['segment_s']:>10.1f}")
    ratio = s["blocked_median_s"] / max(a["blocked_median_s"], 1e-9)
    print(f"async blocks {ratio:.1f}x less per save")
    last_json_line({"benchmark": "pretrain_checkpoint_stall", "params": model.num_params(),
                    "saves": args.saves, "steps_between": args.steps_between,
                    "sync": s, "async": a, "blocked_ratio_sync_over_async": ratio}, args.out)


if __name__ == "__main__":
    main()
