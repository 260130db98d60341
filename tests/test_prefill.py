"""Prefill, the other half of a request (chapter 3): a prompt that starts a sequence attends
through SDPA's own causal tiles (attention.Causal) instead of a [T, S] mask. Oracles: the explicit
mask's logits and greedy tokens, and the rule `prefix_causal` stated on positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minigen
from minigen import GenerationConfig, attention
from minigen.attention import Causal, prefix_causal
from minigen.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prefix_causal_holds_only_where_the_mask_is_the_lower_triangle_of_the_first_slots():
    pos = torch.arange(6)
    assert prefix_causal(pos, pos)  # the naive loop: keys are the queries
    assert prefix_causal(pos, torch.tensor([0, 1, 2, 3, 4, 5, -1, -1]))  # a cache with room left
    assert not prefix_causal(pos[:1], pos[:1])  # one token: a decode step's own path
    assert not prefix_causal(pos + 2, torch.arange(8))  # a later chunk: earlier positions are cached
    assert not prefix_causal(pos, torch.tensor([0, 1, 2, 3, 4, 5, 2, -1]))  # a slot repeats a position
    assert not prefix_causal(pos, torch.tensor([5, 1, 2, 3, 4, 0, -1, -1]))  # slots in another order
    assert not prefix_causal(torch.tensor([[0, 1, 2], [-1, 0, 1]]), torch.arange(3))  # ragged rows
    # the rule and causal_mask agree wherever it holds
    for keys in (pos, torch.tensor([0, 1, 2, 3, 4, 5, -1, 9])):
        if prefix_causal(pos, keys):
            full = attention.causal_mask(pos, keys)
            assert torch.equal(full[:, :6], torch.ones(6, 6, dtype=torch.bool).tril()) and not full[:, 6:].any()


def _without_causal(monkeypatch):
    monkeypatch.setattr("minigen.attention.prefix_causal", lambda q, k: False)


@pytest.mark.parametrize("kv", ["naive", "contiguous", "paged", "window", "quantized", "bf16 cache"])
def test_a_prompt_through_causal_tiles_matches_the_explicit_mask(tiny_llama, monkeypatch, kv):
    model = tiny_llama[1]
    settings = {"naive": {"use_cache": False}, "contiguous": {}, "paged": {"cache_chunk_size": 16},
                "window": {"window_size": 64, "sink_tokens": 4}, "quantized": {"quant_bits": 8, "quant_group_size": 8},
                "bf16 cache": {"kv_dtype": "bfloat16"}}[kv]
    config = GenerationConfig(max_new_tokens=8, stop_token_ids=[], **settings)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kw):
        calls.append(kw.get("is_causal", False) and kw.get("attn_mask") is None)
        return sdpa(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    fast = minigen.generate(model, ids, config)
    took_tiles = any(calls)
    with monkeypatch.context() as m:
        _without_causal(m)
        slow = minigen.generate(model, ids, config)
    assert torch.equal(fast.tokens, slow.tokens)
    # a window of 64 over a 40-token prompt is a mask of its own (the policy's): the tiles are for plain causal
    assert took_tiles == (kv != "window"), (kv, calls[:3])  # a window is the policy's own mask
    with torch.inference_mode():
        pos = torch.arange(40)
        a = model(ids, pos)
        _without_causal(monkeypatch)
        b = model(ids, pos)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_naive_step_compiles_as_one_graph_with_the_explicit_mask(tiny_llama):
    """prefix_causal reads tensor values: under torch.compile it must not break the graph (chapter 11
    compiles the naive loop with fullgraph=True), and the compiled step gives eager's logits."""
    model, seq = tiny_llama[1], torch.tensor([[1, 2, 3, 4, 5]])
    step = torch.compile(lambda m, s: m(s, torch.arange(s.shape[1]))[:, -1], fullgraph=True, backend="eager")
    with torch.inference_mode():
        torch.testing.assert_close(step(model, seq), model(seq, torch.arange(5))[:, -1],
                                   rtol=1e-5, atol=1e-5)


