"""Mixed precision (minigen/precision.py): what each setting stores and computes in, against oracles
written the obvious way.

Oracles: a 16-bit model with fp32 activations computes exactly what an fp32 model computes on the
same weights rounded to 16 bits (the rounding happens once, at load); the cache in kv_dtype holds
the keys rounded to that dtype; transformers in bf16 for the full-bf16 policy.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import ConfigError, GenerationConfig
from minigen.numerics.precision import Precision

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf():
    return tiny_hf("llama")


def ids_of(T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_activations_on_16_bit_weights_are_the_fp32_model_on_rounded_weights(hf, dtype):
    """fp32 activations against 16-bit weights: the only rounding is the weights' own, once. So the
    model equals an fp32 model whose weights were rounded to 16 bits, to fp32 rounding of sums in
    another order (the kernel for one row, widened weights for several): 1e-5 on logits of ~5."""
    low = minigen.from_hf(hf, dtype=dtype)
    assert low.precision == Precision(compute=torch.float32)  # the CPU default
    rounded = minigen.from_hf(hf)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(dtype).float())
    ids = ids_of(12)
    with torch.inference_mode():
        torch.testing.assert_close(low(ids, torch.arange(12)), rounded(ids, torch.arange(12)), atol=1e-5, rtol=1e-5)
    a = minigen.generate(low, ids, max_new_tokens=16, stop_token_ids=[]).tokens
    b = minigen.generate(rounded, ids, max_new_tokens=16, stop_token_ids=[]).tokens
    assert torch.equal(a, b)


def test_full_bf16_follows_transformers_in_bf16(hf):
    """bf16 weights and bf16 activations, the way transformers runs a bf16 model: logits within
    bf16's resolution (8 bits of mantissa: ~1e-2 relative on logits of ~5, after 2 layers)."""
    model = minigen.from_hf(hf, dtype=torch.bfloat16)
    model.precision = Precision(compute=torch.bfloat16)
    ref = tiny_hf("llama").to(torch.bfloat16)
    ids = ids_of(12, seed=1)
    with torch.inference_mode():
        ours = model(ids, torch.arange(12))
        theirs = ref(ids).logits.float()
    assert (ours - theirs).abs().max() < 0.15, (ours - theirs).abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("flag", ["fp32_norms", "fp32_softmax", "fp32_logits"])
def test_each_critical_path_left_in_bf16_changes_the_logits(hf, flag):
    """Each switch does something: in bf16, the path it names rounds where it did not."""
    model = minigen.from_hf(hf, dtype=torch.bfloat16)
    ids = ids_of(40, seed=2)
    model.precision = Precision(compute=torch.bfloat16)
    with torch.inference_mode():
        kept = model(ids, torch.arange(40))
        model.precision = Precision(compute=torch.bfloat16).replace(**{flag: False})
        low = model(ids, torch.arange(40))
    assert 0 < (low - kept).abs().max() < 1.0


def test_kv_dtype_stores_the_cache_in_its_own_dtype(hf):
    model = minigen.from_hf(hf)
    ids = ids_of(10, seed=3)
    full = minigen.generate(model, ids, max_new_tokens=6, stop_token_ids=[])
    half = minigen.generate(model, ids, max_new_tokens=6, stop_token_ids=[], kv_dtype="float16")
    assert half.stats.kv_cache_bytes * 2 == full.stats.kv_cache_bytes
    # The oracle: the first layer's keys rounded to fp16 once (later layers see the rounding of
    # earlier ones in their inputs).
    cache = minigen.make_cache(model, GenerationConfig(kv_dtype="float16"), 1, 16)
    ref = minigen.make_cache(model, GenerationConfig(), 1, 16)
    with torch.inference_mode():
        model(ids, torch.arange(10), cache)
        model(ids, torch.arange(10), ref)
    assert cache.k.dtype == torch.float16
    torch.testing.assert_close(cache.k[0, :, :, :10].float(), ref.k[0, :, :, :10].half().float(), atol=0, rtol=0)
    assert not torch.equal(cache.k[1, :, :, :10].float(), ref.k[1, :, :, :10].float())


@pytest.mark.parametrize("value", ["int8", "fp16", torch.float16, 16])
def test_bad_kv_dtype_names_the_choices(value):
    with pytest.raises(ConfigError, match="kv_dtype=.*'float32', 'bfloat16', 'float16'"):
        GenerationConfig(kv_dtype=value)


@pytest.mark.parametrize("key, value", [("compile", 1), ("compile", "yes"), ("cuda_graphs", 0)])
def test_compile_switches_are_booleans(key, value):
    with pytest.raises(ConfigError, match=f"{key}={value!r} is invalid: use true or false"):
        GenerationConfig(**{key: value})


def test_precision_settings_are_checked():
    with pytest.raises(ConfigError, match="compute='int8' is not supported"):
        Precision().replace(compute="int8")
    with pytest.raises(ConfigError, match="fp32_norms=1 is invalid"):
        Precision().replace(fp32_norms=1)
    assert Precision().replace(compute="bfloat16").compute == torch.bfloat16
    assert "bf16 weights, fp32 activations" in Precision().describe(torch.bfloat16)
