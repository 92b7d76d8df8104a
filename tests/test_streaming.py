"""Token shards streamed from S3 while training (tasks/train/stream.py) and the block-shuffled
sample order that makes it sequential (tasks/train/prepared_data.py).

S3 is a local moto_server (the `moto_s3` fixture); every read goes through s3torchconnector's
client as on AWS. What a user would notice: a pretraining whose data_dir is an s3:// prefix
trains bitwise as it does on the same files on local disk, reads the same samples on another
number of processes, resumes exactly on a fresh node (empty cache, checkpoint from S3), reads
only the blocks of the windows it trains on, and keeps its cache under the size it was given.
A run made before block shuffling replays bitwise with sample_order global_permutation.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.configs import ConfigError, TrainConfig, from_dict, tiny, to_dict
from tasks.train import checkpoint as ckpt
from tasks.train.prepared_data import BlockShuffleSampler, DataDir, PretrainBatches, _block_starts
from tasks.train.seen import consumed_rows
from tests.test_resilience import run_pretrain
from tests.test_training_scale import losses

BUCKET = "llmops-stream"
# small blocks and windows, so the tiny data set has many of both
ORDER = dict(shuffle_block_rows=8, shuffle_window_blocks=2)


@pytest.fixture
def s3_data(moto_s3, tiny_data_dir, tmp_path, monkeypatch) -> str:
    """The tiny prepared data set uploaded to moto as data prep would leave it on S3; the node's
    stream cache in this test's own work dir."""
    moto_s3.create_bucket(Bucket=BUCKET)
    for path in sorted(tiny_data_dir.rglob("*")):
        if path.is_file():
            moto_s3.upload_file(str(path), BUCKET, f"prep/{path.relative_to(tiny_data_dir).as_posix()}")
    monkeypatch.setenv("LLMOPS_WORKDIR", str(tmp_path / "node"))
    return f"s3://{BUCKET}/prep"


def cfg_for(data_dir: str | Path, output_dir: Path, **overrides) -> TrainConfig:
    cfg = tiny().pretrain
    cfg.data_dir, cfg.output_dir = str(data_dir), str(output_dir)
    return from_dict(TrainConfig, {**to_dict(cfg), "hot_spare": False, **ORDER, **overrides})


def test_block_shuffle_reads_every_row_once_per_epoch_from_few_places_at_a_time():
    starts = _block_starts(np.array([0, 50, 87, 200]), 8)
    # blocks never cross a shard: 7 + 5 + 15 blocks, the last of each shard shorter
    assert len(starts) - 1 == 27 and {50, 87}.issubset(set(starts.tolist()))
    sampler = BlockShuffleSampler(starts, window_blocks=3, seed=7)
    epoch0, epoch1 = sampler.at(np.arange(200)), sampler.at(np.arange(200, 400))
    assert sorted(epoch0.tolist()) == list(range(200)) == sorted(epoch1.tolist())
    assert not np.array_equal(epoch0, epoch1)
    # the first window's positions draw from exactly its 3 blocks: a reader needs only those
    blocks = np.searchsorted(starts, epoch0, side="right") - 1
    first = sampler.window_blocks_of(0, 0)
    width = int(sum(starts[b + 1] - starts[b] for b in first))
    assert set(blocks[:width].tolist()) == set(first.tolist())
    assert set(sampler.ahead(0, 27)[:3].tolist()) == set(first.tolist())
    # a function of (seed, position) alone: a sampler made afresh (a resumed job) agrees
    again = BlockShuffleSampler(starts, window_blocks=3, seed=7)
    assert np.array_equal(again.at(np.arange(150, 260)), np.concatenate([epoch0[150:], epoch1[:60]]))