def test_attend_with_causal_equals_the_bool_mask_in_16_bits_without_fp32_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 12, 16, generator=g).bfloat16(), torch.randn(1, 2, 20, 16, generator=g).bfloat16(),
               torch.randn(1, 2, 20, 16, generator=g).bfloat16())
    pos = torch.arange(12)
    keys = torch.cat([pos, torch.full((8,), -1)])
    for fp32 in (True, False):
        ref = attention.attend(q, k, v, attention.causal_mask(pos, keys), fp32)
        assert torch.equal(attention.attend(q, k, v, Causal(12), fp32), ref) or fp32
        torch.testing.assert_close(attention.attend(q, k, v, Causal(12), fp32), ref, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- prefill_precision="bfloat16"
from minigen.kernels import build as kernel_build, cpu as cpu_kernel  # noqa: E402
from minigen.numerics.precision import FP32, SHORT_PROMPT_ROWS, PromptFormat, prompt_format  # noqa: E402
from minigen.numerics.weight_quant import quantize_matrix  # noqa: E402

needs_bf16 = pytest.mark.skipif(not cpu_kernel.bf16_dot_products(), reason="this CPU has no bf16 dot products")


def _in(model, name: str, with_copies: bool = True, bf16_attention: bool = True):
    """model.ops configured with the prompt format `name` (with_copies: the model's copies, made now)."""
    return model.ops.configured(prompt=prompt_format(name, model if with_copies else None, bf16_attention))


def test_prompt_formats_switch_only_long_prompts():
    assert FP32.dtype(100) == torch.float32 and prompt_format("float32") == FP32
    bf16 = prompt_format("bfloat16")
    assert bf16.dtype(SHORT_PROMPT_ROWS + 1) == torch.bfloat16
    assert bf16.dtype(SHORT_PROMPT_ROWS) == torch.float32  # memory-bound: the fp32 several-row kernel
    assert bf16.attention_dtype(SHORT_PROMPT_ROWS + 1) == torch.bfloat16
    assert bf16.attention_dtype(SHORT_PROMPT_ROWS) == torch.float32
    fp32_attention = prompt_format("bfloat16", None, bf16_attention=False)
    assert fp32_attention.dtype(100) == torch.bfloat16 and fp32_attention.attention_dtype(100) == torch.float32
    assert PromptFormat("int8").dtype(100) == torch.int8 and PromptFormat("int8").dtype(16) == torch.float32
    assert PromptFormat("int8", True).attention_dtype(100) == torch.float32  # int8: the attention stays fp32
    assert [f.describe() for f in (FP32, bf16, fp32_attention, PromptFormat("int8"))] == [
        "fp32", "bf16 products (bf16 attention)", "bf16 products (fp32 attention)", "int8 products"]
    with pytest.raises(ConfigError, match="prefill_precision='float16' is invalid"):
        prompt_format("float16")


@pytest.mark.skipif(not cpu_kernel._ONEDNN_BF16 or kernel_build.compiler() is None,
                    reason="needs oneDNN with bf16 GEMMs (AVX-512 or AMX) and the C kernel")
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4"])
def test_bf16_products_are_the_bf16_rounded_inputs_summed_in_fp32(weights):
    """bf16_linear against fp64 sums of the bf16-rounded inputs: each output within its own bf16
    rounding (2^-8 relative) plus k fp32 roundings of the sum of |x w|; a tile of any weight format."""
    g = torch.Generator().manual_seed(0)
    n, k, rows = 700, 576, 40
    w = torch.randn(n, k, generator=g)
    w = {"float32": w, "bfloat16": w.bfloat16(), "int8": quantize_matrix(w, 8, 32), "int4": quantize_matrix(w, 4, 32)}[weights]
    x = torch.randn(1, rows, k, generator=g)
    y = cpu_kernel.bf16_linear(x, w)
    dense = w.dequantize() if weights.startswith("int") else w.float()
    xb, wb = x.bfloat16().double(), dense.bfloat16().double()
    exact = xb @ wb.T
    bound = 2**-8 * exact.abs() + k * 2**-23 * (xb.abs() @ wb.abs().T)
    assert y is not None and y.dtype == torch.float32 and y.shape == (1, rows, n)
    assert ((y.double() - exact).abs() <= bound).all()
    assert not torch.equal(y, F.linear(x, dense))  # the inputs were rounded: not the fp32 product


def test_the_reference_and_the_kernels_run_the_same_bf16_prompt(tiny_llama):
    model = tiny_llama[1]
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        fp32 = model(ids, torch.arange(40))
        ops = _in(model, "bfloat16", with_copies=False)
        fast = model(ids, torch.arange(40), ops=ops)
        with kernel_build.enabled(False):
            ref = model(ids, torch.arange(40), ops=ops)
    torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)
    assert not torch.equal(fast, fp32) and not torch.equal(ref, fp32)


