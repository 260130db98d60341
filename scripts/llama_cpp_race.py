"""llama.cpp's own benchmark beside minigen's, in turns: the native `llama-bench` on the bundled GGUF
in Q4_1, Q4_0 and Q8_0 (gguf_formats.py makes the last two once), and `python -m minigen bench` with
int4 and int8 weights, on the same machine, thread count, prompt length and decode length.

    python scripts/llama_cpp_race.py --llama-bench PATH [--rounds 3] [--threads 2] [--json OUT]

Why: `bench --engine llama.cpp` runs llama.cpp through llama-cpp-python, built by pip; llama-bench
is llama.cpp's own measurement, of a native build, the number its authors quote. Each round runs
every engine once, one after another, so a slow spell of a shared machine falls on all of them.

    llama.cpp   llama-bench -m FILE -p 512 -n 128 -t THREADS -o json: pp512 and tg128 (its mean of
                its own repetitions, 5 by default), each format a row
    minigen     python -m minigen bench --weight-bits {4,8} --no-baseline --prompt-len 512
                --new-tokens 128 --repeats 3, with OMP_NUM_THREADS=THREADS: prompt tok/s (512 / its
                time to the first token, which includes sampling that token); and the same with
                --prompt-len 16: decode tok/s (its median 128-token run minus its 1-token run), from
                a short context as llama-bench's tg128 decodes from an empty one (a first race
                decoded after the 512-token prompt: every step attended to 512 more positions)

The table prints decode tok/s (tg128) and prompt tok/s (pp512) per engine and round, with the CPU
model and the threads. The binary's path: --llama-bench or $LLAMA_BENCH.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from minigen.errors import BenchError, MinigenError  # noqa: E402
from minigen.kernels.fastpaths import machine  # noqa: E402
from minigen.measure.gguf_formats import FORMATS, requantized_gguf  # noqa: E402
from minigen.paths import check_output_path  # noqa: E402

PROMPT, DECODE = 512, 128
SHORT_PROMPT = 16  # minigen's decode runs from a prompt this short (tg128's cache starts empty)
MINIGEN_BITS = (4, 8)
TIMEOUT_S = 900  # one engine's run; a hung binary ends the race with an error, not forever


class RaceError(Exception):
    """A bad argument or a failed run, said in one line (main prints it, exit code 2)."""


def check_binary(path: str | None) -> Path:
    if not path:
        raise RaceError("name llama.cpp's llama-bench binary: --llama-bench PATH or LLAMA_BENCH=PATH "
                        "(built by cmake in llama.cpp's build/bin)")
    binary = Path(path)
    if not binary.is_file():
        raise RaceError(f"--llama-bench {path}: no such file; build llama.cpp (cmake --build build "
                        "--target llama-bench) and pass build/bin/llama-bench")
    if not os.access(binary, os.X_OK):
        raise RaceError(f"--llama-bench {path}: not executable (chmod +x it, or pass the built binary)")
    return binary


def run(cmd: list[str], what: str, env: dict | None = None) -> str:
    """Run `cmd` -> its stdout; a failure or a timeout -> RaceError with the end of its stderr."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise RaceError(f"{what} ran past {TIMEOUT_S} s: {' '.join(cmd)}") from None
    except OSError as e:
        raise RaceError(f"{what} could not start ({e.strerror or e}): {cmd[0]}") from None
    if done.returncode != 0:
        tail = "\n  ".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise RaceError(f"{what} failed with exit code {done.returncode}:\n  {tail}")
    return done.stdout


def llama_bench(binary: Path, model: Path, threads: int) -> dict:
    """One llama-bench run of pp512 and tg128 on `model` -> {"prompt": tok/s, "decode": tok/s}."""
    out = run([str(binary), "-m", str(model), "-p", str(PROMPT), "-n", str(DECODE), "-t", str(threads),
               "-o", "json"], f"llama-bench on {model.name}")
    try:
        tests = json.loads(out)
        speed = {("prompt" if t["n_gen"] == 0 else "decode"): float(t["avg_ts"]) for t in tests}
    except (ValueError, KeyError, TypeError) as e:
        raise RaceError(f"llama-bench on {model.name} printed no JSON this script reads ({e}): {out[:200]!r}") from None
    if set(speed) != {"prompt", "decode"}:
        raise RaceError(f"llama-bench on {model.name} reported {sorted(speed)}, not pp{PROMPT} and tg{DECODE}")
    return speed


