"""Distillation: a smaller student learns to match a frozen teacher.

    python -m tasks.distill --config CONFIG.json --result RESULT.json   (a DistillConfig)

Loss on completion tokens: alpha * T^2 * KL(softmax(teacher/T) || softmax(student/T))
+ (1 - alpha) * CE(student, reference completion). A share of every step (replay_fraction) is
pretraining rows under the same loss on every token, so the student learns prose from the
teacher's logits as well as the task; a student that only sees the task cannot model text.

The teacher runs in this job, or (teacher_cache set) its top-k logits are read from the cache
`python -m tasks.distill_cache` wrote with the same config. Teacher and student may be of any
architectures (a transformers Llama teacher and our GPT student, say) as long as they share the
tokenizer: a student built from cfg.student takes the teacher's vocab_size and context whatever
cfg.student says; one given as cfg.student_model must have the teacher's tokenizer (refused
otherwise, naming both). With quantize_int8 the trained student is also quantized and measured
against its float self. Checkpoints and resume are the shared loop's, written through to
checkpoint_uri when set, as fine-tuning's are.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from tasks.common.entry import run_stage
from tasks.common.job_tracking import log_json_artifact, stage_run
from tasks.configs import DistillConfig, to_dict

log = logging.getLogger("tasks.distill")

# The final scores' MLflow names: grouped for the charts as the training curves are
# (tasks.common.job_tracking.CHART_NAMES); the result keeps the plain keys.
FINAL_NAMES = {"val_loss": "loss/val", "prose_perplexity": "prose/perplexity",
               "task_accuracy": "task/accuracy", "teacher_val_loss": "teacher/val_loss",
               "teacher_prose_perplexity": "teacher/prose_perplexity",
               "teacher_task_accuracy": "teacher/task_accuracy"}


def student_block_size(cfg: DistillConfig, teacher_dir: Path) -> int:
    """The context the student trains with (what the teacher cache is computed for)."""
    from tasks.posttrain.sources import resolve_model_dir, student_config, vocab_and_context

    if cfg.student_model:
        return vocab_and_context(resolve_model_dir(cfg.student_model,
                                                   Path(cfg.output_dir) / "sources"))[1]
    return student_config(cfg.student, teacher_dir).block_size


def check_student_tokenizer(student_dir: Path, teacher_dir: Path, student_ref: str,
                            teacher_ref: str) -> None:
    """Distillation matches logits token by token: both models must share one tokenizer."""
    from tasks.common.hf_dir import same_tokenizer
    from tasks.configs import ConfigError

    ours, theirs = student_dir / "tokenizer.json", teacher_dir / "tokenizer.json"
    if not same_tokenizer(ours.read_bytes(), theirs.read_bytes()):
        raise ConfigError(f"DistillConfig.student_model {student_ref} has another tokenizer than "
                          f"teacher_model {teacher_ref} ({ours} vs {theirs}): distillation matches "
                          "their token distributions id by id. Pick a student with the teacher's "
                          "tokenizer, or leave student_model empty to build one from `student`.")


def build_student(cfg: DistillConfig, teacher_dir: Path, device):
    """The student: cfg.student_model (tokenizer checked against the teacher's), else a fresh
    model of cfg.student with the teacher's vocabulary and context."""
    from tasks.model.causal_lm import build_model
    from tasks.posttrain.sources import resolve_model_dir, student_config
    from tasks.train.export import load_model

    if cfg.student_model:
        student_dir = resolve_model_dir(cfg.student_model, Path(cfg.output_dir) / "sources")
        check_student_tokenizer(student_dir, teacher_dir, cfg.student_model, cfg.teacher_model)
        return load_model(student_dir, device)[0]
    return build_model(student_config(cfg.student, teacher_dir)).to(device)


def main(cfg: DistillConfig) -> dict[str, Any]:
    import mlflow

    from tasks.posttrain.batches import SFTSteps
    from tasks.posttrain.datasets import load_sft_data
    from tasks.posttrain.objectives import cached_kd, online_kd, with_replay
    from tasks.posttrain.sources import resolve_model_dir
    from tasks.posttrain.teacher_cache import TeacherCache, cache_key, replayed_rows
    from tasks.train.export import load_model, publish_model, published, read_meta
    from tasks.train.loop import one_process_options, train
    from tasks.train.runtime import pick_device, seed_everything
    from tasks.train.scoring import answer_budget, completion_loss, exact_match, shard_loss

    with stage_run("distill", cfg) as run:
        device = pick_device()
        teacher_dir = resolve_model_dir(cfg.teacher_model, Path(cfg.output_dir) / "sources")
        teacher_meta = read_meta(teacher_dir)
        seed_everything(cfg.seed)
        student = build_student(cfg, teacher_dir, device)
        block_size = student.config.block_size
        sft = load_sft_data(cfg.data_dir, teacher_dir, block_size, cfg.eval_examples)
        val_rows = sft.val_rows()
        steps_kwargs = dict(batch_size=cfg.batch_size, seed=cfg.seed,
                            block_size=block_size, pad_id=sft.eos_id,
                            packing=cfg.packing,
                            replay_rows=sft.replay_rows() if cfg.replay_fraction else None,
                            replay_fraction=cfg.replay_fraction)

        teacher, cache = None, None
        if cfg.teacher_cache:
            key = cache_key(teacher_dir=teacher_dir, data_hash=sft.data.content_hash,
                            sft_sha256=sft.sha256, top_k=cfg.cache_top_k,
                            block_size=block_size,
                            replay_rows=replayed_rows(SFTSteps(sft.train, **steps_kwargs),
                                                      cfg.max_steps))
            cache = TeacherCache(cfg.teacher_cache, expected_key=key)
            loss = cached_kd(cfg.temperature, cfg.alpha)
            teacher_params = int(cache.teacher_metrics["params"])
        else:
            teacher, _ = load_model(teacher_dir, device)
            # frozen: eval mode (no dropout) and no gradients, so it costs one forward per batch
            teacher.eval().requires_grad_(False)
            loss = online_kd(teacher, cfg.temperature, cfg.alpha)
            teacher_params = teacher.num_params()
        log.info("distill: teacher %d parameters -> student %d (%.1fx smaller); %d train "
                 "examples; teacher %s", teacher_params, student.num_params(),
                 teacher_params / student.num_params(), len(sft.train),
                 f"from cache {cfg.teacher_cache}" if cache else "online")
        mlflow.set_tag("data.content_hash", sft.data.content_hash)
        mlflow.log_metrics({"params": student.num_params(), "teacher_params": teacher_params})

        def held_out(m) -> dict[str, float]:
            # plain completion CE, comparable with fine-tuning's val_loss
            return {"val_loss": completion_loss(m, sft.eval, cfg.batch_size, device),
                    "prose_val_loss": shard_loss(m, val_rows, cfg.batch_size, cfg.eval_batches,
                                                 device)}

        result = train(
            model=student, cfg=cfg, device=device, resolved_config=to_dict(cfg),
            get_batch=SFTSteps(sft.train, teacher_cache=cache, **steps_kwargs),
            loss_fn=with_replay(loss, cfg.replay_fraction), evaluate=held_out,
            options=one_process_options(cfg))

        budget = answer_budget(sft.eval)
        student_task = exact_match(student, sft.tokenizer, sft.eval, sft.eos_id, budget, device)
        student_held_out = held_out(student)
        if teacher is not None:
            teacher_metrics = teacher_scores(teacher, sft, cfg, device)
        else:
            teacher_metrics = cache.teacher_metrics
        log.info("task accuracy: student %.3f, teacher %.3f; prose perplexity: student %.2f, "
                 "teacher %.2f", student_task["accuracy"], teacher_metrics["task_accuracy"],
                 math.exp(student_held_out["prose_val_loss"]),
                 math.exp(teacher_metrics["prose_val_loss"]))
        metrics = {"val_loss": student_held_out["val_loss"],
                   "prose_perplexity": math.exp(student_held_out["prose_val_loss"]),
                   "task_accuracy": student_task["accuracy"],
                   "teacher_val_loss": teacher_metrics["val_loss"],
                   "teacher_prose_perplexity": math.exp(teacher_metrics["prose_val_loss"]),
                   "teacher_task_accuracy": teacher_metrics["task_accuracy"],
                   "params_ratio": student.num_params() / teacher_params}
        mlflow.log_metrics({FINAL_NAMES.get(k, k): v for k, v in metrics.items()}, step=result.step)
        log_json_artifact({"student": student_task, "teacher": teacher_metrics}, "task_eval.json")

        model_dir, model_uri = publish_model(
            student, cfg.output_dir, stage="distill", step=result.step,
            data_hash=sft.data.content_hash, tokenizer_path=teacher_dir / "tokenizer.json",
            source_checkpoint=result.checkpoint, parent_model_dir=cfg.teacher_model,
            parent=teacher_meta, eos_id=sft.eos_id,
            extra_lineage={"sft_sha256": sft.sha256, "teacher_cache": cfg.teacher_cache or None,
                           "student_model": cfg.student_model or None})
        out = {
            "metrics": {**metrics, "train_loss": result.train_loss,
                        "tokens_per_s": result.tokens_per_s, "params": student.num_params(),
                        "teacher_params": teacher_params, "step": result.step},
            "outputs": {"model_dir": str(model_dir), "checkpoint": result.checkpoint},
            **published(model_dir, model_uri),
            "resumed_from": result.resumed_from,
            "mlflow_run_id": run.info.run_id,
        }
        if cfg.quantize_int8:
            int8 = quantize_student(student, sft, cfg, model_dir, device)
            out["metrics"].update({f"int8.{k}": v for k, v in int8["report"].items()})
            out["outputs"]["int8_model_dir"] = int8["model_dir"]
        return out


def teacher_scores(teacher, sft, cfg: DistillConfig, device) -> dict[str, Any]:
    """The teacher's held-out numbers, for the student to be compared with."""
    from tasks.train.scoring import answer_budget, completion_loss, exact_match, shard_loss

    task = exact_match(teacher, sft.tokenizer, sft.eval, sft.eos_id, answer_budget(sft.eval),
                       device)
    return {"task_accuracy": task["accuracy"], "per_skill": task["per_skill"],
            "val_loss": completion_loss(teacher, sft.eval, cfg.batch_size, device),
            "prose_val_loss": shard_loss(teacher, sft.val_rows(), cfg.batch_size,
                                         cfg.eval_batches, device),
            "params": teacher.num_params()}


def quantize_student(student, sft, cfg: DistillConfig, model_dir: Path, device) -> dict[str, Any]:
    """Quantize the float student to int8, measure both on CPU, write model_int8/ beside it."""
    import mlflow
    import torch

    from tasks.common.job_tracking import log_json_artifact
    from tasks.posttrain.quantize import compare_int8, export_int8, quantize_int8
    from tasks.train.export import read_meta
    from tasks.train.scoring import answer_budget, exact_match, shard_loss

    cpu = torch.device("cpu")
    val_rows = sft.val_rows()
    budget = answer_budget(sft.eval)

    def quality(m) -> dict[str, float]:
        return {"perplexity": math.exp(shard_loss(m, val_rows, cfg.batch_size, cfg.eval_batches,
                                                  cpu)),
                "task_accuracy": exact_match(m, sft.tokenizer, sft.eval, sft.eos_id, budget,
                                             cpu)["accuracy"]}

    quantized = quantize_int8(student)
    inputs = val_rows.take(val_rows.in_order(cfg.batch_size, 1)[0]).inputs
    report = compare_int8(student, quantized, inputs, quality)
    log.info("int8 student: %.2f MB vs %.2f MB float (x%.2f), %.0f vs %.0f tokens/s on CPU "
             "(x%.2f), perplexity %.2f vs %.2f, task accuracy %.3f vs %.3f",
             report["size_bytes_int8"] / 1e6, report["size_bytes_float"] / 1e6,
             report["size_ratio"], report["tokens_per_s_int8"], report["tokens_per_s_float"],
             report["speedup"], report["perplexity_int8"], report["perplexity_float"],
             report["task_accuracy_int8"], report["task_accuracy_float"])
    path = export_int8(quantized, Path(cfg.output_dir), Path(model_dir) / "tokenizer.json",
                       {**read_meta(model_dir), "float_model_dir": str(model_dir),
                        "comparison": report})
    mlflow.log_metrics({f"int8/{k}": v for k, v in report.items()})
    log_json_artifact(report, "int8_report.json")
    _ = device  # measured on CPU whatever the training device: int8 dynamic is a CPU feature
    return {"report": report, "model_dir": str(path)}


if __name__ == "__main__":
    run_stage("distill", DistillConfig, main)
