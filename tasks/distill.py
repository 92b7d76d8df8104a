"""Distillation: a smaller student learns to match a frozen teacher on the SFT task.

    python -m tasks.distill --config CONFIG.json --result RESULT.json   (a DistillConfig)

Loss on completion tokens only: alpha * T^2 * KL(softmax(teacher/T) || softmax(student/T))
+ (1 - alpha) * CE(student, reference completion). The student shares the teacher's tokenizer,
so its vocab_size and block_size are taken from the teacher whatever cfg.student says.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from tasks.common.entry import run_stage
from tasks.common.tracking import log_json_artifact, stage_run
from tasks.configs import DistillConfig, to_dict

log = logging.getLogger("tasks.distill")


def main(cfg: DistillConfig) -> dict[str, Any]:
    import mlflow

    from tasks.model import GPT
    from tasks.train.data import SFTBatches, load_sft_splits, prompt_example
    from tasks.train.export import load_model, publish_model
    from tasks.train.losses import distillation
    from tasks.train.loop import train
    from tasks.train.runtime import pick_device, seed_everything
    from tasks.train.scoring import answer_budget, completion_loss, exact_match

    with stage_run("distill", cfg) as run:
        device = pick_device()
        teacher, teacher_meta = load_model(cfg.teacher_model, device)
        # frozen: eval mode (no dropout) and no gradients, so it costs one forward per batch
        teacher.eval().requires_grad_(False)
        student_cfg = dataclasses.replace(cfg.student, vocab_size=teacher.config.vocab_size,
                                          block_size=teacher.config.block_size)
        seed_everything(cfg.seed)
        student = GPT(student_cfg).to(device)
        data, tokenizer, train_ex, eval_ex = load_sft_splits(
            cfg.data_dir, cfg.teacher_model, student_cfg.block_size, cfg.eval_examples)
        log.info("distill: teacher %d parameters -> student %d (%.1fx smaller); %d train examples",
                 teacher.num_params(), student.num_params(),
                 teacher.num_params() / student.num_params(), len(train_ex))
        mlflow.set_tag("data.content_hash", data.content_hash)
        mlflow.log_metrics({"params": student.num_params(), "teacher_params": teacher.num_params()})

        result = train(
            model=student, cfg=cfg, device=device, resolved_config=to_dict(cfg),
            get_batch=SFTBatches(train_ex, cfg.batch_size, cfg.seed, student_cfg.block_size,
                                 data.eos_id),
            loss_fn=distillation(teacher, cfg.temperature, cfg.alpha),
            # the held-out metric is plain completion CE, comparable with fine-tuning's val_loss
            evaluate=lambda m: {"val_loss": completion_loss(m, eval_ex, cfg.batch_size, device)})

        budget = answer_budget(eval_ex)
        student_task = exact_match(student, tokenizer, eval_ex, data.eos_id, budget, device)
        teacher_task = exact_match(teacher, tokenizer, eval_ex, data.eos_id, budget, device)
        teacher_loss = completion_loss(teacher, eval_ex, cfg.batch_size, device)
        log.info("task accuracy: student %.3f, teacher %.3f", student_task["accuracy"],
                 teacher_task["accuracy"])
        mlflow.log_metrics({"task_accuracy": student_task["accuracy"],
                            "teacher_task_accuracy": teacher_task["accuracy"],
                            "teacher_val_loss": teacher_loss}, step=result.step)
        log_json_artifact({"student": student_task, "teacher": teacher_task}, "task_eval.json")

        model_dir, model_uri = publish_model(
            student, cfg.output_dir, stage="distill", step=result.step, data_hash=data.content_hash,
            tokenizer_path=Path(cfg.teacher_model) / "tokenizer.json",
            source_checkpoint=result.checkpoint, parent_model_dir=cfg.teacher_model,
            parent=teacher_meta, example=prompt_example(eval_ex))
        return {
            "metrics": {"val_loss": result.val["val_loss"], "teacher_val_loss": teacher_loss,
                        "task_accuracy": student_task["accuracy"],
                        "teacher_task_accuracy": teacher_task["accuracy"],
                        "train_loss": result.train_loss, "tokens_per_s": result.tokens_per_s,
                        "params": student.num_params(), "teacher_params": teacher.num_params(),
                        "step": result.step},
            "outputs": {"model_dir": str(model_dir), "checkpoint": result.checkpoint},
            "model_uri": model_uri,
            "resumed_from": result.resumed_from,
            "mlflow_run_id": run.info.run_id,
        }


if __name__ == "__main__":
    run_stage("distill", DistillConfig, main)