def minigen_bench(bits: int, threads: int, folder: Path) -> dict:
    """Two `python -m minigen bench` runs of int`bits` weights -> {"prompt": tok/s, "decode": tok/s}: the
    prompt's rate from a PROMPT-token prompt, the decode rate from a SHORT_PROMPT-token one, as tg128 decodes
    from an empty cache (after PROMPT tokens, each step would also attend to them)."""
    out = folder / f"minigen-int{bits}.json"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    rows = {}
    for what, prompt in (("prompt", PROMPT), ("decode", SHORT_PROMPT)):
        run([sys.executable, "-m", "minigen", "bench", "--weight-bits", str(bits), "--no-baseline",
             "--prompt-len", str(prompt), "--new-tokens", str(DECODE), "--repeats", "3", "--json", str(out)],
            f"minigen bench --weight-bits {bits} --prompt-len {prompt}", env)
        result = json.loads(out.read_text())
        if result["hardware"]["threads"] != threads:
            raise RaceError(f"minigen bench ran on {result['hardware']['threads']} threads, not {threads}")
        rows[what] = result["engines"]["minigen"]
    return {"prompt": rows["prompt"]["prefill_tokens_per_s"], "decode": rows["decode"]["decode_tokens_per_s"]}


def race(binary: Path, rounds: int, threads: int) -> dict[str, list[dict]]:
    """-> {engine: [one {"prompt", "decode"} per round]}, the engines taking turns within each round."""
    models = {f"llama.cpp {fmt}": requantized_gguf(fmt) for fmt in FORMATS}  # made once, before any timing
    speeds: dict[str, list[dict]] = {name: [] for name in models}
    speeds.update({f"minigen int{bits}": [] for bits in MINIGEN_BITS})
    with tempfile.TemporaryDirectory() as folder:
        for r in range(rounds):
            for name, model in models.items():
                speeds[name].append(llama_bench(binary, model, threads))
                print(f"round {r + 1}: {name}: {speeds[name][-1]}", file=sys.stderr)
            for bits in MINIGEN_BITS:
                name = f"minigen int{bits}"
                speeds[name].append(minigen_bench(bits, threads, Path(folder)))
                print(f"round {r + 1}: {name}: {speeds[name][-1]}", file=sys.stderr)
    return speeds


def table(speeds: dict[str, list[dict]], cpu: str, threads: int) -> str:
    """The markdown table: engine x round, decode (tg128) and prompt (pp512) tok/s, and the medians."""
    rounds = len(next(iter(speeds.values())))
    lines = [f"{cpu}, {threads} threads; tok/s, round by round (median last)", "",
             f"| engine | decode tg{DECODE} | prompt pp{PROMPT} |", "|---|---|---|"]
    for name, runs in speeds.items():
        cells = []
        for key in ("decode", "prompt"):
            values = [run_[key] for run_ in runs]
            cells.append(", ".join(f"{v:.1f}" for v in values)
                         + (f" (median {statistics.median(values):.1f})" if rounds > 1 else ""))
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                   help="llama.cpp's llama-bench binary (default: $LLAMA_BENCH)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every engine in turn (default 3)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every engine")
    p.add_argument("--json", help="write the speeds and the machine to this JSON file")
    args = p.parse_args(argv)
    try:
        if args.rounds < 1 or args.threads < 1:
            raise RaceError(f"--rounds {args.rounds} --threads {args.threads}: each must be at least 1")
        binary = check_binary(args.llama_bench)
        if args.json:  # refused before the minutes of runs, not after them
            check_output_path(args.json, "--json", BenchError)
        speeds = race(binary, args.rounds, args.threads)
    except (RaceError, MinigenError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cpu = machine()
    print(table(speeds, cpu, args.threads))
    if args.json:
        Path(args.json).write_text(json.dumps({"date": datetime.date.today().isoformat(), "cpu": cpu,
                                               "threads": args.threads, "prompt": PROMPT,
                                               "decode": DECODE, "speeds": speeds}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
