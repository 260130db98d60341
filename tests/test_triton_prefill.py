"""The Triton prompt-attention kernel (triton_prefill.py) against attention written the obvious way.

Without CUDA every launch runs in Triton's interpreter (TRITON_INTERPRET=1), program by program in
numpy: a key tile costs tens of milliseconds there, so the shapes stay small and tiles large except
where tile boundaries are the point.

Oracles:
- the kernel and attention.attend_prompt_blocks equal a dense loop that fetches every position through
  the block table (or the recent buffer), dequantizes it, and masks each query by its position, over
  tile sizes, GQA ratios 1, 2, 3, 4, windows with sinks, ragged rows whose chunks start after 0, left
  and right padding, 8- and 4-bit pools, fp32 and fp16;
- blocks no query may read hold NaN, so one read would show;
- the key tiles each program loads are exactly the tiles holding a key that some query of the tile
  sees (counted by brute force): for a prompt from position 0, about half of all tiles;
- a model with attention_backend="triton" runs its prompts through the kernel and gives the torch
  backend's greedy tokens, and a prompt fed in pieces (start > 0: Model.forward by hand, and
  generate's prefill_chunk_size) the same logits and tokens;
- the kernel compiles for a Hopper GPU (sm_90) without one.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minigen
from conftest import tiny_hf
from minigen import GenerationConfig
from minigen.attention import AttentionPolicy, attend_prompt_blocks
from minigen.caches.contract import BlockView
from minigen.caches.make import make_cache
from minigen.kernels import triton_prefill
from minigen.kernels.triton_prefill import prefill_attention
from minigen.numerics.quant import QuantizedTensor, dequantize, quantize
from minigen.steps.eager import forward  # reserves the cache's blocks, then runs the model

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 2e-5  # fp32 sums of O(1) terms in another order (tiles, exp2): measured up to ~1e-6


def make_view(lens: list[int], starts: list[int], Hkv: int, Dh: int, bs: int, bits: int | None = None,
              group_size: int = 8, key_axis: int = -3, recent: bool = False, window: int | None = None,
              sinks: int = 0, dtype: torch.dtype = torch.float32, seed: int = 0) -> BlockView:
    """Row b holds positions 0 .. lens[b] - 1 and queries starts[b] .. lens[b] - 1. Blocks are scattered
    in the pool; a block no query may read (past the row, in the recent buffer, or outside the window of
    the first query, as the paged cache frees it) is freed in the table and NaN in the pool."""
    g = torch.Generator().manual_seed(seed)
    B, n = len(lens), max(math.ceil(L / bs) for L in lens)
    N = B * n + 2  # a few blocks no row holds
    k, v = torch.randn(2, N, bs, Hkv, Dh, generator=g).to(dtype)
    table = torch.randperm(N, generator=g)[:B * n].view(B, n)
    recent_start = torch.tensor([s // bs * bs if recent else L for L, s in zip(lens, starts)])  # the open block
    for b, (L, s) in enumerate(zip(lens, starts)):
        for j in range(n):
            first, last = j * bs, j * bs + bs - 1
            if not (first < recent_start[b] and (window is None or first < sinks or s - last < window)):
                table[b, j] = -1
    readable = torch.zeros(N, dtype=torch.bool)
    readable[table[table >= 0]] = True
    k[~readable], v[~readable] = float("nan"), float("nan")
    if bits is not None:
        k, v = quantize(k, bits, group_size, key_axis), quantize(v, bits, group_size, -1)
    R = int(max(L - r for L, r in zip(lens, recent_start.tolist())))
    recent_k, recent_v = torch.randn(2, B, R, Hkv, Dh, generator=g).to(dtype) if recent else (None, None)
    return BlockView(k, v, table, bs, torch.tensor(lens), recent_start, recent_k, recent_v)


def query_positions(lens: list[int], starts: list[int], left: bool) -> torch.Tensor:
    """[B, T]: row b's positions starts[b] .. lens[b] - 1, padded with -1 on the left or the right."""
    T = max(L - s for L, s in zip(lens, starts))
    rows = []
    for L, s in zip(lens, starts):
        pad = [-1] * (T - (L - s))
        rows.append(pad + list(range(s, L)) if left else list(range(s, L)) + pad)
    return torch.tensor(rows)


def sees(p: int, j: int, window: int | None, sinks: int) -> bool:
    """Query position p sees key position j: causal, then the sinks or the window (attention.in_window)."""
    return 0 <= j <= p and (window is None or j < sinks or p - j < window)


