"""The named recipes (`tiny` for tests, `demo` for `make demo`, `gpu`): functions deriving a
`LifecycleConfig` from one `base`. Paths are placeholders (`_UNSET`) the DAG fills per run;
`recipe(name)` looks one up in `RECIPES`."""

from __future__ import annotations

from tasks.configs.data_config import DataPrepConfig
from tasks.configs.evaluate_config import EvalConfig
from tasks.configs.fields import ConfigError
from tasks.configs.gate_config import GateConfig
from tasks.configs.lifecycle_config import LifecycleConfig
from tasks.configs.model_config import ModelConfig
from tasks.configs.sweep_config import LadderConfig, SweepConfig
from tasks.configs.train_config import DistillConfig, FinetuneConfig, TrainConfig


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
    # every val row (118 of 32 tokens): the gate pairs the held-out text document by document
    cfg.evaluate.eval_batches, cfg.evaluate.max_task_examples, cfg.evaluate.max_new_tokens = 8, 20, 8
    cfg.evaluate.suite_examples = 20
    # ten steps teach nothing: only refuse what is far worse than guessing (uniform = 300). A
    # model this small moves by up to 0.8% with its seeds alone (benchmarks/results/gate_noise.json)
    cfg.gate = GateConfig(min_task_accuracy=0.0, max_perplexity=600.0, margin=0.015)
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
