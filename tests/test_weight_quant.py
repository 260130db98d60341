"""Weight-only int8 / int4 quantization (minigen/weight_quant.py) and its C kernels.

Oracles: each weight written back the obvious way (zero + code * scale) within half a step; the
kernel against F.linear on the dequantized matrix; SmolLM2's perplexity with a stated bound; the
GGUF the course ships (its linear layers are Q4_1, its embedding Q8_0), whose values int4 and int8
groups of 32 reproduce.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minigen
from conftest import tiny_hf
from minigen import ConfigError
from minigen.kernels import cpu as cpu_kernel
from minigen.kernels import build as kernel_build
from minigen.numerics.weight_quant import QuantizedWeight, pack4, quantize_matrix, quantize_weights, unpack4, weight_bytes

pytestmark = pytest.mark.usefixtures("one_thread")
needs_cc = pytest.mark.skipif(kernel_build.compiler() is None, reason="no C compiler on this machine")


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([8, 4]), n=st.integers(1, 40), groups=st.integers(1, 4),
       group_size=st.sampled_from([32, 64]), scale=st.sampled_from([1e-3, 1.0, 50.0]), seed=st.integers(0, 2**16))
def test_every_weight_comes_back_within_half_a_step(bits, n, groups, group_size, scale, seed):
    w = torch.randn(n, groups * group_size, generator=torch.Generator().manual_seed(seed)) * scale
    q = quantize_matrix(w, bits, group_size)
    back = q.dequantize()
    step = q.scales.float().repeat_interleave(group_size, dim=1)
    # half a step, plus fp32 rounding of min + code * scale (2^-22 of the larger magnitude)
    bound = step / 2 + 2**-22 * (w.abs() + (q.mins.float().abs().repeat_interleave(group_size, 1)
                                            if q.mins is not None else 0)) + 1e-30
    assert ((back - w).abs() <= bound).all()
    assert q.codes.dtype == (torch.int8 if bits == 8 else torch.uint8) and q.scales.dtype == torch.float16
    assert q.nbytes == n * groups * group_size * bits // 8 + (2 if bits == 8 else 4) * n * groups


def test_pack4_puts_weight_j_and_j_plus_16_in_one_byte():
    codes = torch.arange(32, dtype=torch.uint8) % 16  # [0..15, 0..15]
    packed = pack4(codes[None])[0]
    assert packed.tolist() == [j | (j << 4) for j in range(16)]
    rnd = torch.randint(0, 16, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack4(pack4(rnd)), rnd)


@needs_cc
@settings(max_examples=30, deadline=None)
@example(bits=4, n=37, groups=18, group_size=32, threads=2, seed=1)  # SmolLM2's width: 4 blocks of 128, 2 groups
@example(bits=4, n=5, groups=48, group_size=32, threads=1, seed=2)  # its MLP's: 12 blocks, no rest
@given(bits=st.sampled_from([8, 4]), n=st.integers(1, 70), groups=st.sampled_from([1, 2, 5, 16, 37]),
       group_size=st.sampled_from([32, 64]), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_kernel_equals_the_dequantized_product(bits, n, groups, group_size, threads, seed):
    """Every shape class: n not a multiple of anything (each thread's share of rows ends anywhere),
    one group or several per row (16 and more: the AVX-512 loop widens the scales 16 at a time,
    then the rest); 1 and 2 threads. fp32 sums in another order: ~1e-6 relative."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, groups * group_size, generator=g), torch.randn(groups * group_size, generator=g)
    q = quantize_matrix(w, bits, group_size)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = cpu_kernel.matvec(x, q)
    finally:
        torch.set_num_threads(before)
    assert y is not None and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, q.dequantize()), atol=1e-4, rtol=1e-5)


