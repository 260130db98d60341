"""Prefill on SmolLM2: time to first token per prompt length, format and weight format, in turns in
one process, with transformers beside it; and what each prompt format costs in quality. The
measurement behind issue 24's prefill table.

    python scripts/prefill_speeds.py [--lengths 16 64 512] [--rounds 5] [--threads 2] [--quality 2048]
                                     [--json FILE]

Every (engine, length) runs the same real-English prompt with max_new_tokens=1, the engines taking
turns within each round; the median of the rounds counts. Engines: minigen fp32 weights with
prefill_precision "float32", "bfloat16" and "int8", minigen int8 and int4 weights (groups of 32) in each,
and transformers fp32 (its own generate, one new token). Quality: teacher forcing over --quality
tokens of the text (evaluate.score, one forward, so every row's products run in the prompt's
format, the head's too, except under "int8", whose head stays fp32): perplexity and top-1 agreement
against fp32. The int8 format's copies of the weights (each model's weight_copies) are made before
the timings (w8a8.prepare), the bf16 format's by the warm-up's bf16 prompts (bf16_copies.prepare);
both print their bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import minigen  # noqa: E402
from minigen import GenerationConfig  # noqa: E402
from minigen.evaluate import score  # noqa: E402
from minigen.numerics import bf16_copies, w8a8  # noqa: E402

FORMATS = ("float32", "bfloat16", "int8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quality", type=int, default=2048)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fp32, tokenizer = minigen.load("smollm2-135m")
    models = {"fp32": fp32, "int8": minigen.load("smollm2-135m", weight_bits=8)[0],
              "int4": minigen.load("smollm2-135m", weight_bits=4)[0]}
    text = (Path(minigen.__file__).parent / "data" / "english.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    runs = {f"minigen {w} weights, {p} prompt": (m, p) for w, m in models.items() for p in FORMATS}
    hf = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM
        from minigen.loading import resolve_folder
        hf = AutoModelForCausalLM.from_pretrained(str(resolve_folder("smollm2-135m")), dtype=torch.float32).eval()
        hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0

    def once(name, T):
        prompt = ids[None, :T]
        start = time.perf_counter()
        if name == "transformers":
            with torch.inference_mode():
                hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=1, do_sample=False)
        else:
            m, p = runs[name]
            minigen.generate(m, prompt, GenerationConfig(max_new_tokens=1, stop_token_ids=[], prefill_precision=p))
        return time.perf_counter() - start

    names = list(runs) + (["transformers"] if hf is not None else [])
    for m in models.values():  # once per model, outside the timings: the int8 copies of the blocks' weights
        w8a8.prepare(m)
        print(f"int8 copies: {w8a8.nbytes(m) / 2**20:.0f} MiB beside {sum(t.nbytes for t in [*m.parameters(), *m.buffers()]) / 2**20:.0f} "
              "MiB of weights", flush=True)
    for name in names:
        once(name, 32)  # warm-up (a 32-token bf16 prompt makes each model's bf16 copies: bf16_copies.prepare)
    for w, m in models.items():
        print(f"bf16 copies of {w} weights: {bf16_copies.nbytes(m):,} bytes beside "
              f"{sum(t.nbytes for t in [*m.parameters(), *m.buffers()]):,} bytes of weights", flush=True)
    table = {}
    for T in args.lengths:
        t = {name: [] for name in names}
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                t[name].append(once(name, T))
        table[T] = {name: statistics.median(v) for name, v in t.items()}
    print(f"| engine | " + " | ".join(f"TTFT {T} tokens ms (x fp32)" for T in args.lengths) + " | prefill tok/s at "
          f"{args.lengths[-1]} |")
    print("|---|" + "---|" * (len(args.lengths) + 1))
    base = "minigen fp32 weights, float32 prompt"
    for name in names:
        cells = [f"{1e3 * table[T][name]:.0f} ({table[T][name] / table[T][base]:.2f}x)" for T in args.lengths]
        print(f"| {name} | " + " | ".join(cells) + f" | {args.lengths[-1] / table[args.lengths[-1]][name]:.0f} |")
    quality = {}
    if args.quality:
        q = ids[:args.quality]
        ref = {w: score(m, q) for w, m in models.items()}
        print(f"\n| weights | prompt format | perplexity over {len(q)} tokens | vs fp32 weights, fp32 prompt | "
              "top-1 agreement |\n|---|---|---|---|---|")
        for w, m in models.items():
            for p in FORMATS:
                s = ref[w] if p == "float32" else score(m, q, prefill_precision=p)
                quality[f"{w} {p}"] = (s.perplexity, float((s.top1 == ref["fp32"].top1).float().mean()))
                print(f"| {w} | {p} | {s.perplexity:.3f} | {s.perplexity / ref['fp32'].perplexity - 1:+.2%} | "
                      f"{quality[f'{w} {p}'][1]:.1%} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"ttft_s": table, "quality": quality}, indent=1))


if __name__ == "__main__":
    main()
