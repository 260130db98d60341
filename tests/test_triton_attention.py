"""The Triton decode-attention kernel (triton_attention.py) against attention written the obvious way.

On a machine without CUDA every kernel launch runs in Triton's interpreter (TRITON_INTERPRET=1),
which executes the same kernel program by program in numpy: these tests prove it correct there
(on a CUDA machine the same tests run it compiled; scripts/gpu_check.py times it). Shapes stay
small: one interpreted launch of a few hundred positions takes about 0.1 s.

Oracles:
- the kernel equals a dense reference that fetches every position through the block table (or
  the recent buffer), dequantizes with quant.dequantize and applies the window by position, over
  block sizes 1, 16, 256, group sizes 16 and 32, GQA ratios 1, 3, 8, ragged rows, splits;
- blocks it must not read (freed, past a row's length, outside the window) hold NaN, so one read
  would show; a key it must read, changed, moves the output;
- generation with attention_backend="triton" gives the torch backend's greedy tokens for every
  cache configuration the kernel supports.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minigen
from conftest import tiny_hf
from test_triton_prefill import make_view as prompt_view
from minigen.attention import attend_blocks
from minigen.kernels import triton_attention
from minigen.caches.contract import BlockView
from minigen.numerics.quant import QuantizedTensor, dequantize
from minigen.kernels.triton_attention import BLOCK_N, decode_attention

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 2e-5  # fp32 sums of O(1) terms in another order (tiles, splits): measured up to ~1.5e-6


def make_view(lens: list[int], Hkv: int, Dh: int, bs: int, bits: int | None = None, group_size: int = 16,
              key_axis: int = -3, recent: bool = False, window: int | None = None, sinks: int = 0,
              dtype: torch.dtype = torch.float32, seed: int = 0) -> BlockView:
    """A pool with each row's blocks scattered at random; every block a row may not read is NaN: the
    prompt tests' view (test_triton_prefill.make_view) with one query per row, at its last position."""
    return prompt_view(lens, [L - 1 for L in lens], Hkv, Dh, bs, bits, group_size, key_axis, recent, window, sinks,
                       dtype, seed)


