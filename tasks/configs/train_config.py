"""The training stages' configs: pretraining and each sweep trial (`TrainConfig`, with what a fork
from a step may change: `FORK_KNOBS`, `FORK_PLACES`, `fork_refusals`), supervised fine-tuning
(`FinetuneConfig`) and distillation into a smaller student (`DistillConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tasks.configs.fields import ConfigError, bounded, check, check_bounds, flatten
from tasks.configs.model_config import ModelConfig, OptimConfig


# What may differ between a pretraining and its fork from a step (TrainConfig.fork_from): the
# learning rate and its schedule, the length, the spike guard (FORK_KNOBS), and what only says
# where and how the job runs (FORK_PLACES). Anything else would not continue the same training
# and is refused by name: the architecture (model.*), the data and with it the tokenizer and
# the sequence length (data_dir, compared by content), the batch, the seed, and AdamW's decay
# and betas (the restored optimizer keeps its own).
FORK_KNOBS = ("optim.lr", "optim.min_lr_ratio", "optim.warmup_steps", "optim.grad_clip",
              "max_steps", "max_rollbacks", "spike_sigma", "spike_window", "spike_min_ratio",
              "spike_skip_batches")
FORK_PLACES = ("data_dir", "output_dir", "checkpoint_uri", "fork_from", "fork_step",
               "fork_parent_run_id", "eval_interval", "eval_batches", "checkpoint_interval",
               "keep_checkpoints", "keep_every", "log_interval", "async_checkpoint", "compile",
               "max_restarts", "hot_spare", "hang_timeout_s", "save_timeout_s",
               "restore_timeout_s", "upload_timeout_s", "compile_timeout_s", "burn_in",
               "burn_in_min_gbps", "straggler_check_every", "straggler_factor", "straggler_steps",
               "straggler_action", "sdc_check", "sdc_check_every", "stream_cache_gb")
# What a parent config written before a setting existed ran with: the global permutation, the
# only sample order then (the block sizes mean nothing to it, so any are the same to a fork).
BEFORE_SETTING = {"sample_order": "global_permutation"}


def fork_refusals(parent: dict[str, Any], fork: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The settings of `fork` (a TrainConfig as a dict) that differ from `parent`'s and may not
    change at a fork: dotted name -> (the parent's value, the fork's)."""
    was, now = {**BEFORE_SETTING, **flatten(parent)}, flatten(fork)
    if was.get("sample_order") == now.get("sample_order") == "global_permutation":
        for key in ("shuffle_block_rows", "shuffle_window_blocks"):
            was.pop(key, None), now.pop(key, None)
    return {key: (was.get(key), now.get(key)) for key in sorted(set(was) | set(now))
            if key not in FORK_KNOBS + FORK_PLACES and was.get(key) != now.get(key)}


def checkpoint_uri_field() -> Any:
    """Every training stage's `checkpoint_uri` (TrainConfig, FinetuneConfig, DistillConfig)."""
    return bounded("", help="Also keep checkpoints under s3://bucket/prefix, each written through "
                            "as it commits (one uploader per job) and restored from there on a "
                            "fresh node; empty = output_dir/checkpoints only. Where nothing syncs "
                            "the node's disk (Batch, HyperPod) the job's entry sets it to the "
                            "run's checkpoint storage when empty (CHECKPOINTED_STAGES).")


def check_checkpoint_uri(cfg: Any) -> None:
    name = type(cfg).__name__
    check(not cfg.checkpoint_uri or cfg.checkpoint_uri.startswith("s3://"),
          f"{name}.checkpoint_uri must be empty or an s3://bucket/prefix URI, got "
          f"{cfg.checkpoint_uri!r}: a shared file system (FSx, EFS) is output_dir's place, not "
          "this field's.")


