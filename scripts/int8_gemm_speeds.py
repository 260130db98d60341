"""Times a prompt's int8 products at SmolLM2's shapes (M = 512 rows), interleaved, medians:
fp32 (cpu.linear, oneDNN's GEMM), oneDNN's int8 linear, torch._int_mm, and csrc/gemm_s8.c built
as each variant this CPU can run (MINIGEN_CPU_KERNEL_CFLAGS), on 1 and 2 threads.

    python scripts/int8_gemm_speeds.py [--rounds 15] [--rows 512] [--threads 1 2] [--variants avx512vnni ...]

Each int8 time includes quantizing the rows (the C kernel's inside its call, the others' through
quantize_rows_s8 before) and no outlier columns: the GEMMs on the same codes. Medians, and the best
run (what a quiet machine gives: next to busy processes, a 2-thread product waits a time slice). Prints ms and multiply-adds per ns."""
import argparse
import os
import statistics
import time

import torch

from minigen.kernels import build, cpu, int8
from minigen.numerics import w8a8

SHAPES = ((576, 1536), (576, 960), (576, 576), (1536, 576))  # (k, n): wqkv-like, gate_up halves, wo, w_down
VARIANT_FLAGS = {"avx512vnni": "", "avxvnni": "-mno-avx512f", "avx2": "-mno-avx512f -mno-avxvnni",
                 "portable": "-mno-avx512f -mno-avxvnni -mno-avx2"}


def libraries(variants) -> dict:
    """variant -> a library built with its flags (the ones that build and report that variant here)."""
    libs = {}
    before = os.environ.get("MINIGEN_CPU_KERNEL_CFLAGS")
    try:
        for want, flags in VARIANT_FLAGS.items():
            if want not in variants:
                continue
            os.environ["MINIGEN_CPU_KERNEL_CFLAGS"] = flags
            lib, _ = build._build()
            got = lib.gemm_s8_variant().decode()
            if got == want:
                libs[got] = lib
    finally:
        if before is None:
            os.environ.pop("MINIGEN_CPU_KERNEL_CFLAGS", None)
        else:
            os.environ["MINIGEN_CPU_KERNEL_CFLAGS"] = before
    return libs


def c_product(lib, x, w8):
    def run():  # int8.py's _gemm_s8 through this library: the rows quantized inside the call
        (T, k), n = x.shape, w8.shape[0]
        q, a, y = torch.empty(T, k, dtype=torch.int8), torch.empty(T), torch.empty(T, n)
        lib.gemm_s8(x.data_ptr(), None, q.data_ptr(), a.data_ptr(), w8.blocked.data_ptr(), w8.code_sums.data_ptr(),
                    w8.scales.data_ptr(), y.data_ptr(), T, n, k, torch.get_num_threads())
        return y
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANT_FLAGS), choices=list(VARIANT_FLAGS))
    args = p.parse_args()
    libs = libraries(args.variants)
    print(f"native variant: {int8.variant()}; built: {', '.join(libs)}")
    g = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        w, x = torch.randn(n, k, generator=g), torch.randn(args.rows, k, generator=g)
        w8 = w8a8.quantize_weight(w)
        ref = w8a8.reference_linear(x, w8)
        runs = {"fp32": lambda: cpu.linear(x, w)}
        for b in ("onednn", "int_mm"):
            if int8.available(b):
                runs[b] = (lambda b=b: int8.int8_linear(x, w8, b))
        for v, lib in libs.items():
            runs[f"c {v}"] = c_product(lib, x, w8)
        for name, run in runs.items():  # each right before timing: the same answer
            if name != "fp32":
                assert ((run() - ref).abs() <= 1e-5 * (x.abs() @ w.abs().T)).all(), name
        for threads in args.threads:
            torch.set_num_threads(threads)
            times = {name: [] for name in runs}
            cpu_times = {name: [] for name in runs}  # one thread: the CPU time of this thread, which a
            for name, run in runs.items():           # neighbour's time slices do not count in
                run()
            for _ in range(args.rounds):
                for name, run in runs.items():
                    t, c = time.perf_counter(), time.thread_time()
                    run()
                    times[name].append(time.perf_counter() - t)
                    cpu_times[name].append(time.thread_time() - c)
            macs = args.rows * k * n
            for label, ts in (("wall", times), ("cpu", cpu_times)) if threads == 1 else (("wall", times),):
                line = "  ".join(f"{name} {1e3 * statistics.median(t):.2f} ms ({macs / statistics.median(t) / 1e9:.0f}/ns, "
                                 f"best {1e3 * min(t):.2f})" for name, t in ts.items())
                print(f"M={args.rows} k={k} n={n} threads={threads} {label}: {line}", flush=True)


if __name__ == "__main__":
    main()
