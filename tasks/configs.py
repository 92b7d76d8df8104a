"""Typed, validated configs for every stage, and the named recipes built from one base.

Standard library only: the Airflow side imports this module to build its Param schemas and to
validate a run's settings before any job starts, and MWAA workers have no torch or ray.

A stage's config is written to a JSON file and handed to `python -m tasks.<stage> --config FILE`;
`from_dict` rejects unknown keys so a typo in an override fails loudly instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import math
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


@dataclass(kw_only=True)
class ModelConfig:
    """A GPT-style decoder. Parameters ~ 12 * n_layer * n_embd^2 + vocab_size * n_embd."""

    vocab_size: int = bounded(1024, minimum=64, maximum=1 << 20, help="Tokenizer vocabulary size.")
    block_size: int = bounded(128, minimum=8, maximum=1 << 16, help="Context length in tokens.")
    n_layer: int = bounded(2, minimum=1, maximum=256, help="Transformer blocks.")
    n_head: int = bounded(4, minimum=1, maximum=256, help="Attention heads per block.")
    n_embd: int = bounded(128, minimum=8, maximum=65536, help="Hidden size; a multiple of n_head.")
    dropout: float = bounded(0.0, minimum=0.0, maximum=0.9, help="Dropout probability.")

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(self.n_embd % self.n_head == 0,
               f"ModelConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}).")

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


@dataclass(kw_only=True)
class DataPrepConfig:
    """Raw text -> normalized, exact-deduplicated, tokenized, packed train/val shards + manifest.

    Inputs are JSONL files (`{"id", "text", ...}`) or plain text files. With no inputs the stage
    writes the built-in demo corpus (docstrings of the installed Python) and uses that.
    """

    inputs: list = bounded([], help="Raw text files or globs (JSONL or .txt); empty = demo corpus.")
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
    engine: str = bounded("ray", choices=("ray", "local"), help="ray, or local (in-process).")
    seed: int = bounded(1234, minimum=0, maximum=2**31 - 1)

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(bool(self.output_dir), "DataPrepConfig.output_dir is required: where to write shards.")
        _check(all(isinstance(p, str) and p for p in self.inputs),
               "DataPrepConfig.inputs must be a list of non-empty paths or globs.")
        _check(len(self.sft_inputs) in (0, 2),
               "DataPrepConfig.sft_inputs must be empty or [train.jsonl, eval.jsonl].")


@dataclass(kw_only=True)
class TrainConfig:
    """Pretraining (and each sweep trial): next-token loss on the packed shards of data prep."""

    data_dir: str = bounded("", help="Output directory of data prep (holds manifest.json).")
    output_dir: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    max_steps: int = bounded(200, minimum=1, maximum=10_000_000, help="Optimizer steps.")
    batch_size: int = bounded(16, minimum=1, maximum=1 << 16, help="Sequences per step per process.")
    eval_interval: int = bounded(50, minimum=1, maximum=10_000_000, help="Steps between val evals.")
    eval_batches: int = bounded(8, minimum=1, maximum=100_000, help="Batches per val eval.")
    checkpoint_interval: int = bounded(50, minimum=1, maximum=10_000_000,
                                       help="Steps between checkpoints.")
    keep_checkpoints: int = bounded(2, minimum=1, maximum=1000, help="Checkpoints kept on disk.")
    log_interval: int = bounded(10, minimum=1, maximum=10_000_000, help="Steps between metric logs.")
    seed: int = bounded(1337, minimum=0, maximum=2**31 - 1)

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(bool(self.data_dir), "TrainConfig.data_dir is required: the data prep output.")
        _check(bool(self.output_dir), "TrainConfig.output_dir is required: where checkpoints go.")


@dataclass(kw_only=True)
class FinetuneConfig:
    """Supervised fine-tuning on prompt/completion JSONL, loss on completion tokens only."""

    base_model: str = bounded("", help="Model directory written by pretraining.")
    data_dir: str = bounded("", help="Data prep output (holds sft/train.jsonl and sft/eval.jsonl).")
    output_dir: str = ""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=10))
    max_steps: int = bounded(150, minimum=1, maximum=10_000_000)
    batch_size: int = bounded(16, minimum=1, maximum=1 << 16)
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


@dataclass(kw_only=True)
class DistillConfig:
    """A smaller student learns from the teacher's logits: alpha*T^2*KL(t/T || s/T) + (1-alpha)*CE."""

    teacher_model: str = bounded("", help="Model directory of the fine-tuned teacher.")
    data_dir: str = ""
    output_dir: str = ""
    student: ModelConfig = field(default_factory=lambda: ModelConfig(n_layer=1, n_head=2, n_embd=64))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, warmup_steps=10))
    temperature: float = bounded(2.0, minimum=0.05, maximum=100.0, help="Softening temperature T.")
    alpha: float = bounded(0.7, minimum=0.0, maximum=1.0, help="Weight of the KL term.")
    max_steps: int = bounded(300, minimum=1, maximum=10_000_000)
    batch_size: int = bounded(16, minimum=1, maximum=1 << 16)
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


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out perplexity and task exact-match for each named model directory."""

    models: dict = bounded({}, help="Name -> model directory, e.g. {'teacher': ..., 'student': ...}.")
    data_dir: str = ""
    output_dir: str = ""
    eval_batches: int = bounded(20, minimum=1, maximum=1_000_000, help="Val batches for perplexity.")
    batch_size: int = bounded(16, minimum=1, maximum=1 << 16)
    max_task_examples: int = bounded(200, minimum=1, maximum=1_000_000,
                                     help="Held-out task examples scored by exact match.")
    max_new_tokens: int = bounded(16, minimum=1, maximum=4096)

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(bool(self.models), "EvalConfig.models must name at least one model directory.")
        _check(bool(self.data_dir) and bool(self.output_dir),
               "EvalConfig.data_dir and EvalConfig.output_dir are required.")


# --------------------------------------------------------------------------------------------
# The whole lifecycle: what the DAG resolves from a recipe plus the run's Params


@dataclass(kw_only=True)
class SweepConfig:
    """A few short pretraining trials; the best by validation loss sets pretraining's lr."""

    trials: int = bounded(3, minimum=1, maximum=64, help="Trials, run in parallel as mapped tasks.")
    lr_min: float = bounded(1e-3, minimum=1e-6, maximum=1.0, help="Lowest learning rate tried.")
    lr_max: float = bounded(1e-2, minimum=1e-6, maximum=1.0, help="Highest learning rate tried.")
    steps: int = bounded(60, minimum=1, maximum=1_000_000, help="Steps per trial.")

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check(self.lr_min <= self.lr_max,
               f"SweepConfig.lr_min ({self.lr_min}) must be <= lr_max ({self.lr_max}).")

    def learning_rates(self) -> list[float]:
        """Log-spaced over [lr_min, lr_max], deterministic so a rerun tries the same trials."""
        if self.trials == 1:
            return [math.sqrt(self.lr_min * self.lr_max)]
        ratio = (self.lr_max / self.lr_min) ** (1 / (self.trials - 1))
        return [float(f"{self.lr_min * ratio**i:.3g}") for i in range(self.trials)]


