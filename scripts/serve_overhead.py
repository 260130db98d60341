"""What the HTTP path adds to a request's time to first token: `minigen serve` against its own
Engine in this process, one request at a time, in turns (issue 43's "TTFT overhead at low load").

    python scripts/serve_overhead.py [--pairs 20] [--prompt-tokens 60] [--weight-bits 4] [--json out.json]

The server (`python -m minigen serve MODEL`, started as scripts/serve_race.py starts it, on 127.0.0.1
with OMP_NUM_THREADS=--threads) and an Engine built here on the same model, at the same thread
count, each get the same prompt (--prompt-tokens of English text, as token ids) with max_tokens=2,
greedy, alternately: a pair is one streamed request through the server, timed by the client from
sending to the first text chunk, and one `add_request` + `step()`s here until its first token. A
busy neighbour slows both halves of a pair alike; the medians, the median of the per-pair
differences and the difference of the fastest of each are reported (on a shared machine the last is
the steadiest). Nothing else runs: no request waits for another, so the difference is the
path (HTTP, JSON, the engine thread's hand-off, detokenizing), not queueing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_race beside this script

from minigen.loading import load  # noqa: E402
from minigen.measure.bench import prompt_ids  # noqa: E402
from minigen.measure.machine import hardware_info  # noqa: E402
from minigen.serving.engine import Engine  # noqa: E402
from serve_race import Server, versions, LLAMA_SERVER  # noqa: E402


def server_ttft(client: httpx.Client, url: str, model: str, ids: list[int]) -> float:
    """Seconds from sending one streamed completion to its first text chunk."""
    body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", f"{url}/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a chunk")


def engine_ttft(engine: Engine, ids: list[int]) -> float:
    """Seconds from add_request to the step that samples the request's first token."""
    t0 = time.perf_counter()
    rid = engine.add_request(ids, max_new_tokens=2)
    while rid not in engine.step():
        pass
    took = time.perf_counter() - t0
    engine.run()
    engine.forget(rid)
    return took


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20, help="timed pairs, after one warm-up pair")
    p.add_argument("--prompt-tokens", type=int, default=60)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weight-bits", type=int, choices=[8, 4])
    p.add_argument("--threads", type=int, default=1, help="the server's OMP_NUM_THREADS, and torch's threads here")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, weight_bits=args.weight_bits)
    ids = prompt_ids(tokenizer, args.prompt_tokens)[0].tolist()
    engine = Engine(model, max_batch_size=8)
    cmd = [sys.executable, "-m", "minigen", "serve", args.model, "--host", "127.0.0.1", "--port", "{port}"]
    if args.weight_bits:
        cmd += ["--weight-bits", str(args.weight_bits)]
    server = Server("minigen serve", cmd, args.threads)
    try:
        server.wait_ready()
        with httpx.Client(timeout=60) as client:
            server_ttft(client, server.url, args.model, ids), engine_ttft(engine, ids)  # warm-up pair
            pairs = [(server_ttft(client, server.url, args.model, ids), engine_ttft(engine, ids))
                     for _ in range(args.pairs)]
    finally:
        server.stop()
    served, alone = [s for s, _ in pairs], [e for _, e in pairs]
    result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "cpu": hardware_info()["cpu"], "threads": args.threads, "versions": versions(LLAMA_SERVER),
              "model": args.model, "weight_bits": args.weight_bits, "prompt_tokens": len(ids), "pairs": len(pairs),
              "server_ttft_s": {"median": statistics.median(served), "min": min(served)},
              "engine_ttft_s": {"median": statistics.median(alone), "min": min(alone)},
              "added_s": {"median_of_pairs": statistics.median(s - e for s, e in pairs),
                          "of_medians": statistics.median(served) - statistics.median(alone),
                          "of_minimums": min(served) - min(alone)}}
    print(f"{result['cpu']}, {args.threads} thread(s); {len(ids)}-token prompt, {len(pairs)} pairs in turns")
    print(f"  TTFT through minigen serve: median {1e3 * result['server_ttft_s']['median']:.1f} ms "
          f"(min {1e3 * min(served):.1f})")
    print(f"  TTFT of the Engine here:    median {1e3 * result['engine_ttft_s']['median']:.1f} ms "
          f"(min {1e3 * min(alone):.1f})")
    print(f"  added by the HTTP path: {1e3 * result['added_s']['median_of_pairs']:.2f} ms (median of the pairs' "
          f"differences), {1e3 * result['added_s']['of_minimums']:.2f} ms (of the fastest of each)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
