"""Time from an attempt's start to its first step, token shards streamed from S3 against
downloaded first, at several corpus sizes, through the simulated S3 with its bandwidth cap.

A new attempt on a fresh node (empty work dir, empty stream cache) runs docker/job_entry.py as a
Batch or HyperPod node does, with the fake AWS's proxy in front of moto as S3
(tests/chaos/fake_aws: every connection capped at --mb-per-s, every answer's first byte held back
--first-byte-ms). The two arms, interleaved per size and repetition:

  streamed     job_entry leaves data_dir as its s3:// URI (tasks.common.uris.STREAMED_INPUTS) and
  the
               stage reads the blocks of its first windows (tasks/train/stream.py)
  downloaded   what job_entry did before: `download` (its own function, s3transfer's parallel
               ranged GETs) copies the whole data prefix into the work dir, then the stage reads
               the local copy memory-mapped

Time to first step = from the attempt's start (before the download, for that arm) to the end of
step 1 (steps.rank0.jsonl). Both arms then train the same number of steps (their steps per
second after `--warmup` steps are recorded, one job after the other). The throughput criterion
is measured like for like: the training step with each reader in alternating segments in one
process (`interleaved_rates`), with the first-step runs' blocks and with small blocks whose
windows turn over every 32 steps (the streamed reader fetching a window ahead all the time).

Synthetic token shards (random ids below the tokenizer's vocabulary, 16 MB shards) beside the
prepared demo data's tokenizer and val split; uploaded to moto once per size. Prints one line
per run and the table; the last line is one JSON object, also written to
benchmarks/results/pretrain_first_step.json (machine, load, versions, settings, every value).

    python benchmarks/pretrain_first_step.py [--sizes-gb 0.1 1 4] [--reps 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pretrain_common import MODEL, RESULTS, ROOT, isolate, last_json_line, prepared_data, train_config

import numpy as np  # noqa: E402

from tasks.common.io import read_json  # noqa: E402
from tasks.configs import to_dict  # noqa: E402

BUCKET = "llmops-bench"
SHARD_BYTES = 16 << 20
ENTRY = ROOT / "docker" / "job_entry.py"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def synthetic_data(base: Path, out: Path, gb: float) -> Path:
    """A data dir with `gb` GB of random train rows, the base's tokenizer and val split."""
    if (out / "manifest.json").exists():
        return out
    manifest = read_json(base / "manifest.json")
    row_len, dtype = int(manifest["row_len"]), np.dtype(manifest["dtype"]).newbyteorder("<")
    rows_per_shard = SHARD_BYTES // (row_len * dtype.itemsize)
    total_rows = int(gb * 1e9) // (row_len * dtype.itemsize)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "tokens").mkdir(parents=True)
    shutil.copy(base / manifest["tokenizer"], tmp / manifest["tokenizer"])
    for shard in manifest["splits"]["val"]["shards"]:
        (tmp / shard["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(base / shard["path"], tmp / shard["path"])
    rng = np.random.default_rng(0)
    shards, done = [], 0
    while done < total_rows:
        n = min(rows_per_shard, total_rows - done)
        path = f"tokens/train_synthetic_{len(shards):05d}.bin"
        rng.integers(0, int(manifest["vocab_size"]), size=(n, row_len), dtype=dtype).tofile(tmp / path)
        shards.append({"path": path, "rows": int(n)})
        done += n
    manifest["splits"]["train"] = {"shards": shards, "rows": total_rows}
    manifest["content_hash"] = hashlib.sha256(f"synthetic-{gb}-{total_rows}".encode()).hexdigest()
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out)
    return out


def upload(s3: Any, local: Path, prefix: str) -> int:
    files = [p for p in sorted(local.rglob("*")) if p.is_file()]
    for path in files:
        s3.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(local).as_posix()}")
    return sum(p.stat().st_size for p in files)


