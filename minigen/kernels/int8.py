"""A prompt's int8 products (prefill_precision="int8", chapter 3), three ways to run one GEMM.

Shapes: T rows (a prompt's tokens, over every batch row), n outputs, k inputs (a weight is [n, k]),
m outlier columns of k.

numerics/w8a8.py holds the scheme and its plain-torch oracle, `reference_linear`:

    y[t, j] = a[t] b[j] sum_{k not outlier} qx[t, k] qw[j, k]  +  sum_{k outlier} x[t, k] w[j, k]

Every backend makes the same codes qx of x (quantize_rows_s8's row function in C, else
w8a8.quantize_rows: the same bits) and adds the same fp32 product of the outlier columns; they
differ in who sums the codes:
  "c"       csrc/gemm_s8.c: our vpdpbusd GEMM (AVX512-VNNI, AVX-VNNI, or exact emulations where the
            CPU has neither), on the weight's codes blocked once (w8a8.Int8Weight.blocked);
  "onednn"  oneDNN's int8 linear (torch.ops.onednn.qlinear_pointwise): fast on this course's Xeon, but
            a reference loop on an AMD Zen 5 (10 s for 512 x 576 x 1,536, fp32 took 12 ms), and
            wrong on an x86 CPU without int8 dot products: on an AMD EPYC Zen 1 (family 23 model 1,
            AVX2 only) 0.3% to 2.5% of tests/test_int8_products.py's outputs were off by up to 57
            where the reference holds within 1e-5 (a few outputs far off, as int16 sums of pairs of
            products that saturate would give: not confirmed in oneDNN's source; csrc/gemm_s8.c's own
            AVX2 loop sums exactly), so it is not `available` there;
  "int_mm"  torch._int_mm, int8 x int8 -> int32 (22 ms there: slower than fp32).
All three sums are exact int32 where they are available, so the results are the reference's up to the fp32 rounding of its
sums (bit for bit where those are exact too), and rows never influence each other: a row's scale
is its own, and no backend sums across rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..numerics import w8a8
from ..numerics.w8a8 import Int8Weight
from . import build, cpu

BACKENDS = ("c", "onednn", "int_mm")
# gemm_s8's int32 sums hold k products of (q + 128) in [1, 255] and codes in [-127, 127] without
# overflow up to 2^31 / (255 * 127) = 66,311 columns; a longer row is not its call
MAX_K = 65536


def available(backend: str) -> bool:
    """Whether `backend` runs here: "c" the C kernels switched on and built, "onednn" torch's oneDNN
    int8 linear on a CPU with int8 dot products (or one that cannot tell), "int_mm" torch._int_mm."""
    if backend == "c":
        return build.is_enabled() and build.library() is not None
    if backend == "onednn":  # not where the CPU says it has no int8 dot products (the module docstring)
        return w8a8.onednn_int8() and cpu.int8_dot_products() is not False
    if backend == "int_mm":
        return hasattr(torch, "_int_mm")
    raise ValueError(f"backend={backend!r}: not one of {BACKENDS}")


def variant() -> str | None:
    """The loop the built C library's gemm_s8 runs ("avx512vnni", "avxvnni", "avx2", "portable"), or None
    without the library."""
    lib = build.library() if build.is_enabled() else None
    return lib.gemm_s8_variant().decode() if lib is not None else None


def takes(*tensors: Tensor) -> bool:
    """The rules for standing aside (kernels/cpu.py's, for these calls): the kernels switched on, the
    tensors on the CPU, autograd not tracking them, and neither torch.compile nor a dispatch mode
    (FlopCounterMode) needing to see the op."""
    return (build.is_enabled() and all(t.device.type == "cpu" for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0)


def quantize(x2: Tensor, w8: Int8Weight) -> tuple[Tensor, Tensor]:
    """x2 [T, k] fp32 -> (qx [T, k] int8, a [T, 1] fp32), the outlier columns zeroed: one C call
    (quantize_rows_s8) where the kernels are built, else w8a8.quantize_rows (the same bits)."""
    lib = build.library() if build.is_enabled() else None
    if lib is None:
        return w8a8.quantize_rows(x2, w8.keep)
    q, a = torch.empty(x2.shape, dtype=torch.int8), torch.empty(x2.shape[0], 1)
    keep = w8.keep
    lib.quantize_rows_s8(x2.data_ptr(), None if keep is None else keep.data_ptr(), q.data_ptr(), a.data_ptr(),
                         x2.shape[0], x2.shape[1])
    return q, a


def int8_linear(x: Tensor, w8: Int8Weight, backend: str = "c") -> Tensor | None:
    """x [..., k] @ w.T under prefill_precision="int8" -> [..., n] fp32 through `backend` (one of
    BACKENDS): the rows as int8 codes with a scale each, the codes' exact int32 sums times both
    scales, plus the outlier columns' fp32 product. None where the backend does not apply: not
    available, not fp32 on the CPU, or a caller that must see the op (`takes`)."""
    n, k = w8.shape
    if not (x.dtype == torch.float32 and x.shape[-1] == k and takes(x) and available(backend)):
        return None
    if backend == "c" and k > MAX_K:
        return None
    x2 = x.reshape(-1, k).contiguous()
    if backend == "c":
        y = _gemm_s8(x2, w8)
    else:
        q, a = quantize(x2, w8)
        y = (_onednn if backend == "onednn" else _int_mm)(q, a, w8)
    if y is None:
        return None
    if len(w8.outliers):  # [T, m] @ [m, n]: m = 32 columns of fp32
        y.addmm_(x2[:, w8.outliers], w8.outlier_weights.t())
    return y.view(*x.shape[:-1], n)


def _onednn(q: Tensor, a: Tensor, w8: Int8Weight) -> Tensor | None:
    """oneDNN's int8 GEMM (int32 sums, times the weights' scale per output channel), times each row's."""
    # oneDNN's operand, the codes in its own layout (qlinear_prepack), made once per weight the first
    # time oneDNN runs it and kept in the weight's int8 copy: another backend's weight keeps none
    packed = w8.layouts.get("onednn")
    if packed is None:
        packed = w8.layouts["onednn"] = torch.ops.onednn.qlinear_prepack(w8.codes(), None)
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, packed, w8.scales, w8.zero_points, None, 1.0, 0,
                                              torch.float32, "none", [], "").mul_(a)


