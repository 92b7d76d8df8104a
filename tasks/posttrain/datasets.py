"""What a post-training job reads: SFT examples (prompt/completion or chat JSONL) in the model's
tokenizer, and the prepared data dir whose pretraining rows are replayed and scored."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.train.prepared_data import DataDir, SFTExample, TokenRows, load_sft, model_tokenizer

log = logging.getLogger(__name__)


@dataclass
class SFTData:
    data: DataDir
    tokenizer: Any
    train: list[SFTExample]
    eval: list[SFTExample]
    files: dict[str, list[str]]  # split -> the JSONL files read
    sha256: str  # of the SFT files' bytes, in order: part of the model's lineage

    @property
    def eos_id(self) -> int:
        return self.data.eos_id

    def replay_rows(self) -> TokenRows:
        return self.data.split("train")

    def val_rows(self) -> TokenRows:
        return self.data.split("val")


def load_sft_data(data_dir: str | Path, model_dir: str | Path, block_size: int, eval_limit: int,
                  train_files: list[str] | None = None, eval_files: list[str] | None = None
                  ) -> SFTData:
    """SFT train and eval examples (the first eval_limit) from the given files, or from the data
    dir's sft/ split; the model's tokenizer must be the data dir's (checked by sha256)."""
    data = DataDir(data_dir)
    tokenizer = model_tokenizer(data, model_dir)
    files = {"train": [str(f) for f in train_files or [data.sft_path("train")]],
             "eval": [str(f) for f in eval_files or [data.sft_path("eval")]]}
    digest = hashlib.sha256()
    examples: dict[str, list[SFTExample]] = {}
    for split, paths in files.items():
        examples[split] = []
        for path in paths:
            if not Path(path).is_file():
                raise FileNotFoundError(f"SFT {split} file {path} does not exist.")
            digest.update(Path(path).read_bytes())
            examples[split] += load_sft(path, tokenizer, data.eos_id)
    too_long = sum(len(e.prompt_ids) + len(e.completion_ids) > block_size + 1
                   for e in examples["train"])
    if too_long:
        log.warning("%d of %d SFT examples exceed block_size %d; their prompts are cut from the "
                    "left", too_long, len(examples["train"]), block_size)
    return SFTData(data, tokenizer, examples["train"], examples["eval"][:eval_limit], files,
                   digest.hexdigest())
