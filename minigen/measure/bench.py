"""Side-by-side benchmark: minigen vs transformers `generate`, with the memory-bandwidth roofline.

Both engines run in one process on the same weights and the same prompt, warm-up excluded, and
are timed the same way from outside:

    TTFT      = wall time of a 1-token generate (prefill + first sample)
    decode    = (N - 1) / (time of an N-token generate - TTFT)   tokens/s per sequence
    roofline  = memory read bandwidth / bytes read per decode step

A decode step must read every weight once (plus the KV cache), so on a memory-bound machine no
engine can beat the roofline; the achieved fraction says how much is left on the table.

The decode time is a difference of two measured times, so a run must be long enough for it to
stand out of their noise: `run_bench` refuses fewer than MIN_NEW_TOKENS new tokens, and a
difference that comes out zero or negative raises BenchError instead of printing a rate.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path

import torch

from ..config import GenerationConfig
from ..errors import BenchError
from ..generate import generate
from .machine import PeakRSS, hardware_info, memory_read_bandwidth  # noqa: F401 (also read as bench.*)
from ..numerics.precision import DTYPES, dtype_of
from ..numerics.weight_quant import check_weight_bits, quantize_weights
from ..numerics.weight_quant import weight_bytes as packed_weight_bytes

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

TEXT = Path(__file__).parents[1] / "data" / "english.txt"
# Below this the N-token run is within a prefill's noise of the 1-token run: with 4 tokens on
# SmolLM2 the 4-token run once took no longer than the 1-token run, reported as 3e9 tok/s.
MIN_NEW_TOKENS = 8


# The machine (hardware_info, memory_read_bandwidth, PeakRSS) lives in machine.py; bench re-exports it.


# ---------------------------------------------------------------- bytes per token
def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the weights, packed ones included (weight_quant.weight_bytes), each tensor once."""
    return packed_weight_bytes(module)


def bytes_per_decode_step(model, context: int, kv_bytes_per_element: int = 4) -> int:
    """Bytes one decode step must read: every weight once, plus the keys and values of `context`
    cached tokens. Of the embedding table a step reads one row, unless the output head is tied
    to it: then the head's matrix-vector product reads all of it."""
    cfg = model.config
    weights = weight_bytes(model)  # int8 / int4 weights: their packed bytes
    if model.lm_head is not None:
        weights -= model.embed.nbytes - model.embed[0].nbytes
    if model.pos_embed is not None:
        weights -= model.pos_embed.nbytes - model.pos_embed[0].nbytes
    return weights + context * cfg.kv_bytes_per_token(kv_bytes_per_element)


# ---------------------------------------------------------------- the engines
def prompt_ids(tokenizer, prompt_len: int) -> torch.Tensor:
    """The first `prompt_len` tokens of real English text, [1, prompt_len]."""
    text = TEXT.read_text(encoding="utf-8") if TEXT.exists() else "The quick brown fox jumps over the lazy dog. " * 200
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :prompt_len]
    if ids.shape[1] < prompt_len:
        raise BenchError(f"--prompt-len {prompt_len} is longer than the benchmark text, which is "
                         f"{ids.shape[1]} tokens for this tokenizer: use --prompt-len <= {ids.shape[1]}")
    return ids


def check_bench_args(prompt_len: int, new_tokens: int, repeats: int) -> None:
    """Refuse run sizes that cannot give a meaningful number, before anything is loaded."""
    for flag, value, low, why in (
            ("--prompt-len", prompt_len, 1, "the prompt needs a token"),
            ("--new-tokens", new_tokens, MIN_NEW_TOKENS,
             "the decode time is the N-token run minus the 1-token run, and needs enough tokens to be measurable"),
            ("--repeats", repeats, 1, "the median needs at least one timed run")):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise BenchError(f"{flag} {value!r} is too small: use {flag} >= {low} ({why})")


def exact(config: GenerationConfig) -> bool:
    """True when the config changes speed or memory but never the greedy tokens."""
    lossy = {"quant_bits": None, "window_size": None, "sparse_top_k": None, "sparsity_threshold": 0,
             "kv_budget": None, "kv_dtype": "float32"}
    values = config.to_dict()
    return all(values.get(k) in (None, ok) for k, ok in lossy.items())