def _gemm_s8(x2: Tensor, w8: Int8Weight) -> Tensor:
    """csrc/gemm_s8.c: x2 [T, k] fp32, its rows quantized inside the kernel's parallel region (the codes
    and scales of quantize_rows_s8) -> [T, n] fp32 (sum * a * b)."""
    (T, k), n = x2.shape, w8.shape[0]
    q, a, y = torch.empty(T, k, dtype=torch.int8), torch.empty(T), torch.empty(T, n)
    keep = w8.keep
    if build.loaded().gemm_s8(x2.data_ptr(), None if keep is None else keep.data_ptr(), q.data_ptr(), a.data_ptr(),
                              w8.blocked.data_ptr(), w8.code_sums.data_ptr(), w8.scales.data_ptr(), y.data_ptr(),
                              T, n, k, torch.get_num_threads()) != 0:
        raise MemoryError(f"minigen's C kernel could not allocate x packed ({(T + 11) * (k + 3) // 4 * 4:,} bytes)")
    return y


def _int_mm(q: Tensor, a: Tensor, w8: Int8Weight) -> Tensor:
    """torch._int_mm on the codes: q [T, k] int8, a [T, 1] -> [T, n] fp32 (sum * a * b)."""
    (T, k), n = q.shape, w8.shape[0]
    k8, n8, T17 = -(-k // 8) * 8, -(-n // 8) * 8, max(T, 17)
    # _int_mm's operand, the codes transposed [k8, n8], made once per weight and kept in its int8 copy
    # (a weight that int_mm never runs has none); k and n rounded up to 8 with zeros, the shapes
    # _int_mm's kernels ask for on some builds (and rows to 17 or more: both padded per call)
    codes_t = w8.layouts.get("int_mm")
    if codes_t is None:
        codes_t = torch.zeros(k8, n8, dtype=torch.int8)
        codes_t[:k, :n] = w8.codes().t()
        w8.layouts["int_mm"] = codes_t
    if (T17, k8) != (T, k):
        q = torch.nn.functional.pad(q, (0, k8 - k, 0, T17 - T))  # zero codes: nothing added to a sum
    sums = torch._int_mm(q, codes_t)[:T, :n]  # [T, n] int32
    return sums.float().mul_(a).mul_(w8.scales)  # the reference's order: sum * a, then * b
