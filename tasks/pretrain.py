"""Pretraining: next-token prediction on the packed token shards of data prep.

    python -m tasks.pretrain --config CONFIG.json --result RESULT.json   (a TrainConfig)

Writes output_dir/checkpoints/step_*/ while training (a retry resumes from the newest valid one)
and output_dir/model/ at the end, logged to the stage's MLflow run as a model.
"""

from __future__ import annotations

import logging
from typing import Any

from tasks.common.entry import run_stage
from tasks.common.tracking import stage_run
from tasks.configs import ModelConfig, TrainConfig, to_dict

log = logging.getLogger("tasks.pretrain")


def check_model_fits_data(model: ModelConfig, vocab_size: int, seq_len: int) -> None:
    if model.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size ({model.vocab_size}) is smaller than the tokenizer's "
                         f"vocabulary ({vocab_size}); set model.vocab_size >= {vocab_size}.")
    if model.block_size < seq_len:
        raise ValueError(f"model.block_size ({model.block_size}) is shorter than the data's rows "
                         f"(seq_len {seq_len}); set model.block_size >= {seq_len}.")


def pretrain(cfg: TrainConfig, stage: str = "pretrain", publish: bool = True) -> dict[str, Any]:
    """Train from scratch (or resume) on cfg.data_dir. Sweep trials call this with publish=False:
    they only need the val loss, not a model directory or an MLflow model."""
    import mlflow

    from tasks.model import GPT
    from tasks.train.data import DataDir, PretrainBatches
    from tasks.train.export import publish_model
    from tasks.train.losses import cross_entropy
    from tasks.train.loop import train
    from tasks.train.runtime import pick_device, seed_everything
    from tasks.train.scoring import shard_loss

    with stage_run(stage, cfg) as run:
        device = pick_device()
        data = DataDir(cfg.data_dir)
        data.check_tokenizer()
        check_model_fits_data(cfg.model, data.vocab_size, data.seq_len)
        train_rows, val_rows = data.split("train"), data.split("val")

        seed_everything(cfg.seed)  # the initial weights are part of what the seed reproduces
        model = GPT(cfg.model).to(device)
        log.info("%s: %d parameters on %s; %d train rows x %d tokens, data %s", stage,
                 model.num_params(), device, train_rows.rows, data.seq_len, data.content_hash[:12])
        mlflow.set_tags({"data.content_hash": data.content_hash})
        mlflow.log_metric("params", model.num_params())

        result = train(
            model=model, cfg=cfg, device=device, resolved_config=to_dict(cfg),
            get_batch=PretrainBatches(train_rows, cfg.batch_size, cfg.seed),
            loss_fn=cross_entropy,
            evaluate=lambda m: {"val_loss": shard_loss(m, val_rows, cfg.batch_size,
                                                       cfg.eval_batches, device)})

        out: dict[str, Any] = {
            "metrics": {"val_loss": result.val["val_loss"], "train_loss": result.train_loss,
                        "tokens_per_s": result.tokens_per_s, "params": model.num_params(),
                        "lr": cfg.optim.lr, "step": result.step},
            "outputs": {"checkpoint": result.checkpoint},
            "resumed_from": result.resumed_from,
            "mlflow_run_id": run.info.run_id,
        }
        if publish:
            model_dir, model_uri = publish_model(
                model, cfg.output_dir, stage=stage, step=result.step, data_hash=data.content_hash,
                tokenizer_path=data.tokenizer_path, source_checkpoint=result.checkpoint,
                example=val_rows.take(val_rows.in_order(2, 1)[0]).inputs[:, :16])
            out["outputs"]["model_dir"] = str(model_dir)
            out["model_uri"] = model_uri
        return out


def main(cfg: TrainConfig) -> dict[str, Any]:
    return pretrain(cfg)


if __name__ == "__main__":
    run_stage("pretrain", TrainConfig, main)
