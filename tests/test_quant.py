"""Group-wise KV quantization (minigen/quant.py): round trips, packing, the quantized cache.

Oracles: the round-trip bound |x - x_hat| <= scale / 2 derived from the grid; packing checked
against bytes built by hand; the cache checked against a reference written the obvious way
(quantize the whole history, keep the recent tokens); lossy quality on SmolLM2 by perplexity.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minigen
from minigen.caches.contract import ANY_LAYER
from conftest import tiny_hf
from minigen.config import GenerationConfig
from minigen.errors import CacheFullError, ConfigError
from minigen.caches.make import make_cache
from minigen.caches.contiguous import KVCache
from minigen.evaluate import score
from minigen.numerics.quant import GROUP_AXIS, dequantize, meta_dtype, pack, quantize, round_trip, unpack
from minigen.caches.quantized import QuantizedKVCache


def error_bound(x: torch.Tensor, q) -> torch.Tensor:
    """scale / 2 per element, plus fp32 rounding: the subtract, divide, multiply and add of the
    round trip each err by at most 2^-24 relative to |x| or |zero|, so 2^-20 covers all four."""
    ax = q.axis % x.dim()
    scale = q.scales.float().repeat_interleave(q.group_size, dim=ax)
    zero = q.zeros.float().repeat_interleave(q.group_size, dim=ax)
    return scale / 2 + 2**-20 * (x.abs() + zero.abs()) + 1e-30


# ---------------------------------------------------------------- round trips
@settings(max_examples=150, deadline=None)
@given(bits=st.sampled_from([8, 4, 2]), groups=st.integers(1, 3), group_exp=st.integers(0, 6),
       lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), axis_from_end=st.booleans(),
       kind=st.sampled_from(["normal", "constant", "outliers", "tiny"]),
       magnitude=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**16),
       scale_dtype=st.sampled_from([None, torch.float16, torch.bfloat16, torch.float32]))
def test_round_trip_within_half_a_step(bits, groups, group_exp, lead, axis_from_end, kind, magnitude, seed,
                                       scale_dtype):
    n = 8 // bits
    G = max(n, 2**group_exp)  # a group fills whole bytes
    g = torch.Generator().manual_seed(seed)
    shape = lead + [groups * G, 3] if axis_from_end else lead + [3, groups * G]
    axis = -2 if axis_from_end else -1
    x = torch.randn(shape, generator=g) * magnitude
    if kind == "constant":
        x = torch.full(shape, 1.2345678 * magnitude)  # not representable in fp16
    elif kind == "outliers":
        x.view(-1)[:: 7] *= 50  # a few large values stretch their groups' scales
    elif kind == "tiny":
        x = x * 1e-4
    q = quantize(x, bits, G, axis, scale_dtype)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    # fp32 values get bf16 scales and zeros by default (fp16 cannot hold every fp32 value, bf16 has
    # fp32's range); 16-bit ones are rounded (zero down, scale up) so the grid still covers the group.
    assert q.data.dtype == torch.uint8 and q.scales.dtype == q.zeros.dtype == (scale_dtype or torch.bfloat16)
    assert q.data.shape[axis] == x.shape[axis] // n and q.scales.shape[axis] == x.shape[axis] // G
    assert ((y - x).abs() <= error_bound(x, q)).all(), (y - x).abs().max()


def test_values_on_the_grid_come_back_exactly():
    # 0..15 (and 0..255) in one group: zero = 0 and scale = 1 are exact in fp16, every code is exact.
    for bits in (4, 8):
        x = torch.arange(2**bits, dtype=torch.float32).repeat(3, 1)  # [3, 2^bits]
        assert torch.equal(round_trip(x, bits, 2**bits, axis=-1), x)


def test_coarser_groups_and_fewer_bits_lose_more():
    x = torch.randn(4, 256, 64, generator=torch.Generator().manual_seed(0))
    err = {(b, G): (round_trip(x, b, G, -1) - x).pow(2).mean().item() for b in (8, 4, 2) for G in (8, 64)}
    assert err[(8, 8)] < err[(4, 8)] < err[(2, 8)]
    assert err[(4, 8)] < err[(4, 64)]


def test_per_channel_keys_beat_per_token_keys_when_a_channel_is_an_outlier():
    # KIVI's observation in miniature: one channel 20x larger than the others for every token.
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 128, 64, generator=g)
    k[..., 5] = 20 + torch.randn(128, generator=g)
    per_channel = (round_trip(k, 4, 32, GROUP_AXIS["channel"]) - k).pow(2).mean()
    per_token = (round_trip(k, 4, 32, GROUP_AXIS["token"]) - k).pow(2).mean()
    assert per_channel < per_token / 4


# ---------------------------------------------------------------- packing
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_pack_unpack_exact(bits, axis):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (8, 16, 4), generator=g).to(torch.uint8)
    packed = pack(codes, bits, axis)
    assert packed.shape[axis] == codes.shape[axis] * bits // 8
    assert torch.equal(unpack(packed, bits, axis), codes)


def test_pack_puts_the_first_code_in_the_low_bits():
    codes = torch.tensor([1, 2, 15, 0, 3, 1, 2, 0], dtype=torch.uint8)
    assert pack(codes, 4).tolist() == [0x21, 0x0F, 0x13, 0x02]
    assert pack(codes[:4] % 4, 2).tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6]


# ---------------------------------------------------------------- the cache
def reference_view(history: torch.Tensor, start: int, end: int, bits: int, G: int, R: int, axis: int):
    """What the cache should return after writing positions [start, end): the whole history
    quantized in groups, where a position counts as quantized once end - R tokens are past it
    (rounded up to whole groups), except this call's own tokens, which stay exact."""
    q1 = G * math.ceil(max(0, end - R) / G)
    read = min(q1, start)
    fake = round_trip(history[:, :, :q1], bits, G, axis) if q1 else history[:, :, :0]
    return torch.cat([fake[:, :, :read], history[:, :, read:end]], dim=2)