@needs_cc
@pytest.mark.skipif("avx512f" not in kernel_build.cpu_fingerprint(), reason="the CPU has no AVX-512: one loop to test")
def test_the_8_wide_loops_agree_where_the_cpu_has_avx512(monkeypatch, tmp_path):
    """A CPU with AVX-512 runs the 16-wide int8/int4 loops; one without runs the 8-wide ones. Build
    the kernel without AVX-512 here and hold both to the same oracle, on the same codes."""
    g = torch.Generator().manual_seed(5)
    cases = [(bits, quantize_matrix(torch.randn(n, k, generator=g), bits, G), torch.randn(k, generator=g))
             for bits in (8, 4) for n, k, G in ((7, 64, 32), (33, 576, 32), (5, 37 * 64, 64))]
    wide = [cpu_kernel.matvec(x, q) for _, q, x in cases]
    monkeypatch.setenv("MINIGEN_CPU_KERNEL_CFLAGS", "-mno-avx512f")
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_build, "_lib", None)
    monkeypatch.setattr(kernel_build, "_reason", "not built yet")
    assert kernel_build.status().startswith("built"), kernel_build.status()
    narrow = [cpu_kernel.matvec(x, q) for _, q, x in cases]
    for (bits, q, x), y16, y8 in zip(cases, wide, narrow):
        oracle = F.linear(x, q.dequantize())
        torch.testing.assert_close(y8, oracle, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(y16, oracle, atol=1e-4, rtol=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(wide, narrow))  # two loops ran: sums in two orders


@needs_cc
@pytest.mark.skipif("avx512f" not in kernel_build.cpu_fingerprint(), reason="the CPU has no AVX-512: one loop to test")
def test_the_8_wide_panels_agree_where_the_cpu_has_avx512(monkeypatch, tmp_path):
    """gemm_q built without AVX-512 (panels of 6 rows, blocks of 16 rows of x, no transposes in
    registers) against the same oracle as the 16-wide build, on 1 and 2 threads."""
    cases = gemm_q_cases(7)
    monkeypatch.setenv("MINIGEN_CPU_KERNEL_CFLAGS", "-mno-avx512f")
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_build, "_lib", None)
    monkeypatch.setattr(kernel_build, "_reason", "not built yet")
    assert kernel_build.status().startswith("built"), kernel_build.status()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for _, q, x in cases:
                assert_near_the_dequantized_product(cpu_kernel.quantized_linear(x, q), x, q)
    finally:
        torch.set_num_threads(before)


def test_a_quantized_model_decodes_and_prefills_through_the_kernels():
    hf = tiny_hf("llama", hidden_size=64)
    model = quantize_weights(minigen.from_hf(hf), bits=4)
    assert isinstance(model.blocks[0].attn.wqkv, QuantizedWeight) and isinstance(model.lm_head, QuantizedWeight)
    assert model.lm_head.bits == 8 and model.blocks[0].mlp.w_down.bits == 4
    # the oracle: the float model holding exactly the dequantized weights
    ref = minigen.from_hf(hf)
    with torch.no_grad():
        for (m, name), (rm, _) in zip(minigen.numerics.weight_quant.linear_weights(model), minigen.numerics.weight_quant.linear_weights(ref)):
            getattr(rm, name).copy_(getattr(m, name).dequantize())
        ref.lm_head.copy_(model.lm_head.dequantize())
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids, torch.arange(10)), ref(ids, torch.arange(10)), atol=1e-4, rtol=1e-4)
    # fp32 activations: int8_activations="auto" takes 8-bit ones where they measured faster (an AMD Zen 1),
    # a lossy path whose bounds tests/test_int8_act*.py check; this test's oracle is exact
    out = minigen.generate(model, ids, max_new_tokens=12, stop_token_ids=[], int8_activations=False).tokens
    assert torch.equal(out, minigen.generate(ref, ids, max_new_tokens=12, stop_token_ids=[]).tokens)


needs_onednn = pytest.mark.skipif(not cpu_kernel._ONEDNN, reason="this torch has no oneDNN")


@needs_cc
@needs_onednn
@settings(max_examples=30, deadline=None, derandomize=True)
@given(bits=st.sampled_from([8, 4]), rows=st.integers(2, 80), n=st.integers(1, 300), groups=st.integers(1, 6),
       group_size=st.sampled_from([32, 64, 96]), tile_rows=st.sampled_from([8, 16, 64, 4096]), seed=st.integers(0, 2**16))
@example(bits=4, rows=17, n=1000, groups=18, group_size=32, tile_rows=64, seed=0)  # SmolLM2's k = 576
def test_tiles_of_codes_meet_onednn_with_the_dequantized_bits(bits, rows, n, groups, group_size, tile_rows, seed):
    """_tiled (the bf16 prompt's path for codes, and the fp32 one before gemm_q): each tile of codes
    becomes fp32 in C (dequant_rows) and meets oneDNN's GEMM; the oracle is the same GEMM on the same
    rows of the dequantized matrix, which it must match bit for bit (a tile computes what dequantize()
    computes). Not the GEMM of the whole matrix: oneDNN sums a narrow last tile (n = 9, tiles of 8: a
    tile of one row) in another order, 6e-8 apart."""
    k = groups * group_size
    g = torch.Generator().manual_seed(seed)
    q = quantize_matrix(torch.randn(n, k, generator=g), bits, group_size)
    x = torch.randn(1, rows, k, generator=g)
    assert kernel_build.library() is not None  # _tiled calls the library its callers built
    with mock.patch.object(cpu_kernel, "TILE_BYTES", tile_rows * 4 * k):
        y = cpu_kernel._tiled(x, q, torch.float32)
    w = q.dequantize()
    oracle = torch.cat([cpu_kernel.linear(x, w[r:r + tile_rows]) for r in range(0, n, tile_rows)], dim=-1)
    assert y is not None and y.shape == (1, rows, n) and torch.equal(y, oracle)