def _time_engines(runs: dict, new_tokens: int, repeats: int, progress) -> dict[str, dict]:
    """Time each engine's `run(n)` -> tokens for n = 1 and n = new_tokens, median of `repeats`.

    The engines take turns within each round, so a slow spell of a shared machine (another
    tenant on the memory bus) falls on both engines instead of on one engine's block of runs.
    """
    for run in runs.values():
        run(2)  # warm-up: first-call allocations and kernel selection are not part of the numbers
    times = {name: {"ttft": [], "total": [], "peak": []} for name in runs}
    tokens = {}
    for _ in range(repeats):
        for name, run in runs.items():
            progress.set_postfix_str(name)
            t = time.perf_counter()
            run(1)
            times[name]["ttft"].append(time.perf_counter() - t)
            with PeakRSS() as mem:
                t = time.perf_counter()
                tokens[name] = run(new_tokens)
                times[name]["total"].append(time.perf_counter() - t)
            times[name]["peak"].append(mem.added)
            progress.update(1)
    results = {}
    for name, r in times.items():
        ttft, total = statistics.median(r["ttft"]), statistics.median(r["total"])
        if total <= ttft:
            raise BenchError(f"{name}'s {new_tokens}-token run took {total * 1000:.2f} ms, no longer than its "
                             f"1-token run ({ttft * 1000:.2f} ms), so its decode time cannot be measured: "
                             "use more --new-tokens (e.g. 128) or more --repeats")
        results[name] = {"ttft_s": ttft, "total_s": total,
                         "decode_tokens_per_s": (new_tokens - 1) / (total - ttft),
                         "run_peak_added_bytes": max(r["peak"]), "tokens": tokens[name]}
    return results


