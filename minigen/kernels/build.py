"""Building minigen's C kernels (csrc/) once per machine, and the switch that turns them off.

A decode step at batch 1 is a chain of matrix-vector products: every weight is read once per
token and used for one multiply-add, so the step runs at the speed memory delivers the weights.
torch's fp32 matrix-vector path streams them at about half of this course's CPU read bandwidth
(10 to 16 of 25 to 31 GB/s); the row loops of `csrc/rows.c`, each thread reading its own rows in
one sequential stream, reach 80 to 90% of it (`csrc/kernels.h` says how, and which file holds what).

The kernel's .c files are compiled together, with the system's C compiler (`$CC`, else `cc`, `gcc`
or `clang`), into one library in `$MINIGEN_CACHE/kernels/` the first time it is needed (one to two
seconds), and called through ctypes on the tensors' memory. Each build is named by the contents of
its sources and headers, its compiler, flags and CPU; making a new one removes those not loaded for
UNUSED_DAYS. With torch's Linux wheels it links the same OpenMP runtime (libgomp) as torch, so
its threads are torch's threads: `torch.set_num_threads` governs both, and two thread pools never
compete for the cores. A compiler without OpenMP (Apple's clang) builds it single-threaded, with a
notice; `MINIGEN_CPU_KERNEL_OPENMP=0` forces that build.
`MINIGEN_CPU_KERNEL_CFLAGS` adds compiler flags: `-mno-avx512f` builds the 8-wide loops on a CPU
that has AVX-512, as a CPU without it runs them (the tests check both).

On a busy machine the kernel runs single-threaded while its threads keep arriving late (see the
comment at the top of csrc/parallel.c): waiting for a descheduled thread costs more than it saves.

Without a compiler, or with `MINIGEN_CPU_KERNEL=0`, `cpu.matvec` returns None and the model uses
`F.linear`: the same results up to rounding, slower. `status()` says which one runs and why.

Prompts (more rows than cpu.MAX_ROWS) with fp32 weights are not the C kernels' loops: `cpu.linear`
hands them to oneDNN's GEMM, which torch ships, in place of F.linear's MKL sgemm (faster on this
course's AMD CPU). With int8 / int4 weights they are (csrc/gemm_q.c): the codes become fp32 a panel
at a time in each thread's cache, which oneDNN cannot read.
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

from ..paths import cache_dir, digest_mismatch, digest_path, read_digest, write_digest

SOURCE = Path(__file__).parent / "csrc"  # the kernels' C: every .c file here, built into one library
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
OPENMP_FLAGS = ["-fopenmp"]
# GCC on AMD Zen prefers 128-bit vectors; ask for full 256-bit AVX2 registers.
X86_FLAGS = ["-mprefer-vector-width=256"]

_lib: ctypes.CDLL | None = None
_reason = "not built yet"
# Flags of the variant in use beside the native build's: fastpaths.py measures the AVX-512 loops against
# the same loops built with NO_AVX512 (the AVX2 ones), and where those win, this holds NO_AVX512.
_variant: list[str] = []
NO_AVX512 = ["-mno-avx512f"]
_enabled = os.environ.get("MINIGEN_CPU_KERNEL", "1") != "0"  # the switch: enabled(False), MINIGEN_CPU_KERNEL=0


def cpu_fingerprint() -> str:
    """What `-march=native` depends on: a library built for one CPU may crash on another."""
    model = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                model += line
    return model


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


UNUSED_DAYS = 30  # a build of the kernel not loaded for this long is removed when a new one is made


def _sources() -> list[Path]:
    """What a build is made of, sorted by name: SOURCE's .c files (compiled) and .h files (included)."""
    return sorted(p for p in SOURCE.iterdir() if p.suffix in (".c", ".h"))


def _prune(kernels: Path, keep: Path) -> None:
    """Remove builds of older sources, flags or CPUs that nothing loaded for UNUSED_DAYS (each load
    touches its file): without this, every edit of a source would leave one more library in the cache."""
    old = time.time() - UNUSED_DAYS * 86400
    for lib in kernels.glob("gemv-*.so"):
        with contextlib.suppress(OSError):  # another process pruning, or a file we may not remove
            if lib != keep and lib.stat().st_mtime < old:
                lib.unlink()
                digest_path(lib).unlink(missing_ok=True)