# Shapes for gemm_q: rows of x a whole block of 32 or not (2, 17, 33, 70), a last panel of fewer than
# 12 (AVX-512) or 6 (8-wide) rows of W (13, 37, 500), a single row of W (1), n large enough for two
# threads to split the panels (37 and up: two panels a thread), k a few groups (64, 128) or SmolLM2's
# 576 and 1,536 (in three passes of 512 columns), groups of 32 and 64; 300 rows of k = 1,536 are two
# groups of rows (gemm_q.c: group_rows), which the threads share out.
GEMM_Q_SHAPES = [(2, 13, 64, 32), (17, 37, 576, 32), (33, 400, 576, 32), (70, 500, 1536, 32), (5, 1, 128, 64),
                 (40, 24, 1536, 64), (300, 30, 1536, 32)]


def gemm_q_cases(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(bits, quantize_matrix(torch.randn(n, k, generator=g), bits, G), torch.randn(rows, k, generator=g))
            for bits in (8, 4) for rows, n, k, G in GEMM_Q_SHAPES]


def assert_near_the_dequantized_product(y, x, q):
    """fp32 sums of k products in two orders: each within gamma_k = k u / (1 - k u) of sum |w x| of
    the exact sum (u = 2^-24, Higham's bound for recursive sums), so within twice that of each other."""
    w = q.dequantize()
    k = w.shape[1]
    gamma = k * 2**-24 / (1 - k * 2**-24)
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == torch.float32
    assert ((y - x @ w.T).abs() <= 2 * gamma * (x.abs() @ w.abs().T) + 1e-30).all()


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
def test_a_prompt_multiplies_the_codes_a_panel_at_a_time(threads):
    """quantized_linear (csrc/gemm_q.c): panels of codes widened in cache, every row of x against them.
    The oracle is x @ w.dequantize().T, within the bound of two orders of fp32 sums; every output is
    summed by one thread in one order, so 1 and 2 threads give the same bits."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = [cpu_kernel.quantized_linear(x, q) for _, q, x in gemm_q_cases(threads)]
        torch.set_num_threads(1)
        alone = [cpu_kernel.quantized_linear(x, q) for _, q, x in gemm_q_cases(threads)]
    finally:
        torch.set_num_threads(before)
    for (bits, q, x), y, y1 in zip(gemm_q_cases(threads), got, alone):
        assert_near_the_dequantized_product(y, x, q)
        assert torch.equal(y, y1)
    # the prompt's own shape: [B, T, k] in, [B, T, n] out
    _, q, x = gemm_q_cases(0)[2]
    assert torch.equal(cpu_kernel.quantized_linear(x[None], q)[0], cpu_kernel.quantized_linear(x, q))


def test_a_quantized_prompt_never_dequantizes_a_whole_matrix(monkeypatch):
    """A prompt's products take the codes a tile at a time (chapter 3): dequantize() of a whole
    matrix, 4 bytes a weight written per product, is what they replace. Row lookups (the
    embedding) still dequantize the rows they read. Where the kernels are off, the reference
    dequantizes, as before."""
    model = quantize_weights(minigen.from_hf(tiny_hf("llama", hidden_size=64)), bits=4)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        with kernel_build.enabled(False):
            ref = model(ids, torch.arange(40))
        whole = QuantizedWeight.dequantize
        def rows_only(self, rows=None):
            assert rows is not None, "a whole matrix was dequantized for a product"
            return whole(self, rows)
        monkeypatch.setattr(QuantizedWeight, "dequantize", rows_only)
        out = model(ids, torch.arange(40))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_a_tied_head_is_the_embedding_quantized_once():
    hf = tiny_hf("llama", hidden_size=64, tie_word_embeddings=True)
    model = quantize_weights(minigen.from_hf(hf), bits=4)
    assert model.lm_head is None and isinstance(model.embed, QuantizedWeight) and model.head is model.embed
    ids = torch.tensor([[3, 7]])
    torch.testing.assert_close(model.embed[ids], model.embed.dequantize()[ids])  # lookups dequantize rows
    linear = sum(getattr(m, n).nbytes for m, n in minigen.numerics.weight_quant.linear_weights(model))
    norms = sum(p.nbytes for p in model.parameters())
    assert weight_bytes(model) == linear + model.embed.nbytes + norms


@pytest.mark.parametrize("call, fragment", [
    (lambda m: quantize_weights(m, bits=3), "bits=3 is invalid: weights are quantized to 8 or 4 bits"),
    (lambda m: quantize_weights(m, bits=4, group_size=48), "group_size=48 is invalid: use a multiple of 32"),
    (lambda m: quantize_weights(m, bits=4, group_size=128), "group_size=128 does not divide the input width 64"),
    (lambda m: quantize_weights(quantize_weights(m, bits=4), bits=8), "already quantized"),
])
def test_bad_quantization_settings_name_the_fix(call, fragment):
    model = minigen.from_hf(tiny_hf("llama", hidden_size=64))
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=fragment):
        call(model)
    if "already" not in fragment:  # a refusal changes nothing
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_load_takes_weight_bits():
    with pytest.raises(ConfigError, match="weight_bits=2 is invalid"):
        minigen.load("smollm2-135m", weight_bits=2)


# ---------------------------------------------------------------- SmolLM2
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_smollm2_quality_and_the_shipped_values(smollm2, english_text_ids):
    """Perplexity on 256 tokens of English, fed one at a time (the decode path: the kernel): int8
    within +0.5% of fp32, int4 within +3%. The fp32 weights are the shipped GGUF's Q4_1 (linear
    layers) and Q8_0 (embedding) values, and int4 / int8 groups of 32 give them back exactly, so
    int4 decodes SmolLM2 exactly as fp32 does (measured: the same perplexity, every top-1)."""
    from minigen.loading import build_model, read_config, read_safetensors, resolve_folder
    folder = resolve_folder("smollm2-135m")
    cfg, state = read_config(folder), read_safetensors(folder)
    fp32, _ = smollm2
    ids = english_text_ids[:256]
    base = minigen.score(fp32, ids, chunk_size=1)
    for bits, bound in ((8, 0.005), (4, 0.03)):
        model = quantize_weights(build_model(cfg, state), bits)
        s = minigen.score(model, ids, chunk_size=1)
        assert s.perplexity <= base.perplexity * (1 + bound), (bits, s.perplexity, base.perplexity)
        assert (s.top1 == base.top1).float().mean() >= 0.95
        if bits == 4:  # the Q4_1 values come back: at most half of the smallest step off
            w = fp32.blocks[0].mlp.w_down
            assert (model.blocks[0].mlp.w_down.dequantize() - w).abs().max() < 1e-3
            assert torch.equal(model.embed.dequantize(), fp32.embed)  # Q8_0: every value exactly
            prompt = english_text_ids[None, :32]
            # fp32 activations: int8 ones (int8_activations, on "auto" where faster) round them, by design
            assert torch.equal(minigen.generate(model, prompt, max_new_tokens=24, stop_token_ids=[],
                                                int8_activations=False).tokens,
                               minigen.generate(fp32, prompt, max_new_tokens=24, stop_token_ids=[]).tokens)


def test_bench_times_the_quantized_model_beside_the_float_one(tmp_path):
    from minigen.measure import bench
    from test_loading import save_tiny_tokenizer
    tiny_hf("llama", hidden_size=64).save_pretrained(tmp_path / "tiny")
    save_tiny_tokenizer(tmp_path / "tiny")
    result = bench.run_bench(str(tmp_path / "tiny"), prompt_len=8, new_tokens=96, repeats=3, baseline=False,
                             weight_bits=4)
    engines = result["engines"]
    assert set(engines) == {"minigen fp32", "minigen"} and result["speedup_vs_unquantized"] > 0
    # the roofline counts each engine's own bytes: the packed weights are far fewer
    assert engines["minigen"]["bytes_per_token"] < 0.5 * engines["minigen fp32"]["bytes_per_token"]
    assert not result["exact"]


def test_llama_cpp_engine_needs_its_package():
    import importlib.util
    from minigen import BenchError
    from minigen.measure import bench
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama-cpp-python is installed here")
    with pytest.raises(BenchError, match="pip install llama-cpp-python"):
        bench.check_llama_cpp("smollm2-135m")
