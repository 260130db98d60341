"""Quantization on weights that are not on a 4-bit grid: round-to-nearest against GPTQ (chapter 10).

minigen's SmolLM2 is the dequantized Q4_1 GGUF, so its weights already sit on a 4-bit grid. This
script rotates its residual stream (offgrid.rotate: the same function, every weight off the grid),
then quantizes the rotated model by round-to-nearest (int8, int4 at several group sizes) and by
GPTQ, and scores each against the rotated fp32 model on the chapter's text. It also runs chapter
7's bf16-weight study on both the shipped and the rotated weights. Chapter 10 renders the JSON.

    python scripts/offgrid_quality.py [--tokens 256] [--calibration 256] [--json docs/runs/offgrid_quality.json]

About 25 minutes on one thread of a shared two-core CPU (the committed run: 1,455 s), most of it GPTQ's
column loop (four to six minutes a setting).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

import minigen
from minigen.measure import machine
from minigen.numerics import offgrid

ROOT = Path(__file__).resolve().parent.parent
RTN = [(8, 32), (4, 32), (4, 64), (4, 96), (4, 192)]  # (bits, group): groups that divide 576 and 1,536
GPTQ = [(8, 32), (4, 32), (4, 64), (4, 192)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens scored (the chapter's N_TOKENS)")
    parser.add_argument("--calibration", type=int, default=256, help="GPTQ's calibration tokens")
    parser.add_argument("--seed", type=int, default=0, help="the rotation's seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=str(ROOT / "docs" / "runs" / "offgrid_quality.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    shipped, tokenizer = minigen.load("smollm2-135m")
    text = (Path(minigen.__file__).parent / "data" / "english.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt").input_ids[0]  # [T]
    scored = ids[:args.tokens]  # the chapter's tokens
    calibration = ids[1024:1024 + args.calibration]  # a later passage of the same book: not the scored one

    rotated = offgrid.rotate(shipped, args.seed)
    with torch.inference_mode():
        pos = torch.arange(32)
        a, b = shipped(ids[None, :32], pos)[0], rotated(ids[None, :32], pos)[0]
    base = minigen.score(rotated, scored)
    shipped_base = minigen.score(shipped, scored)
    out = {"date": datetime.date.today().isoformat(), "machine": machine.hardware_info()["cpu"],
           "threads": args.threads, "torch": torch.__version__, "model": "smollm2-135m (dequantized Q4_1 GGUF)",
           "tokens_scored": len(scored), "calibration_tokens": len(calibration), "rotation_seed": args.seed,
           "rotation": {"largest_logit_change": float((a - b).abs().max()), "largest_logit": float(a.abs().max()),
                        "share_on_grid_shipped": offgrid.share_on_4bit_grid(shipped),
                        "share_on_grid_rotated": offgrid.share_on_4bit_grid(rotated),
                        "perplexity_shipped": shipped_base.perplexity, "perplexity_rotated": base.perplexity},
           "rtn": [], "gptq": []}

    def row(model, bits, G, seconds=None):
        s = minigen.score(model, scored)
        r = {"bits": bits, "group": G, "perplexity": s.perplexity,
             "change": s.perplexity / base.perplexity - 1, "top1": float((s.top1 == base.top1).float().mean())}
        if seconds is not None:
            r["seconds"] = seconds
        print(r, flush=True)
        return r

    for bits, G in RTN:
        out["rtn"].append(row(minigen.quantize_weights(offgrid.rotate(shipped, args.seed), bits, group_size=G), bits, G))
    for bits, G in GPTQ:
        t = time.perf_counter()
        m = offgrid.gptq_quantize(offgrid.rotate(shipped, args.seed), calibration, bits, G)
        out["gptq"].append(row(m, bits, G, time.perf_counter() - t))
    out["bf16_weights"] = {"shipped": offgrid.bf16_weight_kl(shipped, scored),
                           "rotated": offgrid.bf16_weight_kl(rotated, scored)}
    out["seconds"] = time.perf_counter() - start
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.json} in {out['seconds']:.0f} s")


if __name__ == "__main__":
    main()