@dataclass(kw_only=True)
class TrainConfig:
    """Pretraining (and each sweep trial): next-token loss on the packed shards of data prep."""

    data_dir: str = bounded("", help="Output directory of data prep (holds manifest.json).")
    output_dir: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    max_steps: int = bounded(200, minimum=1, maximum=10_000_000, help="Optimizer steps.")
    batch_size: int = bounded(16, minimum=1, maximum=1 << 16,
                              help="Sequences per micro-step per process (what one forward holds).")
    global_batch_tokens: int = bounded(0, minimum=0, maximum=1 << 40,
                                       help="Tokens per optimizer step over all processes, kept "
                                            "whatever the world size by gradient accumulation; "
                                            "0 = batch_size x seq_len x world size.")
    eval_interval: int = bounded(50, minimum=1, maximum=10_000_000, help="Steps between val evals.")
    eval_batches: int = bounded(8, minimum=1, maximum=100_000, help="Batches per val eval.")
    checkpoint_interval: int = bounded(50, minimum=1, maximum=10_000_000,
                                       help="Steps between checkpoints: the steps a retry "
                                            "resumes from and a pause or fork can start at.")
    keep_checkpoints: int = bounded(2, minimum=1, maximum=1000,
                                    help="The newest checkpoints kept, on disk and under "
                                         "checkpoint_uri (besides those keep_every keeps).")
    keep_every: int = bounded(0, minimum=0, maximum=10_000_000,
                              help="Also keep every checkpoint whose step is a multiple of this, "
                                   "to go back to or fork from; a multiple of "
                                   "checkpoint_interval; 0 = only the newest keep_checkpoints.")
    log_interval: int = bounded(10, minimum=1, maximum=10_000_000, help="Steps between metric logs.")
    seed: int = bounded(1337, minimum=0, maximum=2**31 - 1,
                        help="Seed of the initial weights and the batch order; a run with only "
                             "the seeds changed shows the run-to-run noise.")
    # The order rows are read in (tasks/train/prepared_data.py) and how they stream from S3
    # (tasks/train/stream.py)
    sample_order: str = bounded("block_shuffle", choices=("block_shuffle", "global_permutation"),
                                help="block_shuffle: shuffle blocks of rows, then rows within "
                                     "windows of blocks, so token shards stream from S3 block by "
                                     "block; global_permutation: one permutation of all rows per "
                                     "epoch (runs made before block shuffling; replays them "
                                     "bitwise; streaming it fetches the whole split first).")
    shuffle_block_rows: int = bounded(1024, minimum=1, maximum=1 << 24,
                                      help="Rows per block (consecutive rows of one shard): one "
                                           "sequential S3 read; 1024 rows of 2048 uint32 tokens = "
                                           "8 MiB.")
    shuffle_window_blocks: int = bounded(16, minimum=1, maximum=1 << 16,
                                         help="Blocks whose rows are shuffled together: a batch "
                                              "draws from window_blocks x block_rows rows.")
    stream_cache_gb: float = bounded(8.0, minimum=0.001, maximum=1e6,
                                     help="An s3:// data_dir streams through a cache on each "
                                          "node's disk of at most this size (two windows at "
                                          "least; the whole split for global_permutation).")
    # Scale-out and resilience (tasks/train/supervisor.py, loop.py, checkpoint.py)
    checkpoint_uri: str = checkpoint_uri_field()
    async_checkpoint: bool = bounded(True, help="Snapshot to CPU and write in the background, at "
                                                "most one save in flight.")
    parallelism: str = bounded("ddp", choices=("ddp", "fsdp"),
                               help="Several processes: replicate the model (ddp) or shard it (fsdp).")
    compile: bool = bounded(True, help="torch.compile the model on GPU (CPU runs eagerly).")
    max_restarts: int = bounded(3, minimum=0, maximum=1000,
                                help="Worker restarts inside the job before the task fails.")
    hot_spare: bool = bounded(True, help="Keep a warm worker process ready to replace a failed one.")
    hang_timeout_s: float = bounded(300.0, minimum=1.0, maximum=86400.0,
                                    help="No step progress this long: dump stacks, restart the worker.")
    # The watchdog's budgets for phases that are slow by nature (tasks/train/supervisor.py). In
    # save, restore and upload every chunk of checkpoint bytes moved counts as progress, so these
    # bound a stall, not a transfer; 30 min, 6x the default hang_timeout_s, still lets a gathered
    # FSDP state, a cold S3 read or a throttled upload through without a byte for minutes.
    save_timeout_s: float = bounded(1800.0, minimum=1.0, maximum=86400.0,
                                    help="A checkpoint save (state gather, write, upload) this long "
                                         "without progress: dump stacks, restart the worker.")
    restore_timeout_s: float = bounded(1800.0, minimum=1.0, maximum=86400.0,
                                       help="A checkpoint restore (download, load) this long "
                                            "without progress: dump stacks, restart the worker.")
    upload_timeout_s: float = bounded(1800.0, minimum=1.0, maximum=86400.0,
                                      help="Waiting for the final checkpoint to be durable with no "
                                           "bytes moving this long: dump stacks, restart the worker.")
    compile_timeout_s: float = bounded(1800.0, minimum=1.0, maximum=86400.0,
                                       help="The first step after torch.compile (it compiles): this "
                                            "long without finishing, restart the worker.")
    max_rollbacks: int = bounded(5, minimum=0, maximum=1000,
                                 help="NaN or spike rollbacks per job (worker restarts included) "
                                      "before it fails without a restart.")
    spike_sigma: float = bounded(6.0, minimum=0.0, maximum=1000.0,
                                 help="A loss above median + k x (MAD as a std) of the window is a "
                                      "spike; 0 = off. Checked after the lr warm-up.")
    spike_window: int = bounded(100, minimum=5, maximum=1_000_000,
                                help="Recent accepted steps the spike statistics cover; detection "
                                     "starts after the lr warm-up, with a full window.")
    spike_min_ratio: float = bounded(3.0, minimum=1.0, maximum=1000.0,
                                     help="A spike is also at least this many times the window's "
                                          "median loss: healthy tiny models spike to 2.2x on their "
                                          "own (benchmarks/results/spike_guard.json).")
    spike_skip_batches: int = bounded(1, minimum=1, maximum=1_000_000,
                                      help="Batches up to and including a spike skipped after rollback.")
    # Cluster health inside the job (tasks/train/health.py); none of it runs on one process
    # except the burn-in's matmul
    burn_in: bool = bounded(True, help="Before training, every rank checks an exact matmul and an "
                                       "all-reduce; a wrong result stops the job, naming the node.")
    burn_in_min_gbps: float = bounded(0.0, minimum=0.0, maximum=100_000.0,
                                      help="The burn-in's all-reduce must reach this bus bandwidth "
                                           "(Gb/s) or the job refuses to start; 0 = timed only.")
    straggler_check_every: int = bounded(10, minimum=0, maximum=10_000_000,
                                         help="Steps between comparisons of the ranks' step times "
                                              "(one small all_gather); 0 = off.")
    straggler_factor: float = bounded(1.5, minimum=1.0, maximum=1000.0,
                                      help="A rank this many times the other ranks' median step "
                                           "time is slow.")
    straggler_steps: int = bounded(3, minimum=1, maximum=1_000_000,
                                   help="Consecutive slow checks before a rank is named a straggler.")
    straggler_action: str = bounded("warn", choices=("warn", "restart"),
                                    help="warn: name it in the log, MLflow and the result; restart: "
                                         "also stop the job (exit 76) for its node to be replaced.")
    sdc_check: bool = bounded(True, help="Compare the data-parallel replicas' parameter checksums "
                                         "before each checkpoint: a mismatch rolls back, a repeat "
                                         "on the same rank stops the job (exit 76).")
    sdc_check_every: int = bounded(0, minimum=0, maximum=10_000_000,
                                   help="Also compare them every this many steps; 0 = before each "
                                        "checkpoint only.")
    # Fork: start from a kept checkpoint of another pretraining (tasks/train/fork.py)
    fork_from: str = bounded("", help="The checkpoints directory of the pretraining to fork "
                                      "(its output_dir/checkpoints); empty = no fork. Only "
                                      "FORK_KNOBS may differ from that run's config.")
    fork_step: int = bounded(0, minimum=0, maximum=10_000_000,
                             help="The kept checkpoint of fork_from to start at; 0 = its newest.")
    fork_parent_run_id: str = bounded("", help="The forked run's MLflow run, for the lineage tags.")

    def __post_init__(self) -> None:
        check_bounds(self)
        check(bool(self.data_dir), "TrainConfig.data_dir is required: the data prep output.")
        check(bool(self.fork_from) or not (self.fork_step or self.fork_parent_run_id),
               "TrainConfig.fork_step and fork_parent_run_id need fork_from: the checkpoints "
               "directory of the pretraining to fork.")
        # Both fields named with their class, so the lifecycle's refusal names both Params.
        check(self.keep_every % self.checkpoint_interval == 0,
               f"TrainConfig.keep_every ({self.keep_every}) must be 0 or a multiple of "
               f"TrainConfig.checkpoint_interval ({self.checkpoint_interval}): only those steps are "
               f"saved. Set keep_every to "
               f"{max(1, round(self.keep_every / self.checkpoint_interval)) * self.checkpoint_interval}"
               f" or 0, or checkpoint_interval to a divisor of it.")
        check(bool(self.output_dir), "TrainConfig.output_dir is required: where checkpoints go.")
        check_checkpoint_uri(self)

    def accumulation_steps(self, seq_len: int, world_size: int) -> int:
        """Micro-steps per optimizer step: global_batch_tokens / (batch_size x seq_len x world
        size). Known only at start (the data's seq_len, the job's world size), so checked there."""
        per_micro_step = self.batch_size * seq_len * world_size
        if self.global_batch_tokens == 0:
            return 1
        if self.global_batch_tokens % per_micro_step == 0:
            return self.global_batch_tokens // per_micro_step
        below = self.global_batch_tokens // per_micro_step * per_micro_step
        sizes = [b for b in range(1, self.global_batch_tokens // (seq_len * world_size) + 1)
                 if self.global_batch_tokens % (b * seq_len * world_size) == 0]
        raise ConfigError(
            f"TrainConfig.global_batch_tokens ({self.global_batch_tokens}) is not a multiple of "
            f"batch_size x seq_len x world size = {self.batch_size} x {seq_len} x {world_size} = "
            f"{per_micro_step}: set global_batch_tokens to "
            f"{' or '.join(str(v) for v in (below, below + per_micro_step) if v > 0)}"
            + (f", or batch_size to one of {sizes[-4:]}" if sizes else
               f" (no batch_size divides it on {world_size} processes)") + ".")


def _check_post_training(cfg: Any, *, required: tuple[str, ...]) -> None:
    """What FinetuneConfig and DistillConfig both check: bounds, the paths and model they cannot
    run without, and room for replayed pretraining rows in each step."""
    name = type(cfg).__name__
    check_bounds(cfg)
    for field_name in required:
        check(bool(getattr(cfg, field_name)), f"{name}.{field_name} is required.")
    check_checkpoint_uri(cfg)
    check(cfg.replay_fraction == 0 or cfg.batch_size >= 2,
           f"{name}.batch_size must be >= 2 to mix replayed rows into each step "
           "(or set replay_fraction to 0).")


@dataclass(kw_only=True)
class FinetuneConfig:
    """Supervised fine-tuning on prompt/completion JSONL, loss on completion tokens only."""

    base_model: str = bounded("", help="What to fine-tune: a Hugging Face causal-LM directory (any "
                                       "model transformers loads: Llama, Qwen2, Mistral, GPT-2...), "
                                       "an s3:// prefix holding one, a checkpoint directory, or an "
                                       "MLflow model (models:/<name>@<alias>, "
                                       "models:/<name>/<version>).")
    data_dir: str = bounded("", help="Data prep output (holds sft/train.jsonl and sft/eval.jsonl).")
    output_dir: str = ""
    train_files: list = bounded([], help="Prompt/completion or chat JSONL to train on; empty = "
                                         "data_dir's sft/train.jsonl.")
    eval_files: list = bounded([], help="Held-out JSONL, same formats; empty = data_dir's "
                                        "sft/eval.jsonl.")
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=10))
    max_steps: int = bounded(150, minimum=1, maximum=10_000_000,
                             help="Fine-tuning optimizer steps (each one batch_size units).")
    batch_size: int = bounded(16, minimum=1, maximum=1 << 16,
                              help="Units per step: SFT examples (packed rows with packing) plus "
                                   "replayed pretraining rows.")
    replay_fraction: float = bounded(0.25, minimum=0.0, maximum=0.9,
                                     help="Share of each step (rows and loss weight) given to "
                                          "pretraining rows, so general language is not forgotten.")
    packing: bool = bounded(False, help="Pack several examples per row (attention stays inside "
                                        "each example).")
    lora_rank: int = bounded(0, minimum=0, maximum=4096,
                             help="LoRA adapter rank; 0 = full fine-tuning.")
    lora_alpha: float = bounded(16.0, minimum=0.0, maximum=1e6, help="LoRA scaling numerator.")
    lora_dropout: float = bounded(0.0, minimum=0.0, maximum=0.9)
    lora_targets: list = bounded([], help="Linear layers that get adapters (leaf names, e.g. "
                                          "c_attn or q_proj); empty = every linear layer of the "
                                          "decoder blocks.")
    eval_batches: int = bounded(8, minimum=1, maximum=100_000,
                                help="Held-out pretraining batches scored for prose loss.")
    eval_interval: int = bounded(50, minimum=1, maximum=10_000_000)
    checkpoint_interval: int = bounded(50, minimum=1, maximum=10_000_000)
    keep_checkpoints: int = bounded(2, minimum=1, maximum=1000)
    checkpoint_uri: str = checkpoint_uri_field()
    log_interval: int = bounded(10, minimum=1, maximum=10_000_000)
    seed: int = bounded(1338, minimum=0, maximum=2**31 - 1,
                        help="Seed of fine-tuning's example order and replayed rows (and new "
                             "LoRA weights).")
    eval_examples: int = bounded(200, minimum=1, maximum=1_000_000,
                                 help="Held-out SFT examples scored before and after training.")

    def __post_init__(self) -> None:
        _check_post_training(self, required=("base_model", "data_dir", "output_dir"))
        check(all(isinstance(t, str) and t for t in self.lora_targets),
               "FinetuneConfig.lora_targets must be layer names (strings), or empty for all.")


