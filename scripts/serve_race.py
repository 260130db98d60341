"""Serving engines side by side over HTTP: one seeded workload, sent by the same client
(minigen/measure/serve_client.py) to each OpenAI-compatible server in turn, on this machine.

    python scripts/serve_race.py [--requests 32 --rate 4] [--low-requests 8 --low-rate 0.5]
                                 [--llama-server PATH] [--threads 1] [--json docs/runs/serve_race.json]

The servers, each started as a subprocess on 127.0.0.1 at a free port, waited for (GET /v1/models
answers), sent every scenario's workload, and stopped (SIGTERM to its process group, then SIGKILL):

    transformers      `transformers serve FOLDER --continuous-batching` on minigen's converted
                      SmolLM2 folder, fp32 (it takes prompts only as text, and refuses ignore_eos:
                      its replies may end at EOS before max_tokens; the table counts them as "short")
    llama.cpp         `llama-server` on the bundled Q4_1 GGUF, -np max-batch-size parallel slots, -cb
    minigen fp32      `python -m minigen serve`
    minigen int4      `python -m minigen serve --weight-bits 4`

An engine whose binary or package is missing is skipped, and the run says so. Beside them, the
in-process baseline: the same workload replayed through minigen's Engine in this process
(serve_bench.py's "minigen" engine, wall-clock arrivals), so that the server's overhead reads as a
ratio: output tok/s through `minigen serve` over Engine.run's (loaded scenario), and TTFT p50
through the server minus in-process (low-rate scenario, where no request waits for another).

Scenarios: "loaded", --requests at --rate per second (Poisson; a rate above what the servers
sustain, so they run full batches), and "low", --low-requests at --low-rate (mostly one request in
flight: TTFT is the overhead of the path, not queueing). Every server gets the same greedy
requests, max_tokens from the workload, ignore_eos where taken.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from minigen.errors import MinigenError  # noqa: E402
from minigen.loading import default_gguf_path, load_tokenizer, resolve_folder  # noqa: E402
from minigen.measure.machine import hardware_info  # noqa: E402
from minigen.measure.serve_bench import ENGINES, Models, pool_blocks, run_serve_bench  # noqa: E402
from minigen.measure.serve_client import build_workload, format_client, run_client  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LLAMA_SERVER = Path("/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server")
READY_TIMEOUT_S = 300  # a server that has not answered /v1/models by then has failed to start
SLOT_CONTEXT = 512  # llama-server's context per slot: the workload's longest request (29 + 256 + 128) fits


class RaceError(MinigenError):
    """A server that failed to start or to answer, in one line."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_commands(args, model_folder: Path, blocks: int) -> dict[str, list[str] | str]:
    """name -> the command that starts its server at port {port}, or why it is skipped."""
    cmds: dict[str, list[str] | str] = {}
    transformers_cli = Path(sys.executable).parent / "transformers"
    missing = [p for p in ("transformers", "fastapi", "uvicorn", "accelerate") if not has_package(p)]
    if missing or not transformers_cli.exists():
        cmds["transformers"] = f"skipped: `transformers serve` needs {missing or [str(transformers_cli)]}"
    else:  # the KV pool as serve_bench's TransformersContinuous sizes it (its default takes most of RAM)
        cmds["transformers"] = [str(transformers_cli), "serve", str(model_folder), "--continuous-batching",
                                "--host", "127.0.0.1", "--port", "{port}", "--device", "cpu", "--dtype", "float32",
                                "--cb-num-blocks", "256", "--cb-block-size", "32", "--cb-max-batch-tokens", "256",
                                "--log-level", "warning"]
    server = Path(args.llama_server)
    if not (server.is_file() and os.access(server, os.X_OK)):
        cmds["llama.cpp Q4_1"] = (f"skipped: no llama-server at {server} (build it: cmake -B build "
                                  "-DLLAMA_BUILD_SERVER=ON && cmake --build build --target llama-server)")
    else:
        cmds["llama.cpp Q4_1"] = [str(server), "-m", str(default_gguf_path()), "--host", "127.0.0.1",
                                  "--port", "{port}", "-np", str(args.max_batch_size), "-cb",
                                  "-c", str(args.max_batch_size * SLOT_CONTEXT), "-t", str(args.threads)]
    minigen = [sys.executable, "-m", "minigen", "serve", args.model, "--host", "127.0.0.1", "--port", "{port}",
               "--max-batch-size", str(args.max_batch_size), "--num-blocks", str(blocks)]
    cmds["minigen fp32"] = minigen
    cmds["minigen int4"] = minigen + ["--weight-bits", "4"]
    return {k: v for k, v in cmds.items() if not args.engine or k in args.engine}