@needs_bf16
def test_bf16_prefill_costs_smollm2_under_half_a_percent_of_perplexity(smollm2, english_text_ids):
    """Teacher forcing over 512 tokens of English, one forward (every row's products in bf16, the
    head's too: a pessimistic bound, since a prefill computes only the last row's logits, in fp32).
    Measured on this course's machines: -0.27% perplexity, 99.2% top-1 agreement; 2,048 tokens -0.09%, 98.5%."""
    from minigen.evaluate import score
    model, _ = smollm2
    skip_where_aside("bf16_prompt", model)  # where oneDNN's bf16 measured slower than fp32, it would eat CI's time
    ids = english_text_ids[:512]
    a, b = score(model, ids), score(model, ids, prefill_precision="bfloat16")
    assert not torch.equal(a.nll, b.nll)  # bf16 ran
    assert abs(b.perplexity / a.perplexity - 1) <= 0.005, (a.perplexity, b.perplexity)
    assert (a.top1 == b.top1).float().mean() >= 0.97


@needs_bf16
def test_bf16_prefill_runs_in_generate_and_the_engine(tiny_llama):
    model = tiny_llama[1]
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    seen = []
    real = cpu_kernel.bf16_linear

    def spy(x, w, kept=None):
        seen.append(x.shape)
        return real(x, w, kept)

    from unittest import mock
    with mock.patch.object(cpu_kernel, "bf16_linear", spy):
        out = minigen.generate(model, ids, max_new_tokens=4, stop_token_ids=[], prefill_precision="bfloat16")
        assert seen and all(s[-2] == 40 for s in seen)  # the prompt's products, never a decode step's
        seen.clear()
        engine = minigen.Engine(model, GenerationConfig(max_new_tokens=4, stop_token_ids=[], prefill_precision="bfloat16"))
        rid = engine.add_request(ids[0].tolist())
        done = engine.run()
        assert seen
    assert out.tokens.shape == (1, 44) and len(done[rid]) == 44  # the prompt and 4 new tokens


def test_bench_counts_a_bf16_prompt_as_lossy():
    """bench asserts minigen's greedy tokens against transformers' only under an exact config: a bf16
    prompt rounds every product's inputs, so its tokens may differ (SmolLM2, 512 tokens: they did)."""
    from minigen.measure import bench
    assert bench.exact(GenerationConfig()) and not bench.exact(GenerationConfig(prefill_precision="bfloat16"))
    assert not bench.exact(GenerationConfig(prefill_precision="int8"))


# the bf16 copies of a model's block weights (numerics/bf16_copies.py)
from minigen.numerics import bf16_copies  # noqa: E402
from minigen.numerics.copies import WeightCopies  # noqa: E402
from minigen.numerics.weight_quant import QuantizedWeight, linear_weights, quantize_weights  # noqa: E402

needs_bf16_gemm = pytest.mark.skipif(not cpu_kernel._ONEDNN_BF16 or kernel_build.compiler() is None,
                                     reason="needs oneDNN with bf16 GEMMs (AVX-512 or AMX) and the C kernel")


def _fresh_tiny(tiny_llama, weights: str = "float32"):
    """A tiny Llama of its own (new weight tensors: no copies yet), fp32 or int4 codes (head int8)."""
    model = minigen.from_hf(tiny_llama[0])
    return quantize_weights(model, 4, 32, head_bits=8) if weights == "int4" else model


