"""kernels/int8.py: a prompt's int8 products through each backend (csrc/gemm_s8.c, oneDNN, torch._int_mm)
against numerics/w8a8.py's oracle, and gemm_s8's variants (AVX512-VNNI, AVX-VNNI, AVX2, portable C)
against each other."""

from __future__ import annotations

import platform

import pytest
import torch

from minigen.kernels import build as kernel_build
from minigen.kernels import cpu
from minigen.kernels import int8
from minigen.numerics import w8a8

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not int8.available(b), reason=f"{b} does not run here"))
            for b in int8.BACKENDS]
EXACT = [p for p in BACKENDS if p.values[0] in ("c", "int_mm")]  # int32 sums, then sum * a * b as the oracle
# (M, k, n, outliers): M = 1, 17, 40, 512 rows; k = 32, 64, 576, 1,536; n odd or off the kernel's 16,
# 32 and 64 (a last panel of one vector, of part of one, and 64 + 1)
CASES = [(1, 32, 5, None), (17, 64, 33, [3]), (40, 576, 701, [17, 3, 40]), (512, 576, 130, None),
         (40, 1536, 65, [0, 1535]), (512, 1536, 97, None), (17, 37, 70, [36])]


def _case(M, k, n, outliers, seed=0):
    """Rows [M, k] with two channels 30x the rest (as an RMSNorm's output has), a weight [n, k] as w8a8 codes."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(M, k, generator=g)
    x[:, [1, min(17, k - 1)]] *= 30
    return x, w, w8a8.quantize_weight(w, None if outliers is None else torch.tensor(outliers))


def _exact(x, w8):
    """The scheme with exact integer sums: the codes' product in int64, then sum * a * b in fp32 (the
    kernels' order), plus the outlier columns' fp32 product as int8_linear adds it."""
    qx, a = w8a8.quantize_rows(x, w8.keep)
    y = (qx.long() @ w8.codes().long().T).float() * a * w8.scales
    if len(w8.outliers):
        y.addmm_(x[:, w8.outliers], w8.outlier_weights.t())
    return y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("M, k, n, outliers", CASES)
def test_every_backend_is_the_reference(backend, M, k, n, outliers):
    """Within the fp32 rounding of the reference's sums and scales (test_prefill's bound: a few 2^-24
    relative of sum |x w|), each row shaped [1, M, k] -> [1, M, n]."""
    x, w, w8 = _case(M, k, n, outliers)
    y = int8.int8_linear(x[None], w8, backend)
    assert y is not None and y.shape == (1, M, n) and y.dtype == torch.float32
    ref = w8a8.reference_linear(x, w8)
    assert ((y[0] - ref).abs() <= 1e-5 * (x.abs() @ w.abs().T)).all()


@pytest.mark.parametrize("backend", EXACT)
@pytest.mark.parametrize("M, k, n, outliers", CASES)
def test_exact_backends_give_the_bits_of_exact_sums(backend, M, k, n, outliers):
    x, _, w8 = _case(M, k, n, outliers, seed=1)
    assert torch.equal(int8.int8_linear(x, w8, backend), _exact(x, w8))


@pytest.mark.parametrize("backend", EXACT)
def test_sums_past_fp32s_integers_stay_exact(backend):
    """Each row the signs of a weight row (codes +-127 on both sides), but c of its columns 0.3 (code 38):
    sums 127^2 (1,536 - c) + 38 127 c, near 24.8e6 > 2^24, odd where c is, which fp32 sums (the
    reference's, spaced 2 there) cannot hold."""
    g = torch.Generator().manual_seed(2)
    k, n = 1536, 9
    signs = torch.randint(0, 2, (n, k), generator=g).float() * 2 - 1
    w8 = w8a8.quantize_weight(signs)
    x = signs.repeat(3, 1)  # [27, k]
    for r in range(len(x)):
        x[r, torch.randperm(k, generator=g)[: r + 1]] *= 0.3
    y, exact = int8.int8_linear(x, w8, backend), _exact(x, w8)
    assert torch.equal(y, exact)
    sums = w8a8.quantize_rows(x)[0].long() @ w8.codes().long().T
    assert ((sums > 2**24) & (sums % 2 == 1)).sum() >= 10  # the case can catch fp32 sums


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_prompt_has_an_empty_product(backend):
    _, _, w8 = _case(1, 64, 33, [3])
    y = int8.int8_linear(torch.zeros(2, 0, 64), w8, backend)
    assert y is not None and y.shape == (2, 0, 33)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_never_influence_each_other(backend):
    """A row's products are the same bits alone and beside rows 1000x larger, before and after them."""
    x, _, w8 = _case(20, 576, 300, [3, 17])
    other = 1000 * _case(20, 576, 1, None, seed=4)[0]
    alone = int8.int8_linear(x, w8, backend)
    assert torch.equal(int8.int8_linear(torch.cat([x, other]), w8, backend)[:20], alone)
    assert torch.equal(int8.int8_linear(torch.cat([other, x]), w8, backend)[20:], alone)


@pytest.mark.skipif(not int8.available("c"), reason="the C kernels are not built here")
def test_the_c_kernel_gives_the_same_bits_on_one_and_two_threads():
    x, _, w8 = _case(512, 576, 130, [3])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = int8.int8_linear(x, w8, "c")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(two, int8.int8_linear(x, w8, "c"))


@pytest.mark.skipif(not int8.available("c"), reason="the C kernels are not built here")
def test_gemm_s8_quantizes_as_torch_or_takes_codes():
    """gemm_s8 given x writes w8a8.quantize_rows' codes and scales; given those codes instead (x NULL),
    the same product."""
    x, _, w8 = _case(40, 576, 70, [3, 17], seed=8)
    lib, (n, k) = kernel_build.library(), w8.shape
    q_ref, a_ref = w8a8.quantize_rows(x, w8.keep)
    q, a, y = torch.empty(40, k, dtype=torch.int8), torch.empty(40), torch.empty(40, n)
    args = (w8.blocked.data_ptr(), w8.code_sums.data_ptr(), w8.scales.data_ptr())
    assert lib.gemm_s8(x.data_ptr(), w8.keep.data_ptr(), q.data_ptr(), a.data_ptr(), *args, y.data_ptr(), 40, n, k, 1) == 0
    assert torch.equal(q, q_ref) and torch.equal(a, a_ref[:, 0])
    y2 = torch.full((40, n), float("nan"))
    assert lib.gemm_s8(None, None, q_ref.data_ptr(), a_ref.data_ptr(), *args, y2.data_ptr(), 40, n, k, 1) == 0
    assert torch.equal(y2, y) and not y.isnan().any()


@pytest.mark.skipif(not int8.available("c"), reason="the C kernels are not built here")
def test_c_codes_are_torchs_bits_at_ties_extremes_and_tails():
    """quantize_rows_s8 (8 lanes, rounding through 1.5 2^23) against w8a8.quantize_rows: values exactly
    half a step apart (ties go to even), tiny and huge rows, an all-zero row, k not a multiple of 8."""
    ties = torch.arange(-254, 255).float()[None] / 2  # max 127: a = 1, every other value a tie
    g = torch.Generator().manual_seed(7)
    rows = [ties, torch.zeros(1, 509), torch.randn(3, 509, generator=g) * 1e-30, torch.randn(3, 509, generator=g) * 1e30]
    x = torch.cat(rows)
    keep = torch.ones(509)
    keep[::7] = 0
    for kept in (None, keep):
        for k in (509, 13, 8):
            w8 = w8a8.quantize_weight(torch.ones(1, k), None)
            w8 = w8 if kept is None else w8a8.quantize_weight(torch.ones(1, k), (kept[:k] == 0).nonzero()[:, 0])
            xk = x[:, :k].contiguous()
            q, a = int8.quantize(xk, w8)
            q_ref, a_ref = w8a8.quantize_rows(xk, w8.keep)
            assert torch.equal(q, q_ref) and torch.equal(a, a_ref)
    assert int8.quantize(ties, w8a8.quantize_weight(torch.ones(1, 509)))[0][0, :6].tolist() == [-127, -126, -126, -126, -125, -124]


def test_blocked_codes_are_the_codes_16_channels_by_4_bytes():
    """w8a8.quantize_weight's blocked copy: codes round(w / b) (computed here), 16 channels x 4 bytes of
    k a 64-byte block, n padded to 64 and k to 4 with zeros; the code sums 128 sum_k qw."""
    n, k = 70, 37
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    w8 = w8a8.quantize_weight(w, torch.tensor([2]))
    b = (w * w8.keep).abs().amax(1) / 127
    codes = torch.round(w * w8.keep / b[:, None]).to(torch.int8)
    assert w8.blocked.shape == (128 // 16, 40 // 4, 16, 4) and w8.shape == (n, k)
    assert torch.equal(w8.blocked[1, 2, 3], codes[16 + 3, 8:12])  # channel 19, k 8..11
    assert torch.equal(w8a8.unblock_codes(w8.blocked, n, k), codes) and torch.equal(w8.codes(), codes)
    assert not w8.blocked[4, :, 6:].any() and not w8.blocked[5:].any()  # channels 70..127
    assert not w8.blocked[:, -1, :, 1:].any() and w8.blocked[:4, -1, :, 0].any()  # k 37..39, not k 36
    assert torch.equal(w8.code_sums, codes.int().sum(1) * 128) and w8.code_sums.dtype == torch.int32


def test_backends_stand_aside_where_they_do_not_apply():
    x, _, w8 = _case(17, 64, 33, None)
    for backend in int8.BACKENDS:
        assert int8.int8_linear(x.double(), w8, backend) is None
        assert int8.int8_linear(x.requires_grad_(), w8, backend) is None
        x = x.detach()
        assert int8.int8_linear(x[:, :32], w8, backend) is None  # k is not the weight's
        with kernel_build.enabled(False):
            assert int8.int8_linear(x, w8, backend) is None and not int8.available("c")
    with pytest.raises(ValueError, match="not one of"):
        int8.available("cuda")


# ---------------------------------------------------------------- gemm_s8 built as each variant
FLAGS = {  # what to take away from -march=native for each variant, and the CPU flag it needs
    "avxvnni": ("-mno-avx512f", "avx_vnni"),
    "avx2": ("-mno-avx512f -mno-avxvnni", "avx2"),
    "portable": ("-mno-avx512f -mno-avxvnni -mno-avx2", None),
}


@pytest.mark.skipif(kernel_build.compiler() is None, reason="no C compiler on this machine")
@pytest.mark.skipif(not int8.available("c"), reason="the C kernels are not built here (MINIGEN_CPU_KERNEL=0?)")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the variants are x86's (-mno-avx512f...)")
@pytest.mark.parametrize("variant", list(FLAGS))
def test_each_variant_gives_the_native_bits(variant, monkeypatch, tmp_path):
    """gemm_s8 built with fewer instructions than -march=native gives (a Zen 3's AVX2, a Zen 5's AVX-VNNI
    without 512-bit vectors here): its int32 sums are exact and its scales applied in the same order,
    so the same bits as the native build's, on 1 and 2 threads."""
    flags, needs = FLAGS[variant]
    if needs is not None and needs not in kernel_build.cpu_fingerprint().split():
        pytest.skip(f"the CPU has no {needs}")
    if int8.variant() == variant:
        pytest.skip(f"-march=native already builds {variant}: compared with the oracle above")
    cases = [_case(M, k, n, outliers, seed=6) for M, k, n, outliers in
             ((40, 576, 701, [17, 3, 40]), (17, 37, 70, [36]), (1, 32, 5, None), (97, 1536, 33, None))]
    native = [int8.int8_linear(x, w8, "c") for x, _, w8 in cases]
    monkeypatch.setenv("MINIGEN_CPU_KERNEL_CFLAGS", flags)
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_build, "_lib", None)
    monkeypatch.setattr(kernel_build, "_reason", "not built yet")
    assert kernel_build.status().startswith("built"), kernel_build.status()
    assert int8.variant() == variant  # the flags built the loop they name
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for (x, _, w8), y in zip(cases, native):
                assert torch.equal(int8.int8_linear(x, w8, "c"), y)
    finally:
        torch.set_num_threads(before)


def test_onednn_is_not_available_where_the_cpu_has_no_int8_dot_products(monkeypatch):
    """Without VNNI, oneDNN's int8 linear sums pairs of products in int16 and saturates (int8.py's
    docstring: an AMD Zen 1), so it is not offered there, and a call to it gives None."""
    x, w, w8 = _case(17, 64, 33, [3])
    monkeypatch.setattr(cpu, "int8_dot_products", lambda: False)
    assert not int8.available("onednn") and int8.int8_linear(x, w8, "onednn") is None
    monkeypatch.setattr(cpu, "int8_dot_products", lambda: None)  # cannot tell (not Linux): as before
    assert int8.available("onednn") == w8a8.onednn_int8()

