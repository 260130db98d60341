"""A C matrix-vector kernel for batch-1 decoding on the CPU, built once per machine.

A decode step at batch 1 is a chain of matrix-vector products: every weight is read once per
token and used for one multiply-add, so the step runs at the speed memory delivers the weights.
torch's fp32 matrix-vector path streams them at about half of this course's CPU read bandwidth
(10 to 16 of 25 to 31 GB/s); `csrc/gemv.c`, a 60-line loop, streams them at 80 to 90% of it.

The kernel is compiled with the system's C compiler (`$CC`, else `cc`, `gcc` or `clang`) into
`$MINIGEN_CACHE/kernels/` the first time it is needed (well under a second), and called through
ctypes on the tensors' memory. Each build is named by its source, compiler, flags and CPU; making
a new one removes those not loaded for UNUSED_DAYS. With torch's Linux wheels it links the same OpenMP runtime
(libgomp) as torch, so its threads are torch's threads: `torch.set_num_threads` governs both,
and two thread pools never compete for the cores. A compiler without OpenMP (Apple's clang)
builds it single-threaded, with a notice; `MINIGEN_CPU_KERNEL_OPENMP=0` forces that build.
`MINIGEN_CPU_KERNEL_CFLAGS` adds compiler flags: `-mno-avx512f` builds the 8-wide loops on a CPU
that has AVX-512, as a CPU without it runs them (the tests check both).

On a busy machine the kernel runs single-threaded while its threads keep arriving late (see the
comment at the top of gemv.c): waiting for a descheduled thread costs more than it saves.

Without a compiler, or with `MINIGEN_CPU_KERNEL=0`, `matvec` returns None and the model uses
`F.linear`: the same results up to rounding, slower. `status()` says which one runs and why.

Prompts (more rows than MAX_ROWS) are not this file's loops: `linear` hands them to oneDNN's GEMM,
which torch ships, in place of F.linear's MKL sgemm (faster on this course's AMD CPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

from ..paths import cache_dir
from ..numerics.weight_quant import QuantizedWeight

SOURCE = Path(__file__).parent / "csrc" / "gemv.c"
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
OPENMP_FLAGS = ["-fopenmp"]
# GCC on AMD Zen prefers 128-bit vectors; ask for full 256-bit AVX2 registers.
X86_FLAGS = ["-mprefer-vector-width=256"]

_lib: ctypes.CDLL | None = None
_reason = "not built yet"
_enabled = os.environ.get("MINIGEN_CPU_KERNEL", "1") != "0"


def _cpu_fingerprint() -> str:
    """What `-march=native` depends on: a library built for one CPU may crash on another."""
    model = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                model += line
    return model


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


UNUSED_DAYS = 30  # a build of the kernel not loaded for this long is removed when a new one is made


def _prune(kernels: Path, keep: Path) -> None:
    """Remove builds of older sources, flags or CPUs that nothing loaded for UNUSED_DAYS (each load
    touches its file): without this, every edit of gemv.c left one more library in the cache."""
    old = time.time() - UNUSED_DAYS * 86400
    for lib in kernels.glob("gemv-*.so"):
        with contextlib.suppress(OSError):  # another process pruning, or a file we may not remove
            if lib != keep and lib.stat().st_mtime < old:
                lib.unlink()


def _compile(cc: str, flags: list[str], lib_path: Path) -> str | None:
    """Compile SOURCE into lib_path (beside it, then renamed) -> None, or the compiler's complaint."""
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: two processes building at once never see half a file
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        out = Path(tmp) / lib_path.name
        done = subprocess.run([cc, *flags, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            return done.stderr.strip()[-500:]
        os.replace(out, lib_path)
    _prune(lib_path.parent, lib_path)
    return None


def _build() -> tuple[ctypes.CDLL, bool]:
    """Compile csrc/gemv.c (once per source, compiler, flags and CPU) and load it -> (library,
    whether it has OpenMP). Tries OpenMP first; a compiler that rejects it builds without."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC, or install one: apt install gcc)")
    base = FLAGS + (X86_FLAGS if platform.machine() in ("x86_64", "AMD64") else [])
    base += os.environ.get("MINIGEN_CPU_KERNEL_CFLAGS", "").split()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    attempts = [(base + OPENMP_FLAGS, True), (base, False)]
    if os.environ.get("MINIGEN_CPU_KERNEL_OPENMP", "1") == "0":
        attempts = attempts[1:]
    complaint = ""
    for flags, openmp in attempts:
        key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, *flags, _cpu_fingerprint()])
                             .encode()).hexdigest()[:16]
        lib_path = cache_dir() / "kernels" / f"gemv-{key}.so"
        if not lib_path.exists():
            complaint = _compile(cc, flags, lib_path) or ""
            if complaint:
                continue
        try:
            lib = ctypes.CDLL(str(lib_path))
        except OSError:  # a truncated or foreign file in the cache: build it again, once
            lib_path.unlink(missing_ok=True)
            complaint = _compile(cc, flags, lib_path) or ""
            if complaint:
                continue
            lib = ctypes.CDLL(str(lib_path))
        with contextlib.suppress(OSError):  # in use: _prune keeps it (a read-only cache still works)
            os.utime(lib_path)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        for fn in (lib.gemv_f32, lib.gemv_bf16):
            fn.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int]  # W, x, y, n, k, threads
            fn.restype = None
        lib.gemm_f32.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]  # W, x, y, n, k, M, threads
        lib.gemm_f32.restype = None
        lib.gemv_q8.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]  # codes, scales, x, y, n, k, G, threads
        lib.gemv_q4.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]  # + mins
        lib.gemv_q8.restype = lib.gemv_q4.restype = None
        lib.gemv_late_regions.restype = i64
        lib.decode_layers.argtypes = [ptr, i64, ptr, i64, ptr, i64]  # layers, L, dims, token, x, pos (fused.py)
        lib.decode_layers.restype = ctypes.c_int
        lib.attend_decode.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_int]
        lib.attend_decode.restype = ctypes.c_int
        lib.rms_norm_rows.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]  # x, weight, out, M, D, eps
        lib.rms_norm_rows.restype = None
        return lib, openmp
    raise RuntimeError(f"{cc} failed to build {SOURCE.name}: {complaint}")


def _load() -> ctypes.CDLL | None:
    global _lib, _reason
    if _lib is None and _reason == "not built yet":
        if sys.platform == "win32":
            _reason = "not built: minigen builds its C kernel on Linux and macOS only"
        else:
            try:
                _lib, openmp = _build()
                _reason = f"built with {_compiler()} from {SOURCE.name}"
                if not openmp:
                    _reason += ", without OpenMP: single-threaded"
                    warnings.warn(f"minigen's C matrix-vector kernel was {_reason.removeprefix('built ')} "
                                  "(the compiler has no OpenMP, or MINIGEN_CPU_KERNEL_OPENMP=0); decoding "
                                  "is correct but slower on several cores.", RuntimeWarning, stacklevel=3)
            except (RuntimeError, OSError) as err:
                _reason = f"not built: {err}"
        if _lib is None:
            warnings.warn(f"minigen's C matrix-vector kernel is {_reason}; decoding falls back to "
                          "torch (same tokens, about 1.5x slower in fp32).", RuntimeWarning, stacklevel=3)
    return _lib


def status() -> str:
    """One line for reports: whether decoding uses the C kernel, and why not if it does not."""
    if not _enabled:
        return "off (MINIGEN_CPU_KERNEL=0 or cpu_kernel.enabled(False)): torch's F.linear"
    _load()
    return _reason


def available() -> bool:
    """Whether minigen's C kernels run here: switched on and built (status() says why not)."""
    return _enabled and _load() is not None


def _takes(*tensors: Tensor, built: bool = True) -> bool:
    """The rules for standing aside shared by the C calls below (matvec has its own, for compile):
    on only where the kernels are on (and, with `built`, the C kernel built), the tensors are on the
    CPU, autograd does not track them, and neither torch.compile nor a dispatch mode
    (FlopCounterMode) needs to see the op."""
    return (_enabled and all(t.device.type == "cpu" for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and (not built or _load() is not None))


def late_regions() -> int:
    """Parallel calls so far in which a thread arrived late, each followed by single-threaded calls
    (gemv.c): 0 on a quiet machine, many next to busy neighbours."""
    return int(_lib.gemv_late_regions()) if _lib is not None else 0


@contextlib.contextmanager
def enabled(on: bool):
    """`with cpu_kernel.enabled(False):` runs the block on torch's F.linear, to compare the two."""
    global _enabled
    before, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = before


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # weights the kernel reads; activations are fp32


def _gemv(x: Tensor, w: Tensor) -> Tensor:
    """The C call: w [n, k] (fp32 or bf16) @ x [k] (fp32) -> y [n] fp32."""
    n, k = w.shape
    x = x.reshape(k).contiguous()
    y = torch.empty(n, dtype=torch.float32)
    fn = _lib.gemv_f32 if w.dtype == torch.float32 else _lib.gemv_bf16
    fn(w.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, torch.get_num_threads())
    return y


# The same call as a torch operator, so that torch.compile keeps it in its graph (chapter 8):
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
    if mins is None:
        _lib.gemv_q8(codes.data_ptr(), scales.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, group_size,
                     torch.get_num_threads())
    else:
        _lib.gemv_q4(codes.data_ptr(), scales.data_ptr(), mins.data_ptr(), x.data_ptr(), y.data_ptr(), n, k,
                     group_size, torch.get_num_threads())
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
    if isinstance(w, QuantizedWeight):  # int8 / int4 codes (chapter 14)
        return _matvec_quantized(x, w)
    if not (_enabled and w.device.type == "cpu" and x.dtype == torch.float32 and w.dtype in KERNEL_DTYPES
            and w.dim() == 2 and w.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return None
    if torch.compiler.is_compiling():  # the kernel was built by the eager steps before the trace
        return matvec_op(x, w) if _lib is not None else None
    if torch._C._len_torch_dispatch_stack() != 0 or _load() is None:
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
    _lib.gemm_f32(w.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, m, torch.get_num_threads())
    return y


# Many fp32 rows (a prompt): oneDNN's GEMM, torch's own, which torch.compile's CPU backend also uses
# for linear layers. F.linear reaches MKL's sgemm, which on this AMD CPU ran a 256-row prompt's
# products at 50-66 multiply-adds per ns where oneDNN ran them at 79-86 (SmolLM2's shapes, 2 threads).
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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


def _matvec_quantized(x: Tensor, w: QuantizedWeight) -> Tensor | None:
    """matvec for a QuantizedWeight: the codes meet x in registers (gemv_q8 / gemv_q4)."""
    if not (_enabled and w.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad):
        return None
    mins = w.mins
    if torch.compiler.is_compiling():
        if _lib is None:
            return None
        if mins is None:
            return torch.ops.minigen.matvec_q8(x, w.codes, w.scales, w.group_size)
        return torch.ops.minigen.matvec_q4(x, w.codes, w.scales, mins, w.group_size)
    if torch._C._len_torch_dispatch_stack() != 0 or _load() is None:
        return None
    return _gemv_q(x, w.codes, w.scales, mins, w.group_size)


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
    if _lib.attend_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), stride, out.data_ptr(),
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
    _lib.rms_norm_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // D, D, eps)
    return out
