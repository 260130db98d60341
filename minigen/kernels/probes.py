"""How each fast path is measured (kernels/fastpaths.py keeps the results and decides): a probe builds
a fast call and its plain reference at the model's shapes, and `run_probe` times them in turns.

Shapes: T rows of a product, D the model's width, F its MLP width, S cached keys.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..numerics import int8_act, w8a8
from ..numerics.weight_quant import quantize_matrix
from . import build, cpu, int8

# a product's rows in the prompt probes: a short prompt (the int8 backends rank differently at 64 rows than at 512)
PROMPT_ROWS = 128
FIRST_ROWS = 17  # the first, short tries of a prompt probe: an 850x slower path costs ~0.8 s here, not 8
# A fast path this many times slower than its reference in every pair of two short tries is not run
# longer. One try of two pairs decided before: on an AMD EPYC Zen 1 (family 23 model 1) next to a C++
# build on both cores, oneDNN's fp32 GEMM took 5.7 ms where MKL took 1.2, so it measured 0.21x and stood
# aside on that machine for good (the result is cached); quiet, it measured 0.99x. Six tries next to two
# busy loops did not repeat it. The cost: an 850x slower path now runs ~0.8 s before it stops, not ~0.4.
GIVE_UP = 4.0
REPEATS = 6  # timed pairs per probe
# A fast path stands aside below this ratio: clearly slower, by more than one-thread timings wander on
# a shared two-core VM (C's one-row loop against MKL's, on the Xeon: 1.05x and 0.95x quiet, 0.87x
# next to two busy processes), and more than a tie that the probe's one thread cannot settle: C's
# row loops gain their most at two threads, where torch's one-row product reaches half the memory's
# bandwidth (kernels/build.py). Every ratio is printed, ties included.
SLOWER = 0.8
# A lossy fast path (int8 activations: numerics/int8_act.py) runs on "auto" only from this ratio up: a tie
# buys nothing for what it costs in accuracy
LOSSY_GAIN = 1.1
# SmolLM2-135M's shapes: the smallest a probe measures at (a test model's 32 channels measure call overhead)
FLOOR = dict(dim=576, hidden=1536, heads=9, kv_heads=3, head_dim=64)


@dataclass(frozen=True)
class Shapes:
    """The products a measurement runs: the model's own matrices, each dimension at least FLOOR's."""
    dim: int  # D, the residual width
    hidden: int  # F, the MLP width
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_config) -> "Shapes":
        c = model_config
        own = dict(dim=c.dim, hidden=c.hidden_dim, heads=c.n_heads, kv_heads=c.n_kv_heads, head_dim=c.head_dim)
        if c.dim < FLOOR["dim"]:  # a test-sized model: SmolLM2's shapes, whole (heads must divide)
            return cls(**FLOOR)
        return cls(**own)

    def key(self) -> str:
        return f"D{self.dim}-F{self.hidden}-H{self.heads}-{self.kv_heads}x{self.head_dim}"


@dataclass(frozen=True)
class Measurement:
    """One fast path against its reference on this machine: seconds a call (medians), and the ratio."""
    path: str
    fast: str  # the fast path, in words
    reference: str  # what it is measured against
    fast_s: float
    reference_s: float
    ratio: float = 0.0  # reference time / fast time, the median over adjacent pairs: above 1 the fast path is faster
    least: float = SLOWER  # the ratio below which it stands aside (LOSSY_GAIN for a lossy path)

    def __post_init__(self):
        if not self.ratio:  # a measurement given as two times: their ratio
            object.__setattr__(self, "ratio", self.reference_s / self.fast_s if self.fast_s > 0 else float("inf"))

    @property
    def stands_aside(self) -> bool:
        return self.ratio < self.least

    def line(self) -> str:
        verdict = "stands aside" if self.stands_aside else "runs"
        return (f"{self.path:<15} {self.ratio:8.2f}x  {verdict:<12} {self.fast} ({self.fast_s * 1e3:.3f} ms) "
                f"against {self.reference} ({self.reference_s * 1e3:.3f} ms)")


@dataclass(frozen=True)
class Probe:
    """How to measure one fast path: `make(shapes, rows)` -> (fast, reference) calls, or None where the
    fast path does not exist here (no C compiler, no oneDNN, no such CPU feature)."""
    path: str
    fast: str
    reference: str
    make: Callable[[Shapes, int], tuple[Callable, Callable] | None]
    prompt: bool = False  # a prompt probe: a first try at FIRST_ROWS rows, then PROMPT_ROWS
    least: float = SLOWER  # below this ratio the path stands aside (Measurement.least)


# ---------------------------------------------------------------- the probes
MAX_ELEMENTS = 1 << 23  # of one probe's matrix (32 MB in fp32): past every cache, and quick to fill at 8B shapes


def _weights(s: Shapes, seed: int = 0) -> dict[str, Tensor]:
    """The model's MLP matrices, w_gate_up [2F, D] and w_down [D, F], random, each cut to MAX_ELEMENTS
    by its output rows (a product's speed per weight does not change with them)."""
    g = torch.Generator().manual_seed(seed)
    return {"gate_up": torch.randn(min(2 * s.hidden, MAX_ELEMENTS // s.dim), s.dim, generator=g) * 0.05,
            "down": torch.randn(min(s.dim, MAX_ELEMENTS // s.hidden), s.hidden, generator=g) * 0.05}


def _layers(s: Shapes, dtype=torch.float32) -> list[Tensor]:
    """STREAM_LAYERS copies of w_gate_up, so that a one-row call streams them from memory as a decode
    step does (one matrix alone stays in the cache between calls, and times the cache instead)."""
    w = _weights(s)["gate_up"]
    return [(w + i * 1e-3).to(dtype).contiguous() for i in range(STREAM_LAYERS)]


STREAM_LAYERS = 8  # 8 x 7 MB at SmolLM2's shapes: past a core's L2 and most of an L3 slice


def _c_matvec(s: Shapes, rows: int, dtype=torch.float32):
    if not build.available():
        return None
    ws, x = _layers(s, dtype), torch.randn(s.dim)
    wide = [w.float() for w in ws] if dtype != torch.float32 else ws  # the reference reads fp32 weights
    return (lambda: [cpu.matvec(x, w) for w in ws][0]), (lambda: [F.linear(x, w) for w in wide][0])


def _c_matvec_q(bits: int):
    def make(s: Shapes, rows: int):
        if not build.available():
            return None
        q = quantize_matrix(_weights(s)["gate_up"], bits, 32)
        x = torch.randn(s.dim)
        return (lambda: cpu.matvec(x, q)), (lambda: F.linear(x, q.dequantize()))
    return make


def _c_rows(s: Shapes, rows: int):
    if not build.available():
        return None
    w = _weights(s)["gate_up"]
    x = torch.randn(8, s.dim)
    return (lambda: cpu.matmul_rows(x, w)), (lambda: F.linear(x, w))


def _avx512_rows(s: Shapes, rows: int):
    """The native build (AVX-512 loops) against a build with -mno-avx512f (the AVX2 loops)."""
    if not (build.available() and build.has_avx512()):
        return None
    plain = build.variant(build.NO_AVX512)
    if plain is None:
        return None
    ws = _layers(s)
    x, y = torch.randn(s.dim), torch.empty(ws[0].shape[0])
    n, k = ws[0].shape

    def run(lib):
        return lambda: [lib.gemv_f32(w.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, torch.get_num_threads())
                        for w in ws]
    return run(build.library()), run(plain)


def _onednn_fp32(s: Shapes, rows: int):
    if not cpu.onednn_fp32():
        return None
    w, x = _weights(s)["down"], torch.randn(rows, s.hidden)
    return (lambda: cpu.linear(x, w)), (lambda: F.linear(x, w))


def _gemm_q(s: Shapes, rows: int):
    if not build.available():
        return None
    q, x = quantize_matrix(_weights(s)["down"], 4, 32), torch.randn(rows, s.hidden)
    return (lambda: cpu.quantized_linear(x, q)), (lambda: F.linear(x, q.dequantize()))


def _c_attention(s: Shapes, rows: int):
    if not build.available():
        return None
    S = 512
    q = torch.randn(1, s.heads, 1, s.head_dim)
    k, v = torch.randn(1, s.kv_heads, S, s.head_dim), torch.randn(1, s.kv_heads, S, s.head_dim)
    mask = torch.zeros(1, S)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=s.heads != s.kv_heads)  # noqa: E731
    return (lambda: cpu.attend_decode(q, k, v, mask)), sdpa  # SDPA: what attention.attend runs


def _c_rms_norm(s: Shapes, rows: int):
    if not build.available():
        return None
    x, w = torch.randn(1, 1, s.dim), torch.randn(s.dim)
    return (lambda: cpu.rms_norm(x, w, 1e-5)), (lambda: F.rms_norm(x, (s.dim,), w, 1e-5))


def _bf16_prompt(s: Shapes, rows: int):
    if not cpu.onednn_bf16():
        return None
    w, x = _weights(s)["down"], torch.randn(rows, s.hidden)
    wb = w.bfloat16()  # the copy a bf16 prompt keeps (made once, not per product)
    return (lambda: cpu.bf16_linear(x, wb)), (lambda: F.linear(x, w))


def _bf16_attention(s: Shapes, rows: int):
    T = 4 * rows  # a prompt's attention: T queries over T keys, causal
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, s.heads, T, s.head_dim, generator=g)
    k, v = (torch.randn(1, s.kv_heads, T, s.head_dim, generator=g) for _ in range(2))
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    gqa = s.heads != s.kv_heads

    def run(q, k, v):
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return run(qb, kb, vb), run(q, k, v)


def _int8(backend: str):
    def make(s: Shapes, rows: int):
        if not int8.available(backend):
            return None
        w, x = _weights(s)["down"], torch.randn(rows, s.hidden)
        w8 = w8a8.quantize_weight(w, torch.arange(min(w8a8.OUTLIER_COLUMNS, s.hidden // 8)))
        if int8.int8_linear(x[:FIRST_ROWS], w8, backend) is None:
            return None
        return (lambda: int8.int8_linear(x, w8, backend)), (lambda: F.linear(x, w))
    return make


OUTLIERS = 4  # channels of a probe's activations 100 times the rest (SmolLM2's marks about 4 blocks a row)


def _outliers(x: Tensor) -> Tensor:
    """x with OUTLIERS of its channels, spread over its width, 100 times larger."""
    x[..., torch.linspace(0, x.shape[-1] - 1, OUTLIERS).long()] *= 100
    return x


def _s8(bits: int, prompt: bool):
    """int8 activations (numerics/int8_act.py) against fp32 activations, both through C: one row against
    STREAM_LAYERS matrices from memory (a decode step), or a prompt's rows. x has OUTLIERS channels 100 times
    the rest, as a model's residual stream has: their blocks are quantized twice, which costs what a real
    product pays. A kernel whose result strays from int8_act's reference here (a wrong build) does not run:
    it says so, and has no measurement."""
    def make(s: Shapes, rows: int):
        if not build.available():
            return None
        if prompt:
            qs, x = [quantize_matrix(_weights(s)["down"], bits, 32)], _outliers(torch.randn(rows, s.hidden))
            fast, ref = (lambda: cpu.quantized_linear_s8(x, qs[0])), (lambda: cpu.quantized_linear(x, qs[0]))
        else:
            qs, x = [quantize_matrix(w, bits, 32) for w in _layers(s)], _outliers(torch.randn(s.dim))
            fast, ref = (lambda: [cpu.matvec_s8(x, q) for q in qs][0]), (lambda: [cpu.matvec(x, q) for q in qs][0])
        y = fast()
        if y is None:
            return None
        want = int8_act.reference_linear(x, qs[0])
        if not torch.allclose(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            warnings.warn(f"minigen: C's int{bits} x int8-activation kernel strays from its reference here (by "
                          f"{float((y - want).abs().max()):.3g}), so it stands aside", RuntimeWarning, stacklevel=2)
            return None
        return fast, ref
    return make


PROBES: tuple[Probe, ...] = (
    Probe("avx512_rows", "the C loops built with AVX-512", "the same loops built without it (AVX2)", _avx512_rows),
    Probe("c_matvec", "C's one-row fp32 matrix-vector loop", "F.linear", _c_matvec),
    Probe("c_matvec_bf16", "C's one-row loop over bf16 weights", "F.linear over fp32 weights",
          lambda s, r: _c_matvec(s, r, torch.bfloat16)),
    Probe("c_matvec_q4", "C's one-row loop over int4 codes", "dequantize + F.linear", _c_matvec_q(4)),
    Probe("c_matvec_q8", "C's one-row loop over int8 codes", "dequantize + F.linear", _c_matvec_q(8)),
    Probe("c_rows", "C's several-row fp32 loop (8 rows)", "F.linear", _c_rows),
    Probe("onednn_fp32", "oneDNN's fp32 GEMM (a prompt)", "F.linear (MKL)", _onednn_fp32, prompt=True),
    Probe("gemm_q", "C's int4 panels (a prompt)", "dequantize + F.linear", _gemm_q, prompt=True),
    Probe("c_attention", "C's one-query attention (512 keys)", "SDPA", _c_attention),
    Probe("c_rms_norm", "C's RMSNorm (one row)", "F.rms_norm", _c_rms_norm),
    Probe("bf16_prompt", "oneDNN's bf16 GEMM (a prompt)", "the fp32 product", _bf16_prompt, prompt=True),
    Probe("bf16_attention", "a prompt's attention in bf16 (SDPA)", "SDPA in fp32", _bf16_attention, prompt=True),
    Probe("int8_c", "C's int8 dot products (a prompt)", "the fp32 product", _int8("c"), prompt=True),
    Probe("int8_onednn", "oneDNN's int8 GEMM (a prompt)", "the fp32 product", _int8("onednn"), prompt=True),
    Probe("int8_int_mm", "torch._int_mm (a prompt)", "the fp32 product", _int8("int_mm"), prompt=True),
    *(Probe(f"c_matvec_q{b}_s8", f"C's one-row int{b} x int8-activation dot products",
            f"C's int{b} row with fp32 activations", _s8(b, False), least=LOSSY_GAIN) for b in (4, 8)),
    *(Probe(f"gemm_q{b}_s8", f"C's int{b} x int8-activation GEMM (a prompt)", f"C's int{b} panels, fp32 activations",
            _s8(b, True), prompt=True, least=LOSSY_GAIN) for b in (4, 8)),
)


def _pairs(fast: Callable, ref: Callable, repeats: int, budget: float = float("inf")) -> list[tuple[float, float]]:
    """`repeats` (fast, reference) seconds, each pair timed back to back (the order alternating), so
    that both calls of a pair meet the same neighbours. Stops early once the fast calls took `budget` s."""
    pairs = []
    for i in range(repeats):
        t0 = time.perf_counter()
        (fast if i % 2 == 0 else ref)()
        t1 = time.perf_counter()
        (ref if i % 2 == 0 else fast)()
        t2 = time.perf_counter()
        pairs.append((t1 - t0, t2 - t1) if i % 2 == 0 else (t2 - t1, t1 - t0))
        if sum(f for f, _ in pairs) > budget:
            break
    return pairs


FIRST_TRY = (2, 0.3)  # pairs, and seconds of fast calls at most: oneDNN warms up over its first calls


def _ratio(pairs: list[tuple[float, float]]) -> float:
    """The median of reference / fast over the pairs: a busy neighbour who slows both calls of a pair
    leaves its ratio alone, where a minimum or a median of each side alone would compare calls that
    met different loads."""
    return statistics.median(r / f for f, r in pairs)


def run_probe(probe: Probe, shapes: Shapes, repeats: int = REPEATS) -> Measurement | None:
    """Time one probe (the module docstring's rules) -> its Measurement, or None where it does not apply."""
    with torch.inference_mode():
        calls = probe.make(shapes, FIRST_ROWS if probe.prompt else 1)
        if calls is None:
            return None
        fast, ref = calls
        if fast() is None and probe.path != "avx512_rows":  # the kernel declined the call: nothing to time
            return None
        ref()
        pairs = _pairs(fast, ref, *FIRST_TRY)  # the first try, short
        if _ratio(pairs) < 1 / GIVE_UP:  # a second short try: one stalled call must not decide for good
            pairs += _pairs(fast, ref, *FIRST_TRY)
        if max(r / f for f, r in pairs) >= 1 / GIVE_UP:
            if probe.prompt:
                fast, ref = probe.make(shapes, PROMPT_ROWS)
                fast(), ref()
            pairs = _pairs(fast, ref, repeats)
            if _ratio(pairs) < probe.least:  # below its bar: measured again, three times as long, before it stands aside
                pairs += _pairs(fast, ref, 2 * repeats)
    f, r = (statistics.median(t) for t in zip(*pairs))
    return Measurement(probe.path, probe.fast, probe.reference, f, r, _ratio(pairs), probe.least)

