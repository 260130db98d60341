"""Fast paths measured where they run: a kernel is chosen by its speed on this machine, not by CPU flags.

A CPU flag says an instruction exists; it does not say that the library behind a kernel uses it
here. On an AMD Zen 5 (avx512_vnni in its flags) oneDNN's int8 linear ran a [512, 576] x [576, 1536]
product in 10 s where fp32 took 12 ms: a reference path, about 850 times slower. So every fast path
whose speed depends on the machine is timed once against its plain reference, at the model's own
shapes, and one that loses stands aside:

    path            the fast path                                 its reference
    c_matvec        one fp32 row: C's matrix-vector loop          F.linear
    c_matvec_bf16   one row, bf16 weights, C                      F.linear over the weights in fp32
    c_matvec_q4/q8  one row, int4 / int8 codes, C                 dequantize + F.linear
    c_rows          8 fp32 rows, C's several-row loop             F.linear
    avx512_rows     one row, the AVX-512 build of the C loops     the same loops built without AVX-512
    onednn_fp32     a prompt's fp32 rows, oneDNN's GEMM           F.linear (MKL)
    gemm_q          a prompt's rows, int4 codes, C panels         dequantize + F.linear
    c_attention     one query over 512 cached keys, C             SDPA
    c_rms_norm      one row's RMSNorm, C                          F.rms_norm
    bf16_prompt     a prompt's rows in bf16, oneDNN               the fp32 product (F.linear)
    bf16_attention  a prompt's attention in bf16, SDPA            SDPA in fp32
    int8_c, int8_onednn, int8_int_mm
                    a prompt's rows as int8 codes (kernels/int8)  the fp32 product (F.linear)
    c_matvec_q4_s8, c_matvec_q8_s8
                    one row, int4 / int8 codes times int8        the C row with fp32 activations
                    activations (integer dot products)
    gemm_q4_s8, gemm_q8_s8
                    a prompt's rows, the same, C's GEMM          C's panels with fp32 activations
    fused_step, fused_verify (steps/fused.py)
                    a decode token / 4 tokens of one sequence in one C call   the eager step
    fused_paged     8 rows of a paged cache at their own positions       the eager step
                    (the serving engine's decode step), one C call
    fused_paged_prompt
                    2 prompts of 32 tokens, int4 blocks, one C call      the eager prefill

How (probes.py): each probe runs a few products (one to 128 rows of the model's own matrices; every
dimension at least SmolLM2-135M's, since a test model's 32 channels would measure call overhead, not
the kernel), fast and reference back to back in pairs, and keeps the median ratio of the pairs (a
busy neighbour slows both calls of a pair alike): about a second for all of them, once per machine.
All at one thread: what each path does per core. More threads split the same work, and next to a
busy neighbour every parallel region waits for its late thread (chapter 11), so a two-thread timing
on a shared machine measures the neighbour, not the kernel. A fast path more than 4x slower than its
reference in every pair of two short first tries is not run longer. The results are kept per (CPU model and flags,
torch version, minigen's version and kernel sources) in $MINIGEN_CACHE/fastpaths/, written
atomically, an entry per shape.

What follows: a fast path whose ratio (reference time / fast time, the median over adjacent pairs)
is below probes.SLOWER (0.8: clearly slower, past what timings wander here; a lossy path, int8
activations, below probes.LOSSY_GAIN, 1.1: a tie buys nothing for its loss) stands aside wherever
minigen chooses by itself (dispatch.py, fused_decode="auto", the int8 product a prompt runs), with
one notice that names the ratio; a setting that demands it (prefill_precision="bfloat16" or "int8",
fused_decode=True) still runs it, with a warning that gives the ratio. `python -m minigen bench`
prints every measurement, and docs/machines.md says what each family of CPU got.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..paths import cache_dir
from . import build
from .probes import PROBES, SLOWER, Measurement, Probe, Shapes, run_probe


class FastPathNotice(RuntimeWarning):
    """A fast path stood aside (or was demanded) where it measured slower than its reference."""


@dataclass
class FastPaths:
    """The measurements of one (machine, shapes), at `threads`: what stands aside, and why."""
    shapes: Shapes
    threads: int
    machine: str
    measured: dict[str, Measurement] = field(default_factory=dict)

    def get(self, path: str) -> Measurement | None:
        return self.measured.get(path)

    def allowed(self, path: str) -> bool:
        """Whether a fast path runs on "auto": measured and not slower than its reference (a path with
        no measurement, which does not exist here, stands aside by its own rules)."""
        m = self.measured.get(path)
        if m is None or not m.stands_aside:
            return True
        notice(m)
        return False

    def gains(self, path: str) -> bool:
        """Whether a lossy fast path runs on "auto": measured here, and at least its Measurement.least times
        its reference (probes.LOSSY_GAIN); one notice where it measured less."""
        m = self.measured.get(path)
        return m is not None and self.allowed(path)

    def best_int8(self) -> Measurement | None:
        """The fastest int8 prompt product measured here (kernels/int8.py's backends), or None."""
        found = [m for p, m in self.measured.items() if p.startswith("int8_")]
        return max(found, key=lambda m: m.ratio) if found else None

    def lines(self) -> list[str]:
        head = f"fast paths measured on {self.machine}, {self.threads} thread(s), shapes {self.shapes.key()}:"
        return [head, *("  " + m.line() for m in self.measured.values())]


_noticed: set[str] = set()  # paths already announced in this process: one notice each


def notice(m: Measurement) -> None:
    """Say once per process that `m`'s fast path stands aside here, with its ratio."""
    if m.path not in _noticed:
        _noticed.add(m.path)
        least = f" (a lossy path runs from {m.least:.2f}x)" if m.least > 1 else ""
        warnings.warn(f"minigen: {m.fast} measured {m.ratio:.2f}x its reference ({m.reference}) on this machine"
                      f"{least}, so it stands aside ({m.path}; python -m minigen bench prints every measurement)",
                      FastPathNotice, stacklevel=3)


def demanded(m: Measurement | None, setting: str) -> None:
    """Warn that a setting demands a fast path that measured slower than its reference here."""
    if m is not None and m.stands_aside:
        warnings.warn(f"minigen: {setting} runs {m.fast}, which measured {m.ratio:.2f}x its reference "
                      f"({m.reference}) on this machine: slower. It runs because the setting asks for it.",
                      FastPathNotice, stacklevel=3)


# ---------------------------------------------------------------- kept per machine
def machine() -> str:
    """The CPU's model name (and family/model numbers on x86), as /proc/cpuinfo says, else platform's."""
    name, fam, mod = platform.processor() or platform.machine(), "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name":
                name = value
            elif key == "cpu family":
                fam = value
            elif key == "model" and not mod:
                mod = value
    return f"{name} (family {fam} model {mod})" if fam else name


def _version() -> str:
    """minigen's version and a digest of the kernels' sources (C and Python): a changed kernel is measured again."""
    try:
        from importlib.metadata import version
        v = version("minigen")
    except Exception:  # running from a checkout that is not installed
        v = "uninstalled"
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for p in sorted([*here.glob("*.py"), *(here / "csrc").iterdir()]):
        digest.update(p.name.encode() + p.read_bytes())
    return f"{v}+{digest.hexdigest()[:12]}"


def cache_file() -> Path:
    """$MINIGEN_CACHE/fastpaths/<digest of the CPU, its flags, the GPU, torch and minigen>.json."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""  # the Triton probe runs there
    key = "\0".join([machine(), build.cpu_fingerprint(), gpu, torch.__version__, _version()])
    return cache_dir() / "fastpaths" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read(path: Path) -> dict:
    """The file's entries, or {} when it is missing or damaged (then measured again and rewritten)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data["entries"] if isinstance(data.get("entries"), dict) else {}
    except (OSError, ValueError, AttributeError, KeyError):
        return {}


def _write(path: Path, entry_key: str, entry: dict) -> str | None:
    """Add one entry to the file, atomically (written beside it, then renamed) -> None, or why not."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read(path)
        entries[entry_key] = entry
        tmp.write_text(json.dumps({"machine": machine(), "torch": torch.__version__, "minigen": _version(),
                                   "entries": entries}, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return str(e)
    return None


_memo: dict[Shapes, FastPaths] = {}  # this process's reads of the file


def _parse(entry: dict) -> dict[str, Measurement]:
    out = {}
    for path, m in entry.items():
        with contextlib.suppress(TypeError, KeyError, ValueError):
            out[path] = Measurement(**{k: m[k] for k in ("path", "fast", "reference", "fast_s", "reference_s", "ratio")},
                                    least=float(m.get("least", SLOWER)))
    return out


MEASURE_THREADS = 1  # see the module docstring: per-core speed, which a busy neighbour barely moves


def measured(shapes: Shapes, probes: tuple[Probe, ...] = PROBES) -> FastPaths:
    """The measurements of `probes` at `shapes`, at one thread: read from the cache file, and whatever it
    lacks measured now and added to it. A fast path that does not exist here (no compiler, no oneDNN)
    has no measurement and stands aside by its own rules."""
    paths = _memo.get(shapes)
    entry_key = f"{shapes.key()}@{MEASURE_THREADS}"
    if paths is None:
        paths = FastPaths(shapes, MEASURE_THREADS, machine(), _parse(_read(cache_file()).get(entry_key, {})))
        _memo[shapes] = paths
        if (m := paths.get("avx512_rows")) is not None and m.stands_aside:
            build.use_variant(build.NO_AVX512)  # measured in an earlier process: the AVX2 loops here too
    todo = [p for p in probes if p.path not in paths.measured and (p.path, entry_key) not in _absent]
    if not todo or not (applies() and build.is_enabled()):
        # nothing new, or not now: with the kernels switched off, or under torch.compile or a dispatch mode,
        # every kernel declines its call, and a probe would record that as "does not exist here"
        return paths
    before = torch.get_num_threads()
    torch.set_num_threads(MEASURE_THREADS)
    try:
        for probe in todo:
            m = run_probe(probe, shapes)
            if m is None:
                _absent.add((probe.path, entry_key))
                continue
            paths.measured[probe.path] = m
            if probe.path == "avx512_rows" and m.stands_aside:
                build.use_variant(build.NO_AVX512)  # the AVX2 loops from now on; later probes time them
    finally:
        torch.set_num_threads(before)
    why = _write(cache_file(), entry_key, {p: asdict(m) for p, m in paths.measured.items()})
    if why is not None and "unwritable" not in _noticed:
        _noticed.add("unwritable")
        warnings.warn(f"minigen: could not keep the fast paths' measurements in {cache_file()} ({why}); "
                      "they hold for this process and are measured again in the next", FastPathNotice, stacklevel=2)
    return paths


_absent: set[tuple[str, str]] = set()  # (path, entry) that does not exist here: not probed again


_forgotten = 0  # how many times forget() ran: a holder of a FastPaths reads it again after one


def forget() -> None:
    """Drop this process's copies of the measurements (tests plant a slow path, then measure again)."""
    global _forgotten
    _memo.clear()
    _absent.clear()
    _noticed.clear()
    _forgotten += 1


def generation() -> int:
    """Changes whenever forget() drops the measurements: whoever keeps a FastPaths compares it."""
    return _forgotten


def applies() -> bool:
    """Whether a choice may read the measurements now: not while torch.compile traces or a dispatch mode
    (FlopCounterMode) watches, when the C kernels stand aside by their own rules anyway."""
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
