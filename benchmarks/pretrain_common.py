"""What the pretraining benchmarks share: prepared data, a model config, and running the
pretrain job through the local backend exactly as the DAG's JobOperator does."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]

from tasks.configs import DataPrepConfig, ModelConfig, TrainConfig, from_dict, to_dict  # noqa: E402

# ~0.5M parameters, 64-token rows: tens of milliseconds per step on one CPU thread
MODEL = ModelConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)


def prepared_data(work: Path) -> Path:
    """Data prep on the built-in demo corpus (cached under work/data)."""
    out = work / "data"
    if (out / "manifest.json").exists():
        return out
    from tasks.data.prep import prepare

    cfg = DataPrepConfig(output_dir=str(out), demo_corpus_docs=2000, demo_sft_examples=50,
                         vocab_size=MODEL.vocab_size, seq_len=MODEL.block_size, engine="local",
                         workers=1)
    prepare(cfg)
    return out


def train_config(data_dir: Path, output_dir: Path, **overrides: Any) -> TrainConfig:
    base = TrainConfig(data_dir=str(data_dir), output_dir=str(output_dir), model=MODEL)
    return from_dict(TrainConfig, {**to_dict(base), **overrides})


def isolate(work: Path) -> None:
    """Own MLflow store and job directories, one thread per process, no stray fault spec."""
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    os.environ["LLMOPS_HOME"] = str(work / "home")
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.pop("LLMOPS_FAULTS", None)
    os.environ.pop("MLFLOW_RUN_ID", None)
    import mlflow

    # create the store's tables now, so the first job measured does not pay for it
    mlflow.MlflowClient().search_experiments(max_results=1)


def run_job(cfg: TrainConfig, name: str, *, faults: str = "", retries: int = 0,
            retry_delay_s: float = 5.0, poll_s: float = 2.0,
            on_poll: Any = None) -> dict[str, Any]:
    """Submit the pretrain job to the local backend and wait like JobOperator (polling every
    poll_s); on failure, wait retry_delay_s and submit again, as an Airflow task retry does
    (the backend restarts a failed job; the stage resumes from its newest valid checkpoint)."""
    from llmops.jobs.backends.base import JobState
    from llmops.jobs.backends.local.local_backend import LocalBackend
    from llmops.jobs.spec import JobSpec

    backend = LocalBackend(jobs_dir=Path(os.environ["LLMOPS_HOME"]) / "jobs")
    spec = JobSpec(stage="pretrain", entrypoint="tasks.pretrain", config=to_dict(cfg), name=name,
                   argv=("--faults", faults) if faults else ())
    started, tries = time.time(), 0
    while True:
        tries += 1
        handle = backend.submit(spec)
        while not (status := backend.status(handle)).state.terminal:
            if on_poll is not None:
                on_poll(Path(handle["job_dir"]))
            time.sleep(poll_s)
        if status.state == JobState.SUCCEEDED:
            return {"result": status.result, "tries": tries, "wall_s": time.time() - started,
                    "job_dir": handle["job_dir"]}
        print(f"  {name}: try {tries} failed ({status.message}); "
              f"{'retrying in %.0fs' % retry_delay_s if tries <= retries else 'giving up'}",
              flush=True)
        if tries > retries:
            raise RuntimeError(f"{name} failed after {tries} tries; see {handle['job_dir']}/output.log*")
        time.sleep(retry_delay_s)


RESULTS = ROOT / "benchmarks" / "results"


CODE = ("tasks", "plugins", "benchmarks", "docker")   # what a benchmark measures


def git_commit(code: tuple[str, ...] = CODE) -> str:
    """The checkout's commit, with '+changes' when the code measured (`code`, paths from the
    repository root) differs from it."""
    import subprocess

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--", *code)
    # a results file being rewritten is not a change to what is measured
    changed = [line for line in changed.splitlines() if "benchmarks/results/" not in line]
    return commit + ("+changes" if changed else "")


# when this benchmark process started, the code it started with and the machine's load then: a
# result records both ends (a checkout shared with other work may move on while it runs)
STARTED = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "git_commit_at_start": git_commit(),
           "load_avg_1_5_15_at_start": [round(x, 2) for x in os.getloadavg()]}


def machine() -> dict[str, Any]:
    """What a result was measured on: platform, cores, commit, versions, and the load when the
    benchmark started and now."""
    import platform

    import torch

    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "git_commit": git_commit(), **STARTED,
            "load_avg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
            "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_result(report: dict[str, Any], out: Path) -> None:
    """Write the result (with the machine it ran on) to `out`, atomically: a benchmark that
    writes as it goes never leaves a half-written file."""
    report = {**report, "machine": machine()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, out)


def last_json_line(report: dict[str, Any], out: Path | None = None) -> None:
    """Print the result as one JSON line (with the machine it ran on) and write it to `out`."""
    print(json.dumps({**report, "machine": machine()}, sort_keys=True, default=str))
    if out is not None:
        write_result(report, out)
        print(f"wrote {out}")


def bare_loop(data_dir: Path, cfg: TrainConfig, steps: int, warmup: int = 20) -> dict[str, float]:
    """The training step and nothing else: no checkpoints, guard, telemetry, logging or
    supervisor. One thread, like a job's worker. Returns tokens/s after `warmup` steps."""
    import math

    import torch

    from tasks.model.gpt import GPT
    from tasks.train.prepared_data import DataDir, PretrainBatches
    from tasks.train.losses import cross_entropy
    from tasks.train.loop import build_optimizer
    from tasks.train.runtime import seed_everything
    from tasks.train.schedule import lr_at

    torch.set_num_threads(1)
    data = DataDir(data_dir)
    seed_everything(cfg.seed)
    model = GPT(cfg.model)
    device = torch.device("cpu")
    optimizer = build_optimizer(model, cfg.optim, device)
    batches = PretrainBatches(data.split("train"), cfg.batch_size, cfg.seed)
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    tokens, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    for step in range(steps):
        if step == warmup:
            tokens, t0, cpu0 = 0, time.perf_counter(), time.process_time()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.optim, cfg.max_steps)
        batch = batches(step)
        loss = cross_entropy(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch.tokens
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"tokens_per_s": tokens / seconds, "s_per_step": seconds / (steps - warmup),
            "tokens_per_cpu_s": tokens / cpu}


def session_cpu_s(leader: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of a session: a local
    job's runner, supervisor, worker, spare (the backend starts each job in its own session)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == leader:  # field 6 of stat: the session id
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick
