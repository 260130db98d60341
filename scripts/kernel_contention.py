"""Decode speed of SmolLM2 (fp32, batch 1) on minigen's C kernel against torch's F.linear, on a
quiet machine and next to busy neighbours: the measurement behind the kernel's threading policy.

    python scripts/kernel_contention.py [--steps 48]

Each setting runs in a fresh process that decodes with the two paths in turn, one step each, so a
busy moment falls on both; the neighbours are started first and stopped after. Neighbours: "busy
loop" is a Python `while True: pass` (one core), "GEMM" a process scoring 300-token texts with
SmolLM2 on two threads (what another notebook kernel does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

WORKER = r"""
import json, statistics, sys, time, torch, minigen
from minigen import GenerationConfig
from minigen.kernels import cpu as cpu_kernel
from minigen.kernels import build as kernel_build
from minigen.caches.make import make_cache
from minigen.steps.eager import decode_step, prefill
steps = int(sys.argv[1])
model, tok = minigen.load("smollm2-135m")
ids = tok("The capital of France is a city of many", return_tensors="pt").input_ids
T = ids.shape[1]
times = {True: [], False: []}
with torch.inference_mode():
    caches = {on: make_cache(model, GenerationConfig(), 1, T + steps) for on in times}
    tokens = {}
    for on in times:
        with kernel_build.enabled(on):
            tokens[on] = prefill(model, ids, caches[on]).argmax(-1)
    for i in range(steps - 1):
        for on in times:
            with kernel_build.enabled(on):
                t = time.perf_counter()
                tokens[on] = decode_step(model, tokens[on][:, None], torch.tensor([T + i]), caches[on]).argmax(-1)
                times[on].append(time.perf_counter() - t)
print(json.dumps({"kernel": 1 / statistics.median(times[True][2:]), "torch": 1 / statistics.median(times[False][2:]),
                  "late_regions": kernel_build.late_regions(), "status": kernel_build.status()}))
"""

GEMM = r"""
import time, torch, minigen
model, _ = minigen.load("smollm2-135m")
ids = torch.randint(0, 40000, (300,), generator=torch.Generator().manual_seed(0))
while True:
    minigen.perplexity(model, ids)
"""


def run(neighbours: list[str], steps: int) -> dict:
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in neighbours]
    try:
        time.sleep(8 if any(code is GEMM for code in neighbours) else 1)  # let them load and start
        out = subprocess.run([sys.executable, "-c", WORKER, str(steps)], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48, help="decode steps per path and setting")
    args = parser.parse_args()
    busy = "while True: pass"
    settings = {"quiet": [], "1 busy loop": [busy], "2 busy loops": [busy, busy],
                "1 GEMM neighbour": [GEMM], "2 GEMM neighbours": [GEMM, GEMM]}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; decode tok/s (median step)")
    print(f"{'setting':20s}{'C kernel':>10s}{'torch':>8s}{'ratio':>8s}{'late regions':>14s}")
    for name, neighbours in settings.items():
        r = run(neighbours, args.steps)
        print(f"{name:20s}{r['kernel']:10.1f}{r['torch']:8.1f}{r['kernel'] / r['torch']:8.2f}{r['late_regions']:14d}",
              flush=True)


if __name__ == "__main__":
    main()