def run_bench(model_name: str = "smollm2-135m", config: GenerationConfig | None = None, prompt_len: int = 64,
              new_tokens: int = 128, repeats: int = 3, dtype: torch.dtype = torch.float32,
              baseline: bool = True, compute_dtype: torch.dtype | str | None = None,
              weight_bits: int | None = None, llama_cpp: bool = False) -> dict:
    """Benchmark minigen (with `config`) against transformers on one model and prompt -> results dict.

    compute_dtype: minigen's activations (precision.py; default fp32 on a CPU). transformers runs
    in the weights' dtype. weight_bits (8 or 4) quantizes minigen's weights (weight_quant.py) and
    adds minigen in the unquantized dtype to the same run, for the ratio. llama_cpp adds llama.cpp
    (llama-cpp-python) on the bundled GGUF. Every setting is checked before the weights load: the
    run sizes, then the model's context."""
    from tqdm.auto import tqdm
    from ..caches.make import check_for_model
    from ..loading import build_model, check_dtype, load_tokenizer, read_config, read_safetensors, resolve_folder
    check_bench_args(prompt_len, new_tokens, repeats)
    dtype = check_dtype(dtype)
    if weight_bits is not None:
        check_weight_bits(weight_bits, "--weight-bits")
    if llama_cpp:
        check_llama_cpp(model_name)
    compute = dtype_of(compute_dtype, "compute_dtype") if compute_dtype is not None else None
    config = config or GenerationConfig()
    if config.do_sample:
        raise BenchError("bench times greedy decoding, on which minigen and transformers must agree token "
                         "for token: drop do_sample and the sampling settings")
    config = config.replace(max_new_tokens=new_tokens, stop_token_ids=[])
    folder = resolve_folder(model_name)
    model_config = read_config(folder)
    if prompt_len + new_tokens > model_config.max_seq_len:
        raise BenchError(f"--prompt-len {prompt_len} + --new-tokens {new_tokens} exceeds the model's context of "
                         f"{model_config.max_seq_len} tokens: lower one of them")
    check_for_model(config, model_config)  # e.g. a quant_group_size that the head dim refuses
    tokenizer = load_tokenizer(folder)
    ids = prompt_ids(tokenizer, prompt_len)
    state = read_safetensors(folder)
    model = build_model(model_config, state, dtype)
    if compute is not None:
        model.precision = model.precision.replace(compute=compute)
    hw = hardware_info()
    compile_s = []

    def minigen_engine(m):
        def run(n: int):
            out = generate(m, ids, config, max_new_tokens=n)
            run.kv = out.stats.kv_cache_bytes
            compile_s.append(out.stats.compile_s)  # the warm-up compiles; later runs reuse it
            return out.tokens
        return run

    runs, modules = {}, {}
    if weight_bits is not None:  # the same run holds minigen unquantized, for the ratio
        runs[f"minigen {_DTYPE_NAMES[dtype]}"], modules[f"minigen {_DTYPE_NAMES[dtype]}"] = minigen_engine(model), model
        model = quantize_weights(build_model(model_config, state, dtype), weight_bits)
        if compute is not None:
            model.precision = model.precision.replace(compute=compute)
    elif dtype != torch.float32:  # the same run holds minigen in fp32, for the ratio (chapter 7)
        floats32 = build_model(model_config, state, torch.float32)
        runs["minigen float32"], modules["minigen float32"] = minigen_engine(floats32), floats32
    runs["minigen"], modules["minigen"] = minigen_engine(model), model
    if baseline:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
        hf.generation_config.eos_token_id = None  # run exactly N tokens, as minigen does
        hf.generation_config.pad_token_id = 0
        mask = torch.ones_like(ids)

        def run_hf(n: int):
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                  return_dict_in_generate=True)
            run_hf.kv = sum(t.nbytes for layer in out.cache.layers for t in (layer.keys, layer.values))
            return out.sequences

        runs["transformers"], modules["transformers"] = run_hf, hf
    if llama_cpp:
        runs["llama.cpp"] = llama_cpp_engine(ids, prompt_len + new_tokens)
    progress = tqdm(total=repeats * len(runs), desc="bench", unit="run")
    engines = _time_engines(runs, new_tokens, repeats, progress)
    progress.close()
    for name, r in engines.items():  # `run(n)` leaves its KV bytes in `run.kv`
        held = weight_bytes(modules[name]) if name in modules else runs[name].weights
        r.update(weight_bytes=held, kv_cache_bytes=runs[name].kv, peak_memory_bytes=held + r["run_peak_added_bytes"])

    # A shared machine's bandwidth moves: probe again after the runs and take the better reading, so
    # a probe that met a busy neighbour does not put an engine "above" its roofline.
    hw["memory_read_gb_s_probes"] = [hw["memory_read_gb_s"], memory_read_bandwidth()]
    hw["memory_read_gb_s"] = max(hw["memory_read_gb_s_probes"])
    kv_elem = DTYPES[config.kv_dtype].itemsize if config.kv_dtype else dtype.itemsize
    context = prompt_len + new_tokens // 2
    per_token = bytes_per_decode_step(model, context, kv_elem)  # minigen's: packed weights when quantized
    roofline = hw["memory_read_gb_s"] * 1e9 / per_token
    result = {"hardware": hw, "model": model_name, "dtype": str(dtype).removeprefix("torch."),
              "weight_bits": weight_bits, "precision": model.precision.describe(model.dtype),
              "compile_s": max(compile_s), "prompt_len": prompt_len, "new_tokens": new_tokens,
              "repeats": repeats, "config": config.to_dict(), "exact": exact(config) and weight_bits is None,
              "bytes_per_token": per_token, "roofline_tokens_per_s": roofline, "engines": {}}
    floats = modules.get(f"minigen {_DTYPE_NAMES[dtype]}", model)  # the unquantized weights transformers reads too
    for name, r in engines.items():  # each engine against the bytes its own step reads
        if name.startswith("minigen"):
            step_bytes = bytes_per_decode_step(modules[name], context, kv_elem)
        elif name == "transformers":
            step_bytes = bytes_per_decode_step(floats, context, kv_elem)
        else:  # llama.cpp: the GGUF file's weights and an fp16 cache
            step_bytes = runs[name].weights + context * model.config.kv_bytes_per_token(2)
        r["bytes_per_token"] = step_bytes
        r["roofline_fraction"] = r["decode_tokens_per_s"] * step_bytes / (hw["memory_read_gb_s"] * 1e9)
        result["engines"][name] = {k: v for k, v in r.items() if k != "tokens"}
    if weight_bits is not None:
        reference = result["engines"][f"minigen {_DTYPE_NAMES[dtype]}"]["decode_tokens_per_s"]
        result["speedup_vs_unquantized"] = result["engines"]["minigen"]["decode_tokens_per_s"] / reference
    elif "minigen float32" in result["engines"]:
        reference = result["engines"]["minigen float32"]["decode_tokens_per_s"]
        result["speedup_vs_float32"] = result["engines"]["minigen"]["decode_tokens_per_s"] / reference
    if llama_cpp:
        result["speedup_vs_llama_cpp"] = (result["engines"]["minigen"]["decode_tokens_per_s"]
                                          / result["engines"]["llama.cpp"]["decode_tokens_per_s"])
    if baseline:
        a, b = engines["minigen"]["tokens"], engines["transformers"]["tokens"]
        match = (a[:, prompt_len:] == b[:, prompt_len:]).float().mean().item()
        result["greedy_token_agreement"] = match
        result["speedup"] = engines["minigen"]["decode_tokens_per_s"] / engines["transformers"]["decode_tokens_per_s"]
        # Only fp32 is held to identical tokens: in bf16 or fp16 two correct implementations
        # round their sums differently, and a near-tie between two tokens may flip.
        if result["exact"] and dtype == torch.float32 and match < 1.0:
            raise AssertionError(f"minigen and transformers greedy tokens differ ({match:.1%} agree) "
                                 "under an exact config: this is a correctness bug")
    return result


