"""csrc/rows_s8.c through kernels/cpu.matvec_s8: one row of int8 / int4 codes against int8 activations
(numerics/int8_act.py). The C codes of x are quantize_activations' bit for bit (an identity weight
shows them, the residual blocks' codes too); the products are int8_act.reference_linear's up to the
order of fp32 sums; they are not the fp32-activation product's (a kernel that skipped quantizing x would
pass the first check alone), nor, where blocks have outliers, the product without their residuals (a
kernel that ignored them); at most 8 blocks a row take a residual, the largest ratios, ties the lower
block; the thread count and every variant (AVX512-VNNI, AVX-VNNI, AVX2, portable) keep to the same oracle."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from minigen.kernels import build as kernel_build
from minigen.kernels import cpu as cpu_kernel
from minigen.numerics.int8_act import BLOCK, quantize_activations, reference_linear, residual_blocks
from minigen.numerics.weight_quant import QuantizedWeight, pack4, quantize_matrix, unpack4

pytestmark = [pytest.mark.skipif(kernel_build.compiler() is None, reason="no C compiler on this machine"),
              pytest.mark.skipif(not kernel_build.available(), reason="the C kernels are not built here")]


def assert_near_reference(y: torch.Tensor, x: torch.Tensor, w: QuantizedWeight) -> None:
    """Within fp32 summation order of the oracle: the codes and int32 sums are exact."""
    ref = reference_linear(x, w).reshape(-1)
    assert y.shape == ref.shape and y.dtype == torch.float32
    tol = 1e-5 * ref.abs().max().item() + 1e-6
    assert (y - ref).abs().max().item() <= tol, ((y - ref).abs().max().item(), tol)


def cases(seed: int):
    g = torch.Generator().manual_seed(seed)
    for bits in (8, 4):
        for G in (32, 64, 128):
            for k in (64, 96, 576, 800, 1536):  # 96, 800: an odd number of blocks (AVX2's int4 pairs leave one)
                if k % G:
                    continue
                for n in (1, 7, 33, 100):
                    yield bits, quantize_matrix(torch.randn(n, k, generator=g), bits, G), torch.randn(k, generator=g)


def identity(bits: int, k: int) -> QuantizedWeight:
    """code 1 on the diagonal, scale 1, minimum 0: y = dx qx + rdx rx, each product rounded once"""
    eye = torch.eye(k, dtype=torch.uint8 if bits == 4 else torch.int8)
    scales = torch.ones(k, k // 32, dtype=torch.float16)
    if bits == 8:
        return QuantizedWeight(eye, scales, None, 8, 32, (k, k), torch.float32)
    return QuantizedWeight(pack4(eye), scales, torch.zeros_like(scales), 4, 32, (k, k), torch.float32)


def codes_times_scales(x: torch.Tensor) -> torch.Tensor:
    """what an identity weight gives: x's codes times their scales, plus the residuals' (0 where unmarked)"""
    qx, dx, rx, rdx = quantize_activations(x)
    return qx.float() * dx.repeat_interleave(BLOCK) + rx.float() * rdx.repeat_interleave(BLOCK)


def without_residuals(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """reference_linear for one row x [k] with the residual blocks left out (fp64 sums)"""
    qx, dx, _, _ = quantize_activations(x)
    q = (unpack4(w.codes) if w.bits == 4 else w.codes).double().unflatten(-1, (-1, BLOCK))  # [n, k / 32, 32]
    blocks = qx.double().unflatten(-1, (-1, BLOCK))  # [k / 32, 32]
    scale = w.scales.double().repeat_interleave(w.group_size // BLOCK, dim=1)
    y = (torch.einsum("bj,nbj->nb", blocks, q) * scale * dx.double()).sum(-1)
    if w.mins is not None:
        y += (dx.double() * blocks.sum(-1)).unflatten(-1, (-1, w.group_size // BLOCK)).sum(-1) @ w.mins.double().T
    return y.float()


def activations_with_outliers(k: int, seed: int) -> torch.Tensor:
    """randn with 3 channels 100 times larger, as a residual stream's few large channels"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, generator=g)
    x[torch.randperm(k, generator=g)[:3]] *= 100.0
    return x


