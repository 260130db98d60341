"""Off-grid weights (a rotation of the residual stream) and GPTQ (numerics/offgrid.py, chapter 10)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minigen.course.distributions import tiny_llama
from minigen.errors import ConfigError
from minigen.numerics import offgrid, weight_quant

# A rotation changes the order of every sum, nothing else: the logits agree to fp32 rounding, which
# we bound at 1e-4 of the largest logit (measured: about 3e-6 on the tiny model, 5e-6 on SmolLM2).
TOLERANCE = 1e-4


def logits(model, ids):
    with torch.inference_mode():
        return model(ids[None], torch.arange(len(ids)))[0]


def tiny(tied: bool):
    m = tiny_llama(vocab_size=50, dim=64, n_layers=2)
    if tied:  # the head is the embedding, as in SmolLM2
        m.config = replace(m.config, tie_embeddings=True)
        m.lm_head = None
    return m


IDS = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied", [False, True])
def test_rotation_keeps_the_function_and_moves_every_weight(tied):
    m = tiny(tied)
    r = offgrid.rotate(m, seed=3)
    a, b = logits(m, IDS), logits(r, IDS)
    assert (a - b).abs().max() <= TOLERANCE * a.abs().max()
    assert r.lm_head is not None and not r.config.tie_embeddings  # untied: embedding and head differ
    assert all(bool((blk.attn_norm.weight == 1).all() and (blk.mlp_norm.weight == 1).all()) for blk in r.blocks)
    assert bool((r.norm.weight == 1).all())
    assert torch.equal(logits(m, IDS), a)  # the original is untouched (rotate copies)
    q = offgrid.random_orthogonal(64, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(64, dtype=q.dtype), atol=1e-12)


def test_weights_dequantized_from_q4_1_are_on_the_grid_and_rotated_ones_are_not():
    m = tiny(False)
    with torch.no_grad():  # put the linears on a Q4_1 grid, as the shipped SmolLM2 is
        for mod, name in weight_quant.linear_weights(m):
            getattr(mod, name).copy_(weight_quant.quantize_matrix(getattr(mod, name), 4, 32).dequantize())
    assert offgrid.share_on_4bit_grid(m) == 1.0
    assert offgrid.share_on_4bit_grid(offgrid.rotate(m)) < 0.01


def test_rotation_refuses_what_it_cannot_rotate():
    with pytest.raises(ConfigError, match="float model"):
        offgrid.rotate(weight_quant.quantize_weights(tiny(False), 4))


def test_gptq_with_an_identity_hessian_is_round_to_nearest():
    """No correlation between inputs: no error worth feeding forward, so GPTQ's codes are RTN's."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    for bits in (8, 4):
        g, r = offgrid.gptq_matrix(w, torch.eye(64), bits, 32), weight_quant.quantize_matrix(w, bits, 32)
        assert torch.equal(g.codes, r.codes) and torch.equal(g.scales, r.scales)


@pytest.mark.parametrize("bits", [8, 4])
def test_gptq_moves_each_layers_output_less_than_round_to_nearest(bits):
    """On the calibration data, ||X W^T - X W_q^T|| is smaller for GPTQ than for RTN, every layer."""
    m = tiny(False)
    hessians = offgrid.input_hessians(m, IDS)
    assert len(hessians) == 4 * m.config.n_layers
    for mod, name in weight_quant.linear_weights(m):
        w = getattr(mod, name).double()
        H = hessians[id(getattr(mod, name))].double()

        def output_error(q):  # ||X (W - W_q)^T||^2 / T * 2 = trace(E H E^T): the layer's output error
            e = q.dequantize().double() - w
            return float(torch.trace(e @ H @ e.T))

        gptq = output_error(offgrid.gptq_matrix(getattr(mod, name), H, bits, 32))
        rtn = output_error(weight_quant.quantize_matrix(getattr(mod, name), bits, 32))
        assert gptq < rtn, (name, bits, gptq, rtn)


def test_gptq_quantize_gives_minigens_format_and_a_close_model():
    m = tiny(False)
    ref = logits(m, IDS)
    q = offgrid.gptq_quantize(offgrid.rotate(m), IDS, 4, 32)
    assert weight_quant.quantized(q)
    assert all(isinstance(getattr(mod, name), weight_quant.QuantizedWeight)
               for mod, name in weight_quant.linear_weights(q))
    got = logits(q, IDS)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.5
    with pytest.raises(ConfigError, match="already quantized"):
        offgrid.gptq_quantize(q, IDS)


def test_bf16_weight_kl_is_small_and_zero_for_weights_already_in_bf16():
    m = tiny(False)
    out = offgrid.bf16_weight_kl(m, IDS)
    assert 0 < out["KL"] < 0.05 and out["top-1 agreement"] > 0.8
    on_bf16 = m.to(torch.bfloat16).float()  # weights already on bf16's grid: rounding moves nothing
    assert offgrid.bf16_weight_kl(on_bf16, IDS)["KL"] < 1e-9


@pytest.mark.slow  # copies and rotates the 135M weights: minutes on a busy two-core CPU
@pytest.mark.timeout(180)
def test_rotation_keeps_smollm2s_logits_and_takes_it_off_its_grid(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("It is a truth universally acknowledged", return_tensors="pt").input_ids[0]
    r = offgrid.rotate(model)
    a, b = logits(model, ids), logits(r, ids)
    assert (a - b).abs().max() <= TOLERANCE * a.abs().max()
    assert offgrid.share_on_4bit_grid(model) == 1.0 and offgrid.share_on_4bit_grid(r) < 0.01