@needs_bf16  # each generates with prefill_precision='bfloat16', refused without bf16 dot products
@pytest.mark.parametrize("weights", ["float32", "int4"])
def test_bf16_copies_are_made_once_reused_and_counted_and_the_head_has_none(tiny_llama, weights):
    model = _fresh_tiny(tiny_llama, weights)
    blocks = bf16_copies.block_weights(model)
    assert len(blocks) == 4 * len(model.blocks) and all(w is not model.head for w in blocks)
    assert [id(w) for w in blocks] == [id(getattr(m, name)) for m, name in linear_weights(model)]
    copies = model.weight_copies
    assert all(copies.bf16_of(w) is None for w in blocks) and bf16_copies.nbytes(model) == 0
    prompt_format("bfloat16")  # no model given: nothing is made
    assert bf16_copies.nbytes(model) == 0
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    minigen.generate(model, ids, max_new_tokens=2, stop_token_ids=[], prefill_precision="bfloat16")
    if weights == "int4":  # codes keep their tile widening: a copy would triple an int4 model's bytes
        assert all(copies.bf16_of(w) is None for w in blocks) and bf16_copies.nbytes(model) == 0
        return
    first = [copies.bf16_of(w) for w in blocks]
    for w, c in zip(blocks, first):
        dense = w.dequantize() if isinstance(w, QuantizedWeight) else w
        assert c is not None and c.dtype == torch.bfloat16 and torch.equal(c, dense.float().bfloat16())
    minigen.generate(model, ids, max_new_tokens=2, stop_token_ids=[], prefill_precision="bfloat16")
    assert prompt_format("bfloat16", model).copies is copies
    assert all(copies.bf16_of(w) is c for w, c in zip(blocks, first))  # the same objects: made once
    assert copies.bf16_of(model.head) is None  # the head: a prefill's last row only, in fp32
    assert bf16_copies.nbytes(model) == 2 * sum(w.shape[0] * w.shape[1] for w in blocks)  # 2 bytes a weight
    if weights == "float32":  # a weight written in place: its copy is stale, and the next bf16 prompt makes it again
        w = blocks[0]
        with torch.no_grad():
            w.mul_(2)
        assert copies.bf16_of(w) is None
        prompt_format("bfloat16", model)
        assert torch.equal(copies.bf16_of(w), w.bfloat16())
        bf16 = minigen.from_hf(tiny_llama[0], dtype=torch.bfloat16)  # a bf16 weight is its own copy
        prompt_format("bfloat16", bf16)
        assert bf16_copies.nbytes(bf16) == 0


@needs_bf16_gemm
def test_the_head_takes_the_bf16_path_only_in_a_teacher_forced_score_and_without_a_copy(tiny_llama, monkeypatch):
    """generate's prefill computes the last row's logits only: the head never reaches bf16_linear; a
    score computes every row's, and its head is converted per call (it has no copy)."""
    from minigen.evaluate import score
    model = _fresh_tiny(tiny_llama)
    heads = []
    real = cpu_kernel.bf16_linear

    def spy(x, w, kept=None):
        if w is model.head:
            heads.append(kept)
        return real(x, w, kept)

    monkeypatch.setattr(cpu_kernel, "bf16_linear", spy)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(6))
    minigen.generate(model, ids, max_new_tokens=2, stop_token_ids=[], prefill_precision="bfloat16")
    assert heads == [] and bf16_copies.nbytes(model) > 0
    score(model, ids[0], prefill_precision="bfloat16")
    assert heads == [None]


@needs_bf16_gemm
@pytest.mark.parametrize("weights", ["float32", "int8", "int4", "int4 of bf16"])
def test_bf16_linear_gives_the_same_bits_with_the_copy_as_without(weights, monkeypatch):
    if weights != "float32":  # codes take no copy (bf16_copies' docstring: the memory it would cost)
        assert bf16_copies.keep(WeightCopies(), quantize_matrix(torch.randn(96, 64), int(weights[3]), 32)) is None
        return
    """The copy is the per-call rounding done once: the same bits, on a matrix of several tiles of
    codes (3,072 rows of 576: two 4 MB fp32 tiles) and on a small one; and with the copy the
    product reads it, no widening of codes (_tiled) and no conversion of the weight."""
    g = torch.Generator().manual_seed(7)
    for n, k in ((3072, 576), (96, 64)):
        w = torch.randn(n, k, generator=g)
        w = {"float32": w, "int8": quantize_matrix(w, 8, 32), "int4": quantize_matrix(w, 4, 32),
             "int4 of bf16": quantize_matrix(w.bfloat16(), 4, 32)}[weights]
        x = torch.randn(2, 20, k, generator=g)
        without = cpu_kernel.bf16_linear(x, w)
        copies = WeightCopies()
        kept = bf16_copies.keep(copies, w)
        assert kept is not None and copies.bf16_of(w) is kept
        with monkeypatch.context() as m:
            m.setattr(cpu_kernel, "_tiled", lambda *a: pytest.fail("codes widened per call"))
            m.setattr(QuantizedWeight, "dequantize", lambda *a: pytest.fail("codes dequantized per call"))
            m.setattr(torch.Tensor, "bfloat16", lambda t: pytest.fail("a weight converted per call")
                      if t is w else torch.Tensor.to(t, torch.bfloat16))
            with_copy = cpu_kernel.bf16_linear(x, w, kept)
        assert with_copy is not None and torch.equal(with_copy, without), (weights, n, k)