@pytest.mark.parametrize("bits,G,R,key_axis", [(4, 8, 8, "channel"), (4, 8, 24, "token"),
                                              (2, 4, 10, "channel"), (8, 16, 16, "channel")])
def test_cache_matches_quantizing_the_history(bits, G, R, key_axis):
    L, B, Hkv, Dh, max_len = 2, 2, 3, 16, 70
    g = torch.Generator().manual_seed(bits + G + R)
    ks, vs = torch.randn(L, B, Hkv, max_len, Dh, generator=g), torch.randn(L, B, Hkv, max_len, Dh, generator=g)
    cache = QuantizedKVCache(L, B, Hkv, max_len, Dh, bits, G, key_axis, R)
    start = 0
    for T in [5, 1, 1, 17, 1, 3, 1, 30, 1, 1, 1, 8]:  # a prompt, decode steps, chunks across groups
        pos = torch.arange(start, start + T)
        assert torch.equal(cache.prepare(pos)[ANY_LAYER], torch.arange(start + T))
        for layer in range(L):
            k, v = cache.update(layer, ks[layer, :, :, pos], vs[layer, :, :, pos])
            ref_k = reference_view(ks[layer], start, start + T, bits, G, R, GROUP_AXIS[key_axis])
            ref_v = reference_view(vs[layer], start, start + T, bits, G, R, -1)
            assert torch.equal(k, ref_k) and torch.equal(v, ref_v), (start, T, layer)
        start += T
    assert start == max_len


