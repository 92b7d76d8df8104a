"""Checkpoint retention: the newest keep_checkpoints plus every keep_every-th step, on local disk
and on S3 (a local moto server), set in TrainConfig; the step just written and an upload not yet
committed are never pruned."""

from __future__ import annotations

import pytest

from tasks.configs import ConfigError, TrainConfig, from_dict, to_dict
from tasks.train import checkpoint as ckpt
from tasks.train.retention import prunable
from tasks.train.checkpoint_s3 import S3Mirror
from tests.test_resilience import run_pretrain, tiny_cfg


def test_the_rule_keeps_the_newest_the_multiples_and_the_step_just_written():
    steps = [2, 4, 6, 8, 10, 12]
    assert prunable(steps, keep_last=2) == [8, 6, 4, 2]
    assert prunable(steps, keep_last=2, keep_every=4) == [6, 2]
    # after a rollback to step 6, stale steps 10 and 12 outnumber the one just written: it stays
    assert 6 not in prunable(steps, keep_last=2, newest=6)
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        prunable(steps, keep_last=0)


def test_keep_every_is_validated_against_the_checkpoint_interval(tmp_path):
    base = {"data_dir": "d", "output_dir": str(tmp_path), "checkpoint_interval": 50}
    assert from_dict(TrainConfig, {**base, "keep_every": 1000}).keep_every == 1000
    with pytest.raises(ConfigError, match=r"keep_every \(120\) must be 0 or a multiple of "
                                          r"TrainConfig\.checkpoint_interval \(50\).*Set keep_every to 100"):
        from_dict(TrainConfig, {**base, "keep_every": 120})
    with pytest.raises(ConfigError, match="keep_every must be >= 0"):
        from_dict(TrainConfig, {**base, "keep_every": -50})


def test_a_pretraining_job_keeps_the_newest_and_every_kth_on_disk_and_s3(moto_s3, tiny_data_dir,
                                                                          tmp_path):
    """python -m tasks.pretrain as a backend runs it, mirroring to S3: checkpoints every 2 steps
    up to 12, keep_checkpoints 2 and keep_every 4 leave steps 4, 8, 10 and 12, in both places."""
    moto_s3.create_bucket(Bucket="ckpts")
    cfg = tiny_cfg(tiny_data_dir, tmp_path / "job", max_steps=12, checkpoint_interval=2,
                   keep_checkpoints=2, keep_every=4, eval_interval=12, log_interval=4,
                   hot_spare=False, checkpoint_uri="s3://ckpts/run/checkpoints")
    proc, _ = run_pretrain(cfg, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    local = ckpt.step_dirs(tmp_path / "job" / "checkpoints")
    assert [s for s, _ in local] == [12, 10, 8, 4]
    assert all(ckpt.verify_checkpoint(p) is None for _, p in local)
    mirror = S3Mirror(cfg.checkpoint_uri)
    assert mirror.steps() == [12, 10, 8, 4]

    # an upload in flight (files, no manifest yet) is not a checkpoint: pruning leaves it alone
    moto_s3.put_object(Bucket="ckpts", Key="run/checkpoints/step_000014/model.pt", Body=b"part")
    mirror.prune(1, every=4, newest=12)
    assert mirror.steps() == [12, 8, 4]
    keys = [o["Key"] for o in moto_s3.list_objects_v2(Bucket="ckpts")["Contents"]]
    assert "run/checkpoints/step_000014/model.pt" in keys
    assert not [k for k in keys if "step_000010" in k]
    assert to_dict(cfg)["keep_every"] == 4