def reference(q, view, query_pos, window=None, sinks=0) -> torch.Tensor:
    """Dense attention of each real query over the positions it sees, fetched one by one; padding: 0."""
    K = dequantize(view.k) if isinstance(view.k, QuantizedTensor) else view.k  # [N, bs, Hkv, Dh]
    V = dequantize(view.v) if isinstance(view.v, QuantizedTensor) else view.v
    B, H, T, Dh = q.shape
    out = torch.zeros(B, H, T, Dh)
    for b in range(B):
        rs, bs = int(view.recent_start[b]), view.block_size

        def fetch(p, X, recent):  # the key or value of position p: [Hkv, Dh]
            return X[int(view.block_table[b, p // bs]), p % bs] if p < rs else recent[b, p - rs]

        for t in range(T):
            p = int(query_pos[b, t])
            seen = [j for j in range(p + 1) if sees(p, j, window, sinks)]
            if not seen:
                continue
            k = torch.stack([fetch(j, K, view.recent_k) for j in seen]).float()  # [S, Hkv, Dh]
            v = torch.stack([fetch(j, V, view.recent_v) for j in seen]).float()
            G = H // k.shape[1]
            for h in range(H):
                probs = (k[:, h // G] @ q[b, h, t].float() / math.sqrt(Dh)).softmax(dim=0)  # [S]
                out[b, h, t] = probs @ v[:, h // G]
    return out


def tiles_seen(query_pos, Hkv: int, block_m: int, block_n: int, window, sinks) -> torch.Tensor:
    """[B, Hkv, M]: per program, the key tiles holding a key that some query of its tile sees (brute force)."""
    B, T = query_pos.shape
    M = math.ceil(T / block_m)
    out = torch.zeros(B, Hkv, M, dtype=torch.int32)
    for b in range(B):
        for m in range(M):
            ps = [int(p) for p in query_pos[b, m * block_m:(m + 1) * block_m] if p >= 0]
            n_tiles = (max(ps) // block_n + 1) if ps else 0
            out[b, :, m] = sum(any(sees(p, j, window, sinks) for p in ps
                                   for j in range(i * block_n, (i + 1) * block_n)) for i in range(n_tiles))
    return out


@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_the_torch_reference_equals_the_dense_loop(bits, window):
    """attention.attend_prompt_blocks (TorchOps' reference of the kernel) against the loop above."""
    lens, starts = [30, 9, 17], [4, 0, 16]
    view = make_view(lens, starts, Hkv=2, Dh=16, bs=8, bits=bits, recent=bits is not None, window=window, sinks=2)
    pos = query_positions(lens, starts, left=True)
    q = torch.randn(3, 4, pos.shape[1], 16, generator=torch.Generator().manual_seed(3))
    sinks = 2 if window is not None else 0
    real = (pos >= 0)[:, None, :, None]
    out = attend_prompt_blocks(q, view, pos, window, sinks)
    assert torch.isfinite(out).all()  # padding queries too
    torch.testing.assert_close(out * real, reference(q, view, pos, window, sinks), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- the kernel over shapes, tiles and formats
@st.composite
def cases(draw):
    bs = draw(st.sampled_from([1, 4, 16]))
    bits = draw(st.sampled_from([None, None, 8, 4]))
    G = draw(st.sampled_from([1, 2, 3, 4]))
    G_PAD = 1 << (G - 1).bit_length()
    window = draw(st.none() | st.integers(1, 20))
    B = draw(st.integers(1, 2))
    lens = draw(st.lists(st.integers(1, 40), min_size=B, max_size=B))
    return dict(
        lens=lens, starts=[draw(st.integers(0, L - 1)) for L in lens], left=draw(st.booleans()),
        Hkv=draw(st.sampled_from([1, 2])), G=G, Dh=draw(st.sampled_from([16, 24, 32])), bs=bs, bits=bits,
        key_axis=draw(st.sampled_from([-1] + ([-3] if bs % 8 == 0 else []))),
        recent=draw(st.booleans()) or bits is not None, window=window,
        sinks=draw(st.integers(0, min(window, 4))) if window else 0,
        dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.float16])),
        block_m=draw(st.sampled_from([16, 32])) // G_PAD, block_n=draw(st.sampled_from([16, 32])),
        seed=draw(st.integers(0, 2**16)))


@settings(max_examples=32, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_kernel_equals_reference(case):
    c = dict(case)
    G, left, block_m, block_n = c.pop("G"), c.pop("left"), c.pop("block_m"), c.pop("block_n")
    view = make_view(**c)
    pos = query_positions(c["lens"], c["starts"], left)
    B, T, H = pos.shape[0], pos.shape[1], c["Hkv"] * G
    q = torch.randn(B, H, T, c["Dh"], generator=torch.Generator().manual_seed(c["seed"])).to(c["dtype"])
    visits = torch.zeros(B, c["Hkv"], math.ceil(T / block_m), dtype=torch.int32)
    out = prefill_attention(q, view, pos, c["window"], c["sinks"], block_m, block_n, visits)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()  # no NaN block was read, and padding queries stay finite
    tol = ATOL if c["dtype"] == torch.float32 else 2e-3  # fp16 inputs and output: 2^-11 relative each
    real = (pos >= 0)[:, None, :, None]
    torch.testing.assert_close(out.float() * real, reference(q, view, pos, c["window"], c["sinks"]),
                               atol=tol, rtol=tol)
    assert torch.equal(visits, tiles_seen(pos, c["Hkv"], block_m, block_n, c["window"], c["sinks"]))


# ---------------------------------------------------------------- the skipping can fail
@pytest.mark.parametrize("window,sinks", [(None, 0), (16, 0), (20, 3)])
def test_tiles_above_the_diagonal_and_outside_the_window_are_never_loaded(window, sinks):
    """A 128-token prompt from position 0 in 16 x 16 tiles: query tile i loads key tiles 0..i, 36 of
    64; with a window, at most the window's tiles (and one tile of sinks) whatever the position."""
    T = 128
    view = make_view([T], [0], Hkv=1, Dh=16, bs=16, window=window, sinks=sinks)
    pos = torch.arange(T)[None]
    q = torch.randn(1, 1, T, 16, generator=torch.Generator().manual_seed(0))
    visits = torch.zeros(1, 1, T // 16, dtype=torch.int32)
    out = prefill_attention(q, view, pos, window, sinks, block_m=16, block_n=16, visits=visits)
    torch.testing.assert_close(out, attend_prompt_blocks(q, view, pos, window, sinks), atol=ATOL, rtol=0)
    per_tile = visits.flatten().tolist()
    if window is None:
        assert per_tile == [i + 1 for i in range(T // 16)] and sum(per_tile) == 36  # not 8 x 8 = 64
    else:  # the tiles under the union of the tile's windows (W + 15 positions), plus tile 0 for the sinks
        assert max(per_tile) <= math.ceil((window + 15) / 16) + 1 + (sinks > 0) and sum(per_tile) < 36
    assert per_tile == tiles_seen(pos, 1, 16, 16, window, sinks).flatten().tolist()


def test_a_padding_only_tile_loads_nothing():
    """Rows of different lengths: the short row's trailing tiles hold only padding and visit no key tile."""
    lens, starts = [40, 3], [0, 0]
    view = make_view(lens, starts, Hkv=1, Dh=16, bs=4)
    pos = query_positions(lens, starts, left=False)
    q = torch.randn(2, 2, 40, 16, generator=torch.Generator().manual_seed(1))
    visits = torch.zeros(2, 1, 5, dtype=torch.int32)  # 8 queries x 2 heads per tile: 5 tiles of 40 queries
    out = prefill_attention(q, view, pos, block_m=8, block_n=16, visits=visits)
    assert visits[1, 0].tolist() == [1, 0, 0, 0, 0] and visits[0, 0].tolist() == [1, 1, 2, 2, 3]
    assert torch.isfinite(out).all() and (out[1, :, 3:] == 0).all()  # padding: finite, and discarded


def test_two_bit_codes_are_refused():
    view = make_view([8], [0], Hkv=1, Dh=16, bs=8, bits=2, recent=True)
    with pytest.raises(minigen.ConfigError, match="quant_bits=2.*use 8 or 4"):
        prefill_attention(torch.randn(1, 1, 8, 16), view, torch.arange(8)[None])


# ---------------------------------------------------------------- the model: prompts through the kernel
@pytest.fixture
def launches(monkeypatch):
    """Counts the prompt kernel's launches from the model."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[2])  # T
        return prefill_attention(*args, **kwargs)

    monkeypatch.setattr(triton_prefill, "prefill_attention", counted)  # what kernels/dispatch.py launches
    return calls


MODELS = {"llama": dict(hidden_size=64),  # head dim 16, 4 query heads on 2 key/value heads
          "mistral": dict(hidden_size=64, num_key_value_heads=1),  # G = 4
          "gpt2": {}}  # G = 1, head dim 8 (padded to 16), learned positions
SETTINGS = [dict(cache_chunk_size=16), dict(cache_chunk_size=4, window_size=6, sink_tokens=2),
            dict(cache_chunk_size=4, quant_bits=4, quant_group_size=4, window_size=9)]


@pytest.fixture(scope="module")
def models():
    return {kind: minigen.from_hf(tiny_hf(kind, **overrides)) for kind, overrides in MODELS.items()}


@pytest.mark.parametrize("kind,settings", [("llama", s) for s in SETTINGS] + [("mistral", SETTINGS[1]),
                                                                               ("gpt2", SETTINGS[0])],
                         ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_triton_generates_the_torch_tokens(models, kind, settings, launches):
    model = models[kind]
    prompts = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    torch_tokens = minigen.generate(model, prompts, max_new_tokens=4, **settings).tokens
    assert not launches
    triton_tokens = minigen.generate(model, prompts, max_new_tokens=4, attention_backend="triton", **settings).tokens
    assert launches == [21] * model.config.n_layers  # the prompt went through the kernel in every layer
    assert torch.equal(triton_tokens, torch_tokens)


@pytest.mark.parametrize("settings", SETTINGS[:3], ids=["paged", "window", "int4"])
def test_a_prompt_in_pieces_gives_the_torch_logits(models, settings, launches):
    """Pieces of 9, 7 and 5 tokens: the second and third start at positions 9 and 16, after cached keys."""
    model = models["llama"]
    tokens = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(2))
    logits = {}
    for backend in ("torch", "triton"):
        config = GenerationConfig(attention_backend=backend, **settings)
        cache, policy = make_cache(model, config, 2, 21), AttentionPolicy.from_config(config)
        ops = model.ops.configured(reads_blocks=backend == "triton")  # attention_backend (steps/choose.ops_for)
        with torch.no_grad():
            logits[backend] = torch.cat([forward(model, tokens[:, a:b], torch.arange(a, b), cache, policy, ops=ops)
                                         for a, b in ((0, 9), (9, 16), (16, 21))], dim=1)
    assert launches == [T for T in (9, 7, 5) for _ in range(model.config.n_layers)]  # every piece, every layer
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_prefill_chunk_size_runs_each_piece_through_the_kernel(models, launches):
    """generate's chunked prefill: pieces of 8, 8 and 5 tokens, each through the kernel, the torch tokens."""
    kw = dict(cache_chunk_size=4, window_size=6, sink_tokens=2, prefill_chunk_size=8, max_new_tokens=3)
    prompts = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(3))
    model = models["llama"]
    torch_tokens = minigen.generate(model, prompts, **kw).tokens
    triton_tokens = minigen.generate(model, prompts, attention_backend="triton", **kw).tokens
    assert launches == [T for T in (8, 8, 5) for _ in range(model.config.n_layers)]
    assert torch.equal(triton_tokens, torch_tokens)


# ---------------------------------------------------------------- the compiler, without a GPU
COMPILE_FOR_HOPPER = r'''
import inspect, os
os.environ["TRITON_INTERPRET"] = "0"  # before minigen decorates its kernels: compiled, not interpreted
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minigen.kernels import triton_prefill

kernel = triton_prefill._prefill_attention_kernel
constexprs = dict(G=3, G_PAD=4, D_PAD=32, BLOCK_M=4, BLOCK_N=16, GROUP=16, K_BITS=4, V_BITS=4, K_ALONG_SLOTS=True,
                  LOW_PRECISION=True, COUNT=True)
types = dict(q_ptr="*bf16", out_ptr="*bf16", qpos_ptr="*i64", visits_ptr="*i32", k_ptr="*u8", v_ptr="*u8",
             k_scales_ptr="*bf16", k_zeros_ptr="*bf16", v_scales_ptr="*bf16", v_zeros_ptr="*bf16",
             table_ptr="*i64", recent_start_ptr="*i64", recent_k_ptr="*bf16", recent_v_ptr="*bf16", qk_scale="fp32")
names = list(inspect.signature(kernel.fn).parameters)
signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
assert "cubin" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm
print("compiled")
'''


def test_the_kernel_compiles_for_a_hopper_gpu(tmp_path):
    """The interpreter runs code the compiler refuses (tests/test_triton_attention.py lists how): the
    kernel, with its unrolled phases, 4-bit codes, 16-bit dot products and the tile count, compiles to a
    cubin for sm_90 without a GPU. Small tiles keep it to seconds; the GPU's defaults compiled too (~1 min each)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(root), TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
