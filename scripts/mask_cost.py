"""What structured output costs per token on SmolLM2 (issue 44's "mask cost per token at most 10%
of a decode step"), for each of the 30 test schemas in tests/data/schemas/.

    python scripts/mask_cost.py [--threads 1] [--repeats 3] [--max-new-tokens 96] [--json docs/runs/mask_cost.json]

For each schema and backend (llguidance on all 30; minigen's own automaton on the 22 of its subset):
- compile_s: the compile of the schema against SmolLM2's vocabulary (the tokenizer's one-time
  tables are built before the first timed compile);
- a greedy generate under response_format (the default step: the fused C step at batch 1) beside the
  same prompt and number of new tokens without the mask, in turns (masked, plain, masked, ...): the
  median time per decode step of each, and their ratio - 1 (the overhead as the loop sees it, with
  the masks computed while the forward runs);
- mask_us: the matcher's own work per token, replayed on one thread with nothing overlapping it
  (allowed() + advance() for each token of the reply), and its share of the plain decode step; the
  own backend's masks are cached per DFA state by then, so first_visits_s adds what computing them
  cost the first time (a trie walk per state reached), once per schema.
A reply that ends must parse and follow its schema (jsonschema), or the run stops there; one that
the model never ends (it may keep writing digits: tests/test_structured.py) is timed over
--max-new-tokens and marked ended=false.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from minigen import GenerationConfig, generate  # noqa: E402
from minigen.decoding.structured import compile_guide, compiled  # noqa: E402
from minigen.decoding.token_mask import vocabulary_trie  # noqa: E402
from minigen.decoding.guidance import ll_tokenizer  # noqa: E402
from minigen.loading import load  # noqa: E402
from minigen.measure.machine import hardware_info  # noqa: E402

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "data" / "schemas"


def in_subset(schema: dict) -> bool:
    """The schemas README's mark: a "$comment" that starts "In minigen's subset"."""
    return str(schema.get("$comment", "")).startswith("In minigen's subset")


def chat(tokenizer, schema: dict) -> torch.Tensor:
    body = {k: v for k, v in schema.items() if k != "$comment"}
    text = f"Write one JSON value that follows this JSON schema, and nothing else:\n{json.dumps(body)}"
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt").input_ids


def step_median(stats) -> float:
    """The median decode step of a run: its token latencies after the first (which holds the prompt)."""
    return statistics.median(stats.token_latencies_s[1:])


def replay_us(guide, tokens: list[int]) -> float:
    """The matcher's work per token, alone on this thread: allowed() then advance() for each token."""
    matcher, start = guide.matcher(), time.perf_counter()
    for t in tokens:
        matcher.allowed()
        matcher.advance(t)
    return (time.perf_counter() - start) / len(tokens) * 1e6


def measure(model, tokenizer, name: str, schema: dict, backend: str, repeats: int, max_new: int) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    config = GenerationConfig(max_new_tokens=max_new, response_format=fmt, guided_backend=backend)
    eos = model.config.eos_token_ids
    compiled.cache_clear()
    start = time.perf_counter()
    guide = compile_guide(config, tokenizer, model.config.vocab_size, eos)
    compile_s = time.perf_counter() - start
    ids = chat(tokenizer, schema)
    masked, plain, reply = [], [], None
    for _ in range(repeats):
        out = generate(model, ids, config, tokenizer=tokenizer)
        reply = out.tokens[0, ids.shape[1]:].tolist()
        masked.append(step_median(out.stats))
        n = len(reply)
        out = generate(model, ids, max_new_tokens=n, stop_token_ids=[])
        plain.append(step_median(out.stats))
    text = tokenizer.decode(reply, skip_special_tokens=True)
    ended = reply[-1] in eos  # a model may never stop (tests/test_structured.py: a bare number's digits)
    if ended:
        jsonschema.validate(json.loads(text), schema)
    m, p = statistics.median(masked), statistics.median(plain)
    first_visits_s = getattr(guide, "first_visit_s", 0.0)  # the own backend: masks computed as rows first reach states
    mask_us = statistics.median(replay_us(guide, reply) for _ in range(repeats))
    return {"schema": name, "backend": backend, "compile_s": compile_s, "first_visits_s": first_visits_s,
            "reply_tokens": len(reply), "ended": ended,
            "masked_step_s": m, "plain_step_s": p, "overhead": m / p - 1,
            "mask_us": mask_us, "mask_share_of_step": mask_us * 1e-6 / p, "reply": text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--only", help="a substring of the schema file names to run")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load("smollm2-135m")
    started = time.perf_counter()
    ll_tokenizer(tokenizer), vocabulary_trie(tokenizer)  # the tokenizer's one-time tables, not any schema's
    print(f"tokenizer tables (llguidance's and the own trie), once: {time.perf_counter() - started:.2f} s")
    rows = []
    for path in sorted(SCHEMAS.glob("*.json")):
        if args.only and args.only not in path.name:
            continue
        schema = json.loads(path.read_text())
        for backend in ("llguidance", "minigen") if in_subset(schema) else ("llguidance",):
            row = measure(model, tokenizer, path.name, schema, backend, args.repeats, args.max_new_tokens)
            rows.append(row)
            print(f"{path.name:<34} {backend:<10} compile {row['compile_s'] * 1e3:7.1f} ms  reply {row['reply_tokens']:3d} "
                  f"tokens  step {row['plain_step_s'] * 1e3:5.1f} -> {row['masked_step_s'] * 1e3:5.1f} ms "
                  f"({row['overhead']:+.1%})  mask {row['mask_us']:7.1f} us ({row['mask_share_of_step']:.2%} of a step)",
                  flush=True)
    by = {b: [r for r in rows if r["backend"] == b] for b in ("llguidance", "minigen")}
    summary = {b: {"schemas": len(rs), "median_overhead": statistics.median(r["overhead"] for r in rs),
                   "max_overhead": max(r["overhead"] for r in rs),
                   "median_mask_share": statistics.median(r["mask_share_of_step"] for r in rs),
                   "max_mask_share": max(r["mask_share_of_step"] for r in rs),
                   "median_compile_s": statistics.median(r["compile_s"] for r in rs),
                   "max_compile_s": max(r["compile_s"] for r in rs)} for b, rs in by.items() if rs}
    for b, s in summary.items():
        print(f"{b}: overhead median {s['median_overhead']:+.1%}, max {s['max_overhead']:+.1%}; the mask alone "
              f"median {s['median_mask_share']:.2%}, max {s['max_mask_share']:.2%} of a step; compile median "
              f"{s['median_compile_s'] * 1e3:.1f} ms, max {s['max_compile_s'] * 1e3:.1f} ms")
    if args.json:
        result = {"date": datetime.date.today().isoformat(), "hardware": hardware_info(), "threads": args.threads,
                  "repeats": args.repeats, "model": "smollm2-135m (fp32: the dequantized Q4_1 GGUF)",
                  "step": "the default decode step at batch 1 (see each generate's plan)",
                  "summary": summary, "rows": rows}
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
