"""csrc/rows_s8.c through kernels/cpu.matvec_s8: one row of int8 / int4 codes against int8 activations
(numerics/int8_act.py). The C codes of x are quantize_activations' bit for bit (an identity weight
shows them); the products are int8_act.reference_linear's up to the order of fp32 sums; they are not
the fp32-activation product's (a kernel that skipped quantizing x would pass the first check alone);
the thread count and every variant (AVX512-VNNI, AVX-VNNI, AVX2, portable) keep to the same oracle."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from minigen.kernels import build as kernel_build
from minigen.kernels import cpu as cpu_kernel
from minigen.numerics.int8_act import quantize_activations, reference_linear
from minigen.numerics.weight_quant import QuantizedWeight, pack4, quantize_matrix

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
            for k in (64, 576, 1536):
                if k % G:
                    continue
                for n in (1, 7, 33, 100):
                    yield bits, quantize_matrix(torch.randn(n, k, generator=g), bits, G), torch.randn(k, generator=g)


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
    eye = torch.eye(k, dtype=torch.uint8 if bits == 4 else torch.int8)
    scales = torch.ones(k, k // 32, dtype=torch.float16)
    if bits == 8:
        w = QuantizedWeight(eye, scales, None, 8, 32, (k, k), torch.float32)
    else:
        w = QuantizedWeight(pack4(eye), scales, torch.zeros_like(scales), 4, 32, (k, k), torch.float32)
    qx, dx = quantize_activations(x)
    assert qx[65].item() == -14 and qx[66].item() == -14 and qx[67].item() == -12  # -14.5, -13.5, -12.5: to even
    y = cpu_kernel.matvec_s8(x, w)
    assert torch.equal(y, qx.float() * dx.repeat_interleave(32))
    assert_near_reference(y, x, w)


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
    assert cpu_kernel.rows_s8_variant() == variant.removesuffix("-narrow")
    if variant.endswith("-narrow") and native != "avx512vnni":
        pytest.skip("-march=native does not build the 512-bit loop here")
    for _, w, x in cases(5):
        assert_near_reference(cpu_kernel.matvec_s8(x, w), x, w)
