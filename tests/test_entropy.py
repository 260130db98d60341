"""Attention entropy (chapters 7-8): the formula against known distributions, attention_entropy on
a model whose every head is uniform, the monitor's flags on synthetic attention, and the sink
effect on SmolLM2."""

from __future__ import annotations

import math

import pytest
import torch

import minigen
from minigen.entropy import EntropyMonitor, entropy, normalized_entropy
from minigen.evaluate import attention_entropy

pytestmark = pytest.mark.usefixtures("one_thread")


def test_entropy_of_known_distributions():
    assert entropy(torch.full((8,), 1 / 8)).item() == pytest.approx(math.log(8))
    assert entropy(torch.tensor([1.0, 0.0, 0.0])).item() == 0.0  # 0 log 0 = 0, not NaN
    p = torch.tensor([0.5, 0.25, 0.25, 0.0])
    assert entropy(p).item() == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    assert normalized_entropy(p).item() == pytest.approx(entropy(p).item() / math.log(3))  # 3 nonzero keys


def test_attention_entropy_of_uniform_heads(tiny_llama):
    # Zero query weights make every score 0, so query t attends its t + 1 keys evenly:
    # entropy log(t + 1) in every layer and head; a window of W caps it at log(W + sinks).
    _, model = tiny_llama
    model = type(model)(model.config)
    model.load_state_dict(tiny_llama[1].state_dict())
    H, Dh = model.config.n_heads, model.config.head_dim
    model.blocks[0].attn.wqkv.data[: H * Dh] = 0.0
    model.blocks[1].attn.wqkv.data[: H * Dh] = 0.0
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(0))
    e = attention_entropy(model, ids)  # [L, H, T]
    assert e.shape == (2, 4, 20)
    expected = torch.log(torch.arange(1, 21).float()).expand(2, 4, 20)
    torch.testing.assert_close(e, expected, atol=1e-5, rtol=1e-5)
    windowed = attention_entropy(model, ids, window_size=5, sink_tokens=1, chunk_size=1)
    torch.testing.assert_close(windowed[..., 10:], torch.full((2, 4, 10), math.log(6)), atol=1e-5, rtol=1e-5)


def _step(monitor: EntropyMonitor, probs_per_layer: list[torch.Tensor]) -> None:
    for layer, probs in enumerate(probs_per_layer):
        monitor(layer, probs)


def test_monitor_flags_exploding_and_collapsing_heads():
    # 2 layers x 2 heads over 10 keys. Normal: head (0, 0) peaked, the others moderately spread.
    peaked = torch.tensor([0.91] + [0.01] * 9)
    spread = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1] + [0.0] * 5)
    uniform = torch.full((10,), 0.1)
    one_hot = torch.tensor([1.0] + [0.0] * 9)

    def probs(h00, h01, h10, h11):  # [B=1, H=2, T=1, S=10] per layer
        return [torch.stack([h00, h01])[None, :, None], torch.stack([h10, h11])[None, :, None]]

    monitor = EntropyMonitor(n_layers=2, n_heads=2, warmup=4, delta=0.4, alarm_fraction=0.5)
    for _ in range(6):
        _step(monitor, probs(peaked, spread, spread, spread))
    assert monitor.flags == [] and monitor.alarms() == []
    _step(monitor, probs(uniform, spread, spread, one_hot))  # step 6: (0, 0) explodes, (1, 1) collapses
    assert {(f.layer, f.head, f.kind) for f in monitor.flags} == {(0, 0, "explode"), (1, 1, "collapse")}
    assert all(f.step == 6 for f in monitor.flags)
    assert monitor.alarms() == [6]  # 2 of 4 heads at once
    assert monitor.entropies.shape == (7, 2, 2)


def test_monitor_records_one_step_per_generated_token(tiny_llama):
    _, model = tiny_llama
    monitor = EntropyMonitor.for_model(model, warmup=4)
    prompt = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    out = minigen.generate(model, prompt, max_new_tokens=12, stop_token_ids=[], observers=(monitor,))
    plain = minigen.generate(model, prompt, max_new_tokens=12, stop_token_ids=[])
    assert torch.equal(out.tokens, plain.tokens)  # watching changes nothing
    assert monitor.entropies.shape == (12, 2, 4)  # the prefill's last query + 11 decode steps


def test_smollm2_evicting_sinks_raises_entropy(smollm2, english_text_ids):
    # 200 tokens, window 32. Without sinks, heads that parked their attention on the first token
    # spread it over the window instead. Measured on this CPU (mean normalized entropy, positions
    # 100-199): no sinks 0.63, 4 sinks 0.42.
    model, _ = smollm2
    ids = english_text_ids[:200]
    n_keys = {0: 32, 4: 36}
    means = {}
    for sinks in (0, 4):
        e = attention_entropy(model, ids, use_cache=False, window_size=32, sink_tokens=sinks)
        means[sinks] = (e[..., 100:] / math.log(n_keys[sinks])).mean().item()
    assert means[0] >= means[4] + 0.1, means
