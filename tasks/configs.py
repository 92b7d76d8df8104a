"""Typed, validated configs for every stage, and the named recipes built from one base.

Standard library only: the Airflow side imports this module to build its Param schemas and to
validate a run's settings before any job starts, and MWAA workers have no torch or ray.

A stage's config is written to a JSON file and handed to `python -m tasks.<stage> --config FILE`;
`from_dict` rejects unknown keys so a typo in an override fails loudly instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and how to fix it."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def bounded(default: Any, *, minimum: float | None = None, maximum: float | None = None,
            help: str = "", choices: tuple | None = None) -> Any:
    """A dataclass field whose bounds live in its metadata, so the Airflow Param schema and the
    config's own validation are generated from the same numbers."""
    meta = {"minimum": minimum, "maximum": maximum, "help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _check_bounds(cfg: Any) -> None:
    """Check every field declared with `bounded` against its minimum, maximum and choices."""
    name = type(cfg).__name__
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        lo, hi, choices = f.metadata.get("minimum"), f.metadata.get("maximum"), f.metadata.get("choices")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if choices is not None:
                _check(value in choices, f"{name}.{f.name} must be one of {list(choices)}, got {value!r}.")
            continue
        _check(math.isfinite(value), f"{name}.{f.name} must be a finite number, got {value!r}.")
        if lo is not None:
            _check(value >= lo, f"{name}.{f.name} must be >= {lo}, got {value!r}.")
        if hi is not None:
            _check(value <= hi, f"{name}.{f.name} must be <= {hi}, got {value!r}.")


def from_dict(cls: type[T], data: dict[str, Any], *, where: str = "") -> T:
    """Build a (possibly nested) config dataclass from plain JSON data, refusing unknown keys."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}.")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"Unknown config key(s) in {where}: {unknown}. Known keys: {sorted(known)}.")
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(hint, value, where=f"{where}.{key}")
        else:
            kwargs[key] = _coerce(value, hint, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{where}: {exc}") from None


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Accept what JSON can carry for a field and refuse the rest with the field's name."""
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(f"{where} must be {hint.__name__}, got {type(value).__name__} {value!r}.")
    return value


def _field_type(cls: Any, path: str) -> Any:
    """The type of the field at a dotted path of a config dataclass (None if there is none)."""
    for name in path.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        hints = get_type_hints(cls)
        if name not in hints:
            return None
        cls = hints[name]
    return cls


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"model": {"n_layer": 2}}` -> `{"model.n_layer": 2}`, for MLflow params."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


# --------------------------------------------------------------------------------------------
# Building blocks


MODEL_ARCHS = ("gpt", "llama")


@dataclass(kw_only=True)
class ModelConfig:
    """A decoder built from scratch. Parameters ~ 12 * n_layer * n_embd^2 + vocab_size * n_embd.

    arch "gpt": the project's GPT (tasks/model.py; learned positions, LayerNorm, GELU MLP),
    saved as a Hugging Face GPT-2. "llama": transformers' LlamaForCausalLM (RoPE, RMSNorm,
    SwiGLU MLP, grouped-query attention with n_kv_head key/value heads)."""

    vocab_size: int = bounded(1024, minimum=64, maximum=1 << 20, help="Tokenizer vocabulary size.")
    block_size: int = bounded(128, minimum=8, maximum=1 << 16, help="Context length in tokens.")
    n_layer: int = bounded(2, minimum=1, maximum=256, help="Transformer blocks.")
    n_head: int = bounded(4, minimum=1, maximum=256, help="Attention heads per block.")
    n_embd: int = bounded(128, minimum=8, maximum=65536, help="Hidden size; a multiple of n_head.")
    dropout: float = bounded(0.0, minimum=0.0, maximum=0.9, help="Dropout probability.")
    arch: str = bounded("gpt", choices=MODEL_ARCHS,
                        help="gpt (the built-in GPT, fastest on CPU) or llama (transformers' "
                             "Llama: RoPE, RMSNorm, SwiGLU, grouped-query attention).")
    n_kv_head: int = bounded(0, minimum=0, maximum=256,
                             help="llama: key/value heads (grouped-query attention); 0 = n_head.")

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(self.n_embd % self.n_head == 0,
               f"ModelConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}).")
        _check(self.n_kv_head == 0 or (self.arch == "llama" and self.n_head % self.n_kv_head == 0),
               f"ModelConfig.n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head}) and "
               "applies to arch 'llama' only; 0 = as many as n_head.")

    @property
    def approx_params(self) -> int:
        return 12 * self.n_layer * self.n_embd**2 + self.vocab_size * self.n_embd


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr_ratio * lr."""

    lr: float = bounded(3e-3, minimum=1e-6, maximum=1.0, help="Peak learning rate.")
    min_lr_ratio: float = bounded(0.1, minimum=0.0, maximum=1.0, help="Final lr as a share of lr.")
    warmup_steps: int = bounded(20, minimum=0, maximum=1_000_000, help="Linear warmup steps.")
    weight_decay: float = bounded(0.1, minimum=0.0, maximum=1.0, help="AdamW weight decay.")
    beta1: float = bounded(0.9, minimum=0.0, maximum=0.9999)
    beta2: float = bounded(0.95, minimum=0.0, maximum=0.99999)
    grad_clip: float = bounded(1.0, minimum=0.0, maximum=1e6, help="Max global grad norm; 0 = off.")

    def __post_init__(self) -> None:
        _check_bounds(self)


# --------------------------------------------------------------------------------------------
# Stage configs: one per `python -m tasks.<stage>` entrypoint


# Quality filters data prep knows, in the order FineWeb runs them (see tasks/data/filters.py).
DATA_QUALITY_FILTERS = ("gopher_repetition", "gopher_quality", "c4_quality", "fineweb_quality")


@dataclass(kw_only=True)
class DataPrepConfig:
    """Raw text -> filtered, PII-redacted, deduplicated documents; tokenized, packed train/val
    shards + manifest (tasks/data/prep.py).

    Inputs are JSONL (`{"id", "text", ...}`), Parquet or plain text files, local or s3://. With no
    inputs the stage writes the built-in demo corpus (docstrings of the installed Python).
    """

    inputs: list = bounded([], help="Raw text files, dirs or globs (JSONL, Parquet, .txt; local or "
                                    "s3://); empty = demo corpus.")
    output_dir: str = ""
    sft_inputs: list = bounded([], help="Prompt/completion JSONL (train, eval); empty = demo task.")
    demo_corpus_docs: int = bounded(4000, minimum=10, maximum=10_000_000,
                                    help="Documents in the generated demo corpus.")
    demo_sft_examples: int = bounded(4000, minimum=10, maximum=10_000_000,
                                     help="Examples in the generated demo instruction set.")
    vocab_size: int = bounded(1024, minimum=260, maximum=1 << 20, help="BPE vocabulary size.")
    seq_len: int = bounded(128, minimum=8, maximum=1 << 16, help="Context length of packed rows.")
    val_fraction: float = bounded(0.05, minimum=0.0, maximum=0.5, help="Share of documents held out.")
    min_chars: int = bounded(20, minimum=0, maximum=1_000_000, help="Shorter documents are dropped.")
    workers: int = bounded(2, minimum=1, maximum=4096, help="Parallel shard workers.")
    engine: str = bounded("auto", choices=("auto", "ray", "local"),
                          help="auto (in-process below ray_above_bytes of input, Ray Data above), "
                               "ray, or local (in-process).")
    ray_above_bytes: int = bounded(64 << 20, minimum=0, maximum=1 << 60,
                                   help="engine auto: Ray Data from this many input bytes on.")
    split_bytes: int = bounded(64 << 20, minimum=1024, maximum=1 << 40,
                               help="Input files larger than this are read as several shards (JSONL "
                                    "and text by byte range, Parquet by row groups).")
    dedup_buckets: int = bounded(0, minimum=0, maximum=1 << 20,
                                 help="Key-range buckets the dedup is sharded into; 0 = enough for "
                                      "~4M keys each, at least one per worker.")
    seed: int = bounded(1234, minimum=0, maximum=2**31 - 1)
    input_weights: list = bounded([], help="Mix weight per inputs entry, same order: a source's "
                                           "training documents are repeated (2.0) or sampled (0.5); "
                                           "empty = 1 each.")
    text_field: str = bounded("text", help="JSONL key or Parquet column holding the text.")
    id_field: str = bounded("id", help="JSONL key or Parquet column holding the document id.")
    filters: list = bounded(list(DATA_QUALITY_FILTERS),
                            help=f"Quality filters to run, in order: any of {list(DATA_QUALITY_FILTERS)}.")
    filter_params: dict = bounded({}, help="Threshold overrides per step, e.g. "
                                           "{'gopher_quality': {'min_doc_words': 30}}.")
    blocklist: list = bounded([], help="Words or phrases; a document containing one is dropped.")
    redact_pii: bool = bounded(True, help="Replace emails, public IP addresses and phone numbers.")
    exact_dedup: bool = bounded(True, help="Drop documents whose text equals an earlier one.")
    near_dedup: bool = bounded(True, help="MinHash-LSH near-duplicate removal across all shards.")
    minhash_ngram: int = bounded(5, minimum=1, maximum=64, help="Words per near-dedup shingle.")
    minhash_bands: int = bounded(14, minimum=1, maximum=1024,
                                 help="LSH bands (more bands: lower similarity threshold).")
    minhash_rows: int = bounded(8, minimum=1, maximum=1024,
                                help="Minhashes per band (more rows: higher similarity threshold).")
    tokenizer_path: str = bounded("", help="An existing tokenizer.json (local or s3://); empty = "
                                           "train a byte-level BPE on the data.")
    tokenizer_sample_docs: int = bounded(100_000, minimum=1, maximum=1_000_000_000,
                                         help="Training documents (a seeded sample) the BPE learns from.")

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(bool(self.output_dir), "DataPrepConfig.output_dir is required: where to write shards.")
        _check(all(isinstance(p, str) and p for p in self.inputs),
               "DataPrepConfig.inputs must be a list of non-empty paths or globs.")
        _check(len(self.sft_inputs) in (0, 2),
               "DataPrepConfig.sft_inputs must be empty or [train.jsonl, eval.jsonl].")
        unknown = [f for f in self.filters if f not in DATA_QUALITY_FILTERS]
        _check(not unknown and len(set(self.filters)) == len(self.filters),
               f"DataPrepConfig.filters must name each of {list(DATA_QUALITY_FILTERS)} at most once, "
               f"got {self.filters!r}.")
        _check(isinstance(self.filter_params, dict)
               and all(isinstance(v, dict) for v in self.filter_params.values()),
               "DataPrepConfig.filter_params must map a step name to an object of threshold overrides.")
        _check(all(isinstance(w, str) and w.strip() for w in self.blocklist),
               "DataPrepConfig.blocklist must be a list of non-empty words or phrases.")
        _check(not self.input_weights or len(self.input_weights) == len(self.inputs),
               f"DataPrepConfig.input_weights has {len(self.input_weights)} weights for "
               f"{len(self.inputs)} inputs: give one per inputs entry, or none.")
        _check(all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                   and 0 <= w <= 1000 for w in self.input_weights),
               "DataPrepConfig.input_weights must be numbers between 0 and 1000.")


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
               "straggler_action", "sdc_check", "sdc_check_every")


def fork_refusals(parent: dict[str, Any], fork: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The settings of `fork` (a TrainConfig as a dict) that differ from `parent`'s and may not
    change at a fork: dotted name -> (the parent's value, the fork's)."""
    was, now = flatten(parent), flatten(fork)
    return {key: (was.get(key), now.get(key)) for key in sorted(set(was) | set(now))
            if key not in FORK_KNOBS + FORK_PLACES and was.get(key) != now.get(key)}


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
                                       help="Steps between checkpoints.")
    keep_checkpoints: int = bounded(2, minimum=1, maximum=1000,
                                    help="The newest checkpoints kept, on disk and under "
                                         "checkpoint_uri (besides those keep_every keeps).")
    keep_every: int = bounded(0, minimum=0, maximum=10_000_000,
                              help="Also keep every checkpoint whose step is a multiple of this, "
                                   "to go back to or fork from; a multiple of "
                                   "checkpoint_interval; 0 = only the newest keep_checkpoints.")
    log_interval: int = bounded(10, minimum=1, maximum=10_000_000, help="Steps between metric logs.")
    seed: int = bounded(1337, minimum=0, maximum=2**31 - 1)
    # Scale-out and resilience (tasks/train/supervisor.py, loop.py, checkpoint.py)
    checkpoint_uri: str = bounded("", help="Also keep checkpoints under s3://bucket/prefix (one "
                                           "uploader per node); empty = output_dir/checkpoints only.")
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
        _check_bounds(self)
        _check(bool(self.data_dir), "TrainConfig.data_dir is required: the data prep output.")
        _check(bool(self.fork_from) or not (self.fork_step or self.fork_parent_run_id),
               "TrainConfig.fork_step and fork_parent_run_id need fork_from: the checkpoints "
               "directory of the pretraining to fork.")
        _check(self.keep_every % self.checkpoint_interval == 0,
               f"TrainConfig.keep_every ({self.keep_every}) must be 0 or a multiple of "
               f"checkpoint_interval ({self.checkpoint_interval}): only those steps are saved. Set "
               f"keep_every to "
               f"{max(1, round(self.keep_every / self.checkpoint_interval)) * self.checkpoint_interval}.")
        _check(bool(self.output_dir), "TrainConfig.output_dir is required: where checkpoints go.")
        _check(not self.checkpoint_uri or self.checkpoint_uri.startswith("s3://"),
               f"TrainConfig.checkpoint_uri must be empty or an s3://bucket/prefix URI, got "
               f"{self.checkpoint_uri!r}.")

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
    log_interval: int = bounded(10, minimum=1, maximum=10_000_000)
    seed: int = bounded(1338, minimum=0, maximum=2**31 - 1)
    eval_examples: int = bounded(200, minimum=1, maximum=1_000_000,
                                 help="Held-out SFT examples scored before and after training.")

    def __post_init__(self) -> None:
        _check_bounds(self)
        for name in ("base_model", "data_dir", "output_dir"):
            _check(bool(getattr(self, name)), f"FinetuneConfig.{name} is required.")
        _check(self.replay_fraction == 0 or self.batch_size >= 2,
               "FinetuneConfig.batch_size must be >= 2 to mix replayed rows into each step "
               "(or set replay_fraction to 0).")
        _check(all(isinstance(t, str) and t for t in self.lora_targets),
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
    log_interval: int = bounded(10, minimum=1, maximum=10_000_000)
    seed: int = bounded(1339, minimum=0, maximum=2**31 - 1)
    eval_examples: int = bounded(200, minimum=1, maximum=1_000_000,
                                 help="Held-out SFT examples scored for student and teacher.")

    def __post_init__(self) -> None:
        _check_bounds(self)
        for name in ("teacher_model", "data_dir", "output_dir"):
            _check(bool(getattr(self, name)), f"DistillConfig.{name} is required.")
        _check(self.replay_fraction == 0 or self.batch_size >= 2,
               "DistillConfig.batch_size must be >= 2 to mix replayed rows into each step "
               "(or set replay_fraction to 0).")


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out perplexity and bits per byte, task exact-match and local task suites (through
    lm-evaluation-harness too, unless lm_eval is off) for each named model."""

    models: dict = bounded({}, help="Name -> Hugging Face model directory, s3:// prefix, "
                                    "checkpoint or MLflow model URI, e.g. {'teacher': ..., "
                                    "'champion': 'models:/llm-lifecycle/3'}.")
    data_dir: str = ""
    output_dir: str = ""
    eval_batches: int = bounded(20, minimum=1, maximum=1_000_000, help="Val batches for perplexity.")
    batch_size: int = bounded(16, minimum=1, maximum=1 << 16)
    max_task_examples: int = bounded(200, minimum=1, maximum=1_000_000,
                                     help="Held-out task examples scored by exact match.")
    max_new_tokens: int = bounded(16, minimum=1, maximum=4096)
    suites: list = bounded([], help="Task suite JSONL files or directories (multiple choice "
                                    "{query, choices, gold}; generation {prompt, answer}).")
    demo_suites: bool = bounded(True, help="Also build suites from the data dir's held-out "
                                           "material: SFT multiple choice and a prose cloze.")
    suite_examples: int = bounded(100, minimum=1, maximum=1_000_000, help="Items per suite.")
    lm_eval: bool = bounded(True, help="Also run the suites through EleutherAI's "
                                       "lm-evaluation-harness (its Hugging Face model type, on the "
                                       "local suite files).")

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(bool(self.models), "EvalConfig.models must name at least one model directory.")
        _check(bool(self.data_dir) and bool(self.output_dir),
               "EvalConfig.data_dir and EvalConfig.output_dir are required.")


# --------------------------------------------------------------------------------------------
# The whole lifecycle: what the DAG resolves from a recipe plus the run's Params


SWEEP_SAMPLERS = ("tpe", "random", "grid")
SWEEP_PRUNERS = ("median", "asha", "none")


@dataclass(kw_only=True)
class SweepConfig:
    """Short pretraining trials searched by an Optuna study (plugins/llmops/sweep): the best by
    validation loss sets pretraining's hyperparameters. The learning rate is always searched (log
    scale over [lr_min, lr_max]); `search_space` adds other TrainConfig fields."""

    trials: int = bounded(3, minimum=1, maximum=64, help="Trials, run in parallel as mapped tasks.")
    lr_min: float = bounded(1e-3, minimum=1e-6, maximum=1.0, help="Lowest learning rate tried.")
    lr_max: float = bounded(1e-2, minimum=1e-6, maximum=1.0, help="Highest learning rate tried.")
    steps: int = bounded(60, minimum=1, maximum=1_000_000, help="Steps per trial.")
    sampler: str = bounded("tpe", choices=SWEEP_SAMPLERS,
                           help="tpe (Bayesian), random, or grid (`trials` log-spaced learning rates "
                                "x every choice of search_space).")
    pruner: str = bounded("median", choices=SWEEP_PRUNERS,
                          help="Stops hopeless trials early: median (worse than the median of finished "
                               "trials at the same step), asha (successive halving), none.")
    evals: int = bounded(4, minimum=1, maximum=1000,
                         help="Validation losses each trial reports; the pruner decides after each.")
    search_space: dict = bounded({}, help="More TrainConfig fields to tune: path -> {'low', 'high', "
                                          "'log'} or {'choices': [...]}, e.g. {'optim.weight_decay': "
                                          "{'low': 0.0, 'high': 0.2}}.")
    seed: int = bounded(0, minimum=0, maximum=2**31 - 1, help="Seed of the sampler.")
    study: str = bounded("", help="An Optuna study to continue, by name (a killed run's, say): its "
                                  "finished trials are kept. Empty = one study per DAG run, which a "
                                  "cleared run resumes.")
    budget_hours: float = bounded(100.0, minimum=0.0, maximum=1e7,
                                  help="Refuse to start when the sweep's estimated accelerator-hours "
                                       "exceed this; 0 = no limit.")
    size_from_ladder: bool = bounded(False, help="Size pretraining (width, steps) from the latest "
                                                 "scaling_ladder recommendation.")

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(self.lr_min <= self.lr_max,
               f"SweepConfig.lr_min ({self.lr_min}) must be <= lr_max ({self.lr_max}).")
        _check(isinstance(self.search_space, dict), "SweepConfig.search_space must be an object.")
        hints = {path: _field_type(TrainConfig, path) for path in self.search_space}
        for path, spec in self.search_space.items():
            where = f"SweepConfig.search_space[{path!r}]"
            _check(hints[path] in (int, float, str, bool),
                   f"{where}: not a number or string field of TrainConfig (e.g. 'optim.weight_decay', "
                   "'batch_size', 'model.dropout').")
            _check(isinstance(spec, dict) and (set(spec) <= {"low", "high", "log"} and
                                               {"low", "high"} <= set(spec) or set(spec) == {"choices"}),
                   f"{where} must be {{'low': x, 'high': y[, 'log': true]}} or {{'choices': [...]}}.")
            if "choices" in spec:
                _check(isinstance(spec["choices"], list) and len(spec["choices"]) > 0,
                       f"{where}.choices must be a non-empty list.")
            else:
                _check(all(isinstance(spec[k], (int, float)) and not isinstance(spec[k], bool)
                           for k in ("low", "high")) and spec["low"] < spec["high"],
                       f"{where}: low and high must be numbers with low < high.")
                _check(not spec.get("log") or spec["low"] > 0, f"{where}: a log range needs low > 0.")
        _check(self.sampler != "grid" or all("choices" in s for s in self.search_space.values()),
               "SweepConfig.sampler 'grid' needs {'choices': [...]} for every search_space entry.")

    def space(self) -> dict[str, dict]:
        """Every searched TrainConfig path and its range: the learning rate first."""
        return {"optim.lr": {"low": self.lr_min, "high": self.lr_max, "log": True},
                **self.search_space}

    def learning_rates(self) -> list[float]:
        """Log-spaced over [lr_min, lr_max], deterministic so a rerun tries the same trials."""
        if self.trials == 1:
            return [math.sqrt(self.lr_min * self.lr_max)]
        ratio = (self.lr_max / self.lr_min) ** (1 / (self.trials - 1))
        return [float(f"{self.lr_min * ratio**i:.3g}") for i in range(self.trials)]


@dataclass(kw_only=True)
class LadderConfig:
    """A scaling ladder (dags/scaling_ladder.py): small models of the pretraining model's family,
    one per width x tokens-per-parameter, each trained to the end of its own schedule; the law
    L(N, D) = E + A/N^alpha + B/D^beta is fitted to their final validation losses (Chinchilla
    approach 3, tasks/scaling/law.py) and gives the compute-optimal N and D for a FLOP budget
    (C = 6ND). N counts non-embedding parameters, 12 * n_layer * n_embd^2 (Kaplan et al.: the
    embedding's share distorts the law at small sizes)."""

    widths: list = bounded([32, 64, 96], help="n_embd of each rung; depth, heads, vocabulary and "
                                              "context are the pretraining model's.")
    tokens_per_param: list = bounded([5, 10, 20], help="Training tokens per parameter (D/N); every "
                                                       "width trains at each.")
    held_out: int = bounded(1, minimum=0, maximum=64, help="Largest-compute rungs left out of the "
                                                           "fit, to measure its extrapolation error.")
    target_flops: float = bounded(1e15, minimum=1.0, maximum=1e30,
                                  help="FLOP budget C the compute-optimal N and D are given for.")
    budget_hours: float = bounded(100.0, minimum=0.0, maximum=1e7,
                                  help="Refuse to start when the ladder's estimated accelerator-hours "
                                       "exceed this; 0 = no limit.")
    huber_delta: float = bounded(1e-3, minimum=1e-6, maximum=1.0,
                                 help="Huber loss threshold on log-loss residuals (Chinchilla: 1e-3).")

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(bool(self.widths) and all(isinstance(w, int) and not isinstance(w, bool) and w >= 8
                                         for w in self.widths),
               f"LadderConfig.widths must be a list of integers >= 8, got {self.widths!r}.")
        _check(bool(self.tokens_per_param) and all(
                   isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0
                   for t in self.tokens_per_param),
               f"LadderConfig.tokens_per_param must be a list of positive numbers, got "
               f"{self.tokens_per_param!r}.")
        rungs = len(set(self.widths)) * len(set(self.tokens_per_param))
        _check(rungs - self.held_out >= 5,
               f"LadderConfig: {rungs} rungs minus held_out {self.held_out} leave {rungs - self.held_out} "
               "points to fit a law with 5 constants; give at least 5 + held_out rungs (more widths "
               "or tokens_per_param values).")


@dataclass(kw_only=True)
class LadderFitConfig:
    """The ladder's fit job (python -m tasks.ladder): its rungs' results in, the law and a
    recommendation out."""

    points: list = bounded([], help="One per finished rung: {'n_params', 'tokens', 'loss', ...}.")
    ladder: LadderConfig = field(default_factory=LadderConfig)
    model: ModelConfig = field(default_factory=ModelConfig)  # the family recommended sizes keep
    tokens_per_step: int = bounded(2048, minimum=1, maximum=1 << 40,
                                   help="batch_size * seq_len of the pretraining run sized by the fit.")
    output_dir: str = ""

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(bool(self.output_dir), "LadderFitConfig.output_dir is required.")
        _check(all(isinstance(p, dict) and {"n_params", "tokens", "loss"} <= set(p) for p in self.points),
               "LadderFitConfig.points must be objects with n_params, tokens and loss.")


# Metrics evaluation scores item by item (tasks/evaluate.py `per_item`).
ITEM_METRIC = re.compile(r"^(task_accuracy|suite\.[^.]+\.accuracy|harness\.[^.]+\.(acc|acc_norm|exact_match))$")


@dataclass(kw_only=True)
class GateConfig:
    """What a model must reach to be registered and made `champion` (plugins/llmops/promotion.py):
    absolute thresholds, and no worse than the current champion beyond champion_margins."""

    min_task_accuracy: float = bounded(0.0, minimum=0.0, maximum=1.0,
                                       help="Lowest exact-match accuracy that may ship.")
    max_perplexity: float = bounded(1e9, minimum=1.0, maximum=1e9,
                                    help="Highest held-out perplexity that may ship.")
    prefer: str = bounded("student", choices=("student", "teacher"),
                          help="Which passing model to register when both pass.")
    champion_margins: dict = bounded({"task_accuracy": 0.02, "bits_per_byte": 0.02},
                                     help="Metric -> how much worse than the champion a challenger "
                                          "may be (0 = at least as good; negative = must beat it "
                                          "by that much). *loss, *perplexity, *bits_per_byte are "
                                          "lower-is-better.")
    require_approval: bool = bounded(False, help="Retraining: a human approves (Airflow's "
                                                 "ApprovalOperator) before `champion` moves.")
    paired: dict = bounded({}, help="Item-level metric (task_accuracy, suite.<name>.accuracy, "
                                    "harness.<name>.acc) -> "
                                    "{'policy': 'superior'} (must beat the champion, with "
                                    "confidence) or {'policy': 'non_inferior', 'margin': 0.02} "
                                    "(at worst that much worse, with confidence): a paired "
                                    "bootstrap on the items both were scored on, in place of "
                                    "that metric's champion_margins entry.")
    confidence: float = bounded(0.95, minimum=0.5, maximum=0.999,
                                help="Confidence of the paired comparisons' intervals.")
    bootstrap_resamples: int = bounded(2000, minimum=200, maximum=100000,
                                       help="Bootstrap resamples per paired comparison.")
    bootstrap_seed: int = bounded(0, minimum=0, maximum=2**31 - 1,
                                  help="Seed of the paired bootstrap (a decision can be recomputed).")
    exclude_contaminated: bool = bounded(True, help="Leave evaluation items found in the training "
                                                    "data out of every score the gate reads.")
    # Seen items are already left out of the scores; refusing is for a suite whose clean part is
    # too small to stand for it. 0.25, not GPT-3's "any overlap": the demo corpus (Python
    # docstrings) holds 11% of its held-out cloze items in training text for real (bytes and
    # bytearray document the same methods in the same words), and those are excluded, not fatal.
    max_contaminated_share: float = bounded(0.25, minimum=0.0, maximum=1.0,
                                            help="Refuse when a larger share of any metric's items "
                                                 "appears in the training data.")

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(isinstance(self.champion_margins, dict) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) for k, v in self.champion_margins.items()),
            "GateConfig.champion_margins must map metric names to finite numbers, e.g. "
            "{'task_accuracy': 0.02}.")
        _check(isinstance(self.paired, dict), "GateConfig.paired must be a dict, e.g. "
               "{'task_accuracy': {'policy': 'superior'}}.")
        for metric, rule in self.paired.items():
            where = f"GateConfig.paired[{metric!r}]"
            _check(isinstance(metric, str) and bool(ITEM_METRIC.match(metric)),
                   f"{where}: only item-level metrics can be compared item by item: "
                   "task_accuracy, suite.<name>.accuracy or harness.<name>.acc (acc_norm, exact_match).")
            _check(isinstance(rule, dict) and not set(rule) - {"policy", "margin"},
                   f"{where} must be {{'policy': ..., 'margin': ...}}; unknown keys "
                   f"{sorted(set(rule) - {'policy', 'margin'}) if isinstance(rule, dict) else rule!r}.")
            _check(rule.get("policy") in ("superior", "non_inferior"),
                   f"{where}.policy must be 'superior' or 'non_inferior', got {rule.get('policy')!r}.")
            margin = rule.get("margin", 0.0)
            _check(isinstance(margin, (int, float)) and not isinstance(margin, bool)
                   and 0.0 <= margin < 1.0, f"{where}.margin must be a number in [0, 1), got {margin!r}.")
            _check(rule["policy"] == "non_inferior" or margin == 0.0,
                   f"{where}: a margin applies to 'non_inferior' only; 'superior' means above 0.")


@dataclass(kw_only=True)
class LifecycleConfig:
    data: DataPrepConfig
    sweep: SweepConfig
    pretrain: TrainConfig
    finetune: FinetuneConfig
    distill: DistillConfig
    evaluate: EvalConfig
    gate: GateConfig = field(default_factory=GateConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    # Not in `pretrain` or `sweep`: a run that takes an earlier run's sweep (start_at pretrain,
    # a fork) must be free to set it, and those sections are compared with that run's.
    pretrain_lr: float = bounded(0.0, minimum=0.0, maximum=1.0,
                                 help="Pretraining's learning rate instead of the sweep's best (a "
                                      "fork's new rate, say); 0 = the sweep's best.")

    def __post_init__(self) -> None:
        _check_bounds(self)


# --------------------------------------------------------------------------------------------
# Recipes: functions deriving from one base. Paths are placeholders the DAG fills per run.

_UNSET = "<set per run>"


def base() -> LifecycleConfig:
    model = ModelConfig(vocab_size=1024, block_size=128, n_layer=2, n_head=4, n_embd=128)
    return LifecycleConfig(
        data=DataPrepConfig(output_dir=_UNSET, vocab_size=model.vocab_size, seq_len=model.block_size),
        sweep=SweepConfig(),
        pretrain=TrainConfig(data_dir=_UNSET, output_dir=_UNSET, model=model),
        finetune=FinetuneConfig(base_model=_UNSET, data_dir=_UNSET, output_dir=_UNSET),
        distill=DistillConfig(teacher_model=_UNSET, data_dir=_UNSET, output_dir=_UNSET,
                              student=ModelConfig(vocab_size=model.vocab_size,
                                                  block_size=model.block_size,
                                                  n_layer=1, n_head=2, n_embd=64)),
        evaluate=EvalConfig(models={"teacher": _UNSET}, data_dir=_UNSET, output_dir=_UNSET),
        # Measured on the demo recipe: pretrained perplexity ~56; the fine-tuned teacher ~51 and
        # the student ~68 with replay, but ~25 million for a teacher tuned on the task alone
        # (accuracy 0.99 either way). 250 refuses a model that lost its prose, a random one
        # (~vocab size) and anything near them, and leaves room for run-to-run noise.
        gate=GateConfig(min_task_accuracy=0.5, max_perplexity=250.0),
    )


def tiny() -> LifecycleConfig:
    """Seconds per stage: for tests."""
    cfg = base()
    cfg.data.demo_corpus_docs, cfg.data.demo_sft_examples = 300, 300
    cfg.data.vocab_size, cfg.data.seq_len, cfg.data.workers = 300, 32, 2
    cfg.pretrain.model = ModelConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=32)
    cfg.pretrain.max_steps, cfg.pretrain.batch_size = 20, 8
    cfg.pretrain.eval_interval = cfg.pretrain.checkpoint_interval = 10
    cfg.pretrain.eval_batches, cfg.pretrain.log_interval = 2, 5
    cfg.sweep = SweepConfig(trials=2, lr_min=1e-3, lr_max=1e-2, steps=10, evals=2)
    cfg.ladder = LadderConfig(widths=[16, 24, 32], tokens_per_param=[4, 16], target_flops=1e12)
    cfg.finetune.max_steps, cfg.finetune.batch_size = 10, 8
    cfg.finetune.eval_interval = cfg.finetune.checkpoint_interval = 5
    cfg.distill.student = ModelConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=16)
    cfg.distill.max_steps, cfg.distill.batch_size = 10, 8
    cfg.distill.eval_interval = cfg.distill.checkpoint_interval = 5
    cfg.evaluate.eval_batches, cfg.evaluate.max_task_examples, cfg.evaluate.max_new_tokens = 2, 20, 8
    cfg.evaluate.suite_examples = 20
    # ten steps teach nothing: only refuse what is far worse than guessing (uniform = 300)
    cfg.gate = GateConfig(min_task_accuracy=0.0, max_perplexity=600.0)
    return cfg


def demo() -> LifecycleConfig:
    """`make demo`: a few minutes on 2 CPU cores (measured on a shared 2-core box: pretrain
    ~65 s; with a quarter of each step replaying prose, finetune ~85 s and distill ~2-4 min)."""
    cfg = base()
    cfg.pretrain.max_steps = 600  # ~7 passes over the demo corpus; val loss still falling
    cfg.pretrain.eval_interval = cfg.pretrain.checkpoint_interval = 100
    # the numbers task goes from 0 to ~0.7-0.9 exact match in ~1500 SFT steps of this model
    cfg.finetune.max_steps, cfg.finetune.log_interval = 1500, 50
    cfg.finetune.eval_interval, cfg.finetune.checkpoint_interval = 250, 500
    # one layer cannot learn to copy and carry digits; two thin ones (48 wide: 0.21 of the
    # teacher's parameters) matched its accuracy (0.995) at perplexity ~68 vs ~51
    cfg.distill.student.n_layer, cfg.distill.student.n_embd, cfg.distill.student.n_head = 2, 48, 2
    cfg.distill.max_steps, cfg.distill.log_interval = 3500, 100
    cfg.distill.eval_interval, cfg.distill.checkpoint_interval = 500, 1000
    return cfg


def gpu() -> LifecycleConfig:
    """A realistic single-node start on one GPU (~85M parameters); scale out with the backend."""
    cfg = base()
    cfg.data.demo_corpus_docs, cfg.data.vocab_size, cfg.data.seq_len = 50_000, 8192, 1024
    cfg.pretrain.model = ModelConfig(vocab_size=8192, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    cfg.pretrain.max_steps, cfg.pretrain.batch_size = 5000, 32
    cfg.pretrain.eval_interval, cfg.pretrain.checkpoint_interval = 250, 500
    cfg.sweep = SweepConfig(trials=8, lr_min=1e-4, lr_max=3e-3, steps=300)
    cfg.ladder = LadderConfig(widths=[192, 384, 576, 768], tokens_per_param=[10, 20, 40],
                              target_flops=1e19)
    cfg.finetune.max_steps, cfg.distill.max_steps = 1000, 2000
    # ~0.22 of the teacher's parameters (not measured on a GPU yet)
    cfg.distill.student = ModelConfig(vocab_size=8192, block_size=1024, n_layer=5, n_head=8, n_embd=512)
    return cfg


RECIPES = {"tiny": tiny, "demo": demo, "gpu": gpu}


def recipe(name: str) -> LifecycleConfig:
    if name not in RECIPES:
        raise ConfigError(f"Unknown recipe {name!r}. Choose one of {sorted(RECIPES)}.")
    return RECIPES[name]()
