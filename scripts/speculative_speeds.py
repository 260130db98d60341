"""Speculative decoding on SmolLM2, every draft and k, measured and predicted, in turns in one process:
the measurement behind issue 23's table (alpha, tokens per target forward, measured against predicted
speed-up) and README's speculative rows.

    python scripts/speculative_speeds.py [--new-tokens 128] [--rounds 3] [--ks 2 4 6] [--weight-bits 4]
                                         [--drafts ngram layers:24 int8:32 ...] [--json FILE]

Prompt lookup ("ngram") runs on the grounded prompt (bench.prompt_ids(..., grounded=True): the model
is asked to repeat 200 tokens of English text) and on an open-ended one; every draft on the
open-ended one. Each measurement is a pair of runs, greedy, no stop token: plain decoding of the
prompt, then the draft decoding alone (the ratio of their rates is c, the draft's step over the
target's) or a speculative setting (the ratio is its speed-up); the greedy tokens of every
speculative run are checked against plain decoding's. The table gives the median over rounds. alpha is read off the mean acceptance length (speculation.py); the
prediction is Leviathan et al.'s E(alpha, k) / (k c + v) with v = 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import minigen  # noqa: E402
from minigen import drafts  # noqa: E402
from minigen.measure import bench  # noqa: E402
from minigen.measure.machine import hardware_info  # noqa: E402
from minigen.measure.speculation import alpha_from_length, predicted_speedup  # noqa: E402

OPEN = "Write a short story about a robot who learns to paint."


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--drafts", nargs="+", default=["ngram", "layers:24", "layers:28", "int8:32", "int4:64",
                                                        "int4:32", "unrelated"])
    parser.add_argument("--weight-bits", type=int, choices=[8, 4], help="quantize the target (drafts: ngram only)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    model, tok = minigen.load(weight_bits=args.weight_bits)
    prompts = {"grounded": bench.prompt_ids(tok, 200, grounded=True),
               "open": tok.apply_chat_template([{"role": "user", "content": OPEN}], add_generation_prompt=True,
                                               return_tensors="pt")["input_ids"]}
    made = {name: drafts.parse(name, model) for name in args.drafts if name != "ngram"}
    runs = {}  # label -> (prompt, config overrides, draft model or None)
    for name in args.drafts:
        for prompt in (["grounded", "open"] if name == "ngram" else ["open"]):
            for k in args.ks:
                method = "ngram" if name == "ngram" else "draft"
                runs[(name, prompt, k)] = (prompt, dict(speculative_method=method, num_speculative_tokens=k),
                                           made.get(name))
    gen = dict(max_new_tokens=args.new_tokens, stop_token_ids=[])
    plain = {p: minigen.generate(model, ids, **gen) for p, ids in prompts.items()}  # warm-up and the reference
    # each measurement is a pair, plain decoding of the same prompt right before it: a ratio within a
    # pair holds on a shared machine whose speed moves from one minute to the next
    ratios = {key: [] for key in [*made, *runs]}
    stats = {}
    for r in range(args.rounds):
        for name, draft in made.items():  # c: the draft's step over the target's
            target = minigen.generate(model, prompts["open"], **gen).stats.decode_tokens_per_s
            ratios[name].append(target / minigen.generate(draft, prompts["open"], **gen).stats.decode_tokens_per_s)
        for key, (p, overrides, draft) in runs.items():
            base = minigen.generate(model, prompts[p], **gen).stats.decode_tokens_per_s
            out = minigen.generate(model, prompts[p], **gen, **overrides, draft_model=draft)
            assert torch.equal(out.tokens, plain[p].tokens), f"{key}: speculative greedy tokens differ from plain"
            ratios[key].append(out.stats.decode_tokens_per_s / base)
            stats[key] = out.stats
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    hw = hardware_info()
    print(f"{hw['cpu']}, {hw['threads']} threads, torch {hw['torch']}; SmolLM2-135M "
          f"{'int%d' % args.weight_bits if args.weight_bits else 'fp32 (the dequantized Q4_1 file)'}; "
          f"{args.new_tokens} greedy tokens, median of {args.rounds} rounds in turns; plain decode "
          + ", ".join(f"{p} {plain[p].stats.decode_tokens_per_s:.1f} tok/s ({plain[p].stats.step}, the warm-up run)"
                      for p in prompts))
    print("| draft | prompt | k | c | acceptance rate | tokens per forward | alpha | measured | predicted (v = 1) |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for (name, p, k), s in stats.items():
        c = statistics.median(ratios[name]) if name in made else 0.0
        length = s.mean_acceptance_length
        alpha = alpha_from_length(min(max(length, 1.0), k + 1.0), k)
        row = dict(draft=name, prompt=p, k=k, c=c, acceptance_rate=s.acceptance_rate, tokens_per_forward=length,
                   alpha=alpha, measured=statistics.median(ratios[(name, p, k)]),
                   predicted=predicted_speedup(alpha, k, c))
        rows.append(row)
        print(f"| {name} | {p} | {k} | {c:.2f} | {s.acceptance_rate:.2f} | {length:.2f} | {alpha:.2f} | "
              f"{row['measured']:.2f}x | {row['predicted']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"hardware": hw, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