@needs_bf16  # each generates with prefill_precision='bfloat16', refused without bf16 dot products
@pytest.mark.parametrize("weights", ["float32"])
def test_no_weight_is_converted_to_bf16_per_call_after_the_first_bf16_prompt(tiny_llama, monkeypatch, weights):
    """A spy on every conversion of a weight (Tensor.bfloat16 on a block weight, codes widened by
    _tiled or dequantized): the first bf16 prompt converts each block weight once (its copy), the
    second none; without a model (no copies) every prompt converts them, which is what the spy sees."""
    model = _fresh_tiny(tiny_llama, weights)
    blocks = bf16_copies.block_weights(model)
    weight_ids = {id(w) for w in blocks}
    seen = []
    bfloat16, tiled, dequantize = torch.Tensor.bfloat16, cpu_kernel._tiled, QuantizedWeight.dequantize

    def spy_bfloat16(t):
        if id(t) in weight_ids:
            seen.append(id(t))
        return bfloat16(t)

    def spy_tiled(x, w, dtype):
        if id(w) in weight_ids:  # not the head: a forward's every row reaches it (no copy, see above)
            seen.append(id(w))
        return tiled(x, w, dtype)

    def spy_dequantize(w, rows=None):
        if id(w) in weight_ids:
            seen.append(id(w))
        return dequantize(w, rows)

    monkeypatch.setattr(torch.Tensor, "bfloat16", spy_bfloat16)
    monkeypatch.setattr(cpu_kernel, "_tiled", spy_tiled)
    monkeypatch.setattr(QuantizedWeight, "dequantize", spy_dequantize)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(40)
    with torch.inference_mode():
        model(ids, pos, ops=_in(model, "bfloat16", with_copies=False))  # no copies: each product converts its weight
        assert sorted(seen) == sorted(weight_ids), len(seen)
        seen.clear()
        first = model(ids, pos, ops=_in(model, "bfloat16"))  # the first with the model: at most one each, the copies
        assert len(seen) == len(set(seen)) and bf16_copies.nbytes(model) > 0, len(seen)
        seen.clear()
        second = model(ids, pos, ops=_in(model, "bfloat16"))
    assert seen == [] and torch.equal(first, second)
    minigen.generate(model, ids, max_new_tokens=2, stop_token_ids=[], prefill_precision="bfloat16")
    assert seen == []


# ---------------------------------------------------------------- prefill_precision="int8"
from minigen.numerics import w8a8  # noqa: E402

from minigen.kernels import int8 as int8_kernel  # noqa: E402
from conftest import skip_where_aside  # noqa: E402

INT8_BACKENDS = [b for b in int8_kernel.BACKENDS if int8_kernel.available(b)]
needs_int8 = pytest.mark.skipif(not (cpu_kernel.int8_dot_products() and INT8_BACKENDS),
                                reason="this CPU has no int8 dot products, or no int8 product runs here")


