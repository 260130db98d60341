"""minigen's C kernels for a CPU decode step, as torch calls: matrix-vector products (fp32, bf16,
int8, int4 weights; one row or up to MAX_ROWS rows), RMSNorm and one-query attention.

Each function returns None where its kernel does not apply (the rules are `_takes`), and the
caller (dispatch.py) then runs the plain torch op. The matrix-vector products are also
registered as torch operators (`minigen::matvec`...), so that torch.compile keeps them in its
graph. The C source is csrc/; build.py compiles and loads it.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ..numerics.weight_quant import QuantizedWeight
from . import build

def _takes(*tensors: Tensor, built: bool = True) -> bool:
    """The rules for standing aside shared by the C calls below (matvec has its own, for compile):
    on only where the kernels are on (and, with `built`, the C kernel built), the tensors are on the
    CPU, autograd does not track them, and neither torch.compile nor a dispatch mode
    (FlopCounterMode) needs to see the op."""
    return (build.is_enabled() and all(t.device.type == "cpu" for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and (not built or build.library() is not None))


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # weights the kernel reads; activations are fp32


def _no_memory(nbytes: int) -> MemoryError:
    """What a C call that returned -1 raises: it found no memory for its work buffer."""
    return MemoryError(f"minigen's C kernel could not allocate its work buffer ({nbytes:,} bytes)")


def _gemv(x: Tensor, w: Tensor) -> Tensor:
    """The C call: w [n, k] (fp32 or bf16) @ x [k] (fp32) -> y [n] fp32."""
    n, k = w.shape
    x = x.reshape(k).contiguous()
    y = torch.empty(n, dtype=torch.float32)
    lib = build.loaded()
    if w.dtype == torch.float32:
        lib.gemv_f32(w.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, torch.get_num_threads())
    elif lib.gemv_bf16(w.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, torch.get_num_threads()) != 0:
        raise _no_memory(4 * k)  # x reordered for the bf16 rows
    return y


# The same call as a torch operator, so that torch.compile keeps it in its graph (chapter 11):
# inductor cannot see into C, so the operator says what it returns (`register_fake`) and calls
# the kernel as it is when the compiled step runs. Registered on the CPU dispatch key directly:
# a call costs ~7 us, half of what torch.library.custom_op's wrapper costs, 121 times a step.
_ops = torch.library.Library("minigen", "DEF")
_ops.define("matvec(Tensor x, Tensor w) -> Tensor")  # w [n, k] @ x [.., k], one row of x -> [n] fp32
_ops.impl("matvec", lambda x, w: _gemv(x, w), "CPU")  # looked up at each call (tests may wrap _gemv)


@torch.library.register_fake("minigen::matvec")
def _(x: Tensor, w: Tensor) -> Tensor:
    return torch.empty(w.shape[0], dtype=torch.float32, device=w.device)


def _gemv_q(x: Tensor, codes: Tensor, scales: Tensor, mins: Tensor | None, group_size: int) -> Tensor:
    """The C call for int8 codes [n, k] or int4 codes [n, k / 2] with fp16 scales (and minimums)."""
    n = codes.shape[0]
    k = codes.shape[1] * (2 if mins is not None else 1)
    x = x.reshape(k).contiguous()
    y = torch.empty(n, dtype=torch.float32)
    lib = build.loaded()
    if mins is None:
        lib.gemv_q8(codes.data_ptr(), scales.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, group_size,
                    torch.get_num_threads())
    elif lib.gemv_q4(codes.data_ptr(), scales.data_ptr(), mins.data_ptr(), x.data_ptr(), y.data_ptr(), n, k,
                     group_size, torch.get_num_threads()) != 0:
        raise _no_memory(4 * (k // group_size + k))  # the sums of x over the groups, and x reordered
    return y


_ops.define("matvec_q8(Tensor x, Tensor codes, Tensor scales, int group_size) -> Tensor")
_ops.define("matvec_q4(Tensor x, Tensor codes, Tensor scales, Tensor mins, int group_size) -> Tensor")
_ops.impl("matvec_q8", lambda x, codes, scales, G: _gemv_q(x, codes, scales, None, G), "CPU")
_ops.impl("matvec_q4", lambda x, codes, scales, mins, G: _gemv_q(x, codes, scales, mins, G), "CPU")


@torch.library.register_fake("minigen::matvec_q8")
def _(x: Tensor, codes: Tensor, scales: Tensor, group_size: int) -> Tensor:
    return torch.empty(codes.shape[0], dtype=torch.float32, device=codes.device)


@torch.library.register_fake("minigen::matvec_q4")
def _(x: Tensor, codes: Tensor, scales: Tensor, mins: Tensor, group_size: int) -> Tensor:
    return torch.empty(codes.shape[0], dtype=torch.float32, device=codes.device)


matvec_op = torch.ops.minigen.matvec


def matvec(x: Tensor, w: Tensor) -> Tensor | None:
    """w [n, k] @ x [k] -> [n] fp32, or None where the kernel does not apply.

    It applies to CPU tensors with fp32 activations and fp32 or bf16 weights (bf16 weights are
    widened to fp32 in registers: half the bytes read, fp32 sums). Under torch.compile it returns
    the `minigen::matvec` operator, which the compiled graph calls. It stands aside where torch
    must see the op: autograd and dispatch modes such as FlopCounterMode (a C call is invisible
    to them). The sums run in fp32 in another order than torch's: results agree to about 1e-6
    relative.
    """
    if isinstance(w, QuantizedWeight):  # int8 / int4 codes (chapter 10)
        return _matvec_quantized(x, w)
    if not (build.is_enabled() and w.device.type == "cpu" and x.dtype == torch.float32 and w.dtype in KERNEL_DTYPES
            and w.dim() == 2 and w.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return None
    if torch.compiler.is_compiling():  # the kernel was built by the eager steps before the trace
        return matvec_op(x, w) if build.loaded() is not None else None
    if torch._C._len_torch_dispatch_stack() != 0 or build.library() is None:
        return None
    return _gemv(x, w)


# Rows of x the kernel takes at once: a batch's decode step or a short prompt, where torch's fp32
# GEMM is far from the bandwidth roof. Past this, the product has enough arithmetic per weight read
# for torch's blocked GEMM to win.
MAX_ROWS = 16


def matmul_rows(x: Tensor, w: Tensor) -> Tensor | None:
    """x [M, k] @ w [n, k].T -> [M, n] fp32 for 2 <= M <= MAX_ROWS fp32 rows and fp32 weights, each
    row bit-identical to `matvec` of that row alone; None where the kernel does not apply (the
    same rules as `matvec`, and under torch.compile, which keeps torch's product)."""
    if not (2 <= x.shape[0] <= MAX_ROWS and x.dim() == 2 and x.dtype == torch.float32
            and w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous() and _takes(x, w)):
        return None
    (m, k), n = x.shape, w.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    build.loaded().gemm_f32(w.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, m, torch.get_num_threads())
    return y


# Many fp32 rows (a prompt): oneDNN's GEMM, torch's own, which torch.compile's CPU backend also uses
# for linear layers. F.linear reaches MKL's sgemm, which on this AMD CPU ran a 256-row prompt's
# products at 50-66 multiply-adds per ns where oneDNN ran them at 79-86 (SmolLM2's shapes, 2 threads).
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# oneDNN's bf16 GEMM needs AVX-512 (AVX512-BF16 or AVX512-core, emulated) or AMX: on an AVX2 CPU (the
# AMD EPYC Zen 3 of one session) it refuses the primitive, and the reference's F.linear runs instead.
_ONEDNN_BF16 = _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_fp32() -> bool:
    """Whether torch has oneDNN's fp32 linear here (`linear`)."""
    return _ONEDNN


def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 GEMMs here (`bf16_linear`): AVX-512 or AMX, not an AVX2 CPU."""
    return _ONEDNN_BF16


def linear(x: Tensor, w: Tensor) -> Tensor | None:
    """x [..., k] @ w [n, k].T in fp32 through oneDNN (torch.ops.mkldnn._linear_pointwise), or None
    where it does not apply: the kernels switched off, not fp32, not on the CPU, autograd tracking,
    under torch.compile or a dispatch mode (FlopCounterMode), or a torch built without oneDNN."""
    if not (_ONEDNN and x.dtype == torch.float32 and w.dtype == torch.float32 and w.dim() == 2
            and x.shape[-1] == w.shape[1] and _takes(x, w, built=False)):  # oneDNN needs no C build
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    except RuntimeError:  # a oneDNN that refuses the shape or the CPU: torch's F.linear
        return None


# Entries each of oneDNN's per-shape caches keeps in a long-running process (`minigen serve`). oneDNN's
# primitive cache and ideep's (the layer torch calls it through) each keep up to 1024 primitives by
# default, one per (rows, weight shape) that `linear` has met, and a server's prompts give it a new row
# count with nearly every batch: measured with SmolLM2-135M, 1.5-3 MiB of RSS per new row count, ~500 MiB
# once both caches are full (issue: minigen serve's RSS grew round after round in the soak). One forward
# meets 4-5 weight shapes at one row count, so 64 entries still hit for every layer after the first.
ONEDNN_CACHE_CAPACITY = 64


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's (LRU_CACHE_CAPACITY) at
    `capacity` entries, unless the environment sets them already. Each library reads its variable once,
    at its first primitive: call this before the process's first oneDNN call (serve() does, first thing)."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


def bf16_dot_products() -> bool | None:
    """Whether this CPU multiplies bf16 numbers natively (x86's avx512_bf16 or amx_bf16, ARM's bf16),
    read from /proc/cpuinfo; None where it cannot tell (not Linux). Without them oneDNN's bf16 GEMM
    converts to fp32 and runs slower than an fp32 one."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return None
    flags = {f for line in info.splitlines() if line.startswith(("flags", "Features")) for f in line.split()}
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


# Bytes of one fp32 tile of a matrix for bf16_linear (its weights or codes widened a tile at a
# time): inside the L3 of this course's CPUs (32 MB on the AMD EPYC, 105 MB on the Xeon), and few
# tiles per matrix (SmolLM2: 5 a layer), because each tile is one more pair of parallel regions,
# and next to a busy process every region waits for a time slice (chapter 11). Measured on the
# Xeon: 1 MB tiles (in a core's L2) ran 512-row products about 10% faster on a quiet machine; a
# 512-token prompt through 1 MB tiles took 13.6 s next to a busy process, where transformers took
# 3.6 s.
TILE_BYTES = 4 * 1024 * 1024


def quantized_linear(x: Tensor, w: QuantizedWeight) -> Tensor | None:
    """x [..., k] @ w.T for int8 / int4 weights and several fp32 rows (a prompt, a batch) -> [..., n]
    fp32, in one C call (csrc/gemm_q.c): each thread widens a panel of rows of codes into its cache
    (the bits of w.dequantize()) and multiplies every row of x by it there, in a register-blocked
    loop. No fp32 copy of the matrix, or of a tile of it, is written to memory. fp32 sums in another
    order than oneDNN's: ~1e-6 relative. None where it does not apply (the rules of `_takes`, and
    the C kernel built)."""
    if not (x.dtype == torch.float32 and x.shape[-1] == w.shape[1] and w.dtype == torch.float32
            and _takes(x, w.codes)):
        return None
    n, k = w.shape
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty(x2.shape[0], n)
    mins = None if w.mins is None else w.mins.data_ptr()
    if build.loaded().gemm_q(w.codes.data_ptr(), w.scales.data_ptr(), mins, x2.data_ptr(), y.data_ptr(),
                             x2.shape[0], n, k, w.group_size, torch.get_num_threads()) != 0:
        # x packed in blocks of 32 rows; a thread's panel of 12 rows and its blocks' sums
        raise _no_memory(4 * (k * (x2.shape[0] + 31) + torch.get_num_threads() * (12 * k + 12 * (x2.shape[0] + 31))))
    return y.view(*x.shape[:-1], n)


def quantized_linear_s8(x: Tensor, w: QuantizedWeight) -> Tensor | None:
    """x [..., k] @ w.T for int8 / int4 weights and several fp32 rows, the activations quantized to int8
    per block of 32 (numerics/int8_act.py: `reference_linear`'s result) -> [..., n] fp32, in one C call
    (csrc/gemm_q_s8.c): integer dot products (vpdpbusd) of the codes with x's codes, a panel of codes
    repacked at a time in each thread's cache. None where it does not apply (the rules of
    `quantized_linear`, and k and the group size multiples of 32)."""
    n, k = w.shape
    G = w.group_size
    if not (x.dtype == torch.float32 and x.shape[-1] == k and w.dtype == torch.float32 and w.bits in (4, 8)
            and k % 32 == 0 and G % 32 == 0 and k % G == 0 and _takes(x, w.codes)):
        return None
    x2 = x.reshape(-1, k).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, n)
    mins = None if w.mins is None else w.mins.data_ptr()
    threads = torch.get_num_threads()
    if build.loaded().gemm_q_s8(w.codes.data_ptr(), w.scales.data_ptr(), mins, w.bits, x2.data_ptr(), y.data_ptr(),
                                M, n, k, G, threads) != 0:
        # x's codes, scales and sums (~k + 12 k / 32 bytes a row, 388 more for its residual blocks), a panel
        # of 32 channels a thread
        raise _no_memory(M * (k + 12 * k // 32 + 388) + threads * 32 * (k + 8 * k // G))
    return y.view(*x.shape[:-1], n)


def bf16_linear(x: Tensor, w: Tensor | QuantizedWeight, kept: Tensor | None = None) -> Tensor | None:
    """x [..., k] @ w.T with both rounded to bf16 and fp32 sums, through oneDNN (which runs bf16 dot
    products: AVX512-BF16's vdpbf16ps, or AMX tiles) -> [..., n] fp32, rounded to bf16 by the GEMM:
    a prompt's products under prefill_precision="bfloat16" (chapter 3). w is fp32 or bf16, or int8 /
    int4 codes. `kept`: w's bf16 copy, which the model's first bf16 prompt made (numerics/bf16_copies.py),
    read instead of converting w; without one, w is rounded to bf16 whole (fp32) or a tile of rows at
    a time (codes), with the same bits. None where it does not apply (the rules of `linear`; codes
    without a copy need the C kernel built)."""
    quantized = isinstance(w, QuantizedWeight)
    if not (_ONEDNN_BF16 and x.dtype == torch.float32 and x.shape[-1] == w.shape[1]
            and w.dtype in (torch.float32, torch.bfloat16) and (quantized or w.dim() == 2)
            and _takes(x, w.codes if quantized else w, built=quantized and kept is None)):
        return None
    if quantized and kept is None:
        return _tiled(x, w, torch.bfloat16)
    # a dense matrix: its copy, or rounded to bf16 in one pass (2 bytes a weight, freed after the product)
    wb = kept if kept is not None else w.bfloat16()
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).bfloat16(), wb, None, "none", [], "")
    return y.float().view(*x.shape[:-1], w.shape[0])


