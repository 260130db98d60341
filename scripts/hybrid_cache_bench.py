"""The hybrid cache on a Gemma-3-270M-shaped model (issue 27): its bytes against the count and
against a uniform cache, and its decode speed against a uniform cache on the same random-weight model.

    python scripts/hybrid_cache_bench.py [--context 4096] [--steps 96] [--threads 1 2] [--ops c torch]
                                         [--json docs/runs/hybrid_cache.json]

Bytes come from the caches make_cache builds (minigen/measure/hybrid.py: cache_bytes). Speed: fp32,
batch 1, the eager step, both caches holding the same keys; the steps alternate hybrid and uniform
so a busy spell of a shared machine falls on both steps of a pair, and the ratio is taken pair by
pair (median). One run per --threads value and --ops, each on its own model (the same seed): "c",
minigen's kernels (the C attention skips masked slots, so a uniform cache's sliding layers read only
their window), or "torch", torch's own ops (SDPA reads every slot, as a GPU's attention does).
The JSON records the machine, torch, the threads, the date and the load average before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from minigen.kernels import build as kernel_build  # noqa: E402
from minigen.measure import hybrid  # noqa: E402


def machine() -> dict:
    """The CPU as /proc/cpuinfo names it, with the vector extensions the kernels use."""
    info = {"model_name": None, "cpu_family": None, "model": None, "avx2": False, "avx512f": False}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and info["model_name"] is None:
                info["model_name"] = value
            elif key == "cpu family" and info["cpu_family"] is None:
                info["cpu_family"] = value
            elif key == "model" and info["model"] is None:
                info["model"] = value
            elif key == "flags":
                flags = value.split()
                info["avx2"], info["avx512f"] = "avx2" in flags, "avx512f" in flags
                break
    except OSError:  # no /proc (macOS): the fields stay unknown
        pass
    info["cores"] = os.cpu_count()
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096, help="positions in the cache before decoding")
    parser.add_argument("--steps", type=int, default=96, help="decode steps per cache, taken in turns")
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()],
                        help="torch threads, one run each (default: torch's own)")
    parser.add_argument("--ops", nargs="+", choices=("c", "torch"), default=["c", "torch"],
                        help="minigen's C kernels or torch's own ops, one run each")
    parser.add_argument("--json", default="docs/runs/hybrid_cache.json")
    args = parser.parse_args(argv)
    start = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    sizes = hybrid.cache_bytes()
    speeds = [dict(hybrid.decode_speed(context=args.context, steps=args.steps, threads=n, kernels=ops == "c"),
                   ops=ops) for n in args.threads for ops in args.ops]
    result = {"date": start.strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine(), "torch": torch.__version__,
              "threads": args.threads, "cpu_kernel": kernel_build.status(),
              "load_average_start": load_start, "load_average_end": os.getloadavg(),
              "model": "Gemma-3-270M-shaped (arch llama, random weights)", "model_config": {
                  k: v for k, v in vars(hybrid.GEMMA3_270M).items()},
              "bytes": sizes, "speed": speeds}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    m = result["machine"]
    print(f"{m['model_name']} (family {m['cpu_family']}, model {m['model']}, avx2 {m['avx2']}, "
          f"avx512f {m['avx512f']}), torch {result['torch']}, torch threads {result['threads']}, {result['date']}\n")
    print("| dtype | context | hybrid MB | count MB | hybrid / count | uniform MB | hybrid share of uniform |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in sizes:
        print(f"| {r['dtype']} | {r['context']:,} | {r['hybrid_nbytes'] / 1e6:.2f} | {r['count_bytes'] / 1e6:.2f} | "
              f"{r['hybrid_over_count']:.3f}{'' if r['within_tolerance'] else ' (over 5%)'} | "
              f"{r['uniform_nbytes'] / 1e6:.2f} | {r['hybrid_share_of_uniform']:.1%} |")
    s = speeds[0]
    print(f"\nDecode, fp32, batch 1, {s['step']} step, context {s['context']:,} to {s['context_end']:,}, "
          f"{s['steps']} steps per cache in turns; first-step logits of the two caches differ by "
          f"{s['first_step_max_logit_diff']:.2g}\n")
    print("| threads | ops | cache | tok/s (median step) | MB read per step | roofline tok/s | load average |")
    print("|---:|---|---|---:|---:|---:|---|")
    for s in speeds:
        for name, c in s["caches"].items():
            print(f"| {s['threads']} | {s['ops']} | {name} ({c['cache']}) | {c['tokens_per_s']:.2f} | "
                  f"{c['bytes_read_per_step'] / 1e6:.0f} | {c['roofline_tokens_per_s']:.2f} | "
                  f"{s['load_average_before'][0]:.2f} -> {s['load_average_after'][0]:.2f} |")
    for s in speeds:
        q = s["pair_speed_ratio_quartiles"] or [s["pair_speed_ratio_median"]] * 3
        print(f"\nthreads {s['threads']}, {s['ops']} ops: hybrid / uniform speed, median of {s['steps']} pairs "
              f"{s['pair_speed_ratio_median']:.3f} (quartiles {q[0]:.3f} .. {q[2]:.3f}; hybrid faster in "
              f"{s['pairs_hybrid_faster']:.0%} of pairs); the roofline predicts {s['roofline_ratio']:.3f} "
              f"at {s['memory_read_gb_s']:.1f} GB/s")


if __name__ == "__main__":
    main()
