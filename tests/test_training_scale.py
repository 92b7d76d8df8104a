"""Training at scale on CPU: FSDP2 with sharded torch.distributed.checkpoint checkpoints, and a
global batch that stays the same whatever the world size (gradient accumulation).

Two processes under torchrun (gloo), as the local backend launches them. The uninterrupted
2-rank FSDP run is shared by the tests that compare against it; its step-5 checkpoint, copied
into a fresh output_dir, is where the world-size changes resume from (same config, so the lr
schedule and everything else match the run they continue).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import mlflow
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tasks.common.io import read_json
from tasks.common.job_tracking import chart_name
from tasks.model.causal_lm import build_model
from tasks.configs import ConfigError, TrainConfig, from_dict, tiny, to_dict
from tasks.train import checkpoint as ckpt
from tasks.train import telemetry as tm
from tasks.train.prepared_data import DataDir, PretrainBatches
from tasks.train.losses import cross_entropy
from tasks.train.loop import LoopOptions, train
from tasks.train.runtime import pick_device, seed_everything
from tasks.train.scoring import shard_loss
from tasks.train.supervisor import FATAL_EXIT
from tests.test_resilience import run_pretrain
SEQ_LEN = 32  # the tiny recipe's rows
# 4 sequences per micro-step, 8 per optimizer step: 2 ranks x 1 micro-step or 1 x 2
COMMON = dict(max_steps=10, batch_size=4, global_batch_tokens=8 * SEQ_LEN, checkpoint_interval=5,
              keep_checkpoints=3, eval_interval=10, log_interval=1, hot_spare=False,
              hang_timeout_s=60.0)


def scale_cfg(data_dir: Path, output_dir: Path, **overrides) -> TrainConfig:
    cfg = tiny().pretrain
    cfg.data_dir, cfg.output_dir = str(data_dir), str(output_dir)
    return from_dict(TrainConfig, {**to_dict(cfg), **COMMON, **overrides})


def run_job(cfg: TrainConfig, workdir: Path, *, nproc: int, faults: str = ""
            ) -> tuple[subprocess.CompletedProcess, dict]:
    """python -m tasks.pretrain (under torchrun for nproc > 1) and its result, if it wrote one."""
    workdir.mkdir(parents=True, exist_ok=True)
    proc, result = run_pretrain(cfg, workdir, faults=faults, nproc=nproc)
    return proc, json.loads(result.read_text()) if result.exists() else {}


def train_here(cfg: TrainConfig, data_dir: Path, accumulation: int
               ) -> tuple[torch.nn.Module, list[dict]]:
    """One process in this process, without MLflow: the loop as pretraining drives it."""
    data = DataDir(data_dir)
    threads = torch.get_num_threads()
    pick_device()  # the worker's thread count
    seed_everything(cfg.seed)
    model = build_model(cfg.model)
    val = data.split("val")
    try:
        result = train(
            model=model, cfg=cfg, device=torch.device("cpu"), resolved_config=to_dict(cfg),
            get_batch=PretrainBatches(data.split("train"), cfg.batch_size, cfg.seed,
                                      accumulation=accumulation),
            loss_fn=cross_entropy, tracking=False,
            evaluate=lambda m: {"val_loss": shard_loss(m, val, 4, 1, torch.device("cpu"))},
            options=LoopOptions(accumulation=accumulation,
                                global_batch=cfg.batch_size * accumulation))
    finally:
        torch.set_num_threads(threads)
    return model, result.history


def step_dir(cfg: TrainConfig, step: int) -> Path:
    return Path(cfg.output_dir) / "checkpoints" / f"step_{step:06d}"


def losses(run_id: str) -> dict[int, float]:
    history = mlflow.MlflowClient().get_metric_history(run_id, chart_name("loss"))
    return {m.step: m.value for m in history}


def resume_copy(source: Path, cfg: TrainConfig) -> None:
    """A fresh job whose output_dir holds only `source` (a checkpoint of another run)."""
    shutil.copytree(source, Path(cfg.output_dir) / "checkpoints" / source.name)


@pytest.fixture(scope="module")
def fsdp_run(tiny_data_dir, tmp_path_factory) -> tuple[TrainConfig, dict]:
    """The uninterrupted 2-rank FSDP run."""
    work = tmp_path_factory.mktemp("fsdp_uninterrupted")
    cfg = scale_cfg(tiny_data_dir, work / "out", parallelism="fsdp")
    proc, result = run_job(cfg, work, nproc=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return cfg, result


def test_fsdp_writes_shards_per_rank_and_a_killed_rank_resumes_bitwise(tiny_data_dir, tmp_path,
                                                                        fsdp_run):
    ref_cfg, ref = fsdp_run
    # no gather on rank 0: each rank wrote its own DCP shard, about half of the whole state
    saved = step_dir(ref_cfg, 5)
    manifest = read_json(saved / "manifest.json")
    assert manifest["layout"] == ckpt.SHARDED
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                         "config.json", "trainer.pt"]
    # DCP's index: every tensor of the model and the optimizer with at least 2 rows is stored as
    # two halves, one in each rank's file
    index = FileSystemReader(str(saved)).read_metadata()
    files_of: dict[str, set[str]] = {}
    for where, info in index.storage_data.items():
        files_of.setdefault(where.fqn, set()).add(info.relative_path)
    split = [k for k, m in index.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and len(m.size) and m.size[0] >= 2]
    assert any(k.startswith("model.") for k in split) and any(k.startswith("optimizer.") for k in split)
    for key in split:
        meta = index.state_dict_metadata[key]
        assert sorted(c.sizes[0] for c in meta.chunks) == [meta.size[0] // 2, meta.size[0] - meta.size[0] // 2], key
        assert files_of[key] == {"__0_0.distcp", "__1_0.distcp"}, key

    cfg = scale_cfg(tiny_data_dir, tmp_path / "out", parallelism="fsdp")
    proc, result = run_job(cfg, tmp_path, nproc=2, faults="kill@9:1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    events = tm.read_events(tm.run_dir(cfg.output_dir))
    assert [e for e in events if e["kind"] == "worker_exit" and e.get("code") == -9]
    assert {e["step"] for e in events if e["kind"] == "resume" and e.get("path")} == {5}

    final, expected = ckpt.load_checkpoint(step_dir(cfg, 10)), ckpt.load_checkpoint(step_dir(ref_cfg, 10))
    different = [k for k, v in expected["model"].items() if not torch.equal(v, final["model"][k])]
    assert not different, f"weights differ from the uninterrupted FSDP run in {different}"
    assert final["trainer"]["data_cursor"] == 10 and final["trainer"]["samples_seen"] == 80
    assert "model_uri" in result  # exported from the sharded checkpoint


def test_fsdp_on_a_fresh_node_restores_each_ranks_shards_from_s3_and_ends_bitwise(
        tiny_data_dir, tmp_path, fsdp_run, moto_s3):
    """Issue 50: an FSDP job whose checkpoints are written through to S3 (moto) is killed after
    its step-5 checkpoint; the next attempt starts on a fresh node (a new output dir: nothing on
    disk) and restores from S3, every rank fetching the shared files and then the shards its own
    load plan reads (tasks/train/checkpoint.py fetch_files), and ends bitwise equal to the
    uninterrupted run."""
    ref_cfg, _ = fsdp_run
    moto_s3.create_bucket(Bucket="fsdp-mirror")
    mirror = "s3://fsdp-mirror/run/checkpoints"
    first = scale_cfg(tiny_data_dir, tmp_path / "node1", parallelism="fsdp", checkpoint_uri=mirror,
                      max_restarts=0, async_checkpoint=False)   # step 5 is in S3 before step 6
    proc, _ = run_job(first, tmp_path / "w1", nproc=2, faults="kill@7")
    assert proc.returncode != 0
    fresh = scale_cfg(tiny_data_dir, tmp_path / "node2", parallelism="fsdp", checkpoint_uri=mirror)
    proc, result = run_job(fresh, tmp_path / "w2", nproc=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert result["resumed_from"].endswith("step_000005")
    final, expected = ckpt.load_checkpoint(step_dir(fresh, 10)), ckpt.load_checkpoint(step_dir(ref_cfg, 10))
    assert not [k for k, v in expected["model"].items() if not torch.equal(v, final["model"][k])]


def test_fsdp_checkpoint_resumed_on_one_process_reads_the_same_samples(tiny_data_dir, tmp_path,
                                                                       fsdp_run):
    ref_cfg, ref = fsdp_run
    cfg = scale_cfg(tiny_data_dir, tmp_path / "out", parallelism="fsdp")
    resume_copy(step_dir(ref_cfg, 5), cfg)
    proc, result = run_job(cfg, tmp_path, nproc=1)  # 2 micro-steps of 4 where there were 2 ranks
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "resuming on 1 processes from a checkpoint of 2" in out

    batches = [s["b"] for s in tm.read_steps(tm.run_dir(cfg.output_dir))]
    expected = [s["b"] for s in tm.read_steps(tm.run_dir(ref_cfg.output_dir)) if s["s"] > 5]
    assert batches == expected == list(range(5, 10))
    trainer = ckpt.read_part(step_dir(cfg, 10), "trainer")
    assert (trainer["world_size"], trainer["global_batch"], trainer["samples_seen"]) == (1, 8, 80)

    got, want = losses(result["mlflow_run_id"]), losses(ref["mlflow_run_id"])
    assert sorted(got) == list(range(6, 11))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), step
    final = ckpt.load_checkpoint(step_dir(cfg, 10))["model"]
    for name, value in ckpt.load_checkpoint(step_dir(ref_cfg, 10))["model"].items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_fsdp_shards_a_transformers_llama_by_decoder_layer_and_trains_as_one_process(
        tiny_data_dir, tmp_path):
    """Issue 13: a Llama built from its config (RoPE, RMSNorm, SwiGLU, 2 query heads sharing one
    key/value head) on 2 FSDP ranks, each decoder layer its own unit, trains like the same model
    in one process with 2 micro-steps, and is published as a Hugging Face Llama."""
    model = {**to_dict(tiny().pretrain.model), "arch": "llama", "n_kv_head": 1}
    cfg = scale_cfg(tiny_data_dir, tmp_path / "out", parallelism="fsdp", model=model)
    proc, result = run_job(cfg, tmp_path, nproc=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "FSDP units: 1 LlamaDecoderLayer" in out
    here, history = train_here(scale_cfg(tiny_data_dir, tmp_path / "here", parallelism="fsdp",
                                         model=model), tiny_data_dir, accumulation=2)
    got = losses(result["mlflow_run_id"])
    want = {int(h["step"]): h["loss"] for h in history if "loss" in h}
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), step
    final = ckpt.load_checkpoint(step_dir(cfg, 10))["model"]
    for name, value in here.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5, msg=name)
    config = json.loads((Path(result["outputs"]["model_dir"]) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 1


def test_ddp_on_two_processes_continues_a_one_process_run_with_accumulation(tiny_data_dir,
                                                                            tmp_path):
    """World 1 with 2 micro-steps, resumed at step 5 on 2 ranks with 1: the same samples and,
    within float tolerance, the same losses and weights as the uninterrupted one-process run."""
    one = scale_cfg(tiny_data_dir, tmp_path / "one")
    model, history = train_here(one, tiny_data_dir, accumulation=2)
    cfg = scale_cfg(tiny_data_dir, tmp_path / "two" / "out")
    resume_copy(step_dir(one, 5), cfg)
    proc, result = run_job(cfg, tmp_path / "two", nproc=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    assert [s["b"] for s in tm.read_steps(tm.run_dir(cfg.output_dir))] == list(range(5, 10))
    got = losses(result["mlflow_run_id"])
    want = {int(h["step"]): h["loss"] for h in history if "loss" in h}
    assert sorted(got) == list(range(6, 11))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), step
    final = ckpt.load_checkpoint(step_dir(cfg, 10))
    assert final["trainer"]["world_size"] == 2 and final["trainer"]["samples_seen"] == 80
    for name, value in model.state_dict().items():
        torch.testing.assert_close(final["model"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_accumulation_reads_the_micro_batches_of_more_ranks_and_trains_like_a_bigger_batch(
        tiny_data_dir, tmp_path):
    rows = DataDir(tiny_data_dir).split("train")
    accumulated = PretrainBatches(rows, 4, seed=3, accumulation=2)
    ranks = [PretrainBatches(rows, 4, seed=3, rank=r, world_size=2) for r in range(2)]
    bigger = PretrainBatches(rows, 8, seed=3)
    for b in range(4):
        micro = accumulated(b).split(2)
        for r in range(2):  # micro-step m of one process is exactly rank m's batch of two
            assert torch.equal(micro[r].inputs, ranks[r](b).inputs)
        assert torch.equal(torch.cat([m.inputs for m in micro]), bigger(b).inputs)

    model, history = train_here(scale_cfg(tiny_data_dir, tmp_path / "a", max_steps=6),
                                tiny_data_dir, accumulation=2)
    reference, ref_history = train_here(
        scale_cfg(tiny_data_dir, tmp_path / "b", max_steps=6, batch_size=8,
                  global_batch_tokens=0), tiny_data_dir, accumulation=1)
    got = [h["loss"] for h in history if "loss" in h]
    want = [h["loss"] for h in ref_history if "loss" in h]
    assert len(got) == 6 and got == pytest.approx(want, rel=1e-5)
    # float rounding of 6 steps of sums taken in another order: at most 1.1e-6 on block-shuffled
    # rows (4e-7 on the same steps in the global permutation)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=2e-6, msg=name)


def test_a_global_batch_the_world_size_cannot_divide_is_refused_at_start(tiny_data_dir, tmp_path):
    cfg = scale_cfg(tiny_data_dir, tmp_path / "out")
    assert cfg.accumulation_steps(SEQ_LEN, 1) == 2 and cfg.accumulation_steps(SEQ_LEN, 2) == 1
    with pytest.raises(ConfigError, match=r"global_batch_tokens \(256\) is not a multiple of "
                                          r"batch_size x seq_len x world size = 4 x 32 x 4 = 512"):
        cfg.accumulation_steps(SEQ_LEN, 4)
    bad = scale_cfg(tiny_data_dir, tmp_path / "bad", global_batch_tokens=200)
    proc, _ = run_job(bad, tmp_path, nproc=1)
    assert proc.returncode == FATAL_EXIT  # the supervisor does not restart a config error
    assert ("global_batch_tokens (200) is not a multiple of batch_size x seq_len x world size = "
            "4 x 32 x 1 = 128: set global_batch_tokens to 128 or 256") in proc.stderr + proc.stdout
