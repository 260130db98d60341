"""The machine a measurement runs on: what it is, how fast it reads memory, how much memory a run adds.

`bench` reports these beside its rates, and the chapters print them above every table they
measure, so a number always comes with the hardware that produced it.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import time

import torch

from ..kernels import build as kernel_build

def hardware_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "gpu": gpu, "memory_read_gb_s": memory_read_bandwidth(),
            "cpu_kernel": kernel_build.status()}


def memory_read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """GB/s of a plain streaming read (a sum over a tensor far larger than the caches), best of N."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        x.sum()
        _sync()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PeakRSS:
    """This process's peak resident memory over a `with` block; `.added` is what the block added.

    On Linux the kernel keeps the peak itself (VmHWM) and lets a process reset it, so nothing
    runs beside the engine being timed. Elsewhere (macOS has no /proc) a thread samples the RSS
    every 2 ms with psutil; on two cores such a thread steals time from the run it measures.
    Without psutil either, getrusage's lifetime peak is all there is: `.added` is then what the
    block raised that peak by, a lower bound (0 when an earlier moment of the process used more).
    On a GPU it is the peak of torch's allocations on the device.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.start, self.peak = interval_s, 0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._source = ""  # set by __enter__: "cuda", "kernel" (VmHWM), "poll" or "rusage"

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss() or 0)
            time.sleep(self.interval_s)

    def __enter__(self):
        now = _rss()
        if torch.cuda.is_available():
            self._source, self.start = "cuda", torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        elif now is None:
            self._source, self.start = "rusage", _lifetime_peak_rss()
        elif _reset_peak_rss():
            self._source, self.start = "kernel", now
        else:
            self._source, self.start = "poll", now
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        self.peak = self.start
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self._source == "cuda":
            self.peak = torch.cuda.max_memory_allocated()
        elif self._source == "rusage":
            self.peak = _lifetime_peak_rss()
        else:
            self.peak = max(self.peak, _rss() or 0, _kernel_peak_rss() if self._source == "kernel" else 0)

    @property
    def added(self) -> int:
        return max(0, self.peak - self.start)


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _kernel_peak_rss() -> int:
    """VmHWM, the kernel's record of this process's peak RSS; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss() -> int | None:
    """This process's resident memory now, from /proc or psutil; None where neither tells."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # macOS, or a container without /proc
        pass
    try:
        import psutil  # not a dependency of minigen; used where it is installed
        return psutil.Process().memory_info().rss
    except Exception:  # not installed, or cannot tell (on Linux it reads /proc too): psutil.Error, OSError
        return None


def _lifetime_peak_rss() -> int:
    """getrusage's peak RSS of this process since it started; 0 where there is no getrusage."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
