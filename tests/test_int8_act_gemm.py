"""kernels/cpu.quantized_linear_s8 (csrc/gemm_q_s8.c): a prompt's products with int4 / int8 group-wise
codes and int8 activations per block of 32, against numerics/int8_act.reference_linear, the oracle: its
residual blocks (a block with an outlier quantized twice) too, which x's outliers here make run."""

from __future__ import annotations

import platform

import pytest
import torch

from minigen.kernels import build, cpu
from minigen.numerics import int8_act
from minigen.numerics.int8_act import BLOCK, quantize_activations, reference_linear, residual_blocks
from minigen.numerics.weight_quant import quantize_matrix

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not build.available(), reason="the C kernels are not built here")]

# codes bit for bit; only the fp32 order of the scaled blocks' sums (and of x's group sums) differs
TOL = 1e-5


def _case(bits, G, M, n, k, seed=0):
    """Rows [M, k] with two channels 30x the rest (as an RMSNorm's output has) and three 100x at each row's
    own places (its blocks with one of them alone are quantized twice: each row its own), a weight [n, k]'s
    codes."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(M, k, generator=g)
    x[:, [1, min(17, k - 1)]] *= 30
    x[torch.arange(M)[:, None], torch.randint(k, (M, 3), generator=g)] *= 100
    return x, quantize_matrix(w, bits, G)


def _crowded(bits, G, seed=7):
    """Rows [3, 576] (18 blocks) of more than 8 candidates for the residual: row 0 twelve blocks alike (blocks
    0-11, equal ratios: the lower 7 kept) and block 14 of a larger ratio; row 1 eight candidates (blocks 1-8)
    beside block 0, one value and 31 zeros (its second largest 0: never marked, it would outrank them all
    at ratio inf), and block 9 all zeros; row 2 every block a candidate, of 18 ratios."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(96, 576, generator=g), torch.randn(3, 576, generator=g)
    rows = x.view(3, 18, BLOCK)
    rows /= 3  # candidates of their own: ratios up to ~2.5
    rows[0, :12] = rows[0, 0]
    rows[0, :12, 3], rows[0, 14, 7] = 40, 1000
    rows[1, 0], rows[1, 9] = 0, 0
    rows[1, 0, 5] = 7
    rows[1, 1:9, 9] = 20 * torch.arange(1, 9)
    rows[2] = rows[2, 0]
    rows[2, :, 11] = 10 + torch.arange(18.0) ** 1.5
    return x, quantize_matrix(w, bits, G)


def _close(y, ref):
    return (y - ref).abs().max().item() <= TOL * ref.abs().max().item()


def _marking(x, w, marked):
    """reference_linear with the residual of the blocks `marked` [M, k / 32] in place of residual_blocks'
    (none: the scheme without it): what a kernel that chose other blocks, or none, would give."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(int8_act, "residual_blocks", lambda _: marked)
        return reference_linear(x, w)


def _apart(y, other):
    """y measurably off `other`: by far more than the fp32 rounding that _close allows."""
    return (y - other).abs().max().item() > 100 * TOL * other.abs().max().item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("M, n, k", [(1, 5, 64), (2, 33, 576), (3, 45, 576), (7, 70, 1536), (17, 16, 576),
                                     (64, 97, 1536), (300, 130, 576)])
def test_the_kernel_is_the_reference(bits, G, M, n, k):
    """n off the panel's 16 / 32 / 48 channels (45: the AVX2 repack's eight channels at once, then five
    alone, then three past n), M off its 4 or 6 rows, every group size that divides k."""
    if k % G:
        pytest.skip(f"G = {G} does not divide k = {k}")
    x, w = _case(bits, G, M, n, k)
    y = cpu.quantized_linear_s8(x, w)
    assert y.shape == (M, n) and _close(y, reference_linear(x, w))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_activations_are_quantized(bits):
    """The kernel's result is the int8-activation scheme's, not the fp32-activation product: a kernel
    that multiplied the codes by fp32 x would be off by far more than the fp32 rounding."""
    x, w = _case(bits, 32, 40, 96, 576, seed=1)
    y, ref, fp32 = cpu.quantized_linear_s8(x, w), reference_linear(x, w), x @ w.dequantize().float().T
    assert _close(y, ref)
    assert (y - fp32).abs().max().item() > 100 * TOL * ref.abs().max().item()


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_rows_and_an_outlier(bits):
    """A row of zeros gives int4's minimums times 0 and int8's 0; a block with one huge activation rounds
    the others to a few levels, as the reference does; a batch's rows keep the bits they get alone."""
    x, w = _case(bits, 64, 9, 50, 576, seed=2)
    x[3] = 0
    x[5, 100] = 1e4
    y = cpu.quantized_linear_s8(x, w)
    assert _close(y, reference_linear(x, w))
    assert torch.equal(y[3], torch.zeros(50))  # int4's w = min + s q meets x = 0: exactly 0 too


@pytest.mark.parametrize("bits", [4, 8])
def test_the_residual_blocks_run(bits):
    """quantize_activations' four tensors: the residual's codes and scales are 0 outside the marked blocks
    and not all 0 in them; the kernel is the reference and measurably off the scheme without them."""
    x, w = _case(bits, 32, 40, 96, 576, seed=8)
    qx, dx, rx, rdx = quantize_activations(x)
    marked = residual_blocks(x)
    assert qx.shape == rx.shape == x.shape and dx.shape == rdx.shape == marked.shape == (40, 18)
    assert marked.sum(-1).min() >= 1 and (rdx[marked] > 0).all()
    assert not rdx[~marked].any() and not rx.view(40, 18, BLOCK)[~marked].any()
    y = cpu.quantized_linear_s8(x, w)
    assert _close(y, reference_linear(x, w)) and _apart(y, _marking(x, w, torch.zeros_like(marked)))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("G", [32, 64])
