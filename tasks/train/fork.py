"""Fork a pretraining from a step: start from a kept checkpoint of another pretraining
(TrainConfig.fork_from, fork_step) with some knobs changed.

The fork's job copies the parent's checkpoint into its own output_dir/checkpoints before any
worker starts; the loop then resumes from it as from its own (tasks/train/loop.py): weights,
optimizer moments, step, random state, data cursor and guard state exactly as the parent had
them at that step. So a fork with nothing changed ends bitwise where its parent ended, and one
with a new learning rate takes its first step from the parent's state with the new lr.

Refused before any training, naming the setting: a step the parent does not keep (the
retention policy, keep_checkpoints and keep_every, decides which remain), a checkpoint that does
not verify, a change outside tasks.configs.FORK_KNOBS (the architecture, the batch, the seed...),
data of other content (another tokenizer or sequence length), max_steps not past the step.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from tasks.common.io import publish_dir, read_json
from tasks.configs import TrainConfig, fork_refusals, to_dict
from tasks.train import checkpoint as ckpt
from tasks.train.prepared_data import content_hash

log = logging.getLogger(__name__)


class ForkError(ValueError):
    """The fork cannot start from that checkpoint with this config; the message says why."""


def parent_checkpoint(cfg: TrainConfig) -> Path:
    """The parent's checkpoint the fork starts from, checked (see the module doc)."""
    parent = Path(cfg.fork_from)
    kept = sorted(step for step, _ in ckpt.step_dirs(parent))
    if not kept:
        raise ForkError(f"fork_from: {parent} holds no checkpoint (step_* directories); give the "
                        "checkpoints directory of a pretraining (its output_dir/checkpoints).")
    step = cfg.fork_step or kept[-1]
    if step not in kept:
        raise ForkError(f"fork_step: step {step} is not a kept checkpoint of {parent}; it keeps "
                        f"steps {', '.join(map(str, kept))}. Fork at one of them (keep_every "
                        "keeps every K-th step of a pretraining to fork from).")
    path = parent / f"step_{step:06d}"
    problem = ckpt.verify_checkpoint(path)
    if problem:
        raise ForkError(f"fork_step: the checkpoint {path} does not verify ({problem}).")
    if cfg.max_steps <= step:
        raise ForkError(f"max_steps ({cfg.max_steps}) must be past fork_step ({step}): the fork "
                        "trains from that step on.")
    was = read_json(path / "config.json")
    refused = [f"{key} ({a!r} in the parent, {b!r} here)"
               for key, (a, b) in fork_refusals(was, to_dict(cfg)).items()]
    if refused:
        raise ForkError(f"a fork may change only its learning rate and schedule, max_steps and "
                        f"the guard's settings; these differ from the parent's: "
                        f"{'; '.join(refused)}. Set them as the parent had them.")
    if content_hash(was.get("data_dir")) != content_hash(cfg.data_dir):
        raise ForkError(f"data_dir: {cfg.data_dir} is not the data the parent trained on "
                        f"({was.get('data_dir')}; their manifests' content hashes differ), so its "
                        "tokenizer, sequence length and data cursor would not continue the "
                        "parent's. Fork on the parent's data.")
    return path


def seed(cfg: TrainConfig) -> dict[str, Any] | None:
    """Copy the parent's checkpoint (checked) into cfg.output_dir/checkpoints, before any worker
    starts. None when the fork has checkpoints of its own already (a restarted or retried fork
    resumes from its newest). Returns the lineage: parent run, step, checkpoint."""
    source = parent_checkpoint(cfg)
    lineage = {"fork.parent_checkpoint": str(source), "fork.step": int(source.name[len("step_"):]),
               "fork.parent_run_id": cfg.fork_parent_run_id}
    root = Path(cfg.output_dir) / "checkpoints"
    if ckpt.step_dirs(root):
        log.info("fork: %s has checkpoints already; resuming from its newest", root)
        return lineage
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{source.name}-fork"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    problem = ckpt.verify_checkpoint(tmp)
    if problem:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ForkError(f"fork_step: the copy of {source} does not verify ({problem}).")
    publish_dir(tmp, root / source.name)
    log.info("fork: starting from %s (step %d)%s", source, lineage["fork.step"],
             f", MLflow run {cfg.fork_parent_run_id}" if cfg.fork_parent_run_id else "")
    return lineage