def test_global_permutation_replays_runs_made_before_block_shuffling(tiny_data_dir):
    """sample_order global_permutation is the order every run read before block shuffling: batch
    b of the old code was rows perm_e[p % n] for its positions p, perm_e = the seeded permutation
    of epoch e (the reader as it was, written out here)."""
    rows = DataDir(tiny_data_dir).split("train")
    old, g = rows.rows, 8
    reader = PretrainBatches(rows, 4, seed=1337, world_size=2, order="global_permutation")
    for b in (0, 3, old // g + 1):   # an early batch, and one in the second epoch
        positions = reader.positions(b)
        before = [np.random.default_rng([1337, int(p // old)]).permutation(old)[p % old] for p in positions]
        assert torch.equal(reader(b).inputs, rows.take(np.array(before)).inputs)
    assert reader.seen(3)["sampler"] == "epoch_permutation"   # what old checkpoints recorded


def test_a_block_shuffled_checkpoint_names_the_rows_its_ranks_read(tiny_data_dir):
    """tasks/train/seen.py's answer for a block-shuffled record is the rows the readers of every
    rank drew for the trained batches (2 ranks, 2 micro-steps, batch 5 skipped)."""
    from tasks.train import seen

    rows = DataDir(tiny_data_dir).split("train", block_rows=8)
    readers = [PretrainBatches(rows, 3, seed=11, rank=r, world_size=2, accumulation=2,
                               order="block_shuffle", window_blocks=2) for r in range(2)]
    record = readers[0].seen(9, {5})
    assert record["sampler"] == "block_shuffle" and record["block_rows"] == 8
    drawn = {int(i) for b in range(9) if b != 5 for r in readers
             for i in r.sampler.at(r.positions(b))}
    assert set(seen.rows_of(record, tiny_data_dir).tolist()) == drawn


def test_streamed_rows_are_the_local_rows_and_only_the_needed_blocks_are_read(tiny_data_dir, s3_data):
    local = DataDir(tiny_data_dir).split("train", block_rows=8)
    remote_dir = DataDir(s3_data)
    remote_dir.check_tokenizer()   # the tokenizer came along with the manifest
    remote = remote_dir.split("train", block_rows=8)
    assert remote.rows == local.rows and remote.streamed is not None
    a = PretrainBatches(local, 4, seed=3, order="block_shuffle", window_blocks=2)
    b = PretrainBatches(remote, 4, seed=3, order="block_shuffle", window_blocks=2)
    for batch in (0, 1, 2, 7):
        assert torch.equal(a(batch).inputs, b(batch).inputs)
        assert torch.equal(a(batch).targets, b(batch).targets)
    # batches 0-7 draw from the first windows only: the reader fetched those and the next, not
    # the split (it has many more blocks)
    row_bytes = remote.row_len * remote.dtype.itemsize
    assert len(remote.block_starts) - 1 > 8
    assert 0 < remote.streamed.fetched_bytes <= 8 * 8 * row_bytes
    assert remote.streamed.fetched_bytes < remote.bytes / 2


def test_the_stream_cache_stays_under_its_size(tiny_data_dir, s3_data):
    remote_dir = DataDir(s3_data, cache_gb=0.0)
    rows = remote_dir.split("train", block_rows=8)
    row_bytes = rows.row_len * rows.dtype.itemsize
    block = 8 * row_bytes
    rows.streamed.cache.limit = rows.cache_bytes = 4 * block   # two windows of two blocks
    reader = PretrainBatches(rows, 4, seed=3, order="block_shuffle", window_blocks=2)
    local = PretrainBatches(DataDir(tiny_data_dir).split("train", block_rows=8), 4, seed=3,
                            order="block_shuffle", window_blocks=2)
    for b in range(rows.rows // 4):   # one epoch: every block passes through the cache
        assert torch.equal(reader(b).inputs, local(b).inputs)
        assert rows.streamed.cache.size() <= 4 * block
    assert rows.streamed.fetched_bytes >= rows.bytes   # every row was read, none kept past its use
    # too small for two windows: refused before any training, naming the setting
    rows.cache_bytes = block
    with pytest.raises(ValueError, match="stream_cache_gb .* two windows"):
        PretrainBatches(rows, 4, seed=3, order="block_shuffle", window_blocks=2)
    with pytest.raises(ValueError, match="stream_cache_gb .* whole streamed split"):
        PretrainBatches(rows, 4, seed=3, order="global_permutation")


def test_sample_order_settings_are_checked_and_a_resume_in_another_order_is_refused(tiny_data_dir):
    with pytest.raises(ConfigError, match="sample_order"):
        cfg_for(tiny_data_dir, Path("/tmp/x"), sample_order="random")
    rows = DataDir(tiny_data_dir).split("train", block_rows=8)
    old = PretrainBatches(rows, 4, seed=3, order="global_permutation").seen(5)
    with pytest.raises(ValueError, match="sample_order 'global_permutation'"):
        PretrainBatches(rows, 4, seed=3).check_resume(old)
    PretrainBatches(rows, 4, seed=3, order="global_permutation").check_resume(old)
    other_window = PretrainBatches(rows, 4, seed=3, window_blocks=2).seen(5)
    with pytest.raises(ValueError, match="shuffle_window_blocks to 2"):
        PretrainBatches(rows, 4, seed=3, window_blocks=4).check_resume(other_window)


def _model(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(output_dir / "checkpoints" / f"step_{step:06d}")["model"]


def _run(cfg: TrainConfig, workdir: Path, **kw) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    proc, result = run_pretrain(cfg, workdir, **kw)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return json.loads(result.read_text())


def test_streamed_pretraining_is_bitwise_the_local_one_resumes_exactly_and_reads_the_same_samples_on_two_ranks(
        tiny_data_dir, s3_data, tmp_path):
    """The pretrain entrypoint, as a Batch or HyperPod node runs it (job_entry leaves an s3://
    data_dir as it is), against the same run on local files (1 process, 2 micro-steps):
    - streamed from S3 on 1 process, killed at step 12 after its step-10 checkpoint was written
      through to S3, then started again on a fresh node (new output dir, empty stream cache): it
      resumes from S3 and ends bitwise equal to the local run;
    - streamed on 2 processes (the same global batch): the checkpoints record the same rows
      consumed, and every step's loss agrees to float rounding (other rows would move it far more).
    """
    common = dict(batch_size=4, global_batch_tokens=8 * 32, log_interval=1)
    local = _run(cfg_for(tiny_data_dir, tmp_path / "local", **common), tmp_path / "w-local")

    mirror = f"s3://{BUCKET}/ckpt"
    first = cfg_for(s3_data, tmp_path / "node1", checkpoint_uri=mirror, max_restarts=0,
                    async_checkpoint=False, **common)   # step 10 is in S3 before step 11
    (tmp_path / "w1").mkdir()
    proc, _ = run_pretrain(first, tmp_path / "w1", faults="kill@12")
    assert proc.returncode != 0
    cache = Path(os.environ["LLMOPS_WORKDIR"]) / "stream-cache"
    assert any(cache.rglob("*.blk"))   # it read through the node's cache
    shutil.rmtree(cache)   # the next attempt's node has an empty disk
    resumed = _run(cfg_for(s3_data, tmp_path / "node2", checkpoint_uri=mirror, **common),
                   tmp_path / "w2")
    assert resumed["resumed_from"].endswith("step_000010")
    for name, tensor in _model(tmp_path / "local", 20).items():
        assert torch.equal(tensor, _model(tmp_path / "node2", 20)[name]), name

    two = _run(cfg_for(s3_data, tmp_path / "two", **common), tmp_path / "w-two", nproc=2)
    step = lambda out: out / "checkpoints" / "step_000020"   # noqa: E731
    assert np.array_equal(consumed_rows(step(tmp_path / "local"), tiny_data_dir),
                          consumed_rows(step(tmp_path / "two"), tiny_data_dir))
    a, b = losses(local["mlflow_run_id"]), losses(two["mlflow_run_id"])
    assert a.keys() == b.keys() and len(a) == 20
    for s in a:
        assert a[s] == pytest.approx(b[s], rel=1e-5), s


def test_a_batch_node_streams_its_token_shards_instead_of_downloading_them_before_step_1(
        tiny_data_dir, tmp_path):
    """docker/job_entry.py as a Batch node starts it (torchrun launcher, AWS_BATCH_JOB_* set, a
    fresh work dir), with the S3 behind the fake AWS's proxy (its jobs port logs every S3
    request): before the first step the node listed nothing under the data prefix and fetched
    no token shard whole, only ranged reads of the blocks its first windows need, a small part
    of the shards' bytes; data_dir reached the stage as the s3:// URI. (The same map_inputs runs
    before hyperpodrun on HyperPod.)"""
    import subprocess
    import sys

    import boto3

    from tests.aws_fixtures import DUMMY_CREDENTIALS, ENTRY, REGION, ROOT, free_port
    from tests.chaos.fake_aws import FakeAws

    fake = FakeAws(free_port(), tmp_path / "fake").start()
    try:
        s3 = boto3.client("s3", endpoint_url=fake.moto_url, region_name=REGION, **{
            k.lower(): v for k, v in DUMMY_CREDENTIALS.items() if k != "AWS_DEFAULT_REGION"})
        s3.create_bucket(Bucket=BUCKET)
        shard_bytes = 0
        for path in sorted(tiny_data_dir.rglob("*")):
            if path.is_file():
                s3.upload_file(str(path), BUCKET, f"prep/{path.relative_to(tiny_data_dir).as_posix()}")
                shard_bytes += path.stat().st_size if path.suffix == ".bin" else 0
        config = to_dict(cfg_for(f"s3://{BUCKET}/prep", Path("unused"), max_steps=5,
                                 checkpoint_interval=5, eval_interval=5))
        config["output_dir"] = f"s3://{BUCKET}/out"
        node = tmp_path / "node0"
        (node / "tmp").mkdir(parents=True)
        env = {**os.environ, **DUMMY_CREDENTIALS, "AWS_ENDPOINT_URL": fake.jobs_url,
               "PYTHONPATH": str(ROOT), "TMPDIR": str(node / "tmp"),
               "AWS_BATCH_JOB_NUM_NODES": "1", "AWS_BATCH_JOB_NODE_INDEX": "0",
               "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "127.0.0.1"}
        proc = subprocess.run(
            [sys.executable, str(ENTRY), "--entrypoint", "tasks.pretrain", "--config-json",
             json.dumps(config), "--result", f"s3://{BUCKET}/out/result.json", "--launcher",
             "torchrun", "--workdir", str(node / "work"), "--checkpoint-uri", f"s3://{BUCKET}/ckpt"],
            env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        assert json.loads((node / "work" / "config.json").read_text())["data_dir"] == f"s3://{BUCKET}/prep"
        steps = (node / "work" / "output" / "resilience" / "steps.rank0.jsonl").read_text().splitlines()
        first_step_done = json.loads(steps[0])["t1"]
        before = [r for r in fake.s3_log if r.origin == "jobs" and r.at <= first_step_done]
        assert not [r for r in before if r.operation.startswith("List") and "prep" in r.path], before
        shards = [r for r in before if f"/{BUCKET}/prep/tokens/" in r.path and r.operation == "GetObject"]
        assert shards and all(r.range.startswith("bytes=") for r in shards), shards
        # 2 windows of 2 blocks of 8 rows of 33 uint16 tokens: what its first steps read ahead
        assert sum(r.bytes for r in shards) <= 2 * 2 * 8 * 33 * 2 < shard_bytes / 20
        assert s3.get_object(Bucket=BUCKET, Key="out/result.json")["Body"].read()
        # the outputs went where the config's output_dir says (no --output-uri given), not into
        # the directory the node was started in
        outputs = s3.list_objects_v2(Bucket=BUCKET, Prefix="out/model/")["Contents"]
        assert any(o["Key"].endswith("model.safetensors") for o in outputs)
    finally:
        fake.stop()