def entry_env(fake_url: str, node: Path, work: Path) -> dict[str, str]:
    return {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": fake_url, "PYTHONPATH": str(ROOT),
            "LLMOPS_WORKDIR": str(node / "work"), "TMPDIR": str(node / "tmp"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "OMP_NUM_THREADS": "1"}


def first_step_run(arm: str, data: str, node: Path, fake_url: str, work: Path,
                   settings: dict[str, Any]) -> dict[str, Any]:
    """One attempt on a fresh node: start, (download,) job_entry, the stage's first steps."""
    shutil.rmtree(node, ignore_errors=True)
    (node / "tmp").mkdir(parents=True)
    (node / "work").mkdir()
    env = entry_env(fake_url, node, work)
    t0 = time.time()
    download_s = 0.0
    if arm == "downloaded":
        sys.path.insert(0, str(ENTRY.parent))
        import job_entry

        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            target = node / "work" / "inputs" / "data"
            target.parent.mkdir(parents=True)
            job_entry.download(data, target)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        data, download_s = str(target), time.time() - t0
    warm = int(settings["_warmup"])
    cfg = train_config(Path(data), node / "out", **{k: v for k, v in settings.items() if k != "_warmup"})
    config = to_dict(cfg)
    config["data_dir"] = data
    proc = subprocess.run([sys.executable, str(ENTRY), "--entrypoint", "tasks.pretrain",
                           "--config-json", json.dumps(config), "--result", str(node / "result.json"),
                           "--workdir", str(node / "work")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} run failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    steps = [json.loads(line) for line in
             (node / "out" / "resilience" / "steps.rank0.jsonl").read_text().splitlines()]
    rate = (len(steps) - 1 - warm) / (steps[-1]["t1"] - steps[warm]["t1"])
    cache = node / "work" / "stream-cache"
    cached = sum(p.stat().st_size for p in cache.rglob("*.blk")) if cache.exists() else 0
    return {"arm": arm, "first_step_s": round(steps[0]["t1"] - t0, 3),
            "download_s": round(download_s, 3), "steps_per_s": round(rate, 3),
            "steps": len(steps), "stream_cache_bytes_at_end": cached}


def interleaved_rates(uri: str, local: Path, node: Path, fake_url: str, settings: dict[str, Any],
                      segments: int, segment_steps: int) -> dict[str, Any]:
    """Training steps/s at the same batch with each reader (streamed from S3 through the capped
    proxy into a fresh cache; the local copy memory-mapped), in alternating segments of
    `segment_steps` steps in this one process (one thread, as a job's worker), so that the load
    other work puts on the machine falls on both alike. Each reader trains its own copy of the
    same model from its own data cursor; the first segment of each is warm-up."""
    import torch

    from tasks.model.gpt import GPT
    from tasks.train.prepared_data import DataDir, PretrainBatches
    from tasks.train.losses import cross_entropy
    from tasks.train.loop import build_optimizer
    from tasks.train.runtime import seed_everything

    shutil.rmtree(node, ignore_errors=True)
    node.mkdir(parents=True)
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "LLMOPS_WORKDIR", *CREDENTIALS)}
    os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": fake_url, "LLMOPS_WORKDIR": str(node)})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = train_config(local, node / "out", **settings)
        arms = {}
        for name, where in (("streamed", uri), ("mmap", local)):
            rows = DataDir(where).split("train", cfg.shuffle_block_rows)
            seed_everything(cfg.seed)
            model = GPT(cfg.model)
            arms[name] = {"rows": rows, "model": model,
                          "optimizer": build_optimizer(model, cfg.optim, torch.device("cpu")),
                          "batches": PretrainBatches(rows, cfg.batch_size, cfg.seed, order=cfg.sample_order,
                                                     window_blocks=cfg.shuffle_window_blocks),
                          "cursor": 0, "seconds": 0.0, "steps": 0}
        for segment in range(segments + 1):
            for name in (("streamed", "mmap") if segment % 2 == 0 else ("mmap", "streamed")):
                arm = arms[name]
                t0 = time.perf_counter()
                for _ in range(segment_steps):
                    batch = arm["batches"](arm["cursor"])
                    loss = cross_entropy(arm["model"], batch)
                    loss.backward()
                    arm["optimizer"].step()
                    arm["optimizer"].zero_grad(set_to_none=True)
                    arm["cursor"] += 1
                if segment:   # the first segment of each is warm-up (the first window's fetch)
                    arm["seconds"] += time.perf_counter() - t0
                    arm["steps"] += segment_steps
        streamed = arms["streamed"]["rows"].streamed
        out = {f"{name}_steps_per_s": round(a["steps"] / a["seconds"], 3) for name, a in arms.items()}
        out["streamed_over_mmap"] = round(out["streamed_steps_per_s"] / out["mmap_steps_per_s"], 3)
        out.update(steps_each=arms["mmap"]["steps"], streamed_fetched_bytes=streamed.fetched_bytes,
                   streamed_waited_s=round(streamed.waited_s, 3),
                   windows_trained=int(arms["streamed"]["cursor"] * cfg.batch_size
                                       // (cfg.shuffle_block_rows * cfg.shuffle_window_blocks)))
        return out
    finally:
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[0.1, 1.0, 4.0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--mb-per-s", type=float, default=80.0, help="S3 bandwidth per connection.")
    p.add_argument("--first-byte-ms", type=float, default=30.0)
    p.add_argument("--steps", type=int, default=150, help="Steps of each first-step run.")
    p.add_argument("--warmup", type=int, default=30, help="Steps before the throughput is timed.")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--segments", type=int, default=8, help="Interleaved segments per reader.")
    p.add_argument("--segment-steps", type=int, default=25, help="Steps per segment.")
    p.add_argument("--work", type=Path, default=None, help="Scratch dir (default: a temp dir).")
    p.add_argument("--out", type=Path, default=RESULTS / "pretrain_first_step.json")
    p.add_argument("--summarize-only", action="store_true",
                   help="Summarize the runs already in --out again, measuring nothing.")
    args = p.parse_args()
    if args.summarize_only:
        return resummarize(args.out)
    work = args.work or Path(tempfile.mkdtemp(prefix="first-step-"))
    work.mkdir(parents=True, exist_ok=True)
    isolate(work)
    sys.path.insert(0, str(ROOT))
    import boto3

    from tests.aws_fixtures import free_port
    from tests.chaos.fake_aws import FakeAws

    base = prepared_data(work)
    # blocks of ~4 MiB (32768 rows of 65 uint16 tokens), 16 per window: what a GET and a
    # window are at real scale with the defaults (1024 rows of 2049 uint32 tokens = 8 MiB)
    row_bytes = (MODEL.block_size + 1) * 2
    common = dict(max_steps=args.steps, batch_size=args.batch_size, checkpoint_interval=100_000,
                  eval_interval=100_000, log_interval=50, hot_spare=False, burn_in=False,
                  shuffle_block_rows=(4 << 20) // row_bytes, shuffle_window_blocks=16)
    # the turnover pair: windows of 4 blocks of 256 rows, a new window every 32 steps
    turnover = {**common, "shuffle_block_rows": 256, "shuffle_window_blocks": 4}
    fake = FakeAws(free_port(), work / "fake").start()
    runs: list[dict[str, Any]] = []
    rates: list[dict[str, Any]] = []
    try:
        s3 = boto3.client("s3", endpoint_url=fake.moto_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        s3.create_bucket(Bucket=BUCKET)
        uris = {}
        for gb in args.sizes_gb:
            local = synthetic_data(base, work / f"data-{gb:g}gb", gb)
            t0 = time.time()
            size = upload(s3, local, f"data-{gb:g}gb")
            uris[gb] = f"s3://{BUCKET}/data-{gb:g}gb"
            print(f"uploaded {size / 1e9:.2f} GB for the {gb:g} GB corpus in {time.time() - t0:.0f}s",
                  flush=True)
        fake.sim.configure(s3_mb_per_s_per_connection=args.mb_per_s, s3_first_byte_ms=args.first_byte_ms)
        for rep in range(args.reps):
            for gb in args.sizes_gb:
                for arm in (("streamed", "downloaded") if rep % 2 == 0 else ("downloaded", "streamed")):
                    row = first_step_run(arm, uris[gb], work / "node", fake.url, work,
                                         {**common, "_warmup": args.warmup})
                    row.update(size_gb=gb, rep=rep, load_avg_1=round(os.getloadavg()[0], 2))
                    runs.append(row)
                    print(json.dumps(row), flush=True)
            # throughput at the same batch, the two readers interleaved in this process
            gb = args.sizes_gb[len(args.sizes_gb) // 2]
            for name, cfg in (("realistic_blocks", common), ("windows_turning_over", turnover)):
                row = interleaved_rates(uris[gb], work / f"data-{gb:g}gb", work / "node-rate",
                                        fake.url, cfg, args.segments, args.segment_steps)
                row.update(size_gb=gb, rep=rep, config=name, load_avg_1=round(os.getloadavg()[0], 2))
                rates.append(row)
                print(json.dumps(row), flush=True)
    finally:
        fake.stop()
    summary = summarize(runs, rates, args.sizes_gb)
    for line in summary["table"]:
        print(line)
    settings = {"sizes_gb": args.sizes_gb, "reps": args.reps,
                "s3_mb_per_s_per_connection": args.mb_per_s, "s3_first_byte_ms": args.first_byte_ms,
                "shard_bytes": SHARD_BYTES, "model": to_dict(MODEL), "row_bytes": row_bytes,
                "first_step_config": {k: v for k, v in common.items()},
                "turnover_config": {k: v for k, v in turnover.items()}, "warmup_steps": args.warmup,
                "interleaved": {"segments": args.segments, "segment_steps": args.segment_steps},
                "note": "each attempt starts from step 0 on a fresh node (empty work dir and cache); "
                        "restoring a checkpoint adds the same to both arms"}
    last_json_line({"benchmark": "pretrain_first_step", "settings": settings, "runs": runs,
                    "interleaved_rates": rates,
                    **{k: v for k, v in summary.items() if k != "table"}}, args.out)


def summarize(runs: list[dict[str, Any]], rates: list[dict[str, Any]], sizes: list[float]
              ) -> dict[str, Any]:
    """Per size and arm the fastest repetition (the one least slowed by other work on the
    machine: a process start-up here takes 20 s idle and 2 minutes under a load of 15) and the
    median; the criteria on the fastest: streamed flat within 20% from the smallest to the
    largest size, downloaded growing with size; streamed steps/s >= 0.95x the memory-mapped
    (median of the interleaved measurements, each configuration)."""
    med = lambda xs: round(statistics.median(xs), 3)   # noqa: E731
    by: dict[str, dict[str, dict[str, float]]] = {}
    for arm in ("streamed", "downloaded"):
        by[arm] = {}
        for gb in sizes:
            rows = [r for r in runs if r["arm"] == arm and r["size_gb"] == gb]
            best = min(rows, key=lambda r: r["first_step_s"])
            by[arm][f"{gb:g}"] = {"first_step_s": best["first_step_s"], "download_s": best["download_s"],
                                  "first_step_s_median": med([r["first_step_s"] for r in rows]),
                                  "download_s_median": med([r["download_s"] for r in rows]),
                                  "steps_per_s_median": med([r["steps_per_s"] for r in rows]),
                                  "stream_cache_bytes_at_end": best["stream_cache_bytes_at_end"],
                                  "reps": len(rows)}
    s, d = by["streamed"], by["downloaded"]
    lo, hi = f"{sizes[0]:g}", f"{sizes[-1]:g}"
    flat = s[hi]["first_step_s"] / s[lo]["first_step_s"]
    interleaved = {name: med([r["streamed_over_mmap"] for r in rates if r["config"] == name])
                   for name in sorted({r["config"] for r in rates})}
    criteria = {
        "streamed_largest_over_smallest": round(flat, 3),
        "streamed_flat_within_20pct": abs(flat - 1) <= 0.2,
        "streamed_largest_over_smallest_median": round(s[hi]["first_step_s_median"]
                                                       / s[lo]["first_step_s_median"], 3),
        "downloaded_grows_with_size": all(d[f"{a:g}"]["first_step_s"] < d[f"{b:g}"]["first_step_s"]
                                          for a, b in zip(sizes, sizes[1:])),
        "streamed_over_mmap_steps_per_s_interleaved": interleaved,
        "streamed_steps_per_s_at_least_095x": min(interleaved.values()) >= 0.95 if interleaved else None,
    }
    table = [f"{'corpus':>8} | {'streamed: first step':>20} | {'(read, whole run)':>17} | "
             f"{'downloaded: first step':>22} | {'(download)':>10}   fastest of reps; median"]
    for gb in sizes:
        k = f"{gb:g}"
        table.append(f"{k + ' GB':>8} | {s[k]['first_step_s']:>19.1f}s | "
                     f"{s[k]['stream_cache_bytes_at_end'] / 1e6:>14.0f} MB | {d[k]['first_step_s']:>21.1f}s | "
                     f"{d[k]['download_s']:>9.1f}s   ({s[k]['first_step_s_median']:.1f}s; "
                     f"{d[k]['first_step_s_median']:.1f}s)")
    for name, ratio in interleaved.items():
        table.append(f"steps/s streamed / mmap, interleaved in one process ({name}): {ratio:.3f}x")
    table.append(json.dumps(criteria))
    return {"by_arm": by, "criteria": criteria, "table": table}


def resummarize(path: Path) -> None:
    """Summarize a result file's runs again (its machine record kept as it ran)."""
    report = json.loads(path.read_text())
    summary = summarize(report["runs"], report["interleaved_rates"], report["settings"]["sizes_gb"])
    for line in summary["table"]:
        print(line)
    report.update({k: v for k, v in summary.items() if k != "table"})
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