def _outlier_rows(rows, k, seed):
    """Rows [rows, k] with two channels 30x larger than the rest, as an RMSNorm's output has."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, [3, 17]] *= 30
    return x


@needs_int8
@pytest.mark.parametrize("backend", INT8_BACKENDS)
def test_int8_products_are_the_fake_quantized_product(backend):
    """int8_linear (C codes, each backend's int32 sums, the outlier columns' fp32 product) against
    w8a8.reference_linear (codes back to floats, an fp32 GEMM): the codes are the same bits, the int32
    sums exact, so they differ only by the fp32 rounding of the reference's sums and of the two
    scales (a few 2^-24 relative of sum |x w|)."""
    n, k, rows = 700, 576, 40
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=g), _outlier_rows(rows, k, 1)
    errors = {}
    for outliers in (None, torch.tensor([17, 3, 40])):  # none, and the two large channels with another
        w8 = w8a8.quantize_weight(w, outliers)
        ref = w8a8.reference_linear(x[None], w8)
        y = int8_kernel.int8_linear(x[None], w8, backend)
        assert y is not None and y.shape == (1, rows, n)
        bound = 1e-5 * (x.abs() @ w.abs().T)
        assert ((y[0] - ref[0]).abs() <= bound).all()
        # the codes: C's quantize_rows_s8 gives torch's bits, and the scheme is within its rounding of x @ w.T
        qx, a = w8a8.quantize_rows(x, w8.keep)
        assert torch.equal(qx.abs().amax(1), torch.full((rows,), 127, dtype=torch.int8))  # each row spans its range
        assert torch.equal(w8.codes().abs().amax(1), torch.full((n,), 127, dtype=torch.int8))
        if outliers is not None:  # the outlier columns carry no codes: their product is fp32's
            assert not qx[:, outliers].any() and not w8.codes()[:, outliers].any()
            assert torch.equal(w8.outlier_weights, w[:, outliers.sort().values])
        lib = kernel_build.library()
        if lib is not None:
            q2, a2 = torch.empty_like(qx), torch.empty_like(a)
            keep = w8.keep
            lib.quantize_rows_s8(x.data_ptr(), None if keep is None else keep.data_ptr(), q2.data_ptr(), a2.data_ptr(),
                                 rows, k)
            assert torch.equal(q2, qx) and torch.equal(a2, a)
        # each code is within half a step of its value: the error of a product is at most
        # sum_k (|x| b/2 + |w| a/2 + a b/4) over the coded columns, a bound derived from the two roundings
        keep = torch.ones(k) if w8.keep is None else w8.keep
        xs, ws = x * keep, w * keep
        err_bound = (xs.abs() @ (w8.scales[:, None] / 2 * keep).T + a / 2 * ws.abs().sum(1)
                     + a * w8.scales * keep.sum() / 4)
        assert ((ref[0] - x @ w.T).abs() <= err_bound * 1.001 + 1e-4).all()
        errors[outliers is None] = (ref[0] - x @ w.T).abs().mean()
    assert errors[False] < errors[True] / 5  # the 30x channels as codes cost the row its range


@needs_int8
@pytest.mark.parametrize("backend", INT8_BACKENDS)
def test_int8_rows_never_influence_each_other(backend):
    """A row's scale is its own: a row's products are the same bits alone and beside a row 1000x larger."""
    k, n = 576, 300
    w8 = w8a8.quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(2)), None)
    x = _outlier_rows(20, k, 3)
    other = 1000 * _outlier_rows(20, k, 4)
    alone = int8_kernel.int8_linear(x, w8, backend)
    together = int8_kernel.int8_linear(torch.cat([x, other]), w8, backend)
    assert torch.equal(together[:20], alone)


@needs_int8
def test_int8_prefill_is_the_reference_and_near_fp32(tiny_llama):
    """A tiny model's 40-token prompt: the kernels give the reference's logits (tolerance: the fp32
    rounding of sums, as above); fp32's within int8's rounding on a random model; and a prompt's
    row gives the same logits alone and in a batch beside a very different prompt."""
    model = tiny_llama[1]
    skip_where_aside("int8", model)  # the product this machine runs for an int8 prompt, measured
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=g)
    with torch.inference_mode():
        fp32 = model(ids, torch.arange(40))
        ops = _in(model, "int8")
        fast = model(ids, torch.arange(40), ops=ops)
        with kernel_build.enabled(False):
            ref = model(ids, torch.arange(40), ops=ops)
        other = torch.full((1, 40), 5)  # one token repeated: activations unlike the random prompt's
        batch = model(torch.cat([ids, other]), torch.arange(40), ops=ops)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)
    # int8 moved the logits, a little (k = 32 here: each code carries a large share of a sum)
    spread = fp32.std().item()
    assert (fast - fp32).abs().mean() < 0.05 * spread and (fast - fp32).abs().max() < 0.5 * spread, spread
    assert not torch.equal(fast, fp32)
    torch.testing.assert_close(batch[:1], fast, atol=1e-5, rtol=1e-5)  # fp32 attention may block by batch
    out = minigen.generate(model, ids, max_new_tokens=8, stop_token_ids=[])
    int8 = minigen.generate(model, ids, max_new_tokens=8, stop_token_ids=[], prefill_precision="int8")
    assert torch.equal(int8.tokens, out.tokens)  # greedy tokens: the first one from the int8 prompt


@needs_int8
def test_int8_prefill_costs_smollm2_under_one_percent_of_perplexity(smollm2, english_text_ids):
    """Teacher forcing over two slices of English, one forward each (every block's products in int8,
    the head in fp32). The outlier columns are calibrated on the text's last 800 characters, past
    both slices. The bound holds whichever int8 product measured fastest here: the products agree
    within 4e-6 of each other on every call, yet a last-bit difference moves the next layer's codes
    where a value lands on a rounding boundary, and perplexity follows. Measured on the Xeon (family 6
    model 167), the same copies, 512 tokens from the start: oneDNN's -0.10% (96.9% top-1), C's,
    torch._int_mm's and the plain-torch reference's +0.61% (96.3%); 1,024 from token 1,024: +0.16% and
    +0.14%. SmoothQuant's smoothing without outlier columns measured up to +1.2%."""
    from minigen.evaluate import score
    model, _ = smollm2
    skip_where_aside("int8", model)  # where every int8 product measured slower than fp32, it would eat CI's time
    for ids in (english_text_ids[:512], english_text_ids[1024:2048]):
        a, b = score(model, ids), score(model, ids, prefill_precision="int8")
        assert not torch.equal(a.nll, b.nll)  # int8 ran
        assert b.perplexity / a.perplexity - 1 <= 0.01, (a.perplexity, b.perplexity)
        assert (a.top1 == b.top1).float().mean() >= 0.94