def test_cache_with_a_window_covering_everything_is_the_full_cache(tiny_llama):
    _, model = tiny_llama
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    cfg = GenerationConfig(quant_bits=2, quant_group_size=8, quant_residual=64)
    exact, quant = score(model, ids, chunk_size=3), score(model, ids, cfg, chunk_size=3)
    # The same keys and values at the same positions; only the number of masked slots differs
    # (the full cache attends over all 40 slots), so logits agree to fp32 rounding.
    torch.testing.assert_close(quant.nll, exact.nll, rtol=0, atol=1e-5)
    assert torch.equal(quant.top1, exact.top1)
    prompt = ids[:, :6]
    plain = minigen.generate(model, prompt, max_new_tokens=20, stop_token_ids=[]).tokens
    assert torch.equal(minigen.generate(model, prompt, cfg, max_new_tokens=20, stop_token_ids=[]).tokens, plain)


def test_quantized_cache_changes_the_logits_at_two_bits(tiny_llama):
    # The converse of the test above, so that a cache that silently stored full precision fails.
    _, model = tiny_llama
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    cfg = GenerationConfig(quant_bits=2, quant_group_size=8, quant_residual=8)
    assert (score(model, ids, cfg, chunk_size=1).nll - score(model, ids).nll).abs().max() > 1e-3


