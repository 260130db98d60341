"""Decode speed of SmolLM2 at batch 1 in every weight format and mode, in turns in one process:
the measurement behind the README's precision and quantization rows.

    python scripts/decode_speeds.py [--new-tokens 64] [--rounds 3] [--no-compile] [--json FILE]

Formats: fp32; bf16 weights with fp32 activations (the CPU default, precision.py), with the cache in
bf16 (the default kv_dtype: the weights' dtype) and in fp32 (bf16+kv32); int8 and int4
weights (weight_quant.py). Modes: eager, compile=True, and fused_decode=True (fused.py: every layer
of a token in one C call). Each (format, mode) pair generates
`--new-tokens` greedy tokens from the benchmark's 64-token prompt once per round, the pairs
taking turns, so a slow spell of a shared machine falls on all of them; the table gives the
median step time over rounds, and each pair's speed against fp32 eager and against fp32 in the
same mode. Compile time is spent in a warm-up before the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import minigen  # noqa: E402
from minigen.kernels import build as kernel_build  # noqa: E402
from minigen.measure import bench  # noqa: E402
from minigen.loading import build_model, load_tokenizer, read_config, read_safetensors, resolve_folder  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="no compiled mode (a compile takes 20-60 s here)")
    parser.add_argument("--json", help="write the step times and ratios to this file")
    args = parser.parse_args(argv)
    folder = resolve_folder("smollm2-135m")
    cfg, state = read_config(folder), read_safetensors(folder)
    ids = bench.prompt_ids(load_tokenizer(folder), 64)
    bf16 = build_model(cfg, state, torch.bfloat16)
    models = {"fp32": build_model(cfg, state), "bf16": bf16, "bf16+kv32": bf16,
              "int8": minigen.quantize_weights(build_model(cfg, state), 8),
              "int4": minigen.quantize_weights(build_model(cfg, state), 4)}
    # bf16+kv32: the same bf16 weights with the cache in fp32 (kv_dtype), as the activations are:
    # attention then reads it without converting it in every layer of every step.
    settings = {name: {"kv_dtype": "float32"} if name.endswith("kv32") else {} for name in models}
    modes = ("eager", "fused") if args.no_compile else ("eager", "compiled", "fused")
    flags = {"eager": {}, "compiled": {"compile": True}, "fused": {"fused_decode": True}}
    runs = {(name, c): m for name, m in models.items() for c in modes}
    for (name, c), m in runs.items():  # warm-up: builds the kernel, compiles
        minigen.generate(m, ids, max_new_tokens=8, stop_token_ids=[], **flags[c], **settings[name])
    steps = {key: [] for key in runs}
    for _ in range(args.rounds):
        for (name, c), m in runs.items():
            out = minigen.generate(m, ids, max_new_tokens=args.new_tokens, stop_token_ids=[], **flags[c],
                                   **settings[name])
            steps[name, c].append(statistics.median(out.stats.token_latencies_s[1:]))
    ms = {key: 1e3 * statistics.median(v) for key, v in steps.items()}
    print(f"SmolLM2-135M, batch 1, greedy, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"kernel: {kernel_build.status()}")
    print(f"{'weights':<10}{'mode':<10}{'MB of weights':>14}{'step ms':>9}{'tok/s':>8}{'vs fp32 eager':>15}"
          f"{'vs fp32 same mode':>19}")
    rows = []
    for (name, c), t in ms.items():
        mb = minigen.numerics.weight_quant.weight_bytes(models[name]) / 1e6
        rows.append({"weights": name, "mode": c, "mb": mb, "step_ms": t, "vs_fp32_eager": ms["fp32", "eager"] / t,
                     "vs_fp32_same_mode": ms["fp32", c] / t})
        print(f"{name:<10}{c:<10}{mb:>14.0f}{t:>9.2f}{1e3 / t:>8.1f}{ms['fp32', 'eager'] / t:>14.2f}x"
              f"{ms['fp32', c] / t:>18.2f}x")
    print(f"late regions (the kernel ran single-threaded after them): {kernel_build.late_regions()}")
    if args.json:
        import json
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__,
                                               "new_tokens": args.new_tokens, "rounds": args.rounds,
                                               "kernel": kernel_build.status(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