@dataclass(kw_only=True)
class DistillConfig:
    """A smaller student learns from the teacher's logits: alpha*T^2*KL(t/T || s/T) + (1-alpha)*CE."""

    teacher_model: str = bounded("", help="The teacher: a Hugging Face causal-LM directory, an "
                                          "s3:// prefix holding one, a checkpoint or an MLflow "
                                          "model URI (models:/<name>@<alias>).")
    data_dir: str = ""
    output_dir: str = ""
    student: ModelConfig = field(default_factory=lambda: ModelConfig(n_layer=1, n_head=2, n_embd=64))
    student_model: str = bounded("", help="Start the student from this model instead of building "
                                          "`student` from scratch (same forms as teacher_model; "
                                          "any architecture, with the teacher's tokenizer).")
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, warmup_steps=10))
    temperature: float = bounded(2.0, minimum=0.05, maximum=100.0, help="Softening temperature T.")
    alpha: float = bounded(0.7, minimum=0.0, maximum=1.0, help="Weight of the KL term.")
    max_steps: int = bounded(300, minimum=1, maximum=10_000_000,
                             help="Distillation optimizer steps of the student (each one "
                                  "batch_size sequences).")
    batch_size: int = bounded(16, minimum=1, maximum=1 << 16)
    replay_fraction: float = bounded(0.25, minimum=0.0, maximum=0.9,
                                     help="Share of each step given to pretraining rows, distilled "
                                          "from the teacher's logits like the SFT part.")
    packing: bool = bounded(False, help="Pack several examples per row.")
    teacher_cache: str = bounded("", help="Directory of the teacher's cached top-k logits "
                                          "(python -m tasks.distill_cache); empty = run the teacher "
                                          "in this job.")
    cache_top_k: int = bounded(32, minimum=1, maximum=1 << 20,
                               help="Teacher logits kept per position in the cache.")
    quantize_int8: bool = bounded(False, help="Also quantize the student to int8 (dynamic, CPU) and "
                                              "report its size, speed and quality against float.")
    eval_batches: int = bounded(8, minimum=1, maximum=100_000,
                                help="Held-out pretraining batches scored for prose loss.")
    eval_interval: int = bounded(100, minimum=1, maximum=10_000_000)
    checkpoint_interval: int = bounded(100, minimum=1, maximum=10_000_000)
    keep_checkpoints: int = bounded(2, minimum=1, maximum=1000)
    checkpoint_uri: str = checkpoint_uri_field()
    log_interval: int = bounded(10, minimum=1, maximum=10_000_000)
    seed: int = bounded(1339, minimum=0, maximum=2**31 - 1,
                        help="Seed of the student's initial weights and distillation's batch order.")
    eval_examples: int = bounded(200, minimum=1, maximum=1_000_000,
                                 help="Held-out SFT examples scored for student and teacher.")

    def __post_init__(self) -> None:
        _check_post_training(self, required=("teacher_model", "data_dir", "output_dir"))


# The stages whose progress is their checkpoints (the shared loop, tasks/train/loop.py), by
# entrypoint, with the config each reads. The stage decides, not the config: on a node whose disk
# does not outlive the job (Batch, HyperPod, Ray), the image's entry (docker/job_entry.py) sets
# the config's `checkpoint_uri` to the job's checkpoint storage whether or not the config names
# the key, and refuses to run one with nowhere off the node to put them; the backends refuse
# a `checkpoint_uri` that could not hold them before any job (llmops.jobs.backends.remote.plan).
# tests/test_checkpoint_write_through.py fails on a stage that trains through the loop and is
# missing here.
CHECKPOINTED_STAGES: dict[str, type] = {
    "tasks.pretrain": TrainConfig,
    "tasks.sweep": TrainConfig,   # each sweep trial or scaling-ladder rung
    "tasks.finetune": FinetuneConfig,
    "tasks.distill": DistillConfig,
}