@pytest.mark.skipif(not INT8_BACKENDS, reason="no int8 product runs here (refused first, for that)")
def test_int8_prefill_is_refused_without_int8_dot_products(tiny_llama, monkeypatch):
    monkeypatch.setattr(cpu_kernel, "int8_dot_products", lambda: False)
    with pytest.raises(ConfigError, match="needs int8 dot products, and this CPU has none"):
        minigen.generate(tiny_llama[1], torch.tensor([[1, 2, 3]]), prefill_precision="int8")
    with pytest.raises(ConfigError, match="needs the model"):
        prompt_format("int8")


@needs_int8
def test_int8_copies_are_made_once_and_the_head_has_none(tiny_llama):
    model = tiny_llama[1]
    w8a8.prepare(model)
    copies = model.weight_copies
    first = copies.int8_of(model.blocks[0].attn.wqkv)
    w8a8.prepare(model)
    assert copies.int8_of(model.blocks[0].attn.wqkv) is first
    for w in w8a8._products(model):  # every product keeps its k // 8 largest input channels fp32 (k = 32 here)
        assert len(copies.int8_of(w).outliers) == min(w8a8.OUTLIER_COLUMNS, w.shape[1] // 8) > 0
    assert copies.int8_of(model.head) is None  # the head stays fp32
    assert w8a8.nbytes(model) >= sum(p.numel() for p in w8a8._products(model))  # a byte a weight, and scales


# ---------------------------------------------------------------- prefill_chunk_size
CHUNK_CACHES = {"contiguous": {}, "paged": {"cache_chunk_size": 8}, "window": {"window_size": 12, "sink_tokens": 2},
                "paged window": {"window_size": 12, "cache_chunk_size": 4},
                "offload": {"prefetch_depth": 1},
                "sparse": {"sparse_top_k": 8}, "prompt lookup": {"speculative_method": "ngram"}}


@pytest.mark.parametrize("kv", list(CHUNK_CACHES))
def test_a_prompt_in_pieces_gives_the_whole_prompts_tokens(tiny_llama, kv):
    """Each piece writes its keys, the next reads them: greedy tokens equal one forward's, for every
    cache the pieces write into, pieces of one token, of a few, and longer than the window."""
    model = tiny_llama[1]
    ids = torch.randint(0, 97, (1, 37), generator=torch.Generator().manual_seed(0))
    base = GenerationConfig(max_new_tokens=8, stop_token_ids=[], **CHUNK_CACHES[kv])
    whole = minigen.generate(model, ids, base).tokens
    for C in (1, 5, 16):
        assert torch.equal(minigen.generate(model, ids, base.replace(prefill_chunk_size=C)).tokens, whole), (kv, C)


def test_a_ragged_batch_in_pieces_keeps_each_rows_tokens(tiny_llama):
    model = tiny_llama[1]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g) for n in (37, 20, 5)]
    config = GenerationConfig(max_new_tokens=6, stop_token_ids=[])
    whole = minigen.generate(model, prompts, config).tokens
    pieces = minigen.generate(model, prompts, config.replace(prefill_chunk_size=7)).tokens
    assert all(torch.equal(a, b) for a, b in zip(whole, pieces))


def test_no_forward_of_a_chunked_prompt_runs_more_than_the_chunk(tiny_llama, monkeypatch):
    """What the setting is for: the activations of a forward scale with its tokens."""
    model = tiny_llama[1]
    widths = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, tokens, *a, **k: widths.append(tokens.shape[1])
                        or forward(self, tokens, *a, **k))
    minigen.generate(model, torch.randint(0, 97, (1, 37)), max_new_tokens=3, stop_token_ids=[], prefill_chunk_size=16,
                     fused_decode=False)
    assert widths == [16, 16, 5, 1, 1], widths
    widths.clear()
    minigen.generate(model, torch.randint(0, 97, (1, 37)), max_new_tokens=3, stop_token_ids=[], fused_decode=False)
    assert widths == [37, 1, 1], widths