@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)])
def test_nbytes_counts_codes_scales_zeros_and_the_window(dtype, size):
    meta = 2  # scales and zeros are 2 bytes whatever the model's dtype (bf16 for an fp32 model)
    L, B, Hkv, Dh, max_len, G, R = 3, 2, 2, 64, 100, 32, 40
    cache = QuantizedKVCache(L, B, Hkv, max_len, Dh, bits=4, group_size=G, key_axis="channel", residual=R,
                             dtype=dtype)
    S_q = 64  # whole groups of the 100 - 40 = 60 positions that can leave the window
    codes = 2 * L * B * Hkv * S_q * Dh // 2  # K and V, two 4-bit codes per byte
    key_meta = 2 * L * B * Hkv * (S_q // G) * Dh * meta  # a 2-byte scale and zero per channel per group
    value_meta = 2 * L * B * Hkv * S_q * (Dh // G) * meta  # per token per group of channels
    window = 2 * L * B * Hkv * R * Dh * size  # recent tokens in the cache's dtype
    assert cache.nbytes == codes + key_meta + value_meta + window


def test_four_bit_cache_is_3x_smaller_than_fp16_at_4096_tokens(smollm2):
    model, _ = smollm2
    fp16 = 4096 * model.config.kv_bytes_per_token(2)
    fp32 = 4096 * model.config.kv_bytes_per_token(4)
    # The article's comparison: an fp16 model's cache, with fp16 scales, zeros and window.
    half = QuantizedKVCache(model.config.n_layers, 1, model.config.n_kv_heads, 4096, model.config.head_dim,
                            bits=4, group_size=32, dtype=torch.float16, device="meta")
    assert 3.0 <= fp16 / half.nbytes < 3.2  # not 4x: a 16-bit scale + zero per 32 elements is one more bit
    # SmolLM2 in fp32: bf16 scales and zeros (one more bit per element, as fp16's) and an fp32 window.
    cache = make_cache(model, GenerationConfig(quant_bits=4), batch=1, max_len=4096)
    assert cache.k.scales.dtype == cache.v.zeros.dtype == torch.bfloat16
    assert 3.0 <= fp16 / cache.nbytes < 3.2 and 6.0 <= fp32 / cache.nbytes < 32 / 5  # was 2.58x and 5.2x


@pytest.mark.parametrize("head_dim", [32, 64])
def test_four_bit_store_of_an_fp32_model_costs_5_bits_per_element(head_dim):
    """Regression: an fp32 model's scales and zeros were fp32, so its 4-bit store cost 6 bits per
    element and was 2.67x smaller than fp16 (2.58x with the window, at 4,096 tokens), not 3.2x."""
    G, S_q = 32, 256  # tokens that left the window: whole groups
    cache = QuantizedKVCache(1, 1, 1, S_q + G, head_dim, bits=4, group_size=G, residual=G, dtype=torch.float32,
                             device="meta")  # sizes only
    assert cache.n_quantized(S_q + G) == S_q
    per_token = (cache.k.nbytes + cache.v.nbytes) / S_q  # codes, scales and zeros of K and V
    # Per token, K and V each: head_dim / 2 bytes of 4-bit codes; a 2-byte scale and zero per
    # channel per 32 tokens (keys) or per 32 channels (values) = head_dim * 4 / 32 bytes. So
    # 2 * head_dim * (0.5 + 4/32) = 1.25 * head_dim bytes (40 at head dim 32, 80 at 64), against
    # fp16's 2 * head_dim * 2 = 4 * head_dim: 3.2x exactly (fp32 scales: 1.5 * head_dim, 2.67x).
    assert per_token == 1.25 * head_dim
    assert 2 * head_dim * 2 / per_token == 3.2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_keys_beyond_fp16_range_never_come_back_nan(dtype):
    """Regression: scales and zeros were fp16, so a bf16 model's keys above 65,504 became inf, then NaN.
    An fp32 model's are bf16 (2 bytes, fp32's range), never fp16."""
    hf = tiny_hf("llama")
    model = minigen.from_hf(hf, dtype=dtype)
    with torch.no_grad():
        for block in model.blocks:  # the key rows of the fused q/k/v matrix, scaled up
            H, Hkv, Dh = model.config.n_heads, model.config.n_kv_heads, model.config.head_dim
            block.attn.wqkv[H * Dh:(H + Hkv) * Dh] *= 3e4
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(0))
    cache = make_cache(model, GenerationConfig(quant_bits=4, quant_group_size=8), 1, 48)
    with torch.inference_mode():
        logits = model(ids, torch.arange(48), cache)
    assert cache.k.scales.dtype == cache.k.zeros.dtype == torch.bfloat16
    k_max = max(float(dequantize_store(cache, layer).abs().max()) for layer in range(model.config.n_layers))
    assert k_max > 65504, k_max  # the keys really are beyond fp16's range ...
    assert torch.isfinite(logits).all()  # ... and come back finite
    out = minigen.generate(model, ids[:, :40], max_new_tokens=8, quant_bits=4, quant_group_size=8,
                           stop_token_ids=[])
    assert out.tokens.shape == (1, 48)


def dequantize_store(cache, layer):
    """Every quantized key of one layer, in full precision (the store's groups, dequantized)."""
    from minigen.numerics.quant import QuantizedTensor
    k = cache.k
    return dequantize(QuantizedTensor(k.data[layer], k.scales[layer], k.zeros[layer], k.bits, k.group_size,
                                      k.axis, k.dtype))


def test_stats_report_the_quantized_bytes(tiny_llama):
    _, model = tiny_llama
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    cfg = GenerationConfig(quant_bits=4, quant_group_size=8, max_new_tokens=10, stop_token_ids=[])
    out = minigen.generate(model, ids, cfg)
    assert out.stats.kv_cache_bytes == make_cache(model, cfg, 1, 16).nbytes
    assert out.stats.kv_cache_bytes < KVCache.for_model(model, 1, 16).nbytes


def test_cache_full_and_out_of_order_writes_raise():
    cache = QuantizedKVCache(1, 1, 1, 8, 8, bits=4, group_size=4, residual=4)
    cache.prepare(torch.arange(5))
    with pytest.raises(ValueError, match="appends: it holds positions 0..4, so write position 5 next"):
        cache.prepare(torch.tensor([3]))
    with pytest.raises(CacheFullError, match="at least 9"):
        cache.prepare(torch.arange(5, 9))


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize("overrides,match", [
    (dict(quant_bits=3), "quant_bits=3"),
    (dict(quant_bits=True), "quant_bits=True"),
    (dict(quant_bits=4, quant_group_size=0), "quant_group_size=0"),
    (dict(quant_bits=4, quant_group_size=7), "multiple of 2"),
    (dict(quant_bits=4, quant_key_axis="head"), "quant_key_axis='head'"),
    (dict(quant_bits=4, quant_residual=16), "quant_residual=16"),
])
def test_bad_quant_config_raises(overrides, match):
    with pytest.raises(ConfigError, match=match):
        GenerationConfig(**overrides)


def test_group_size_must_divide_the_head_dim(tiny_llama):
    _, model = tiny_llama  # head dim 8
    with pytest.raises(ConfigError, match="does not divide this model's head dim 8") as e:
        make_cache(model, GenerationConfig(quant_bits=4, quant_group_size=32), 1, 10)
    assert "quant_group_size=8" in str(e.value)  # a size that works


# ---------------------------------------------------------------- quality on the real model
@pytest.mark.timeout(500)
def test_smollm2_perplexity_at_8_and_4_bits(smollm2, english_text_ids):
    """Teacher-forced at chunk_size=1, so every prediction reads the cache as decoding does. The
    storage measured is the package's: bf16 scales and zeros for SmolLM2 in fp32."""
    model, _ = smollm2
    assert meta_dtype(model.dtype) == torch.bfloat16
    ids = english_text_ids[:200]
    # The full-precision baseline in one pass: a full cache fed one token at a time gives the
    # same logits to fp32 rounding (the KV cache's equivalence tests), at a fraction of the cost.
    base = score(model, ids)
    int8 = score(model, ids, chunk_size=1, quant_bits=8)
    int4 = score(model, ids, chunk_size=1, quant_bits=4, quant_group_size=32)
    assert (int8.top1 == base.top1).float().mean() >= 0.99
    assert int8.perplexity <= base.perplexity * 1.002
    assert int4.perplexity <= base.perplexity * 1.015
    assert int4.perplexity != base.perplexity  # the int4 run really read quantized keys


# ---------------------------------------------------------------- the chapter's panel and exercises
def test_quant_panel_shows_the_cache_bytes_and_updates_live():
    from minigen.course.exercises.ch01 import SMOLLM2_135M as cfg
    from minigen.course.widgets import quant_panel
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3, 96, 64, generator=g), torch.randn(3, 96, 64, generator=g)
    panel = quant_panel(keys, values, cfg, context=4096)
    (bits, group), (window, _), label = panel.children[0].children, panel.children[1].children, panel.children[2]
    four = panel.numbers()
    assert four["bytes"] == QuantizedKVCache(30, 1, 3, 4096, 64, 4, 32, dtype=torch.float16, device="meta").nbytes
    fp16 = 4096 * cfg.kv_bytes_per_token(2)
    assert 0 < four["key_error"] < 0.2 and f"{fp16 / four['bytes']:.2f}x smaller than fp16" in label.value
    assert 3.0 < fp16 / four["bytes"] < 3.2
    shown = label.value
    bits.value = 2
    assert label.value != shown and panel.numbers()["key_error"] > 2 * four["key_error"]
    window.value = 96  # the window covers every captured token: nothing is quantized
    assert panel.numbers()["key_error"] == panel.numbers()["value_error"] == 0.0


def test_chapter_4_exercise_solutions_pass_and_mistakes_fail():
    from minigen.course.exercises import ExerciseFailed, ch06
    assert ch06.check_quantize_group(ch06.solution_quantize_group)
    assert ch06.check_quantized_cache_bytes(ch06.solution_quantized_cache_bytes)

    def too_many_levels(x, bits):  # divides the range by 2^bits instead of 2^bits - 1
        lo, hi = x.min().item(), x.max().item()
        scale = (hi - lo) / 2**bits
        return ((x - lo) / max(scale, 1e-30)).round().clamp(0, 2**bits - 1), scale, lo

    with pytest.raises(ExerciseFailed, match="2\\^bits - 1 steps"):
        ch06.check_quantize_group(too_many_levels)
    with pytest.raises(ExerciseFailed, match="scale and zero of every group"):
        ch06.check_quantized_cache_bytes(lambda *a: ch06._mistaken_bytes(*a, meta_numbers=0))
