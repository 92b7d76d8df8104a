"""Supervised fine-tuning of a model on prompt/completion or chat pairs.

    python -m tasks.finetune --config CONFIG.json --result RESULT.json   (a FinetuneConfig)

Starts from a Hugging Face causal-LM directory (ours or any transformers model), an s3:// prefix
holding one, a checkpoint or a registered MLflow model (tasks/posttrain/sources.py). Trains on data_dir/sft/train.jsonl (or cfg.train_files) with loss on completion
tokens only (the prompt is context, not something to imitate), full or LoRA, examples padded or
packed. A share of every step replays pretraining rows with plain LM loss, so the model keeps its
prose (without it the demo model's held-out perplexity goes from ~56 to millions). Before and
after, the held-out examples are scored by completion loss and exact-match accuracy, and the held-
out pretraining rows by perplexity, so both the gain and any forgetting show in the result and in
MLflow side by side. Checkpoints and resume are the shared loop's, as in pretraining: with
checkpoint_uri set (on Batch and HyperPod the job's entry sets it), every checkpoint is written
through to S3 as it commits and a new attempt on a fresh node resumes from there.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from tasks.common.entry import run_stage
from tasks.common.job_tracking import log_json_artifact, stage_run
from tasks.configs import FinetuneConfig, to_dict

log = logging.getLogger("tasks.finetune")


def main(cfg: FinetuneConfig) -> dict[str, Any]:
    import mlflow

    from tasks.posttrain.batches import SFTSteps
    from tasks.posttrain.datasets import load_sft_data
    from tasks.posttrain.lora import ADAPTER_DIR, add_lora, trainable_parameters
    from tasks.posttrain.objectives import next_token_loss, with_replay
    from tasks.posttrain.sources import resolve_model_dir
    from tasks.train.export import load_model, publish_model, published
    from tasks.train.loop import one_process_options, train
    from tasks.train.runtime import pick_device, seed_everything
    from tasks.train.scoring import answer_budget, completion_loss, exact_match, shard_loss

    with stage_run("finetune", cfg) as run:
        device = pick_device()
        seed_everything(cfg.seed)
        base_dir = resolve_model_dir(cfg.base_model, Path(cfg.output_dir) / "sources")
        model, base_meta = load_model(base_dir, device)
        block_size = model.config.block_size
        sft = load_sft_data(cfg.data_dir, base_dir, block_size, cfg.eval_examples,
                            cfg.train_files, cfg.eval_files)
        val_rows = sft.val_rows()
        log.info("finetune: %d parameters from %s; %d train / %d eval examples", model.num_params(),
                 cfg.base_model, len(sft.train), len(sft.eval))
        mlflow.log_metric("params", model.num_params())
        mlflow.set_tags({"data.content_hash": sft.data.content_hash, "sft.sha256": sft.sha256,
                         "base_model": cfg.base_model})

        def held_out(m) -> dict[str, float]:
            return {"val_loss": completion_loss(m, sft.eval, cfg.batch_size, device),
                    "prose_val_loss": shard_loss(m, val_rows, cfg.batch_size, cfg.eval_batches,
                                                 device)}

        def score(m) -> dict[str, Any]:
            return {**held_out(m),
                    "task": exact_match(m, sft.tokenizer, sft.eval, sft.eos_id,
                                        max_new_tokens=answer_budget(sft.eval), device=device)}

        before = score(model)
        log.info("before fine-tuning: completion loss %.4f, task accuracy %.3f, prose perplexity "
                 "%.2f", before["val_loss"], before["task"]["accuracy"],
                 math.exp(before["prose_val_loss"]))
        mlflow.log_metrics({"loss/val_before": before["val_loss"],
                            "prose/perplexity_before": math.exp(before["prose_val_loss"]),
                            "task/accuracy_before": before["task"]["accuracy"]}, step=0)

        adapters = None
        if cfg.lora_rank:
            adapters = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                                cfg.lora_targets)
        mlflow.log_metric("trainable_params", trainable_parameters(model))

        result = train(
            model=model, cfg=cfg, device=device, resolved_config=to_dict(cfg),
            get_batch=SFTSteps(sft.train, batch_size=cfg.batch_size, seed=cfg.seed,
                               block_size=block_size, pad_id=sft.eos_id, packing=cfg.packing,
                               replay_rows=sft.replay_rows() if cfg.replay_fraction else None,
                               replay_fraction=cfg.replay_fraction),
            loss_fn=with_replay(next_token_loss, cfg.replay_fraction),
            evaluate=held_out, options=one_process_options(cfg))
        adapter_dir = None
        if adapters is not None:
            # peft's own format, for serving the base with adapters (vLLM, TGI, PeftModel)
            adapter_dir = adapters.save(Path(cfg.output_dir) / ADAPTER_DIR, str(base_dir))
            mlflow.log_artifacts(str(adapter_dir), artifact_path=ADAPTER_DIR)
            model = adapters.merge()  # a plain model again: what every later stage loads

        after = score(model)
        log.info("after fine-tuning: completion loss %.4f, task accuracy %.3f, prose perplexity "
                 "%.2f", after["val_loss"], after["task"]["accuracy"],
                 math.exp(after["prose_val_loss"]))
        mlflow.log_metrics({"task/accuracy_after": after["task"]["accuracy"],
                            "prose/perplexity_after": math.exp(after["prose_val_loss"]),
                            **{f"task/accuracy_after.{k}": v
                               for k, v in after["task"]["per_skill"].items()}},
                           step=result.step)
        log_json_artifact({"before": before["task"], "after": after["task"]}, "task_eval.json")

        model_dir, model_uri = publish_model(
            model, cfg.output_dir, stage="finetune", step=result.step,
            data_hash=sft.data.content_hash, tokenizer_path=base_dir / "tokenizer.json",
            source_checkpoint=result.checkpoint, parent_model_dir=cfg.base_model,
            parent=base_meta, eos_id=sft.eos_id,
            extra_lineage={"sft_sha256": sft.sha256, "lora_rank": cfg.lora_rank,
                           "parent_registered_version": _registered(base_meta)})
        return {
            "metrics": {"val_loss": after["val_loss"], "val_loss_before": before["val_loss"],
                        "prose_perplexity_before": math.exp(before["prose_val_loss"]),
                        "prose_perplexity_after": math.exp(after["prose_val_loss"]),
                        "task_accuracy_before": before["task"]["accuracy"],
                        "task_accuracy_after": after["task"]["accuracy"],
                        "train_loss": result.train_loss, "tokens_per_s": result.tokens_per_s,
                        "params": model.num_params(), "step": result.step},
            "outputs": {"model_dir": str(model_dir), "checkpoint": result.checkpoint,
                        **({"adapter_dir": str(adapter_dir)} if adapter_dir else {})},
            **published(model_dir, model_uri),
            "resumed_from": result.resumed_from,
            "mlflow_run_id": run.info.run_id,
        }


def _registered(meta: dict[str, Any]) -> str | None:
    if meta.get("registered_model"):
        return f"{meta['registered_model']}/{meta['registered_version']}"
    return None


if __name__ == "__main__":
    run_stage("finetune", FinetuneConfig, main)