def _compile(cc: str, flags: list[str], lib_path: Path) -> str | None:
    """Compile every .c file in SOURCE into one library at lib_path (built beside it, then renamed) ->
    None, or the compiler's complaint. The files include their headers from their own folder."""
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: two processes building at once never see half a file
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        out = Path(tmp) / lib_path.name
        sources = [str(p) for p in _sources() if p.suffix == ".c"]
        done = subprocess.run([cc, *flags, *sources, "-o", str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            return done.stderr.strip()[-500:]
        os.replace(out, lib_path)
    write_digest(lib_path)  # after the library: checked before every dlopen (_load)
    _prune(lib_path.parent, lib_path)
    return None


def _load(lib_path: Path) -> ctypes.CDLL | None:
    """Load a built library and declare its functions -> the library, or None when the file is not
    the one built here. Its size and sha256 (45 to 60 KB: well under a millisecond) are checked
    against its digest BEFORE dlopen: the dynamic loader maps a cut file and crashes with SIGBUS
    when it touches the missing pages, which no `except` can catch. A file without a digest (built
    by an older minigen) is rebuilt too: two seconds, once. A foreign library that loads but lacks
    our functions (AttributeError) is refused as well."""
    record = read_digest(lib_path)
    if record is None or digest_mismatch(lib_path, record) is not None:
        return None
    try:
        lib = ctypes.CDLL(str(lib_path))
        _declare(lib)
    except (OSError, AttributeError):  # not a library, or another library than ours
        return None
    return lib


def _build(extra: list[str] | None = None) -> tuple[ctypes.CDLL, bool]:
    """Compile csrc/*.c into one library (once per content of the sources and headers, compiler, flags
    and CPU) and load it -> (library, whether it has OpenMP). Tries OpenMP first; a compiler that
    rejects it builds without. `extra`: flags after the others (default: the variant in use)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC, or install one: apt install gcc)")
    base = FLAGS + (X86_FLAGS if platform.machine() in ("x86_64", "AMD64") else [])
    base += os.environ.get("MINIGEN_CPU_KERNEL_CFLAGS", "").split()
    base += _variant if extra is None else extra
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    attempts = [(base + OPENMP_FLAGS, True), (base, False)]
    if os.environ.get("MINIGEN_CPU_KERNEL_OPENMP", "1") == "0":
        attempts = attempts[1:]
    sources = [f"{p.name}\0{p.read_text()}" for p in _sources()]  # a renamed file is another build too
    complaint = ""
    for flags, openmp in attempts:
        key = hashlib.sha256("\0".join([*sources, cc, version, *flags, cpu_fingerprint()])
                             .encode()).hexdigest()[:16]
        lib_path = cache_dir() / "kernels" / f"gemv-{key}.so"
        if not lib_path.exists():
            complaint = _compile(cc, flags, lib_path) or ""
            if complaint:
                continue
        lib = _load(lib_path)
        if lib is None:  # a truncated, corrupt or foreign file in the cache: build it again, once
            lib_path.unlink(missing_ok=True)
            complaint = _compile(cc, flags, lib_path) or ""
            if complaint:
                continue
            lib = _load(lib_path)
            if lib is None:
                raise RuntimeError(f"{lib_path} was rebuilt but does not load; remove {lib_path.parent} "
                                   "and try again")
        with contextlib.suppress(OSError):  # in use: _prune keeps it (a read-only cache still works)
            os.utime(lib_path)
        return lib, openmp
    raise RuntimeError(f"{cc} failed to build {SOURCE.name}/: {complaint}")


def _declare(lib: ctypes.CDLL) -> None:
    """Give every function of the library its C signature; AttributeError if one is missing."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.gemv_f32, lib.gemv_bf16):
        fn.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int]  # W, x, y, n, k, threads
    lib.gemv_f32.restype = None
    lib.gemv_bf16.restype = ctypes.c_int  # 0, or -1 without memory for its work buffer
    lib.gemm_f32.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]  # W, x, y, n, k, M, threads
    lib.gemm_f32.restype = None
    lib.gemv_q8.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]  # codes, scales, x, y, n, k, G, threads
    lib.gemv_q4.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]  # + mins
    lib.gemv_q8.restype = None
    lib.gemv_q4.restype = ctypes.c_int  # the same
    # int8 activations (csrc/rows_s8.c): the same arguments as gemv_q8 / gemv_q4 -> 0, or -1 without memory
    lib.gemv_q8_s8.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]  # codes, scales, x, y, n, k, G, threads
    lib.gemv_q4_s8.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]  # + mins
    lib.gemv_q8_s8.restype = lib.gemv_q4_s8.restype = ctypes.c_int
    lib.rows_s8_variant.restype = ctypes.c_char_p  # b"avx512vnni", b"avxvnni", b"avx2" or b"portable"
    lib.gemv_late_regions.restype = i64
    # layers, L, dims, tokens [B], B, x [B, D], pos (steps/fused.py); verify_layers: T for B, positions pos..
    for fn in (lib.decode_layers, lib.verify_layers):
        fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64]
        fn.restype = ctypes.c_int
    # decode_paged: layers, L, dims, tokens [B], B, x [B, D], positions [B], block tables [B, stride], stride,
    # block size (the serving engine's paged cache)
    lib.decode_paged.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, i64]
    lib.decode_paged.restype = ctypes.c_int
    # prefill_paged: layers, L, dims, tokens [M], M, x [M, D], positions [M], sequence of each row [M], block
    # tables, stride, block size, the rows whose logits are wanted [n_out], n_out
    lib.prefill_paged.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, ptr, i64]
    lib.prefill_paged.restype = ctypes.c_int
    lib.attend_decode.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_int]
    lib.attend_decode.restype = ctypes.c_int
    lib.rms_norm_rows.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]  # x, weight, out, M, D, eps
    lib.rms_norm_rows.restype = None
    lib.dequant_rows.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]  # codes, scales, mins, out, n, k, G
    lib.dequant_rows.restype = None
    lib.quantize_rows_s8.argtypes = [ptr, ptr, ptr, ptr, i64, i64]  # x, keep (0 in outlier columns), codes, scales, M, k
    lib.quantize_rows_s8.restype = None
    # codes, scales, mins, x, y, M, n, k, G, threads -> 0, or -1 without memory (csrc/gemm_q.c)
    lib.gemm_q.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.gemm_q.restype = ctypes.c_int
    # x (or NULL), keep, qx, a (outputs with x), blocked codes, code sums, b, y, M, n, k, threads -> 0,
    # or -1 without memory (csrc/gemm_s8.c)
    lib.gemm_s8.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.gemm_s8.restype = ctypes.c_int
    lib.gemm_s8_variant.restype = ctypes.c_char_p  # the loop this build runs: b"avx512vnni", b"avxvnni", ...
    # codes, scales, mins, bits, x, y, M, n, k, G, threads -> 0, or -1 without memory (csrc/gemm_q_s8.c)
    lib.gemm_q_s8.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.gemm_q_s8.restype = ctypes.c_int
    lib.gemm_q_s8_variant.restype = ctypes.c_char_p  # b"avx512vnni", b"avxvnni", b"avx2", b"portable"