# ---------------------------------------------------------------- llama.cpp, as an optional engine
def check_llama_cpp(model_name: str) -> None:
    """llama.cpp runs the bundled GGUF through llama-cpp-python, when it is installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise BenchError("--engine llama.cpp needs llama-cpp-python, which is not installed: pip install "
                         "llama-cpp-python (it builds llama.cpp from source; minigen's tests do not need it)")
    if model_name.lower() not in ("smollm2-135m", "smollm2-135m-instruct"):
        raise BenchError(f"--engine llama.cpp runs the bundled GGUF of 'smollm2-135m', not {model_name!r}")


def llama_cpp_engine(ids: torch.Tensor, context: int):
    """run(n) -> tokens [1, T + n]: llama.cpp's greedy decoding of the prompt, on the Q4_1 GGUF file."""
    from llama_cpp import Llama
    from ..loading import default_gguf_path
    path = default_gguf_path()
    llm = Llama(model_path=str(path), n_ctx=context + 8, n_threads=torch.get_num_threads(),
                n_threads_batch=torch.get_num_threads(), verbose=False)
    prompt = ids[0].tolist()

    def run(n: int):
        llm.reset()
        out = list(prompt)
        for i, token in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            out.append(int(token))
            if i + 1 == n:
                break
        return torch.tensor([out])

    run.kv = 0  # llama.cpp sizes its own cache; not counted here
    run.weights = path.stat().st_size
    return run


def print_report(result: dict) -> None:
    hw = result["hardware"]
    print(f"\nhardware: {hw['cpu']} | {hw['threads']} threads | torch {hw['torch']} | GPU: {hw['gpu'] or 'none'}")
    if "cpu_kernel" in hw and not hw["gpu"]:
        print(f"minigen's batch-1 matrix-vector kernel: {hw['cpu_kernel']}")
    print(f"model {result['model']} ({result['dtype']}), prompt {result['prompt_len']} tokens, "
          f"{result['new_tokens']} new tokens, median of {result['repeats']}")
    if "precision" in result:
        print(f"minigen's precision: {result['precision']}"
              + (f"; compiled in {result['compile_s']:.1f} s (the warm-up run; timed runs reuse it)"
                 if result.get("compile_s") else ""))
    if result.get("config", {}).get("fused_decode"):
        print("minigen's decode step: fused_decode=True, every layer of a token in one C call (fused.py)")
    if result.get("weight_bits"):
        print(f"minigen's weights: int{result['weight_bits']} (linear layers; the output head int8), "
              f"packed: the roofline counts the packed bytes")
    print(f"{'engine':<14}{'decode tok/s':>14}{'TTFT ms':>10}{'peak MiB':>10}{'KV MiB':>9}{'MB/step':>9}"
          f"{'of roofline':>13}")
    for name, r in result["engines"].items():
        print(f"{name:<14}{r['decode_tokens_per_s']:>14.1f}{r['ttft_s'] * 1000:>10.0f}"
              f"{r['peak_memory_bytes'] / 2**20:>10.0f}{r['kv_cache_bytes'] / 2**20:>9.2f}"
              f"{r.get('bytes_per_token', result['bytes_per_token']) / 1e6:>9.0f}{r['roofline_fraction']:>12.0%}")
    probes = hw.get("memory_read_gb_s_probes")  # absent from a result saved before bench probed twice
    when = (f"the better of {', '.join(f'{b:.1f}' for b in probes)} before and after the runs" if probes
            else "measured now")
    print(f"memory read bandwidth ({when}): {hw['memory_read_gb_s']:.1f} GB/s; "
          f"bytes per decode step (minigen): {result['bytes_per_token'] / 1e6:.0f} MB; "
          f"roofline: {result['roofline_tokens_per_s']:.1f} tok/s")
    if "speedup_vs_unquantized" in result:
        print(f"minigen int{result['weight_bits']} / minigen {result['dtype']} decode: "
              f"{result['speedup_vs_unquantized']:.2f}x (same run)")
    if "speedup_vs_float32" in result:
        print(f"minigen {result['dtype']} / minigen float32 decode: {result['speedup_vs_float32']:.2f}x (same run)")
    if "speedup_vs_llama_cpp" in result:
        print(f"minigen / llama.cpp decode: {result['speedup_vs_llama_cpp']:.2f}x")
    if "speedup" in result:
        print(f"minigen / transformers decode: {result['speedup']:.2f}x; greedy tokens agree: "
              f"{result['greedy_token_agreement']:.1%} ({'exact config' if result['exact'] else 'lossy config'}"
              f"{'' if result['dtype'] == 'float32' else '; asserted in float32 only'})")
