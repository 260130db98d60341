"""A soak test of `minigen serve` under load (issue 43): R rounds of D seconds of 64 streaming clients,
a quarter hanging up mid-stream; after each round, once idle, the server must run and queue nothing,
its KV pool be back where it began, and its RSS not grow across rounds (minigen/measure/serve_soak.py
says each check and its tolerance).

    python scripts/serve_soak.py [--rounds 3 --duration-s 120 --clients 64] [--weight-bits 4]
                                 [--max-waiting 256] [--threads 1] [--json docs/runs/serve_soak.json]

The server, `python -m minigen serve MODEL --max-batch-size 8`, is started as a subprocess on
127.0.0.1 at a free port, waited for and stopped as scripts/serve_race.py does (its Server), with
OMP_NUM_THREADS=--threads (1 by default: the clients share this machine). Prompts and lengths are
serve-bench's workload (serve_client.build_workload). Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from minigen.errors import MinigenError  # noqa: E402
from minigen.loading import load_tokenizer, resolve_folder  # noqa: E402
from minigen.measure.serve_client import build_workload  # noqa: E402
from minigen.measure.serve_soak import cpu_info, format_soak, run_soak  # noqa: E402
from serve_race import Server, versions  # noqa: E402  (scripts/ is this script's sys.path[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration-s", type=float, default=120.0, help="seconds each round sends new requests")
    p.add_argument("--clients", type=int, default=64, help="streaming clients, each one request after another")
    p.add_argument("--disconnect-fraction", type=float, default=0.25, help="share of requests that hang up mid-stream")
    p.add_argument("--requests", type=int, default=4096, help="the workload's size (taken in turn, cycled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-waiting", type=int, help="the server's --max-waiting (default: its own, 256)")
    p.add_argument("--weight-bits", type=int, choices=[8, 4], help="serve int8 or int4 weights (default fp32)")
    p.add_argument("--threads", type=int, default=1, help="the server's OMP_NUM_THREADS")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    try:
        return soak(args)
    except MinigenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def soak(args) -> int:
    tokenizer = load_tokenizer(resolve_folder(args.model))
    workload = build_workload(tokenizer, args.requests, math.inf, seed=args.seed)
    cmd = [sys.executable, "-m", "minigen", "serve", args.model, "--host", "127.0.0.1", "--port", "{port}",
           "--max-batch-size", str(args.max_batch_size)]
    cmd += ["--max-waiting", str(args.max_waiting)] if args.max_waiting else []
    cmd += ["--weight-bits", str(args.weight_bits)] if args.weight_bits else []
    server = Server(f"minigen serve {args.model}", cmd, args.threads)
    try:
        ready_s = server.wait_ready()
        print(f"{server.name}: ready in {ready_s:.1f} s at {server.url} (pid {server.proc.pid})", flush=True)
        result = run_soak(server.url, server.proc.pid, workload, tokenizer, rounds=args.rounds,
                          duration_s=args.duration_s, clients=args.clients,
                          disconnect_fraction=args.disconnect_fraction, seed=args.seed,
                          log=lambda line: print(line, flush=True))
        alive = server.proc.poll() is None
        result["checks"]["server alive"] = {"pass": alive, "detail": "running after the last round" if alive else
                                            f"exited with code {server.proc.returncode}"}
        result["pass"] = result["pass"] and alive
    finally:
        server.stop()
    result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": cpu_info(),
              "cores": os.cpu_count(), "versions": versions(Path(os.devnull)),  # no llama-server here
              "settings": {"model": args.model, "command": " ".join(cmd), "threads": args.threads,
                           "max_batch_size": args.max_batch_size, "max_waiting": args.max_waiting or 256,
                           "weight_bits": args.weight_bits, "ready_s": ready_s}} | result
    print(format_soak(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