def library() -> ctypes.CDLL | None:
    """The C kernels' library, built on first use; None where it cannot be built (status() says why)."""
    global _lib, _reason
    if _lib is None and _reason == "not built yet":
        if sys.platform == "win32":
            _reason = "not built: minigen builds its C kernel on Linux and macOS only"
        else:
            try:
                _lib, openmp = _build()
                _reason = f"built with {compiler()} from {SOURCE.name}/" + (f" ({' '.join(_variant)})" if _variant else "")
                if not openmp:
                    _reason += ", without OpenMP: single-threaded"
                    warnings.warn(f"minigen's C matrix-vector kernel was {_reason} "
                                  "(the compiler has no OpenMP, or MINIGEN_CPU_KERNEL_OPENMP=0); decoding "
                                  "is correct but slower on several cores.", RuntimeWarning, stacklevel=3)
            except (RuntimeError, OSError) as err:
                _reason = f"not built: {err}"
        if _lib is None:
            warnings.warn(f"minigen's C matrix-vector kernel is {_reason}; decoding falls back to "
                          "torch (same tokens, about 1.5x slower in fp32).", RuntimeWarning, stacklevel=3)
    return _lib


def has_avx512() -> bool:
    """Whether the native build runs the AVX-512 loops: an x86 CPU with avx512f, not turned off by
    MINIGEN_CPU_KERNEL_CFLAGS."""
    return (platform.machine() in ("x86_64", "AMD64") and " avx512f " in f" {cpu_fingerprint()} "
            and "-mno-avx512f" not in os.environ.get("MINIGEN_CPU_KERNEL_CFLAGS", ""))


def variant(flags: list[str]) -> ctypes.CDLL | None:
    """The kernels built with `flags` added (a second library beside the one in use, cached the same
    way), or None where it cannot be built."""
    try:
        return _build(flags)[0]
    except (RuntimeError, OSError):
        return None


def use_variant(flags: list[str]) -> None:
    """Run the kernels built with `flags` added from now on (fastpaths.py: the AVX2 loops where they beat
    the AVX-512 ones); the next call to library() loads that build."""
    global _lib, _reason, _variant
    if flags != _variant:
        _variant, _lib, _reason = list(flags), None, "not built yet"
        library()


def status() -> str:
    """One line for reports: whether decoding uses the C kernel, and why not if it does not."""
    if not _enabled:
        return "off (MINIGEN_CPU_KERNEL=0 or kernels.build.enabled(False)): torch's F.linear"
    library()
    return _reason


def available() -> bool:
    """Whether minigen's C kernels run here: switched on and built (status() says why not)."""
    return _enabled and library() is not None


def late_regions() -> int:
    """Parallel calls so far in which a thread arrived late, each followed by single-threaded calls
    (csrc/parallel.c): 0 on a quiet machine, many next to busy neighbours."""
    return int(_lib.gemv_late_regions()) if _lib is not None else 0


@contextlib.contextmanager
def enabled(on: bool):
    """`with build.enabled(False):` runs the block on torch's own ops, to compare the two."""
    global _enabled
    before, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = before


def is_enabled() -> bool:
    """Whether the C kernels are switched on (MINIGEN_CPU_KERNEL, `enabled`): built or not."""
    return _enabled


def loaded() -> ctypes.CDLL | None:
    """The library if an earlier call built it, without building it (a compiled graph's trace
    must not start a compiler)."""
    return _lib
