"""The pipeline's bubble, measured (issue 45): SmolLM2 split over N stages (one process each, gloo on
127.0.0.1), a batch of B rows in m micro-batches, and each stage's busy fraction over the decode steps.

    python scripts/pipeline_bubble.py [--stages 2] [--rows 4] [--micro-batches 1 2 4] [--new 32] [--repeats 2]
                                      [--threads 1] [--torch-ops] [--json docs/runs/pipeline_bubble.json]

Each stage loads the model once, keeps its layers (parallel/pipeline.py make_stage), and generates once
unmeasured (warm-up), then --repeats times for each m; the last repeat of each m is reported. A stage is
busy while it embeds, runs its blocks, or applies the head and samples; the window runs from the first
decode step's first work on any stage to the last step's last (parallel.bubble). One process (N = 1, the
same code, no sends) runs beside it as the baseline. Theory for equal stages and free transfers: busy
= m / (m + N - 1) with the steps in lockstep, 1 once m >= N with micro-batches round the ring as here
(a micro-batch's token returns to stage 0 before its turn comes again), 1/N at m = 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import minigen  # noqa: E402
from minigen.kernels import build  # noqa: E402
from minigen.parallel import bubble, make_stage, pipeline_generate, run_ranks  # noqa: E402

PROMPT = "Pipeline parallelism splits a model's layers over several devices, so that"


def work(rank: int, n_stages: int, ids: torch.Tensor, micro_batches: list[int], new: int, repeats: int,
         torch_ops: bool) -> dict:
    """One stage: load, keep this stage's layers, warm up, then each m `repeats` times -> {m: times dict}."""
    with build.enabled(False) if torch_ops else contextlib.nullcontext():
        stage = make_stage(minigen.load("smollm2-135m")[0], rank, n_stages)
        config = dict(max_new_tokens=new, stop_token_ids=())  # every row decodes `new` tokens
        pipeline_generate(stage, ids, micro_batches[-1], **config)  # warm-up
        out = {}
        for m in micro_batches:
            for _ in range(repeats):
                out[m] = pipeline_generate(stage, ids, m, **config).times.as_dict()
    return out


def cpu_name() -> str:
    """lscpu's model name, family and model numbers (Linux), else platform.processor()."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
        info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        return f"{info.get('Model name')} (family {info.get('CPU family')} model {info.get('Model')}, {info.get('CPU(s)')} CPUs)"
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    parser.add_argument("--torch-ops", action="store_true", help="torch's ops instead of minigen's C kernels")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    _, tokenizer = minigen.load("smollm2-135m")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.repeat(args.rows, 1)  # [B, T]
    rows, load = [], os.getloadavg()[0]  # a busy machine's other processes take the stages' cores
    for n_stages in (1, args.stages):
        times = run_ranks(work, n_stages, args=(ids, args.micro_batches, args.new, args.repeats, args.torch_ops),
                          timeout=590, threads=args.threads)
        for m in args.micro_batches:
            result = bubble([stage[m] for stage in times], args.rows)
            waits = [stage[m]["wait_s"] for stage in times]
            rows.append({"stages": n_stages, "micro_batches": m, "busy": [round(b, 3) for b in result["busy"]],
                         "wait_s": [round(w, 3) for w in waits], "window_s": round(result["window_s"], 3),
                         "tok_per_s": round(result["tok_per_s"], 1)})
            print(f"N={n_stages} m={m}: busy {', '.join(f'{b:.0%}' for b in result['busy'])}, "
                  f"{result['tok_per_s']:.1f} tok/s over {result['window_s']:.2f} s", flush=True)
    report = {"what": "SmolLM2-135M fp32, pipeline stages as gloo processes on 127.0.0.1, decode steps only",
              "cpu": cpu_name(), "threads_per_stage": args.threads, "rows": args.rows, "prompt_tokens": ids.shape[1],
              "new_tokens": args.new, "ops": "torch" if args.torch_ops else "minigen kernels (default)",
              "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)],  # before, after
              "date": datetime.date.today().isoformat(), "runs": rows}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
