"""The GPT itself: shapes, causality, loss, greedy decoding, parameter count."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.configs import ModelConfig, tiny
from tasks.model.gpt import GPT, IGNORE_INDEX


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny().pretrain.model).eval()


def test_shapes_and_initial_loss(model):
    cfg = model.config
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size))
    logits, loss = model(idx)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size)
    assert loss is None
    _, loss = model(idx, idx)
    # at init the prediction is close to uniform: loss ~ ln(vocab)
    assert loss.shape == ()
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5


def test_future_tokens_do_not_change_past_logits(model):
    cfg = model.config
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = torch.randint(0, cfg.vocab_size, (2, 6))
    before, _ = model(idx)
    after, _ = model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_ignored_targets_carry_no_loss(model):
    idx = torch.randint(0, model.config.vocab_size, (2, 8))
    targets = idx.clone()
    targets[:, :5] = IGNORE_INDEX
    _, loss = model(idx, targets)
    logits, _ = model(idx)
    expected = torch.nn.functional.cross_entropy(logits[:, 5:].reshape(-1, logits.size(-1)),
                                                 idx[:, 5:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_longer_than_block_size_is_refused(model):
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros((1, model.config.block_size + 1), dtype=torch.long))


def test_generate_is_greedy_and_stops_when_every_row_stopped(model):
    idx = torch.randint(0, model.config.vocab_size, (2, 5))
    out = model.generate(idx, max_new_tokens=6)
    assert out.shape == (2, 11)
    assert torch.equal(out[:, :5], idx)
    # each new token is the argmax given everything before it
    expected = idx
    for _ in range(6):
        logits, _ = model(expected)
        expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, expected)
    # if the first greedy tokens are declared stop tokens, decoding ends right there
    first = set(out[:, 5].tolist())
    stopped = model.generate(idx, max_new_tokens=6, stop_ids=first)
    assert stopped.shape == (2, 6)


def test_num_params_counts_the_tied_head_once():
    cfg = ModelConfig(vocab_size=100, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model.num_params() == sum(unique.values())
    assert model.num_params(non_embedding=True) == model.num_params() - 16 * 32
    # the config's rule of thumb is close (it leaves out biases, LayerNorms and positions)
    assert abs(model.num_params() - cfg.approx_params) / model.num_params() < 0.1
