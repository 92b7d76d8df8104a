"""What a Hugging Face causal-LM directory must hold, checked from its JSON files alone.

Standard library only: the Airflow side (plugins/llmops/policy/model_refs.py, on MWAA without torch
or transformers) refuses a bad model reference with these checks before any job starts, and the jobs
use the same ones.
"""

from __future__ import annotations

import json
from typing import Any

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
WEIGHT_SUFFIX = ".safetensors"
# a causal LM's class as transformers names it: LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
# the parts of tokenizer.json that decide which ids a text becomes and back; transformers adds an
# empty post_processor when it saves a tokenizer, and padding/truncation are call settings
TOKENIZER_IDENTITY = ("model", "added_tokens", "normalizer", "pre_tokenizer", "decoder")


def config_problem(config: Any) -> str | None:
    """Why a parsed config.json is not a causal LM transformers can build, or None."""
    if not isinstance(config, dict):
        return "config.json is not a JSON object"
    if not config.get("model_type"):
        return "config.json has no model_type"
    archs = config.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith(CAUSAL_LM_SUFFIXES) for a in archs):
        return (f"config.json's architectures {archs} name no causal language model (a class "
                f"ending in {' or '.join(CAUSAL_LM_SUFFIXES)}, as AutoModelForCausalLM loads)")
    if config.get("auto_map"):
        return ("config.json's auto_map asks for the model's own Python code (trust_remote_code), "
                "which the stages never run; use a model transformers implements")
    return None


def files_problem(names: set[str]) -> str | None:
    """Why a directory's file names are not a loadable model with its tokenizer, or None."""
    if CONFIG not in names:
        return f"it has no {CONFIG}"
    if not any(n.endswith(WEIGHT_SUFFIX) for n in names):
        pickled = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")))
        return ("it has no safetensors weights" + (f" (only {pickled}, which load by unpickling: "
                "re-save with save_pretrained(..., safe_serialization=True))" if pickled else ""))
    if TOKENIZER not in names:
        return (f"it has no {TOKENIZER} (a fast tokenizer): save one with "
                "AutoTokenizer.from_pretrained(...).save_pretrained(<dir>)")
    return None


def tokenizer_identity(spec: dict[str, Any]) -> str:
    """A canonical string of what makes two tokenizer.json files the same tokenizer."""
    return json.dumps({k: spec.get(k) for k in TOKENIZER_IDENTITY}, sort_keys=True)


def same_tokenizer(a: bytes | str, b: bytes | str) -> bool:
    """Do two tokenizer.json contents turn every text into the same ids?"""
    if a == b:
        return True
    return tokenizer_identity(json.loads(a)) == tokenizer_identity(json.loads(b))


def eos_token(tokenizer_config: dict[str, Any]) -> str | None:
    """The EOS token a tokenizer_config.json declares (a string or an AddedToken dict)."""
    eos = tokenizer_config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None