def has_package(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


class Server:
    """One server subprocess: started in its own process group, logged to a temporary file."""

    def __init__(self, name: str, cmd: list[str], threads: int):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve_race_", suffix=".log", delete=False)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads),
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen([c.replace("{port}", str(self.port)) for c in cmd], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)

    def tail(self) -> str:
        return "\n  ".join(Path(self.log.name).read_text(errors="replace").strip().splitlines()[-8:])

    def wait_ready(self) -> float:
        """Seconds until GET /v1/models answers 200; RaceError if the process ends or time runs out."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < READY_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RaceError(f"{self.name} exited with code {self.proc.returncode} before it was ready:\n  {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise RaceError(f"{self.name} did not answer {self.url}/models within {READY_TIMEOUT_S} s:\n  {self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def in_process(workload, max_batch_size: int, models: Models) -> dict:
    """The workload replayed through minigen's Engine in this process, arrivals on the wall clock."""
    engine = {"minigen in-process": lambda: ENGINES["minigen"](models, workload, max_batch_size)}
    m = run_serve_bench(workload, engine, skip_idle=False)["runs"]["minigen in-process"]
    return {k: m[k] for k in ("ttft_s", "tpot_s", "e2e_latency_s", "output_tokens_per_s")} | {
        "output_tokens": sum(r["output_tokens"] for r in m["requests"]), "requests": len(m["requests"])}


def versions(llama_server: Path) -> dict:
    out = {p: importlib.metadata.version(p) for p in ("torch", "transformers", "openai", "fastapi", "uvicorn")
           if has_package(p)}
    out["python"] = sys.version.split()[0]
    out["minigen commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True).stdout.strip()
    if llama_server.is_file():
        done = subprocess.run([str(llama_server), "--version"], capture_output=True, text=True, timeout=30)
        out["llama.cpp"] = " ".join((done.stdout + done.stderr).split()[:6])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32, help="requests of the loaded scenario")
    p.add_argument("--rate", type=float, default=4.0, help="its arrivals per second (Poisson); inf: all at once")
    p.add_argument("--low-requests", type=int, default=8, help="requests of the low-rate scenario (0: none)")
    p.add_argument("--low-rate", type=float, default=0.5, help="its arrivals per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-size", type=int, default=8, help="sequences each server runs at once")
    p.add_argument("--threads", type=int, default=1, help="llama-server -t, and OMP_NUM_THREADS of the others (default 1: "
                   "the client shares this machine; on 2 cores a server spinning 2 threads starves it)")
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-s", type=float, default=0.2, help="goodput: TPOT at most this")
    p.add_argument("--model", default="smollm2-135m", help="minigen's name or folder of the model (and tokenizer)")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", str(LLAMA_SERVER)))
    p.add_argument("--engine", action="append", help="race only these (repeatable); default all")
    p.add_argument("--no-in-process", action="store_true", help="skip the in-process Engine baseline")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    try:
        return race(args)
    except MinigenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def race(args) -> int:
    folder = resolve_folder(args.model)
    tokenizer = load_tokenizer(folder)
    scenarios = {"loaded": (args.requests, args.rate)}
    if args.low_requests:
        scenarios["low"] = (args.low_requests, args.low_rate)
    workloads = {s: build_workload(tokenizer, n, rate, seed=args.seed) for s, (n, rate) in scenarios.items()}
    blocks = max(pool_blocks(w, args.max_batch_size) for w in workloads.values())
    hw = hardware_info()
    result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu": hw["cpu"],
              "cores": os.cpu_count(), "torch_threads": hw["threads"], "versions": versions(Path(args.llama_server)),
              "max_batch_size": args.max_batch_size, "slo": {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s},
              "scenarios": {s: {"workload": w.description, "runs": {}} for s, w in workloads.items()}, "skipped": {}}
    for name, cmd in engine_commands(args, folder, blocks).items():
        if isinstance(cmd, str):
            result["skipped"][name] = cmd
            print(f"{name}: {cmd}")
            continue
        server = Server(name, cmd, args.threads)
        try:
            ready_s = server.wait_ready()
            print(f"{name}: ready in {ready_s:.1f} s at {server.url}", flush=True)
            for s, w in workloads.items():
                run = run_client(server.url, w, tokenizer, seed=args.seed, slo_ttft_s=args.slo_ttft_s,
                                 slo_tpot_s=args.slo_tpot_s)
                result["scenarios"][s]["runs"][name] = run | {"ready_s": ready_s}
                print(f"  {s}: {run['output_tokens_per_s']:.1f} output tok/s, {run['counts']['completed']} completed",
                      flush=True)
        except MinigenError as e:
            result["skipped"][name] = f"failed: {e}"
            print(f"{name}: failed: {e}", file=sys.stderr)
        finally:
            server.stop()
    if not args.no_in_process:
        # the baseline gets the servers' thread count: OMP_NUM_THREADS does not reach this process's torch
        torch.set_num_threads(args.threads)
        models = Models(args.model)
        for s, w in workloads.items():
            result["scenarios"][s]["in_process"] = in_process(w, args.max_batch_size, models)
    result["overhead"] = overhead(result)
    print(format_race(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


def overhead(result: dict) -> dict:
    """minigen serve (fp32) against the in-process Engine: output tok/s ratio under load, and the TTFT
    p50 the HTTP path adds at the low rate."""
    out = {}
    loaded, low = result["scenarios"]["loaded"], result["scenarios"].get("low")
    if "in_process" in loaded and "minigen fp32" in loaded["runs"]:
        out["loaded_output_tok_s_server_over_in_process"] = (loaded["runs"]["minigen fp32"]["output_tokens_per_s"]
                                                             / loaded["in_process"]["output_tokens_per_s"])
    if low and "in_process" in low and "minigen fp32" in low["runs"]:
        out["low_ttft_p50_added_s"] = low["runs"]["minigen fp32"]["ttft_s"]["p50"] - low["in_process"]["ttft_s"]["p50"]
    return out


def format_race(result: dict) -> str:
    lines = [f"{result['date']}  {result['cpu']}, {result['cores']} cores; {result['versions']}"]
    for s, sc in result["scenarios"].items():
        lines += ["", f"{s}: {sc['workload']}", format_client(sc["runs"]) if sc["runs"] else "(no server ran)"]
        if "in_process" in sc:
            m = sc["in_process"]
            lines.append(f"{'minigen Engine in-proc.':<24}{m['output_tokens_per_s']:>10.1f}{'':>15}"
                         f"{m['ttft_s']['p50']:>9.3f}/{m['ttft_s']['p90']:.3f}/{m['ttft_s']['p99']:.3f}"
                         f"{m['tpot_s']['p50'] * 1e3:>10.1f}/{m['tpot_s']['p90'] * 1e3:.1f}/{m['tpot_s']['p99'] * 1e3:.1f}"
                         f"  (no HTTP; {m['requests']} requests)")
    for name, why in result["skipped"].items():
        lines.append(f"{name}: {why}")
    for key, value in result["overhead"].items():
        lines.append(f"{key}: {value:.3f}" if math.isfinite(value) else f"{key}: {value}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
