"""A long prompt's attention on SmolLM2: its share of prefill time and the memory it needs, with the
explicit [T, S] mask (minigen before chapter 3) and with SDPA's own causal tiles (attention.Causal),
at 512, 2,048 and 8,192 tokens: the measurement behind issue 24's long-prompt table.

    python scripts/long_prompts.py [--lengths 512 2048 8192] [--threads 2] [--json FILE]

Each (length, path) runs in a fresh process, so that its peak resident memory (ru_maxrss) is its
own: the model loaded and a short prompt run first (the baseline), then one forward of the long
prompt at positions 0..T-1 with the logits of the last position only, as a prefill runs it. The
attention time is the time inside scaled_dot_product_attention, summed over the 30 layers.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def one(T: int, path: str, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    import minigen
    torch.set_num_threads(threads)
    model, _ = minigen.load("smollm2-135m")
    if path == "mask":
        import minigen.attention
        minigen.attention.prefix_causal = lambda q, k: False  # the explicit [T, S] mask, as before
    spent = [0.0]
    sdpa = F.scaled_dot_product_attention

    def timed(*args, **kw):
        start = time.perf_counter()
        out = sdpa(*args, **kw)
        spent[0] += time.perf_counter() - start
        return out

    F.scaled_dot_product_attention = timed
    ids = torch.randint(100, 40000, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids[:, :64], torch.arange(64), last_only=True)  # warm-up: every op's first call
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        spent[0] = 0.0
        start = time.perf_counter()
        model(ids, torch.arange(T), last_only=True)
        total = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tokens": T, "path": path, "prefill_s": total, "attention_s": spent[0], "peak_growth_bytes": peak - base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # T path: run in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.threads)))
        return
    rows = []
    print("| tokens | attention | prefill s | tok/s | attention s | attention share | peak memory growth MB |")
    print("|---|---|---|---|---|---|---|")
    for T in args.lengths:
        for path in ("mask", "tiles"):
            out = subprocess.run([sys.executable, __file__, "--one", str(T), path, "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(r)
            label = "[T, S] mask" if path == "mask" else "causal tiles"
            print(f"| {T:,} | {label} | {r['prefill_s']:.2f} | {T / r['prefill_s']:.0f} | {r['attention_s']:.2f} | "
                  f"{r['attention_s'] / r['prefill_s']:.0%} | {r['peak_growth_bytes'] / 2**20:.0f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
