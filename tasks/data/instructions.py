"""The demo instruction task: "what number comes after / before N?", one exact answer each.

Chosen so a ~1M-parameter GPT learns it in a few hundred CPU steps while the pretrained model
(trained on prose, which has almost no "Q: ... A: 4173") scores zero: a fine-tuning gain that
exact match can see. Digits are one token each, so an answer is the question's number copied
digit by digit with the last digit (and any carry) changed. Measured with the demo model (2
layers, 128 wide, 200 pretraining steps) and batches of 16, completion-only loss: exact match
0.0 before fine-tuning; after 150 steps at lr 1e-3 about 0.05-0.10, at lr 3e-3 about 0.25-0.50;
after 300 steps at lr 1e-3 about 0.45. Adding two 2-digit numbers was tried as a third skill and
stayed near 0.01 at that budget while taking steps from the others, so it is not in the demo.

Train and eval are disjoint by the number asked about, not just by text: a number asked about
in eval never appears in any train question, so eval measures the skill, not recall.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from tasks.common.io import atomic_write

EVAL_FRACTION = 0.2
MAX_NUMBER = 9999  # questions ask about 1..9999


def _successor(n: int) -> tuple[str, str]:
    return f"Q: What number comes after {n}?\nA:", f" {n + 1}"


def _predecessor(n: int) -> tuple[str, str]:
    return f"Q: What number comes before {n}?\nA:", f" {n - 1}"


SKILLS = {"successor": _successor, "predecessor": _predecessor}


def is_eval_number(n: int, seed: int) -> bool:
    """Which side a number belongs to: a pure function of (n, seed), so it can be re-checked."""
    digest = hashlib.sha256(f"{seed}:{n}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < EVAL_FRACTION


def generate_examples(n_examples: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval) examples {"id", "prompt", "completion", "skill"}, skills in equal shares."""
    rng = random.Random(seed)
    n_eval = max(1, round(n_examples * EVAL_FRACTION))
    out: dict[str, list[dict]] = {}
    for split, count in (("train", n_examples - n_eval), ("eval", n_eval)):
        numbers = [n for n in range(1, MAX_NUMBER + 1) if is_eval_number(n, seed) == (split == "eval")]
        examples = []
        for skill_index, (skill, render) in enumerate(SKILLS.items()):
            # Equal shares, the first skills taking the remainder.
            wanted = count // len(SKILLS) + (skill_index < count % len(SKILLS))
            # No repeats while the side has enough numbers; only a huge request repeats some.
            chosen = rng.sample(numbers, wanted) if wanted <= len(numbers) else rng.choices(numbers, k=wanted)
            for n in chosen:
                prompt, completion = render(n)
                examples.append({"prompt": prompt, "completion": completion, "skill": skill})
        rng.shuffle(examples)
        out[split] = [{"id": f"{split}-{i:06d}", **ex} for i, ex in enumerate(examples)]
    return out["train"], out["eval"]


def write_examples(path: str | Path, examples: list[dict]) -> Path:
    data = "".join(json.dumps(ex, ensure_ascii=False) + "\n" for ex in examples).encode()
    return atomic_write(path, lambda fh: fh.write(data))


def write_demo_sft(out_dir: str | Path, n_examples: int, seed: int) -> tuple[Path, Path]:
    """Write out_dir/train.jsonl and out_dir/eval.jsonl (about 20% eval)."""
    train, evaluation = generate_examples(n_examples, seed)
    out_dir = Path(out_dir)
    return write_examples(out_dir / "train.jsonl", train), write_examples(out_dir / "eval.jsonl", evaluation)


def load_examples(path: str | Path) -> list[dict]:
    """Read a prompt/completion JSONL file, refusing it with file:line and the fix if any line is bad.

    Unlike pretraining text, a bad line here is not quarantined: silently dropping examples from
    an eval set would change the benchmark without anyone noticing.
    """
    examples = []
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{where}: not a UTF-8 JSON line ({exc}).") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object with 'prompt' and 'completion'.")
            for key in ("prompt", "completion"):
                if not isinstance(record.get(key), str) or not record[key]:
                    raise ValueError(f"{where}: '{key}' must be a non-empty string.")
            examples.append({"id": str(record.get("id", f"{Path(path).stem}-{line_no:06d}")),
                             "prompt": record["prompt"], "completion": record["completion"],
                             "skill": str(record.get("skill", ""))})
    if not examples:
        raise ValueError(f"{path}: no examples; an SFT file needs at least one prompt/completion line.")
    return examples