@dataclass(kw_only=True)
class GateConfig:
    """What a model must reach to be registered and made `champion`."""

    min_task_accuracy: float = bounded(0.0, minimum=0.0, maximum=1.0,
                                       help="Lowest exact-match accuracy that may ship.")
    max_perplexity: float = bounded(1e9, minimum=1.0, maximum=1e9,
                                    help="Highest held-out perplexity that may ship.")
    prefer: str = bounded("student", choices=("student", "teacher"),
                          help="Which passing model to register when both pass.")

    def __post_init__(self) -> None:
        _check_bounds(self)


@dataclass(kw_only=True)
class LifecycleConfig:
    data: DataPrepConfig
    sweep: SweepConfig
    pretrain: TrainConfig
    finetune: FinetuneConfig
    distill: DistillConfig
    evaluate: EvalConfig
    gate: GateConfig = field(default_factory=GateConfig)


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
    cfg.sweep = SweepConfig(trials=2, lr_min=1e-3, lr_max=1e-2, steps=10)
    cfg.finetune.max_steps, cfg.finetune.batch_size = 10, 8
    cfg.finetune.eval_interval = cfg.finetune.checkpoint_interval = 5
    cfg.distill.student = ModelConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=16)
    cfg.distill.max_steps, cfg.distill.batch_size = 10, 8
    cfg.distill.eval_interval = cfg.distill.checkpoint_interval = 5
    cfg.evaluate.eval_batches, cfg.evaluate.max_task_examples, cfg.evaluate.max_new_tokens = 2, 20, 8
    return cfg


def demo() -> LifecycleConfig:
    """`make demo`: every stage in about a minute on 2 CPU cores (measured on a shared 2-core
    box: pretrain ~65 s, finetune ~35 s, distill ~50 s, each with ~8 s of startup and logging)."""
    cfg = base()
    cfg.pretrain.max_steps = 600  # ~7 passes over the demo corpus; val loss still falling
    cfg.pretrain.eval_interval = cfg.pretrain.checkpoint_interval = 100
    # the numbers task goes from 0 to ~0.7-0.9 exact match in ~1500 SFT steps of this model
    cfg.finetune.max_steps, cfg.finetune.log_interval = 1500, 50
    cfg.finetune.eval_interval, cfg.finetune.checkpoint_interval = 250, 500
    # one layer cannot learn to copy and carry digits; two thin ones keep most of the teacher's
    # accuracy at a third of its size
    cfg.distill.student.n_layer = 2
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
    cfg.finetune.max_steps, cfg.distill.max_steps = 1000, 2000
    cfg.distill.student = ModelConfig(vocab_size=8192, block_size=1024, n_layer=6, n_head=8, n_embd=512)
    return cfg


RECIPES = {"tiny": tiny, "demo": demo, "gpu": gpu}


def recipe(name: str) -> LifecycleConfig:
    if name not in RECIPES:
        raise ConfigError(f"Unknown recipe {name!r}. Choose one of {sorted(RECIPES)}.")
    return RECIPES[name]()
