"""Supervised fine-tuning of a pretrained model on prompt/completion pairs.

    python -m tasks.finetune --config CONFIG.json --result RESULT.json   (a FinetuneConfig)

Trains on data_dir/sft/train.jsonl with loss on completion tokens only (the prompt is context,
not something to imitate). The held-out slice of sft/eval.jsonl is scored before and after, by
completion loss and by exact-match accuracy of greedy answers, so the effect of fine-tuning shows
in the result and in MLflow side by side.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tasks.common.entry import run_stage
from tasks.common.tracking import log_json_artifact, stage_run
from tasks.configs import FinetuneConfig, to_dict

log = logging.getLogger("tasks.finetune")


def main(cfg: FinetuneConfig) -> dict[str, Any]:
    import mlflow

    from tasks.train.data import SFTBatches, load_sft_splits, prompt_example
    from tasks.train.export import load_model, publish_model
    from tasks.train.losses import cross_entropy
    from tasks.train.loop import train
    from tasks.train.runtime import pick_device, seed_everything
    from tasks.train.scoring import answer_budget, completion_loss, exact_match

    with stage_run("finetune", cfg) as run:
        device = pick_device()
        seed_everything(cfg.seed)
        model, base_meta = load_model(cfg.base_model, device)
        block_size = model.config.block_size
        data, tokenizer, train_ex, eval_ex = load_sft_splits(
            cfg.data_dir, cfg.base_model, block_size, cfg.eval_examples)
        log.info("finetune: %d parameters from %s; %d train / %d eval examples", model.num_params(),
                 cfg.base_model, len(train_ex), len(eval_ex))
        mlflow.log_metric("params", model.num_params())
        mlflow.set_tag("data.content_hash", data.content_hash)

        def score(m) -> dict[str, Any]:
            return {"val_loss": completion_loss(m, eval_ex, cfg.batch_size, device),
                    "task": exact_match(m, tokenizer, eval_ex, data.eos_id,
                                        max_new_tokens=answer_budget(eval_ex), device=device)}

        before = score(model)
        log.info("before fine-tuning: completion loss %.4f, task accuracy %.3f",
                 before["val_loss"], before["task"]["accuracy"])
        mlflow.log_metrics({"val_loss_before": before["val_loss"],
                            "task_accuracy_before": before["task"]["accuracy"]}, step=0)

        result = train(
            model=model, cfg=cfg, device=device, resolved_config=to_dict(cfg),
            get_batch=SFTBatches(train_ex, cfg.batch_size, cfg.seed, block_size, data.eos_id),
            loss_fn=cross_entropy,
            evaluate=lambda m: {"val_loss": completion_loss(m, eval_ex, cfg.batch_size, device)})

        after = score(model)
        log.info("after fine-tuning: completion loss %.4f, task accuracy %.3f",
                 after["val_loss"], after["task"]["accuracy"])
        mlflow.log_metrics({"task_accuracy_after": after["task"]["accuracy"],
                            **{f"task_accuracy_after.{k}": v
                               for k, v in after["task"]["per_skill"].items()}},
                           step=result.step)
        log_json_artifact({"before": before["task"], "after": after["task"]}, "task_eval.json")

        model_dir, model_uri = publish_model(
            model, cfg.output_dir, stage="finetune", step=result.step, data_hash=data.content_hash,
            tokenizer_path=Path(cfg.base_model) / "tokenizer.json",
            source_checkpoint=result.checkpoint, parent_model_dir=cfg.base_model, parent=base_meta,
            example=prompt_example(eval_ex))
        return {
            "metrics": {"val_loss": after["val_loss"], "val_loss_before": before["val_loss"],
                        "task_accuracy_before": before["task"]["accuracy"],
                        "task_accuracy_after": after["task"]["accuracy"],
                        "train_loss": result.train_loss, "tokens_per_s": result.tokens_per_s,
                        "params": model.num_params(), "step": result.step},
            "outputs": {"model_dir": str(model_dir), "checkpoint": result.checkpoint},
            "model_uri": model_uri,
            "resumed_from": result.resumed_from,
            "mlflow_run_id": run.info.run_id,
        }


if __name__ == "__main__":
    run_stage("finetune", FinetuneConfig, main)