def test_at_most_eight_blocks_a_row(bits, G):
    """More than 8 candidates: those of the largest ratio, ties to the lower block; a block whose second
    largest is 0 (or all of it) never. Each other choice is measurably off the kernel."""
    x, w = _crowded(bits, G)
    marked = residual_blocks(x)
    want = torch.zeros(3, 18, dtype=torch.bool)
    want[0, [*range(7), 14]] = want[1, 1:9] = want[2, 10:] = True
    assert torch.equal(marked, want)  # the reference's own choice, as this test reads it
    y = cpu.quantized_linear_s8(x, w)
    assert _close(y, reference_linear(x, w))
    for row, blocks in ((0, [*range(8)]), (0, [*range(5, 12), 14]), (1, [*range(8)]), (2, range(8))):
        other = marked.clone()
        other[row] = False
        other[row, list(blocks)] = True
        assert _apart(y[row], _marking(x, w, other)[row])


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_never_influence_each_other(bits):
    """A row alone, or in a batch of rows with other blocks marked (or as many as 8), at any place of a tile."""
    x, w = _case(bits, 32, 23, 70, 576, seed=3)
    x = torch.cat([x, _crowded(bits, 32)[0]])
    assert len({tuple(row) for row in residual_blocks(x).tolist()}) > 20
    y = cpu.quantized_linear_s8(x, w)
    for r in (0, 5, 22, 23, 24, 25):
        assert torch.equal(cpu.quantized_linear_s8(x[r:r + 1], w)[0], y[r])
    assert torch.equal(cpu.quantized_linear_s8(x[4:13], w), y[4:13])
    assert torch.equal(cpu.quantized_linear_s8(x[21:], w), y[21:])


@pytest.mark.parametrize("bits", [4, 8])
def test_one_and_two_threads_give_the_same_bits(bits):
    x, w = _case(bits, 32, 300, 200, 1536, seed=4)
    x = torch.cat([x, _crowded(bits, 32)[0].repeat(1, 1536 // 576 + 1)[:, :1536]])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.quantized_linear_s8(x, w)
        torch.set_num_threads(2)
        two = cpu.quantized_linear_s8(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_batched_shapes_and_standing_aside():
    """x [..., k] -> [..., n]; None where the kernel does not apply (k off 32, fp64 x, the kernels off)."""
    x, w = _case(4, 32, 12, 40, 64)
    assert torch.equal(cpu.quantized_linear_s8(x.view(3, 4, 64), w), cpu.quantized_linear_s8(x, w).view(3, 4, 40))
    assert cpu.quantized_linear_s8(x.double(), w) is None
    with build.enabled(False):
        assert cpu.quantized_linear_s8(x, w) is None
    assert cpu.quantized_linear_s8(torch.randn(2, 48), quantize_matrix(torch.randn(8, 48), 8, 48)) is None
    assert build.library().gemm_q_s8_variant().decode() in ("avx512vnni", "avxvnni", "avx2", "portable")


FLAGS = {  # what to take away from -march=native for each variant, and the CPU flag it needs
    "avxvnni": ("-mno-avx512f", "avx_vnni"),
    "avx2": ("-mno-avx512f -mno-avxvnni", "avx2"),
    "avx2-bytes": ("-mno-avx512f -mno-avxvnni -DGQ_BYTE_REPACK", "avx2"),  # the repack a channel at a time
    "portable": ("-mno-avx512f -mno-avxvnni -mno-avx2", None),
}


@pytest.mark.skipif(build.compiler() is None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="the variants are x86's (-mno-avx512f...), built here")
@pytest.mark.parametrize("variant", list(FLAGS))
def test_each_variant_is_the_reference(variant, monkeypatch, tmp_path):
    """gemm_q_s8 built with fewer instructions than -march=native (a Zen 3's AVX2, a Zen 5's AVX-VNNI
    without 512-bit vectors here) is the reference too, on 1 and 2 threads alike."""
    flags, needs = FLAGS[variant]
    if needs is not None and needs not in build.cpu_fingerprint().split():
        pytest.skip(f"the CPU has no {needs}")
    cases = [_case(bits, G, M, n, k, seed=6) for bits, G, M, n, k in
             ((4, 32, 40, 70, 576), (8, 64, 17, 33, 1536), (4, 128, 1, 5, 128), (8, 32, 97, 130, 576),
              (4, 32, 9, 45, 576), (8, 32, 9, 45, 576))]
    cases += [_crowded(4, 64), _crowded(8, 32)]  # more than 8 candidates a row, a second largest of 0
    monkeypatch.setenv("MINIGEN_CPU_KERNEL_CFLAGS", flags)
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_lib", None)
    monkeypatch.setattr(build, "_reason", "not built yet")
    assert build.status().startswith("built"), build.status()
    assert build.library().gemm_q_s8_variant().decode() == variant.split("-")[0]  # the flags built the loop they name
    before = torch.get_num_threads()
    try:
        for x, w in cases:
            torch.set_num_threads(1)
            one = cpu.quantized_linear_s8(x, w)
            torch.set_num_threads(2)
            assert _close(one, reference_linear(x, w)) and torch.equal(cpu.quantized_linear_s8(x, w), one)
    finally:
        torch.set_num_threads(before)