def many_candidates() -> tuple[torch.Tensor, list[int]]:
    """x [576] (18 blocks) with 11 blocks wanting a residual, 10 of them at the same ratio, and blocks that
    must not (ratio exactly 2, second largest 0, the largest twice) -> (x, the 8 blocks marked)"""
    g = torch.Generator().manual_seed(6)
    x = (torch.rand(576, generator=g) * 1.8 - 0.9).unflatten(0, (18, BLOCK))  # |x| < 0.9
    x[:, 5] = 1.0  # every block's second largest |x| is exactly 1: its ratio is its largest
    ratio = {0: 3.0, 1: 5.0, 2: -5.0, 3: 5.0, 4: 2.5, 5: 5.0, 6: -5.0, 7: 7.0, 8: 5.0, 9: 5.0, 10: 5.0, 11: 5.0,
             12: 2.0, 14: 5.0}
    for b, r in ratio.items():
        x[b, 17] = r
    x[13] = 0.0
    x[13, 9] = 4.0    # one nonzero value: its second largest is 0, not a candidate
    x[15, 3] = x[15, 20] = -6.0  # the largest twice: ratio 1
    return x.flatten(), [1, 2, 3, 5, 6, 7, 8, 9]  # 7 (ratio 7), then the lowest seven at 5