def reference(q: torch.Tensor, view: BlockView, window: int | None = None, sinks: int = 0) -> torch.Tensor:
    """Dense attention of each row's query over the positions it sees, fetched one by one."""
    K = dequantize(view.k) if isinstance(view.k, QuantizedTensor) else view.k  # [N, bs, Hkv, Dh]
    V = dequantize(view.v) if isinstance(view.v, QuantizedTensor) else view.v
    B, H, Dh = q.shape
    out = torch.empty(B, H, Dh)
    for b in range(B):
        L, rs, bs = int(view.seq_lens[b]), int(view.recent_start[b]), view.block_size
        keys, values = [], []
        for p in range(L):
            if window is not None and not (p < sinks or L - 1 - p < window):
                continue
            if p < rs:
                block = int(view.block_table[b, p // bs])
                keys.append(K[block, p % bs]), values.append(V[block, p % bs])
            else:
                keys.append(view.recent_k[b, p - rs]), values.append(view.recent_v[b, p - rs])
        k, v = torch.stack(keys).float(), torch.stack(values).float()  # [S, Hkv, Dh]
        G = H // k.shape[1]
        for h in range(H):
            probs = (k[:, h // G] @ q[b, h].float() / math.sqrt(Dh)).softmax(dim=0)  # [S]
            out[b, h] = probs @ v[:, h // G]
    return out


@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_the_torch_reference_over_blocks_equals_the_dense_loop(bits, window):
    """attention.attend_blocks (TorchOps' reference of the kernel) against the loop above."""
    view = make_view([7, 40, 1], Hkv=2, Dh=16, bs=16, bits=bits, recent=bits is not None)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(3))
    sinks = 2 if window is not None else 0
    torch.testing.assert_close(attend_blocks(q, view, window, sinks), reference(q, view, window, sinks),
                               atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the grid the issue names
@pytest.mark.parametrize("bs", [1, 16, 256])
@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("gqa", [1, 3, 8])
def test_kernel_equals_reference_over_the_grid(bs, bits, gqa):
    group_size = 16 if gqa != 3 else 32
    key_axis = -3 if bs % group_size == 0 else -1  # keys per channel need whole groups of slots per block
    lens = [min(300, 3 * bs + 5), 1, 2 * BLOCK_N + 3][: 2 + (gqa == 1)]  # ragged, one row of a single token
    view = make_view(lens, Hkv=2, Dh=32, bs=bs, bits=bits, group_size=group_size, key_axis=key_axis,
                     recent=bits is not None, seed=bs + gqa)
    q = torch.randn(len(lens), 2 * gqa, 32, generator=torch.Generator().manual_seed(1))
    out = decode_attention(q, view, num_splits=3)
    assert torch.isfinite(out).all()  # no NaN block was read
    torch.testing.assert_close(out, reference(q, view), atol=ATOL, rtol=0)


@st.composite
def cases(draw):
    bs = draw(st.sampled_from([1, 16, 256]))
    bits = draw(st.sampled_from([None, 8, 4]))
    group_size = draw(st.sampled_from([16, 32]))
    axes = [-1] + ([-3] if bs % group_size == 0 else [])
    Dh = draw(st.sampled_from([32, 64] + ([48] if group_size == 16 or bits is None else [])))  # 48: padded to 64
    window = draw(st.none() | st.integers(1, 40))
    return dict(
        lens=draw(st.lists(st.integers(1, 300 if bs == 256 else 90), min_size=1, max_size=3)),
        Hkv=draw(st.sampled_from([1, 2])), gqa=draw(st.sampled_from([1, 3, 8])), Dh=Dh, bs=bs, bits=bits,
        group_size=group_size, key_axis=draw(st.sampled_from(axes)), recent=draw(st.booleans()) or bits is not None,
        window=window, sinks=draw(st.integers(0, min(window, 5))) if window else 0,
        dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16])),
        splits=draw(st.sampled_from([1, 2, 5])), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_kernel_equals_reference(case):
    c = dict(case)
    gqa, splits = c.pop("gqa"), c.pop("splits")
    view = make_view(**c)
    B, H = len(c["lens"]), c["Hkv"] * gqa
    q = torch.randn(B, H, c["Dh"], generator=torch.Generator().manual_seed(c["seed"])).to(c["dtype"])
    out = decode_attention(q, view, c["window"], c["sinks"], num_splits=splits)
    assert out.dtype == q.dtype and out.shape == (B, H, c["Dh"])
    tol = ATOL if c["dtype"] == torch.float32 else 1e-2  # a bf16 result is rounded to 8 bits: 2^-8 relative
    torch.testing.assert_close(out.float(), reference(q, view, c["window"], c["sinks"]), atol=tol, rtol=tol)


# ---------------------------------------------------------------- the test can fail
def test_a_changed_key_moves_the_output_only_where_it_is_seen():
    """One code changed inside the window moves the output; changed outside it, nothing moves."""
    view = make_view([40], Hkv=1, Dh=32, bs=16, bits=4, window=10, sinks=2)
    q = torch.randn(1, 2, 32, generator=torch.Generator().manual_seed(3))
    before = decode_attention(q, view, 10, 2)
    for pos, seen in ((35, True), (1, True), (20, False)):  # in the window, a sink, outside
        block = int(view.block_table[0, pos // 16])
        if block < 0:  # freed: never read, so nothing to change
            assert not seen
            continue
        codes = view.k.data.clone()
        codes[block, (pos % 16) // 2] ^= 0xFF  # both 4-bit codes of this byte flipped
        changed = BlockView(QuantizedTensor(codes, view.k.scales, view.k.zeros, 4, 16, -3, torch.float32),
                            view.v, view.block_table, 16, view.seq_lens, view.recent_start)
        moved = (decode_attention(q, changed, 10, 2) - before).abs().max().item()
        assert (moved > 1e-4) == seen, (pos, moved)


def test_a_wrong_layout_is_detected():
    """Keys read as if packed along channels instead of slots: the reference tells them apart."""
    view = make_view([50, 33], Hkv=2, Dh=32, bs=16, bits=4, key_axis=-3)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(4))
    k = view.k  # the kernel finds offsets from bs, Hkv, Dh and the axis; the tensors' own shapes do not matter
    wrong = BlockView(QuantizedTensor(k.data, k.scales, k.zeros, 4, 16, -1, k.dtype), view.v, view.block_table,
                      16, view.seq_lens, view.recent_start)
    bad = decode_attention(q, wrong)
    assert not torch.allclose(bad, reference(q, view), atol=1e-3)


# ---------------------------------------------------------------- generation: the same greedy tokens
SUPPORTED = [  # every cache the kernel reads: paged, full precision or 8/4-bit codes, with or without a window
    dict(cache_chunk_size=16),
    dict(cache_chunk_size=1),
    dict(cache_chunk_size=16, kv_dtype="bfloat16"),
    dict(cache_chunk_size=4, window_size=6, sink_tokens=2),
    dict(cache_chunk_size=8, quant_bits=8, quant_group_size=8),
    dict(cache_chunk_size=4, quant_bits=4, quant_group_size=4),
    dict(cache_chunk_size=16, quant_bits=4, quant_group_size=16, quant_key_axis="token", window_size=9, sink_tokens=1),
    dict(cache_chunk_size=1, quant_bits=8, quant_group_size=8, quant_key_axis="token"),
]


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama: head dim 16, 4 query heads on 2 key/value heads."""
    return minigen.from_hf(tiny_hf("llama", hidden_size=64))


@pytest.fixture
def launches(monkeypatch):
    """Counts the kernel's launches from the model."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "decode_attention", counted)  # what kernels/dispatch.py launches
    return calls


@pytest.mark.parametrize("settings", SUPPORTED, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_triton_generates_the_torch_tokens(tiny, launches, settings):
    prompts = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    torch_tokens = minigen.generate(tiny, prompts, max_new_tokens=10, **settings).tokens
    assert not launches
    triton_tokens = minigen.generate(tiny, prompts, max_new_tokens=10, attention_backend="triton", **settings).tokens
    assert len(launches) == 9 * tiny.config.n_layers  # every decode step of every layer went through the kernel
    assert torch.equal(triton_tokens, torch_tokens)


@pytest.mark.parametrize("settings", [{}, dict(quant_bits=4, quant_group_size=4)], ids=["full", "int4"])
def test_forked_rows_read_their_shared_blocks(tiny, launches, settings):
    """parallel_sample: rows forked from one prompt share its blocks (copy-on-write) in every table."""
    prompt = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(2))
    kw = dict(n=3, max_new_tokens=6, do_sample=True, seed=0, cache_chunk_size=4, **settings)
    torch_rows = minigen.parallel_sample(tiny, prompt, **kw).tokens
    triton_rows = minigen.parallel_sample(tiny, prompt, attention_backend="triton", **kw).tokens
    assert launches and torch.equal(triton_rows, torch_rows)


def test_a_compiled_kernel_refuses_a_cpu_model(tiny, monkeypatch):
    """Where CUDA exists Triton compiles for it: a model on the CPU is refused before any work."""
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)
    with pytest.raises(minigen.ConfigError, match="compiles its kernel for CUDA.*TRITON_INTERPRET=1"):
        minigen.generate(tiny, torch.tensor([[1, 2, 3]]), attention_backend="triton", cache_chunk_size=4)


def test_smollm2_generates_the_torch_tokens(smollm2, launches):
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    for settings in (dict(cache_chunk_size=32, quant_bits=4), dict(cache_chunk_size=4, window_size=4, sink_tokens=2)):
        a = minigen.generate(model, ids, max_new_tokens=4, **settings).tokens
        b = minigen.generate(model, ids, max_new_tokens=4, attention_backend="triton", **settings).tokens
        assert torch.equal(a, b), settings
    assert len(launches) == 2 * 3 * model.config.n_layers


# ---------------------------------------------------------------- the compiler, without a GPU
COMPILE_FOR_HOPPER = r'''
import inspect, os, sys
os.environ["TRITON_INTERPRET"] = "0"  # before minigen decorates its kernels: compiled, not interpreted
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minigen.kernels import triton_attention as ta, triton_steps as ts

def compile_for_hopper(kernel, types, constexprs):
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    assert "cubin" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm

for dtype, bits, along_slots in (("bf16", 0, False), ("fp32", 8, True), ("bf16", 4, False)):
    pool, p = ("u8" if bits else dtype), "*" + dtype
    meta = "*bf16"  # quant.meta_dtype: an fp32 or bf16 model's scales and zeros are bf16
    # out in q's dtype: one split stores its result directly (plan_decode); several store fp32 partials
    types = dict(q_ptr=p, out_ptr=p if bits == 0 else "*fp32", lse_ptr="*fp32", k_ptr="*" + pool, v_ptr="*" + pool, k_scales_ptr=meta,
                 k_zeros_ptr=meta, v_scales_ptr=meta, v_zeros_ptr=meta, table_ptr="*i64", seq_lens_ptr="*i64",
                 recent_start_ptr="*i64", recent_k_ptr=p, recent_v_ptr=p, sm_scale="fp32")
    compile_for_hopper(ta._decode_attention_kernel, types, dict(G=4, G_PAD=16, D_PAD=128, BLOCK_N=ta.BLOCK_N,
                       GROUP=32, K_BITS=bits, V_BITS=bits, K_ALONG_SLOTS=along_slots))
f32 = "*fp32"
for kernel, types, constexprs in (
        (ts.add_kernel, dict(x_ptr=f32, y_ptr=f32, out_ptr=f32), dict(BLOCK=16)),
        (ts.row_dot_kernel, dict(x_ptr=f32, y_ptr=f32, out_ptr=f32), dict(BLOCK=16)),
        (ts.softmax_kernel, dict(x_ptr=f32, out_ptr=f32), dict(BLOCK=512)),
        (ts.online_softmax_kernel, dict(s_ptr=f32, v_ptr=f32, out_ptr=f32), dict(BLOCK=16)),
        (ts.head_attention_kernel, dict(q_ptr=f32, k_ptr=f32, v_ptr=f32, out_ptr=f32, sm_scale="fp32"),
         dict(BLOCK=16, D=64)),
        (ts.paged_head_attention_kernel, dict(q_ptr=f32, k_ptr=f32, v_ptr=f32, table_ptr="*i64", out_ptr=f32,
                                              sm_scale="fp32"), dict(BLOCK=16, D=64)),
        (ts.paged_int4_attention_kernel, dict(q_ptr=f32, k_codes="*u8", k_scales="*bf16", k_zeros="*bf16",
                                              v_codes="*u8", v_scales="*bf16", v_zeros="*bf16", table_ptr="*i64",
                                              out_ptr=f32, sm_scale="fp32"), dict(G=16, BLOCK=16, D=64)),
        (ts.flash_attention_kernel, dict(q_ptr=f32, k_ptr=f32, v_ptr=f32, out_ptr=f32, visits_ptr="*i32",
                                         sm_scale="fp32"), dict(CAUSAL=True, BLOCK_M=64, BLOCK_N=64, D=64))):
    compile_for_hopper(kernel, types, constexprs)
print("compiled")
'''


def test_the_kernels_compile_for_a_hopper_gpu(tmp_path):
    """The interpreter accepts some code the compiler refuses (an early return, a constexpr division by
    zero, mixed loop types): Triton compiles every kernel here to a cubin for sm_90 (an H100 / H200)
    without a GPU. It proves they compile, not that they run fast or right on one (gpu_check.py does)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(root),
               TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("T,causal,block_m,block_n", [(50, True, 16, 16), (50, False, 16, 32), (64, True, 32, 16),
                                                      (37, True, 16, 32)])
def test_the_step_kernel_of_a_prompt_is_flash_attention(T, causal, block_m, block_n):
    """triton_steps.flash_attention (chapter 3's first step): SDPA's output, and with causal=True each
    tile of queries loads only the key tiles up to its last query (about half of them)."""
    import torch.nn.functional as F

    from minigen.kernels import triton_steps as ts
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(2, T, 24, generator=g) for _ in range(3))
    out, visits = ts.flash_attention(q, k, v, causal, block_m, block_n)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal), atol=1e-5, rtol=1e-5)
    M, N = math.ceil(T / block_m), math.ceil(T / block_n)
    want = [math.ceil(min((i + 1) * block_m, T) / block_n) if causal else N for i in range(M)]
    assert visits.tolist() == [want, want], visits


def test_merge_splits_is_the_softmax_of_the_whole_row():
    """triton_attention.merge_splits (flash-decoding's reduction, chapter 12's exercise checks against it):
    the splits' normalised results and log-sum-exps merge into softmax(s) v over every position, also
    with scores large enough that exp alone overflows and with a split that saw no key (lse = -inf)."""
    g = torch.Generator().manual_seed(9)
    s, v = 60 * torch.randn(3, 40, generator=g, dtype=torch.float64), torch.randn(3, 40, 8, generator=g, dtype=torch.float64)
    bounds = [(0, 7), (7, 7), (7, 30), (30, 40)]  # the second split is empty
    out = torch.zeros(3, len(bounds), 8, dtype=torch.float64)
    lse = torch.full((3, len(bounds)), float("-inf"), dtype=torch.float64)
    for p, (a, b) in enumerate(bounds):
        if b > a:
            out[:, p] = (s[:, a:b].softmax(-1)[..., None] * v[:, a:b]).sum(1)
            lse[:, p] = s[:, a:b].logsumexp(-1)
    merged = triton_attention.merge_splits(out, lse)
    torch.testing.assert_close(merged, (s.softmax(-1)[..., None] * v).sum(1))


# ---------------------------------------------------------------- one plan per step, one launch per layer
def test_a_step_plans_once_and_a_planned_call_only_launches(tiny, monkeypatch):
    """The model plans each decode step's attention once (plan_decode) for all its layers; a call
    with a plan and one split is the kernel's launch alone: its result is the plan's own buffer, in
    q's dtype, and no merge runs. Planning reads no tensor (the bound is the view's capacity)."""
    plans, merges = [], []
    real_plan = triton_attention.plan_decode
    monkeypatch.setattr(triton_attention, "plan_decode", lambda *a, **k: plans.append(1) or real_plan(*a, **k))
    monkeypatch.setattr(triton_attention, "merge_splits", lambda *a: merges.append(1))
    prompts = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    torch_tokens = minigen.generate(tiny, prompts, max_new_tokens=6, cache_chunk_size=16).tokens
    tokens = minigen.generate(tiny, prompts, max_new_tokens=6, cache_chunk_size=16, attention_backend="triton").tokens
    assert torch.equal(tokens, torch_tokens) and len(plans) == 5 and not merges  # 5 decode steps, 1 split each

    view = make_view([40, 7], Hkv=2, Dh=32, bs=16, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
    reads = []
    monkeypatch.setattr(torch.Tensor, "__int__", lambda self: reads.append(1) or 0)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(1) or 0)
    plan = real_plan(q, view, num_splits=1)
    assert not reads  # no length read back from the device
    monkeypatch.undo()
    out = decode_attention(q, view, plan=plan)
    assert out.dtype == torch.bfloat16 and out.data_ptr() == plan.out.data_ptr()
    torch.testing.assert_close(out.float(), reference(q, view), atol=1e-2, rtol=1e-2)