def test_prefill_chunk_size_is_refused_where_it_cannot_mean_the_same(tiny_llama):
    model = tiny_llama[1]
    with pytest.raises(minigen.ConfigError, match=r"prefill_chunk_size=0 is invalid"):
        GenerationConfig(prefill_chunk_size=0)
    with pytest.raises(minigen.ConfigError, match=r"kv_budget=8 and prefill_chunk_size=4.*Fix"):
        GenerationConfig(prefill_chunk_size=4, kv_budget=8)
    with pytest.raises(minigen.ConfigError, match=r"use_cache=False and prefill_chunk_size=4"):
        GenerationConfig(prefill_chunk_size=4, use_cache=False)
    with pytest.raises(minigen.ConfigError, match=r"max_num_batched_tokens=64\) and prefill_chunk_size=None"):
        minigen.Engine(model, GenerationConfig(prefill_chunk_size=64))
    from minigen.production.engines import vllm_engine_args
    args = vllm_engine_args(GenerationConfig(prefill_chunk_size=512))
    assert args["enable_chunked_prefill"] is True and args["max_num_batched_tokens"] == 512


def test_score_feeds_the_configs_prefill_chunk_size(tiny_llama, monkeypatch):
    from minigen.evaluate import score
    model = tiny_llama[1]
    text = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(2))
    whole = score(model, text).nll
    widths = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, tokens, *a, **k: widths.append(tokens.shape[1])
                        or forward(self, tokens, *a, **k))
    pieces = score(model, text, prefill_chunk_size=8).nll
    assert widths == [8, 8, 8, 6], widths
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


def test_a_later_piece_attends_only_up_to_the_last_slot_it_sees(tiny_llama, monkeypatch):
    """A piece at positions 10..17 of a 64-slot cache: SDPA gets 18 key slots, not 64 (the others are
    empty and masked, but SDPA would score them), and the logits are those of the whole mask."""
    from minigen.caches.make import make_cache
    model = tiny_llama[1]
    ids = torch.randint(0, 97, (1, 18), generator=torch.Generator().manual_seed(3))
    widths = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: widths.append(k.shape[2])
                        or sdpa(q, k, v, **kw))

    def piece():
        cache = make_cache(model, GenerationConfig(), 1, 64)
        with torch.inference_mode():
            model(ids[:, :10], torch.arange(10), cache)
            widths.clear()
            return model(ids[:, 10:], torch.arange(10, 18), cache)
    trimmed = piece()
    assert set(widths) == {18}, widths
    monkeypatch.setattr("minigen.attention.seen_slots", lambda mask: mask.shape[-1])
    whole = piece()
    assert set(widths) == {64}, widths
    torch.testing.assert_close(trimmed, whole, atol=1e-5, rtol=1e-5)


def test_bf16_prompts_attend_in_bf16_with_fp32_softmax():
    """In a "bfloat16" PromptFormat a prompt's attention gets bf16 q, k, v (SDPA's softmax stays
    fp32), causal or masked; a decode step's query (one row) and "float32" prompts keep fp32."""
    g = torch.Generator().manual_seed(0)
    T = 40
    q, k, v = torch.randn(1, 6, T, 16, generator=g), torch.randn(1, 2, T, 16, generator=g), torch.randn(1, 2, T, 16, generator=g)
    pos = torch.arange(T)
    want = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, enable_gqa=True).float()
    fp32 = attention.attend(q, k, v, Causal(T))
    fmt = prompt_format("bfloat16")
    assert fmt.attention_dtype(T) == torch.bfloat16 and fmt.attention_dtype(1) == torch.float32
    causal = attention.attend(q, k, v, Causal(T), bf16=True)
    masked = attention.attend(q, k, v, attention.causal_mask(pos, pos), bf16=True)
    one = attention.attend(q[:, :, -1:], k, v, torch.ones(1, T, dtype=torch.bool),
                           bf16=fmt.attention_dtype(1) == torch.bfloat16)
    assert causal.dtype == torch.float32 and torch.equal(causal, want)
    torch.testing.assert_close(masked, want, atol=1e-2, rtol=0)  # the masked kernel sums in another order
    assert not torch.equal(causal, fp32) and (causal - fp32).abs().max() < 0.05
    ref = F.scaled_dot_product_attention(q[:, :, -1:], k, v, enable_gqa=True)
    torch.testing.assert_close(one, ref)  # one row: fp32
