"""GPU pretraining throughput: tokens/s, MFU, checkpoint stall and a kill-and-resume, on one GPU.

Runs the project's own training loop (tasks/train/loop.py: bf16 autocast, torch.compile, fused
AdamW, pinned-memory checkpoint snapshots written in the background) on

  gpu-recipe   the `gpu` recipe's model (12 x 768, ~91M parameters, 1024-token context)
  gpt-355m     24 x 1024, vocabulary 50304 (~355M parameters), the size the MFU target is set at
  gpt-355m-fsdp the same through the loop's own FSDP path (a one-rank DistContext: the loop
               shards it, fully_shard per block, and saves asynchronously through
               torch.distributed.checkpoint): what sharding costs on one device

and a kill-and-resume of the gpu-recipe model through `python -m tasks.pretrain` (supervisor, hot
spare, checkpoints every quarter of the run, SIGKILL at 60% of it): seconds from the kill to the
first step after it, the steps redone, and the model it publishes.

Tokens/s and MFU exclude the first step of every start (the compile) and the time spent saving;
MFU is given against the data sheet's peak (tasks/common/hardware.py, by the device's exact name)
and against a bf16 matmul measured here. Data are random token rows in data prep's format
(throughput does not depend on what the tokens say) beside a real BPE tokenizer, so the script
needs no corpus and no network.

    python benchmarks/gpu_throughput.py [--steps 60] [--out benchmarks/results/gpu_throughput.json]

Each part is written to the results file as it finishes (a failed part with its error, the rest
kept); the exit status is non-zero if any part failed. Without a CUDA device it prints why and
exits 0 without writing a result; `--cpu-smoke` runs the same code on tiny models on the CPU
(tests/test_benchmarks.py does, on every `make test`) and writes to <work>, not to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]

from pretrain_common import RESULTS, write_result  # noqa: E402
from tasks.configs import ModelConfig, OptimConfig, TrainConfig, from_dict, to_dict  # noqa: E402

CONFIGS: dict[str, tuple[ModelConfig, int]] = {  # model, micro-batch (sequences)
    "gpu-recipe": (ModelConfig(vocab_size=8192, block_size=1024, n_layer=12, n_head=12, n_embd=768), 16),
    "gpt-355m": (ModelConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024), 8),
}
SMOKE = {"gpu-recipe": (ModelConfig(vocab_size=512, block_size=32, n_layer=1, n_head=2, n_embd=32), 4),
         "gpt-355m": (ModelConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=32), 4)}


def synthetic_data(work: Path, vocab: int, seq_len: int, rows: int = 4096) -> Path:
    """A data prep output directory of random rows (manifest last, as prep writes it), with a
    real byte-level BPE trained by data prep's own code on generated words, so that publishing a
    model (which loads and copies tokenizer.json) works as it does after a real prep. Its
    vocabulary is at most `vocab` (BPE stops merging when the text runs out of pairs) and the
    random ids stay inside it."""
    import numpy as np

    from tasks.data.tokens import EOS_ID, token_dtype, train_tokenizer

    out = work / f"data-v{vocab}-t{seq_len}"
    if (out / "manifest.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(4000)]
    texts = [" ".join(rng.choice(words, size=64)) for _ in range(400)]
    tokenizer = train_tokenizer(texts, vocab)
    (out / "tokenizer.json").write_text(tokenizer.to_str())
    size = tokenizer.get_vocab_size()
    splits = {}
    for split, n in (("train", rows), ("val", max(64, rows // 16))):
        path = out / f"{split}-000.bin"
        rng.integers(0, size, size=(n, seq_len + 1)).astype(token_dtype(size)).tofile(path)
        splits[split] = {"shards": [{"path": path.name, "rows": n}]}
    manifest = {"eos_id": EOS_ID, "vocab_size": size, "seq_len": seq_len, "row_len": seq_len + 1,
                "dtype": token_dtype(size), "splits": splits,
                "content_hash": f"random-{vocab}-{seq_len}", "tokenizer": "tokenizer.json",
                "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def one_rank_fsdp(device: Any) -> Any:
    """The loop's own distributed context for one process (what torchrun gives each rank of a
    job, here with an in-process store): the loop shards the model with it (FSDP2, one unit per
    block) and saves through torch.distributed.checkpoint, as a multi-GPU job does."""
    import datetime

    import torch.distributed as dist

    from tasks.train.distributed import DistContext

    return DistContext(rank=0, world_size=1, local_rank=0, device=device,
                       timeout=datetime.timedelta(minutes=10), parallelism="fsdp",
                       store=dist.HashStore(), key="bench")


def matmul_flops(device: Any, n: int) -> float:
    """FLOP/s of an n x n matmul as this device runs it (bf16 on a GPU, fp32 on a CPU): the
    peak a model could reach here, beside the data sheet's."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    # The best of five timed blocks: a peak is the most the device did, and one block on shared
    # cores can lose its time slice (the CPU smoke beside another test process once measured a
    # third of the peak, and its model "reached" 2.5 times it).
    reps, best = 20, 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
    return best


