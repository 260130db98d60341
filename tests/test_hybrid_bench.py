"""The hybrid cache's benchmark (measure/hybrid.py): its byte count written out by hand, and a decode
comparison that runs on a tiny model (speeds are returned, never asserted: they live in the bench run)."""

import pytest
import torch

from minigen.errors import BenchError
from minigen.kernels import build as kernel_build
from minigen.measure import hybrid
from minigen.checkpoints.model_config import ModelConfig

# three sliding layers of a 4-token window, one full layer: 2 KV heads of 8
TINY = ModelConfig(arch="llama", vocab_size=97, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
                   max_seq_len=64, layer_types=("sliding_attention", "full_attention", "sliding_attention",
                                                "sliding_attention"), sliding_window=4)


def test_cache_bytes_are_the_count():
    rows = hybrid.cache_bytes(TINY, contexts=(4, 20), dtypes=(torch.float32, torch.bfloat16))
    assert [(r["dtype"], r["context"]) for r in rows] == [("float32", 4), ("float32", 20), ("bfloat16", 4),
                                                          ("bfloat16", 20)]
    for r in rows:
        size = 4 if r["dtype"] == "float32" else 2
        per_position = 2 * 2 * 8 * size  # K and V x Hkv x Dh x bytes
        count = (3 * 4 + 1 * r["context"]) * per_position  # 3 sliding layers x window + 1 full x context
        uniform = 4 * r["context"] * per_position
        ring_positions = 4 * 8  # the ring's slot positions: window x int64
        assert r["cache"] == "HybridKVCache"
        assert r["count_bytes"] == count
        assert r["hybrid_nbytes"] == count + ring_positions
        assert r["uniform_nbytes"] == uniform
        assert r["hybrid_share_of_uniform"] == pytest.approx((count + ring_positions) / uniform)
        assert r["within_tolerance"] == (abs((count + ring_positions) / count - 1) <= 0.05)


def test_gemma3_shape_within_five_percent_at_8192():
    """The issue's bound, on the real shape: zeros that are never touched, so no memory is spent."""
    (row,) = hybrid.cache_bytes(contexts=(8192,), dtypes=(torch.bfloat16,))
    assert row["within_tolerance"] and row["hybrid_over_count"] == pytest.approx(1, abs=0.05)
    assert row["hybrid_share_of_uniform"] < 0.25  # 15 x 512 + 3 x 8,192 of 18 x 8,192: about 22%


def test_decode_speed_runs_both_caches():
    result = hybrid.decode_speed(TINY, context=12, steps=3, memory_read_gb_s=10.0)
    assert set(result["caches"]) == {"hybrid", "uniform"}
    assert result["caches"]["hybrid"]["cache"] == "HybridKVCache" and result["caches"]["uniform"]["cache"] == "KVCache"
    assert result["step"] == "eager" and result["context_end"] == 15
    assert result["first_step_max_logit_diff"] < 1e-5  # the same keys, the same window: the same logits
    for c in result["caches"].values():
        assert len(c["step_seconds"]) == 3 and c["tokens_per_s"] > 0
    assert result["attention_skips_masked_slots"] == kernel_build.available()


@pytest.mark.parametrize("kernels", [False, True])
def test_decode_speed_counts_the_slots_attention_reads(kernels):
    if kernels and not kernel_build.available():
        pytest.skip(f"minigen's C kernel is not available here: {kernel_build.status()}")
    result = hybrid.decode_speed(TINY, context=12, steps=3, kernels=kernels, memory_read_gb_s=10.0)
    assert result["attention_skips_masked_slots"] == kernels
    per_slot = 2 * 2 * 8 * 4  # K and V x Hkv x Dh x fp32
    read = {name: c["bytes_read_per_step"] - result["weight_bytes_per_step"] for name, c in result["caches"].items()}
    if kernels:  # C skips masked slots: the full layer reads the middle step's 12 + 1 + 3 // 2 = 14
        # positions, each sliding layer its window of 4, in either cache
        assert read == {"uniform": (14 + 3 * 4) * per_slot, "hybrid": (14 + 3 * 4) * per_slot}
    else:  # SDPA reads all 16 slots (12 + 1 + 3) in every layer of the uniform cache, and the hybrid's rings of 4
        assert read == {"uniform": 4 * 16 * per_slot, "hybrid": (16 + 3 * 4) * per_slot}


def test_decode_speed_refuses_a_model_without_sliding_layers():
    full = ModelConfig(arch="llama", vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                       hidden_dim=64, max_seq_len=64)
    with pytest.raises(BenchError, match="sliding layers"):
        hybrid.decode_speed(full, context=8, steps=2)
    with pytest.raises(BenchError, match="exceeds the model's context of 64"):
        hybrid.decode_speed(TINY, context=60, steps=8)


def test_decode_speed_refuses_caches_that_hold_different_keys(monkeypatch):
    """The first step's logits are the check that both caches hold the same window of the same keys."""
    calls = []
    real_fill = hybrid.fill

    def fill_differently(cache, cfg, context, seed):
        calls.append(cache)
        real_fill(cache, cfg, context, seed + len(calls))  # the uniform cache gets other keys

    monkeypatch.setattr(hybrid, "fill", fill_differently)
    with pytest.raises(BenchError, match="different logits"):
        hybrid.decode_speed(TINY, context=12, steps=2, memory_read_gb_s=10.0)


def test_bytes_per_decode_step_counts_each_layer_at_its_own_size():
    """bench's roofline reads each layer's held positions: a sliding layer's window, not the context."""
    from minigen.measure.bench import bytes_per_decode_step
    model = hybrid.random_model(TINY)
    weights = bytes_per_decode_step(model, 0)
    per_position = 2 * 2 * 8 * 4  # K and V x Hkv x Dh x fp32
    assert bytes_per_decode_step(model, 20) - weights == hybrid.counted_bytes(TINY, 20, 4)
    assert hybrid.counted_bytes(TINY, 20, 4) == (3 * 4 + 20) * per_position  # 3 sliding layers x 4 + 1 full x 20
    assert bytes_per_decode_step(model, 3) - weights == 4 * 3 * per_position  # shorter than the window: every layer
