"""Honest throughput figures: one table of accelerator peaks (exact names) shared by the jobs' MFU
and the budget estimator, and the FLOPs-per-token formula against a count of the model's matmuls."""

from __future__ import annotations

import pytest
import torch

from tasks.common import hardware
from tasks.configs import ModelConfig
from tasks.model.gpt import GPT
from tasks.train.runtime import gpt_flops_per_token, peak_flops


@pytest.mark.parametrize("device_name, accelerator, tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312.0),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100 80GB", 312.0),
    ("NVIDIA A10G", "A10G", 125.0),
    ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA L40", "L40", 181.05),
    ("NVIDIA L40S", "L40S", 362.05),
    ("NVIDIA B200", "B200", 2250.0),
])
def test_each_gpu_gets_its_own_peak_by_exact_name(device_name, accelerator, tflops):
    found = hardware.for_device_name(device_name)
    assert found is not None and (found.name, found.peak_tflops) == (accelerator, tflops)


def test_an_unlisted_device_gets_no_peak_and_so_no_mfu(monkeypatch):
    for name in ("Tesla T4", "NVIDIA GeForce RTX 4090", "NVIDIA H100X", "NVIDIA L4X"):
        assert hardware.for_device_name(name) is None, name
    monkeypatch.delenv("LLMOPS_PEAK_TFLOPS", raising=False)
    assert peak_flops(torch.device("cpu")) == 0.0  # no guessed CPU peak
    monkeypatch.setenv("LLMOPS_PEAK_TFLOPS", "100")
    assert peak_flops(torch.device("cpu")) == 100e12


def test_the_budget_estimator_reads_the_same_table():
    from llmops.policy import budget

    for instance_type, name in (("ml.g5.2xlarge", "A10G"), ("ml.g6e.12xlarge", "L40S"),
                                ("ml.p4d.24xlarge", "A100 40GB"), ("ml.p4de.24xlarge", "A100 80GB"),
                                ("ml.p5.48xlarge", "H100 SXM"), ("ml.p5e.48xlarge", "H200 SXM"),
                                ("ml.p5en.48xlarge", "H200 SXM"), ("ml.trn1.32xlarge", "Trainium")):
        found, speed = budget.accelerator(instance_type)
        assert found == name, instance_type
        assert speed == budget.PLANNING_MFU * hardware.ACCELERATORS[name].peak_tflops * 1e12
    assert budget.accelerator("ml.m5.xlarge") == budget.UNKNOWN


def test_flops_per_token_is_the_models_matmuls_plus_attention():
    """6 FLOPs per weight and token (forward 2, backward 4) for every matmul, counted by torch's
    FlopCounterMode over a real forward + backward; plus the attention products, which that counter
    does not see on CPU (they run inside scaled_dot_product_attention), counted by hand: QK^T and
    AV are 2*T*d each per token and layer forward, x3 with backward = 12*L*T*d. The formula also
    charges 6 FLOPs per bias and LayerNorm parameter (PaLM's convention): that is all it adds."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = ModelConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
    model = GPT(cfg)
    B, T = 2, cfg.block_size
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(x, x)
        loss.backward()
    matmuls_per_token = counter.get_total_flops() / (B * T)
    L, d, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    assert matmuls_per_token == 6 * (12 * L * d * d + V * d)  # the layers' weights and the tied head
    attention = 12 * L * T * d
    elementwise_params = sum(p.numel() for n, p in model.named_parameters()
                             if p.dim() == 1)  # biases and LayerNorm gains/biases
    formula = gpt_flops_per_token(model.num_params(), L, d, T, model.transformer.wpe.weight.numel())
    assert formula == matmuls_per_token + attention + 6 * elementwise_params
    # on a real model the convention's extra is small: the gpu recipe's 12 x 768 GPT
    big = ModelConfig(vocab_size=8192, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    L, d, V, T = big.n_layer, big.n_embd, big.vocab_size, big.block_size
    exact = 6 * (12 * L * d * d + V * d) + 12 * L * T * d
    params = 12 * L * d * d + 13 * L * d + 2 * d + V * d + T * d  # what num_params() counts
    assert gpt_flops_per_token(params, L, d, T, T * d) / exact - 1 < 0.002