def measure(name: str, model_cfg: ModelConfig, batch: int, work: Path, steps: int, *,
            fsdp: bool, device_type: str, matmul_peak: float) -> dict[str, Any]:
    """Train `steps` steps through the loop (checkpoints async, every steps // 3); returns the
    steady tokens/s, MFU (against the data sheet and against the measured matmul), the seconds
    each save blocked training, the whole run's wall time, and peak memory."""
    import torch

    from tasks.model.gpt import GPT
    from tasks.train import checkpoint as ckpt
    from tasks.train import telemetry as tm
    from tasks.train.prepared_data import DataDir, PretrainBatches
    from tasks.train.losses import cross_entropy
    from tasks.train.loop import LoopOptions, train
    from tasks.train.runtime import gpt_flops_per_token, peak_flops, pick_device, seed_everything
    from tasks.train.scoring import shard_loss

    device = pick_device() if device_type == "cuda" else torch.device("cpu")
    data_dir = synthetic_data(work, model_cfg.vocab_size, model_cfg.block_size)
    data = DataDir(data_dir)
    out = work / "runs" / name
    cfg = from_dict(TrainConfig, {**to_dict(TrainConfig(data_dir=str(data_dir), output_dir=str(out),
                                                        model=model_cfg)),
                                  "max_steps": steps, "batch_size": batch, "log_interval": 10,
                                  "eval_interval": steps, "eval_batches": 2, "keep_checkpoints": 1,
                                  "checkpoint_interval": max(10, steps // 3), "compile": True,
                                  "parallelism": "fsdp" if fsdp else "ddp",
                                  "optim": to_dict(OptimConfig(lr=3e-4, warmup_steps=10))})
    seed_everything(cfg.seed)
    model = GPT(cfg.model)
    n_params = model.num_params()
    flops = gpt_flops_per_token(n_params, model_cfg.n_layer, model_cfg.n_embd, model_cfg.block_size,
                                model.transformer.wpe.weight.numel())
    model = model.to(device)
    events = tm.EventLog(tm.run_dir(out), source="bench", echo=False)
    val = data.split("val")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    result = train(model=model, cfg=cfg, device=device, resolved_config=to_dict(cfg),
                   get_batch=PretrainBatches(data.split("train"), batch, cfg.seed),
                   loss_fn=cross_entropy, tracking=False,
                   evaluate=lambda m: {"val_loss": shard_loss(m, val, batch, 2, device)},
                   options=LoopOptions(compile=True, events=events, flops_per_token=flops,
                                       peak_flops=peak_flops(device), global_batch=batch,
                                       dist=one_rank_fsdp(device) if fsdp else None))
    wall = time.time() - t0
    saves = [e["blocked_s"] for e in tm.read_events(tm.run_dir(out)) if e["kind"] == "save"]
    mfus = [h["mfu"] for h in result.history if "mfu" in h]
    per_token = result.tokens_per_s * flops
    return {"config": name, "params": n_params, "micro_batch": batch, "seq_len": model_cfg.block_size,
            "fsdp": fsdp, "steps": steps, "tokens_per_s": round(result.tokens_per_s, 1),
            "mfu": round(sum(mfus[1:]) / len(mfus[1:]), 4) if len(mfus) > 1 else None,
            "mfu_of_measured_matmul": round(per_token / matmul_peak, 4) if matmul_peak else None,
            "flops_per_token": flops, "peak_flops": peak_flops(device),
            "checkpoint_layout": "dcp" if ckpt.is_sharded(result.checkpoint) else "pt",
            "checkpoint_blocked_s": [round(s, 4) for s in saves], "wall_s": round(wall, 1),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if device.type == "cuda" else None, "final_loss": round(result.train_loss, 4),
            "val_loss": round(result.val["val_loss"], 4)}


def kill_and_resume(work: Path, model_cfg: ModelConfig, batch: int, steps: int) -> dict[str, Any]:
    """The job as a backend runs it, SIGKILLed once: recovery seconds and steps redone."""
    from tasks.train import telemetry as tm

    data_dir = synthetic_data(work, model_cfg.vocab_size, model_cfg.block_size)
    out = work / "runs" / "kill-and-resume"
    kill_at = max(3, int(steps * 0.6))
    cfg = from_dict(TrainConfig, {**to_dict(TrainConfig(data_dir=str(data_dir), output_dir=str(out),
                                                        model=model_cfg)),
                                  "max_steps": steps, "batch_size": batch, "log_interval": 10,
                                  "eval_interval": steps, "eval_batches": 2,
                                  "checkpoint_interval": max(2, steps // 4), "hang_timeout_s": 600.0})
    config, result = work / "kill-config.json", work / "kill-result.json"
    config.write_text(json.dumps(to_dict(cfg)))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}",
           "PYTHONPATH": f"{ROOT}:{ROOT / 'plugins'}"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "tasks.pretrain", "--config", str(config),
                           "--result", str(result), "--faults", f"kill@{kill_at}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the kill-and-resume job failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    events = tm.read_events(tm.run_dir(out))
    kill = next(e for e in events if e["kind"] == "fault_injected" and e.get("fault", "").startswith("kill"))
    steps_log = tm.read_steps(tm.run_dir(out))
    after = [s for s in steps_log if s["t1"] > kill["t"]]
    first_after = min(after, key=lambda s: s["t1"])
    report = json.loads(result.read_text())
    return {"kill_at_step": kill_at, "recovery_s": round(first_after["t1"] - kill["t"], 2),
            "resumed_at_step": first_after["s"], "steps_redone": kill_at - first_after["s"],
            "job_wall_s": round(time.time() - t0, 1), "final_step": report["metrics"]["step"],
            "restarts": sum(1 for e in events if e["kind"] == "restart"),
            "model_dir": report["outputs"].get("model_dir")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--work", type=Path, default=Path("/tmp/llmops-bench-gpu"))
    parser.add_argument("--out", type=Path, help="the results file (default: the committed "
                        "benchmarks/results/gpu_throughput.json on a GPU, "
                        "<work>/gpu_throughput_smoke.json with --cpu-smoke)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU (checks the script)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("gpu_throughput: skipped, no CUDA device (torch.cuda.is_available() is False); "
              "nothing written")
        return
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.out or (args.work / "gpu_throughput_smoke.json" if args.cpu_smoke
                       else RESULTS / "gpu_throughput.json")
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{args.work / 'mlflow.db'}")
    device_type = "cpu" if args.cpu_smoke else "cuda"
    configs = SMOKE if args.cpu_smoke else CONFIGS
    matmul_peak = matmul_flops(torch.device(device_type), 256 if args.cpu_smoke else 8192)
    report: dict[str, Any] = {
        "benchmark": "gpu_throughput", "cpu_smoke": args.cpu_smoke,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cuda": torch.version.cuda, "measured_matmul_flops": round(matmul_peak),
        "target": "MFU >= 0.45 on an H200 for >= 350M parameters", "runs": [],
        "kill_and_resume": None, "errors": []}

    def record(part: str, fn: Any) -> Any:
        """Run one part; a failure is recorded with its error and the other parts still run.
        The file is rewritten after every part, so a later crash keeps what was measured."""
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - recorded in the results file, then re-reported
            traceback.print_exc()
            report["errors"].append({"part": part, "error": f"{type(exc).__name__}: {exc}"[-2000:]})
            value = None
        write_result(report, out)
        return value

    for name, fsdp in (("gpu-recipe", False), ("gpt-355m", False), ("gpt-355m", True)):
        model_cfg, batch = configs[name]
        label = name + ("-fsdp" if fsdp else "")
        row = record(label, lambda: measure(label, model_cfg, batch, args.work, args.steps, fsdp=fsdp,
                                            device_type=device_type, matmul_peak=matmul_peak))
        if row is None:
            continue
        report["runs"].append(row)
        write_result(report, out)
        print(f"{row['config']:>14}: {row['params'] / 1e6:7.1f}M params  {row['tokens_per_s']:>10,.0f} tok/s  "
              f"MFU {row['mfu'] if row['mfu'] is not None else 'n/a'}  save blocked "
              f"{max(row['checkpoint_blocked_s'] or [0]):.3f}s max  peak {row['peak_memory_gib']} GiB",
              flush=True)
    model_cfg, batch = configs["gpu-recipe"]
    kill_steps = args.steps * 2 if args.cpu_smoke else max(40, args.steps * 2)
    recovery = record("kill-and-resume",
                      lambda: kill_and_resume(args.work, model_cfg, batch, kill_steps))
    if recovery is not None:
        report["kill_and_resume"] = recovery
        write_result(report, out)
        print(f"kill-and-resume: recovered {recovery['recovery_s']}s after the kill at step "
              f"{recovery['kill_at_step']}, {recovery['steps_redone']} steps redone", flush=True)
    print(f"wrote {out}")
    if report["errors"]:
        sys.exit(f"gpu_throughput: {len(report['errors'])} part(s) failed: "
                 + "; ".join(e["part"] for e in report["errors"]))


if __name__ == "__main__":
    main()
