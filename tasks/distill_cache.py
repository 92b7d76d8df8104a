"""The teacher half of cached distillation: its top-k logits on everything the student will see.

    python -m tasks.distill_cache --config CONFIG.json --result RESULT.json   (a DistillConfig)

Takes the same DistillConfig as the student's job and writes the cache to cfg.teacher_cache: the
teacher's top cache_top_k logits at every loss position of the SFT train examples and on every
pretraining row the student's steps will replay (batches are a function of the step, so that set
is known in advance). The student's job (`python -m tasks.distill` with the same config) then
trains without loading the teacher. See tasks/posttrain/teacher_cache.py for the format.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tasks.common.entry import run_stage
from tasks.common.job_tracking import stage_run
from tasks.configs import ConfigError, DistillConfig

log = logging.getLogger("tasks.distill_cache")


def main(cfg: DistillConfig) -> dict[str, Any]:
    import mlflow

    from tasks.distill import student_block_size, teacher_scores
    from tasks.posttrain.batches import SFTSteps
    from tasks.posttrain.datasets import load_sft_data
    from tasks.posttrain.sources import resolve_model_dir
    from tasks.posttrain.teacher_cache import build_cache, cache_key, replayed_rows
    from tasks.train.export import load_model
    from tasks.train.runtime import pick_device

    if not cfg.teacher_cache:
        raise ConfigError("DistillConfig.teacher_cache must name the directory to write the cache to.")
    with stage_run("distill_cache", cfg) as run:
        device = pick_device()
        teacher_dir = resolve_model_dir(cfg.teacher_model, Path(cfg.output_dir) / "sources")
        teacher, _ = load_model(teacher_dir, device)
        teacher.eval().requires_grad_(False)
        block_size = student_block_size(cfg, teacher_dir)
        sft = load_sft_data(cfg.data_dir, teacher_dir, block_size, cfg.eval_examples)
        replay = sft.replay_rows() if cfg.replay_fraction else None
        steps = SFTSteps(sft.train, batch_size=cfg.batch_size, seed=cfg.seed, block_size=block_size,
                         pad_id=sft.eos_id, replay_rows=replay, replay_fraction=cfg.replay_fraction)
        rows = replayed_rows(steps, cfg.max_steps)
        key = cache_key(teacher_dir=teacher_dir, data_hash=sft.data.content_hash,
                        sft_sha256=sft.sha256, top_k=cfg.cache_top_k, block_size=block_size,
                        replay_rows=rows)
        path = build_cache(teacher, cfg.teacher_cache, key=key, examples=sft.train, replay=replay,
                           replay_rows=rows, batch_size=cfg.batch_size, device=device,
                           teacher_metrics=teacher_scores(teacher, sft, cfg, device))
        manifest = (path / "manifest.json").read_text()
        mlflow.log_text(manifest, "teacher_cache_manifest.json")
        size = sum(f.stat().st_size for f in path.iterdir())
        mlflow.log_metrics({"cache_bytes": size, "replay_rows": len(rows),
                            "teacher_params": teacher.num_params()})
        return {"metrics": {"cache_bytes": size, "replay_rows": len(rows),
                            "examples": len(sft.train), "top_k": cfg.cache_top_k},
                "outputs": {"teacher_cache": str(path)},
                "mlflow_run_id": run.info.run_id}


if __name__ == "__main__":
    run_stage("distill_cache", DistillConfig, main)
