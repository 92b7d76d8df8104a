"""Hugging Face-native models (issue 13), in-process and in seconds: our GPT is saved as exactly
the GPT-2 transformers loads; a transformers Llama keeps what the built-in path guarantees (packed
rows give each example its own logits; its LoRA adapter, saved in peft's format, merges onto the
base to what the stage merged; exact LoRA resume is test_post_training's, for both kinds); a model
on S3 is fetched once; start_run refuses a model no job could load, naming the Param, before any
job or MLflow run. The DAG run is in test_lifecycle_hf.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tasks.configs import ModelConfig
from tasks.model.gpt import GPT, IGNORE_INDEX
from tasks.train.prepared_data import DataDir, collate_sft, load_sft, load_tokenizer

PROMPT = "Q: What number comes after 41?\nA:"


def test_our_gpt_is_saved_as_exactly_the_gpt2_transformers_loads(tiny_data_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.train.export import export_model, load_model

    data = DataDir(tiny_data_dir)
    torch.manual_seed(0)
    gpt = GPT(ModelConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    model_dir = export_model(gpt, tmp_path, data.tokenizer_path, {"stage": "test"},
                             eos_id=data.eos_id)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert type(hf).__name__ == "GPT2LMHeadModel" and tokenizer.eos_token_id == data.eos_id
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids[0].tolist() == load_tokenizer(data.tokenizer_path).encode(
        PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, gpt(ids)[0])
        ours = gpt.generate(ids, 6)[0].tolist()
    theirs = hf.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist()
    assert theirs == ours[:len(theirs)] and len(theirs) > ids.shape[1]  # EOS may stop it early
    back, meta = load_model(model_dir)
    assert isinstance(back, GPT) and meta["architecture"] == "GPT2LMHeadModel"
    for key, value in gpt.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_a_transformers_llama_packs_examples_like_the_builtin_gpt(tiny_llama_dir, tiny_data_dir):
    from tasks.model.causal_lm import HFCausalLM, decoder_layers, linear_layer_names
    from tasks.posttrain.batches import collate_packed
    from tasks.posttrain.packing import packed_logits
    from tasks.train.export import load_model

    model, meta = load_model(tiny_llama_dir)
    assert isinstance(model, HFCausalLM) and meta["stage"] == "external"
    assert model.config.block_size == 32 and model.hf.config.num_key_value_heads == 2
    # FSDP's units and LoRA's default targets come from the architecture itself
    assert [type(m).__name__ for m in decoder_layers(model)] == ["LlamaDecoderLayer"] * 2
    assert linear_layer_names(model) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                         "up_proj", "v_proj"]
    data = DataDir(tiny_data_dir)
    examples = load_sft(data.sft_path("train"), load_tokenizer(data.tokenizer_path), data.eos_id,
                        limit=6)
    packed = collate_packed([examples[:3], examples[3:]], block_size=32, pad_id=data.eos_id)
    alone = collate_sft(examples, block_size=32, pad_id=data.eos_id)
    with torch.no_grad():
        logits = packed_logits(model.eval(), packed.inputs, packed.positions, packed.segments)
        reference = model(alone.inputs)[0]
    keep, kept = packed.targets != IGNORE_INDEX, alone.targets != IGNORE_INDEX
    assert torch.equal(packed.targets[keep], alone.targets[kept])
    torch.testing.assert_close(logits[keep], reference[kept], atol=1e-5, rtol=1e-5)


def test_a_llama_lora_adapter_in_peft_format_merges_onto_the_base_as_the_stage_merged_it(
        tiny_llama_dir, tiny_data_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tasks.train.export import load_model
    from tests.test_post_training import lora_steps

    _, adapters = lora_steps(lambda: load_model(tiny_llama_dir)[0], tiny_data_dir, tmp_path, 8)
    adapter_dir = adapters.save(tmp_path / "adapter", str(tiny_llama_dir))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter_dir.iterdir()}
    merged = adapters.merge()
    assert not any(".lora_" in k for k in merged.state_dict())
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
                                       adapter_dir).merge_and_unload()
    ids = torch.randint(1, 300, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, merged.eval()(ids)[0], atol=1e-5, rtol=1e-4)
        assert not torch.allclose(served(ids).logits,
                                  AutoModelForCausalLM.from_pretrained(tiny_llama_dir)(ids).logits)


def test_a_model_on_s3_is_downloaded_once_and_loads_like_the_local_one(tiny_llama_dir, tmp_path,
                                                                       moto_s3):
    from tasks.posttrain.sources import resolve_model_dir
    from tasks.train.export import load_model

    moto_s3.create_bucket(Bucket="models")
    for f in tiny_llama_dir.iterdir():
        moto_s3.upload_file(str(f), "models", f"team/llama/{f.name}")
    local = resolve_model_dir("s3://models/team/llama/", tmp_path)
    assert resolve_model_dir("s3://models/team/llama", tmp_path) == local  # a retry reuses it
    assert json.loads((local / "meta.json").read_text())["resolved_from"] == "s3://models/team/llama"
    ids = torch.randint(1, 300, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(load_model(local)[0](ids)[0], load_model(tiny_llama_dir)[0](ids)[0])
    moto_s3.put_object(Bucket="models", Key="empty/readme.txt", Body=b"x")
    with pytest.raises(ValueError, match=r"s3://models/empty is not a usable model directory: "
                                         r"it has no config.json"):
        resolve_model_dir("s3://models/empty", tmp_path)


# --------------------------------------------------------------------------------------------
# start_run: a model no job could load is refused before any job and any MLflow run


def _variant(src: Path, out: Path, *, drop: tuple[str, ...] = (), config: dict | None = None,
             add: dict[str, bytes] | None = None) -> str:
    shutil.copytree(src, out)
    for name in drop:
        (out / name).unlink()
    if config is not None:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    for name, data in (add or {}).items():
        (out / name).write_bytes(data)
    return str(out)


def _start(params: dict, run_id: str) -> dict:
    from llmops.stages import lifecycle

    return lifecycle.start_run({"recipe": "tiny", **params}, dag_id="hf_models_test", run_id=run_id)


@pytest.mark.parametrize("case, patterns", [
    ("missing", [r"Param 'base_model': '.*/nowhere' is not a directory"]),
    ("outside", [r"Param 'base_model': '/etc/llama' is outside the allowed data roots"]),
    ("no_config", [r"is not a model directory: it has no config.json"]),
    ("pickled", [r"has no safetensors weights \(only \['pytorch_model.bin'\], which load by "
                 r"unpickling: re-save with save_pretrained"]),
    ("no_tokenizer", [r"it has no tokenizer.json \(a fast tokenizer\)"]),
    ("encoder", [r"not a causal language model: config.json's architectures \['BertModel'\]"]),
    ("remote_code", [r"auto_map asks for the model's own Python code \(trust_remote_code\)"]),
    ("unregistered", [r"Param 'base_model': 'models:/no-such-model@champion' is not in the model "
                      r"registry"]),
    ("two_tokenizers", [r"Params 'base_model' \(.*\) and 'student_model' \(.*\) have different "
                        r"tokenizers", r"Pick a student_model with the base_model's tokenizer"]),
])
def test_a_model_no_job_could_load_is_refused_naming_the_param(case, patterns, tiny_llama_dir,
                                                               tmp_path):
    from llmops.infra import tracking
    from llmops.stages import lifecycle

    llama = str(tiny_llama_dir)
    params = {
        "missing": {"base_model": str(tmp_path / "nowhere")},
        "outside": {"base_model": "/etc/llama"},
        "no_config": lambda: {"base_model": _variant(tiny_llama_dir, tmp_path / "m",
                                                     drop=("config.json",))},
        "pickled": lambda: {"base_model": _variant(tiny_llama_dir, tmp_path / "m",
                                                   drop=("model.safetensors",),
                                                   add={"pytorch_model.bin": b"\x80"})},
        "no_tokenizer": lambda: {"base_model": _variant(tiny_llama_dir, tmp_path / "m",
                                                        drop=("tokenizer.json",))},
        "encoder": lambda: {"base_model": _variant(tiny_llama_dir, tmp_path / "m",
                                                   config={"architectures": ["BertModel"]})},
        "remote_code": lambda: {"base_model": _variant(
            tiny_llama_dir, tmp_path / "m", config={"auto_map": {"AutoModelForCausalLM": "x.Y"}})},
        "unregistered": {"base_model": "models:/no-such-model@champion"},
        "two_tokenizers": lambda: {"base_model": llama, "student_model": _other_tokenizer(
            tiny_llama_dir, tmp_path / "m")},
    }[case]
    params = params() if callable(params) else params
    exp = tracking.client().get_experiment_by_name("hf_models_test")
    before = len(tracking.client().search_runs([exp.experiment_id])) if exp else 0
    with pytest.raises(lifecycle.validation_errors()) as info:
        _start(params, f"manual__refused_{case}")
    for pattern in patterns:
        assert re.search(pattern, str(info.value)), f"{pattern!r} not in: {info.value}"
    exp = tracking.client().get_experiment_by_name("hf_models_test")
    assert (len(tracking.client().search_runs([exp.experiment_id])) if exp else 0) == before


def _other_tokenizer(src: Path, out: Path) -> str:
    """The same model with one merge of its BPE changed: another tokenizer."""
    path = Path(_variant(src, out))
    spec = json.loads((path / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return str(path)


def test_a_base_model_replaces_sweep_and_pretraining_and_sets_the_datas_tokenizer(tiny_llama_dir):
    from llmops.stages import lifecycle, specs

    run = _start({"base_model": str(tiny_llama_dir), "student_arch": "llama"}, "manual__base")
    assert run["base_model"] == str(tiny_llama_dir)
    assert run["config"]["data"]["tokenizer_path"] == str(tiny_llama_dir / "tokenizer.json")
    data = {"outputs": {"data_dir": "/out/data"}, "data_hash": "abc"}
    assert specs.sweep_trials(run, data) == []
    spec = specs.finetune_spec(run, data, None)
    assert spec["config"]["base_model"] == str(tiny_llama_dir)
    # the step cache knows the base model by its content, not its path
    assert len(run["base_model_hash"]) == 64
    assert specs.given_base(run)["content_hashes"]["model_dir"] == run["base_model_hash"]
    model = {"outputs": {"model_dir": "/out/m"}, "mlflow_run_id": "r"}
    spec = specs.evaluate_spec(run, data, None, model, model)
    assert spec["config"]["models"]["pretrained"] == str(tiny_llama_dir)
    assert specs.distill_spec(run, data, model)["config"]["student"]["arch"] == "llama"


def test_data_prep_ends_documents_with_the_eos_a_models_tokenizer_config_declares(
        tiny_data_dir, tmp_path):
    """A Llama-style tokenizer has no <|endoftext|>: its tokenizer_config.json names the EOS."""
    from tasks.configs import tiny
    from tasks.data.prep import prepare

    spec = json.loads((tiny_data_dir / "tokenizer.json").read_text())
    spec["model"]["vocab"]["</s>"] = spec["model"]["vocab"].pop("<|endoftext|>")
    for token in spec["added_tokens"]:
        token["content"] = "</s>" if token["content"] == "<|endoftext|>" else token["content"]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))
    cfg = tiny().data
    cfg.output_dir, cfg.engine = str(tmp_path / "without"), "local"
    cfg.tokenizer_path = str(model_dir / "tokenizer.json")
    with pytest.raises(ValueError, match=r"has no '<\|endoftext\|>' token and no "
                                         r"tokenizer_config.json beside it declaring"):
        prepare(cfg)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    cfg.output_dir = str(tmp_path / "with")
    prepare(cfg)
    manifest = json.loads((tmp_path / "with" / "manifest.json").read_text())
    assert manifest["eos_id"] == spec["model"]["vocab"]["</s>"]


def test_a_student_model_with_another_tokenizer_than_the_teacher_is_refused_naming_both(
        tiny_llama_dir, tmp_path):
    """The job's own check (start_run makes the same one before any job)."""
    from tasks.configs import ConfigError, DistillConfig
    from tasks.distill import build_student

    cfg = DistillConfig(teacher_model=str(tiny_llama_dir), data_dir="-", output_dir=str(tmp_path),
                        student_model=str(tiny_llama_dir))
    student = build_student(cfg, tiny_llama_dir, torch.device("cpu"))  # same tokenizer: loads
    assert type(student.hf).__name__ == "LlamaForCausalLM"
    other = _other_tokenizer(tiny_llama_dir, tmp_path / "other")
    cfg.student_model = other
    with pytest.raises(ConfigError, match=rf"DistillConfig.student_model {re.escape(other)} has "
                                          rf"another tokenizer than teacher_model "
                                          rf"{re.escape(str(tiny_llama_dir))}"):
        build_student(cfg, tiny_llama_dir, torch.device("cpu"))