@pytest.mark.parametrize("bits", [8, 4])
def test_the_rows_are_the_reference_and_not_the_fp32_product(bits):
    far = 0
    for b, w, x in cases(1):
        if b != bits:
            continue
        y = cpu_kernel.matvec_s8(x, w)
        assert_near_reference(y, x, w)
        fp32 = F.linear(x, w.dequantize())
        far += (y - fp32).abs().max().item() > 1e-3 * fp32.abs().max().item()
    assert far >= 10  # int8 activations move the result well past rounding: a kernel that ignored them fails


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [128, 576])
def test_the_codes_of_x_are_quantize_activations(bits, k):
    """An identity weight (code 1 on the diagonal, scale 1, minimum 0) gives y = dx * qx, one product
    rounded once: equal to torch's only if every code and scale is."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(k, generator=g) * torch.logspace(-3, 3, k)[torch.randperm(k, generator=g)]
    x[32:64] = 0.0                               # a block of zeros: codes 0, scale 0
    x[3] = 1e6                                   # an outlier flattens the rest of its block
    x[64:96] = torch.arange(32) - 15.5           # halves: 127 / amax is 1, so x * inv ties
    x[64] = 127.0
    w = identity(bits, k)
    qx, _, _, rdx = quantize_activations(x)
    assert qx[65].item() == -14 and qx[66].item() == -14 and qx[67].item() == -12  # -14.5, -13.5, -12.5: to even
    assert rdx[0] > 0  # the outlier's block takes a residual
    y = cpu_kernel.matvec_s8(x, w)
    assert torch.equal(y, codes_times_scales(x))
    assert_near_reference(y, x, w)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [576, 1536])
def test_outlier_blocks_take_their_residuals(bits, k):
    """Blocks with a channel 100x the rest: the kernel adds their residuals (it is the reference, and not
    the reference without them, by far more than the tolerance); an identity weight shows their codes."""
    x = activations_with_outliers(k, seed=7 + k)
    assert residual_blocks(x).sum().item() >= 3
    assert torch.equal(cpu_kernel.matvec_s8(x, identity(bits, k)), codes_times_scales(x))
    g = torch.Generator().manual_seed(8)
    for G in (32, 64, 192):
        w = quantize_matrix(torch.randn(100, k, generator=g), bits, G)
        y = cpu_kernel.matvec_s8(x, w)
        assert_near_reference(y, x, w)
        ref = reference_linear(x, w)
        assert (y - without_residuals(x, w)).abs().max().item() > 100 * (1e-5 * ref.abs().max().item() + 1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_at_most_8_blocks_the_largest_ratios_first(bits):
    """11 candidates: the 8 of the largest ratio, ties to the lower block; a ratio of exactly 2, a block
    with one nonzero value, a block whose largest comes twice: none"""
    x, marked = many_candidates()
    assert residual_blocks(x).nonzero().flatten().tolist() == marked  # the reference itself
    assert torch.equal(cpu_kernel.matvec_s8(x, identity(bits, 576)), codes_times_scales(x))
    w = quantize_matrix(torch.randn(64, 576, generator=torch.Generator().manual_seed(9)), bits, 64)
    assert_near_reference(cpu_kernel.matvec_s8(x, w), x, w)


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_blocks_and_an_outlier(bits):
    g = torch.Generator().manual_seed(3)
    w = quantize_matrix(torch.randn(70, 576, generator=g), bits, 64)
    x = torch.zeros(576)
    assert torch.equal(cpu_kernel.matvec_s8(x, w), reference_linear(x, w))  # all zero (int4: its minimums too)
    x = torch.randn(576, generator=g)
    x[:64] = 0.0
    x[100] = 3e4
    assert_near_reference(cpu_kernel.matvec_s8(x, w), x, w)
    assert_near_reference(cpu_kernel.matvec_s8(x.view(1, 1, 576), w), x, w)  # one row in any shape


@pytest.mark.parametrize("bits", [8, 4])
def test_the_thread_count_keeps_the_bits(bits):
    g = torch.Generator().manual_seed(4)
    w = quantize_matrix(torch.randn(1000, 576, generator=g), bits, 32)
    x = torch.randn(576, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernel.matvec_s8(x, w)
        torch.set_num_threads(2)
        two = cpu_kernel.matvec_s8(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert_near_reference(one, x, w)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_gets_the_bits_it_gets_alone(bits):
    """The AVX2 build takes four rows a call (rows4_q4_s8 / rows4_q8_s8; past n the last row again): a
    row's output does not depend on the rows beside it, so the fused step's several rows of x (a verify
    chunk) and a single row agree bit for bit."""
    g = torch.Generator().manual_seed(13)
    for k in (96, 576):  # 96: the int4 loop's odd last block
        w = quantize_matrix(torch.randn(7, k, generator=g), bits, 32)
        for x in (torch.randn(k, generator=g), activations_with_outliers(k, seed=14)):
            y = cpu_kernel.matvec_s8(x, w)
            for i in range(7):
                alone = QuantizedWeight(w.codes[i:i + 1], w.scales[i:i + 1], None if w.mins is None else w.mins[i:i + 1],
                                        bits, 32, (1, k), torch.float32)
                assert torch.equal(cpu_kernel.matvec_s8(x, alone), y[i:i + 1]), (k, i)
            assert torch.equal(cpu_kernel.matvec_s8(x, QuantizedWeight(w.codes.flip(0), w.scales.flip(0), None if w.mins is None
                                                                       else w.mins.flip(0), bits, 32, (7, k), torch.float32)),
                               y.flip(0))


def test_where_it_stands_aside():
    w = quantize_matrix(torch.randn(8, 64), 8, 32)
    x = torch.randn(64)
    assert cpu_kernel.matvec_s8(x.double(), w) is None
    assert cpu_kernel.matvec_s8(torch.randn(2, 64), w) is None  # one row only
    assert cpu_kernel.matvec_s8(x.requires_grad_(), w) is None
    with kernel_build.enabled(False):
        assert cpu_kernel.matvec_s8(x.detach(), w) is None
    with torch.no_grad():
        assert cpu_kernel.matvec_s8(x, w) is not None


FLAGS = {  # variant -> (flags, the CPU flag it needs)
    "avx512vnni-narrow": ("-DROWS_S8_NARROW", "avx512_vnni"),
    "avxvnni": ("-mno-avx512f", "avx_vnni"),
    "avx2": ("-mno-avx512f -mno-avxvnni", "avx2"),
    "avx2-single": ("-mno-avx512f -mno-avxvnni -DROWS_S8_SINGLE", "avx2"),  # int4 a block at a time
    "avx2-one": ("-mno-avx512f -mno-avxvnni -DROWS_S8_ONE", "avx2"),  # one row a call, not four
    "portable": ("-mno-avx512f -mno-avxvnni -mno-avx2", None),
}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the variants are x86's (-mno-avx512f...)")
@pytest.mark.parametrize("variant", list(FLAGS))
def test_each_variant_keeps_to_the_reference(variant, monkeypatch, tmp_path):
    flags, needs = FLAGS[variant]
    if needs is not None and needs not in kernel_build.cpu_fingerprint().split():
        pytest.skip(f"the CPU has no {needs}")
    native = cpu_kernel.rows_s8_variant()
    monkeypatch.setenv("MINIGEN_CPU_KERNEL_CFLAGS", flags)
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_build, "_lib", None)
    monkeypatch.setattr(kernel_build, "_reason", "not built yet")
    assert kernel_build.status().startswith("built"), kernel_build.status()
    assert cpu_kernel.rows_s8_variant() == variant.split("-")[0]
    if variant.endswith("-narrow") and native != "avx512vnni":
        pytest.skip("-march=native does not build the 512-bit loop here")
    for _, w, x in cases(5):
        assert_near_reference(cpu_kernel.matvec_s8(x, w), x, w)
    x, _ = many_candidates()
    for bits in (8, 4):  # the residual blocks: their codes, the cap and the tie order, and the products
        for v in (x, activations_with_outliers(576, seed=10), activations_with_outliers(1536, seed=11)):
            assert torch.equal(cpu_kernel.matvec_s8(v, identity(bits, v.numel())), codes_times_scales(v))
            w = quantize_matrix(torch.randn(40, v.numel(), generator=torch.Generator().manual_seed(12)), bits, 64)
            assert_near_reference(cpu_kernel.matvec_s8(v, w), v, w)
