"""What `prefill_chunk_size` costs and saves on SmolLM2: a long prompt's time to the first token and
the peak bytes of tensors the generation holds (cache included), with the prompt in one forward
and in pieces, beside the memory planner's estimate of the same bytes.

    python scripts/prefill_chunks.py [--lengths 2048 8192] [--chunks 0 2048 512 256] [--rounds 3]
                                     [--threads 2] [--json FILE]

Chunk 0 is the whole prompt. The times are medians of `rounds`, the settings taking turns within
each round, so that a busy neighbour slows them alike. The bytes come from a separate run under
measure.profiling.peak_tensor_bytes (which counts every storage torch's ops create), because a dispatch
mode turns the C kernels off and would distort the times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402

import minigen  # noqa: E402
from minigen.measure import plan as planner  # noqa: E402
from minigen.measure import profiling  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 2048, 512, 256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = minigen.load("smollm2-135m")
    cfg, rows = model.config, []
    for T in args.lengths:
        ids = torch.randint(100, 40000, (1, T), generator=torch.Generator().manual_seed(0))
        configs = {c: minigen.GenerationConfig(max_new_tokens=1, stop_token_ids=[], prefill_chunk_size=c or None)
                   for c in args.chunks if c < T}
        times: dict[int, list[float]] = {c: [] for c in configs}
        minigen.generate(model, ids[:, :64], max_new_tokens=1)  # warm-up
        for _ in range(args.rounds):
            for c, config in configs.items():
                times[c].append(minigen.generate(model, ids, config).stats.ttft_s)
        whole = statistics.median(times[0]) if 0 in times else None
        for c, config in configs.items():
            peak, _ = profiling.peak_tensor_bytes(lambda: minigen.generate(model, ids, config))
            planned = (planner.kv_cache_bytes(cfg, config, 1, T + 1, prompt_len=T)
                       + planner.activation_bytes(cfg, 1, T + 1, config=config))
            ttft = statistics.median(times[c])
            row = {"tokens": T, "chunk": c or None, "ttft_s": ttft, "x_whole": ttft / whole if whole else None,
                   "peak_tensor_bytes": peak, "planned_bytes": planned}
            rows.append(row)
            print(f"{T:>6} tokens, chunk {c or 'whole':>5}: TTFT {ttft:6.2f} s"
                  + (f" ({ttft / whole:.2f}x whole)" if whole else "")
                  + f", peak tensors {peak / 2**20:7.1f} MiB, planned {planned / 2**20:7.1f} MiB "
                  f"({planned / peak - 1:+.1%})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