def int8_dot_products() -> bool | None:
    """Whether this x86 CPU multiplies int8 numbers into int32 sums natively (AVX512-VNNI, AVX-VNNI or
    AMX-INT8), read from /proc/cpuinfo; None where it cannot tell (not Linux). Without them oneDNN's
    int8 GEMM widens the codes with several instructions per product and gains nothing over fp32."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return None
    flags = {f for line in info.splitlines() if line.startswith("flags") for f in line.split()}
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


def _tiled(x: Tensor, w: Tensor | QuantizedWeight, dtype: torch.dtype) -> Tensor:
    """x [..., k] @ w.T, the rows of w turned into `dtype` a tile of TILE_BYTES at a time (codes through
    dequant_rows), x in `dtype`, each tile through oneDNN's GEMM while it is in cache -> [..., n] fp32."""
    n, k = w.shape
    x2 = x.reshape(-1, k).to(dtype).contiguous()
    rows = max(8, TILE_BYTES // (4 * k) // 8 * 8)
    codes = w if isinstance(w, QuantizedWeight) else None
    wide = torch.empty(min(rows, n), k) if codes is not None else None  # the codes as fp32
    tile = wide if dtype == torch.float32 else torch.empty(min(rows, n), k, dtype=dtype)
    y = torch.empty(x2.shape[0], n)
    lib, threads = build.loaded(), torch.get_num_threads()
    for r in range(0, n, rows):
        m = min(rows, n - r)
        if codes is not None:
            lib.dequant_rows(codes.codes[r].data_ptr(), codes.scales[r].data_ptr(),
                             None if codes.mins is None else codes.mins[r].data_ptr(), wide.data_ptr(), m, k,
                             codes.group_size, threads)
            if tile is not wide:
                tile[:m].copy_(wide[:m])
        else:
            tile[:m].copy_(w[r:r + m])
        y[:, r:r + m] = torch.ops.mkldnn._linear_pointwise(x2, tile[:m], None, "none", [], "")
    return y.view(*x.shape[:-1], n)


def _matvec_quantized(x: Tensor, w: QuantizedWeight) -> Tensor | None:
    """matvec for a QuantizedWeight: the codes meet x in registers (gemv_q8 / gemv_q4)."""
    if not (build.is_enabled() and w.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad):
        return None
    mins = w.mins
    if torch.compiler.is_compiling():
        if build.loaded() is None:
            return None
        if mins is None:
            return torch.ops.minigen.matvec_q8(x, w.codes, w.scales, w.group_size)
        return torch.ops.minigen.matvec_q4(x, w.codes, w.scales, mins, w.group_size)
    if torch._C._len_torch_dispatch_stack() != 0 or build.library() is None:
        return None
    return _gemv_q(x, w.codes, w.scales, mins, w.group_size)


def matvec_s8(x: Tensor, w: QuantizedWeight) -> Tensor | None:
    """w [n, k] (int8 or int4 codes) @ x [k] with x quantized to int8 in blocks of 32 (numerics/int8_act.py)
    -> [n] fp32, through csrc/rows_s8.c's integer dot products (gemv_q8_s8 / gemv_q4_s8): the codes of
    int8_act.quantize_activations bit for bit, fp32 sums of the scaled blocks in another order than
    int8_act.reference_linear's (~1e-6 relative). x is one row: [k], [1, k] or [1, 1, k]. None where it
    does not apply: `_takes`' rules (no torch.compile operator: a compiled graph keeps fp32 activations),
    fp32 x, k and the group size multiples of 32."""
    n, k = w.shape
    G = w.group_size
    if not (x.dtype == torch.float32 and x.numel() == k and x.shape[-1] == k and k % 32 == 0 and G % 32 == 0
            and k % G == 0 and _takes(x, w.codes)):
        return None
    x = x.reshape(k).contiguous()
    y = torch.empty(n, dtype=torch.float32)
    lib, threads = build.loaded(), torch.get_num_threads()
    if w.mins is None:
        failed = lib.gemv_q8_s8(w.codes.data_ptr(), w.scales.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, G, threads)
    else:
        failed = lib.gemv_q4_s8(w.codes.data_ptr(), w.scales.data_ptr(), w.mins.data_ptr(), x.data_ptr(), y.data_ptr(),
                                n, k, G, threads)
    if failed:
        raise _no_memory(k + 4 * (k // 32 + k // G) + 44 * min(8, k // 32))  # x's codes, block scales, group sums, residuals
    return y


def rows_s8_variant() -> str | None:
    """The loop csrc/rows_s8.c was built with ("avx512vnni", "avxvnni", "avx2", "portable"), or None
    where the C kernels are not built."""
    lib = build.library() if build.is_enabled() else None
    return None if lib is None else lib.rows_s8_variant().decode()


def attend_decode(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor | None:
    """softmax(q k^T / sqrt(Dh) + mask) v for one query per row (a decode step) -> [B, H, 1, Dh], or
    None where the C loop does not apply (then attention.attend uses torch's SDPA).

    q [B, H, 1, Dh], k and v [B, Hkv, S, Dh] (a cache's own tensors: contiguous), mask additive (0 or
    -inf) [1, S] for every row or [B, 1, 1, S], all fp32 on the CPU; grouped-query heads as SDPA's
    enable_gqa pairs them. Every (row, head) is summed alone in a fixed order, so a row of a batch
    gets the bits it gets alone; every cache layout reaches the same loop, so the exact features
    (blocks, an offload tier) keep their bits too. The same rules for standing aside as `matvec`,
    and under torch.compile it stands aside (the compiled graph keeps SDPA).
    """
    B, H, T, Dh = q.shape
    S = k.shape[2] if k.dim() == 4 else -1
    if not (T == 1 and k.dim() == 4 and k.shape == v.shape and k.shape[0] == B and k.shape[3] == Dh
            and H % k.shape[1] == 0 and mask.shape in ((1, S), (B, 1, 1, S))
            and all(t.dtype == torch.float32 for t in (q, k, v, mask)) and _takes(q, k, v, mask)):
        return None
    stride = 0 if mask.shape == (1, S) else S  # one mask for every row, or one per row
    q, k, v, mask = q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous()  # a cache's own: no copy
    out = torch.empty(B, H, 1, Dh, dtype=torch.float32)
    if build.loaded().attend_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), stride, out.data_ptr(),
                          B, H, k.shape[1], S, Dh, torch.get_num_threads()) != 0:
        return None  # no memory for the scores: torch's path
    return out


# Rows RMSNorm takes in C: a decode step's few rows, where torch's seven small operations cost more
# than the arithmetic (61 µs a norm at batch 8 here); a prompt's many rows stay with torch.
MAX_NORM_ROWS = 64


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """x / sqrt(mean(x^2) + eps) * weight over x's last dim, fp32, for up to MAX_NORM_ROWS rows on the
    CPU; None where the C loop does not apply (the same rules as `matvec`)."""
    D = x.shape[-1]
    if not (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.numel() <= MAX_NORM_ROWS * D
            and weight.shape == (D,) and weight.is_contiguous() and _takes(x, weight)):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    build.loaded().rms_norm_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // D, D, eps)
    return out
