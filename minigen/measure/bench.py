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

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import drafts
from ..config import GenerationConfig
from ..decoding.logits import LogitsProcessing
from ..errors import BenchError
from ..generate import generate
from ..steps.choose import measurements
from .machine import PeakRSS, hardware_info, memory_read_bandwidth
from ..numerics.precision import DTYPES, dtype_of
from ..numerics.weight_quant import check_weight_bits, quantize_weights
from ..numerics.weight_quant import weight_bytes as packed_weight_bytes
from . import speculation
from .llama_cpp import check_llama_cpp, llama_cpp_engines

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

TEXT = Path(__file__).parents[1] / "data" / "english.txt"
# The decode time is the N-token run minus the 1-token run. With fewer new tokens that difference
# is within a prefill's noise (on SmolLM2 a 4-token run can take no longer than the 1-token run),
# and dividing by a difference near zero reports an absurd rate, such as 3e9 tok/s.
MIN_NEW_TOKENS = 8
SPECULATIVE_KEYS = ("speculative_method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


# ---------------------------------------------------------------- bytes per token
def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the weights, packed ones included (weight_quant.weight_bytes), each tensor once."""
    return packed_weight_bytes(module)


def bytes_per_decode_step(model, context: int, kv_bytes_per_element: int = 4) -> int:
    """Bytes one decode step must read: every weight once, plus the keys and values of `context`
    cached tokens in each layer, at most its window in a sliding one (ModelConfig.kv_positions: what
    the hybrid cache holds, and what any cache's attention reads where it skips masked slots).
    Of the embedding table a step reads one row, unless the output head is tied to it: then the
    head's matrix-vector product reads all of it."""
    cfg = model.config
    weights = weight_bytes(model)  # int8 / int4 weights: their packed bytes
    if model.lm_head is not None:
        weights -= model.embed.nbytes - model.embed[0].nbytes
    if model.pos_embed is not None:
        weights -= model.pos_embed.nbytes - model.pos_embed[0].nbytes
    positions = sum(cfg.kv_positions(layer, context) for layer in range(cfg.n_layers))  # L x context: none slides
    return weights + positions * 2 * cfg.n_kv_heads * cfg.head_dim * kv_bytes_per_element


# ---------------------------------------------------------------- the engines
def prompt_ids(tokenizer, prompt_len: int, grounded: bool = False) -> torch.Tensor:
    """The first `prompt_len` tokens of real English text, [1, prompt_len]. grounded=True wraps them in
    a chat prompt that asks the model to copy them (an input-grounded task: what prompt lookup,
    chapter 13, speeds up), [1, prompt_len + the template's tokens]. SmolLM2-135M paraphrases when
    asked to "repeat the text exactly" and copies when asked to copy it "word for word"."""
    text = TEXT.read_text(encoding="utf-8") if TEXT.exists() else "The quick brown fox jumps over the lazy dog. " * 200
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :prompt_len]
    if ids.shape[1] < prompt_len:
        raise BenchError(f"--prompt-len {prompt_len} is longer than the benchmark text, which is "
                         f"{ids.shape[1]} tokens for this tokenizer: use --prompt-len <= {ids.shape[1]}")
    if grounded:
        passage = tokenizer.decode(ids[0])
        messages = [{"role": "user", "content": "Copy the following text word for word, without changing anything:\n\n" + passage}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
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
             "kv_budget": None, "kv_dtype": "float32", "prefill_precision": "float32"}
    values = config.to_dict()
    # penalties, a bias or a mask sample another distribution than transformers' plain greedy
    return all(values.get(k) in (None, ok) for k, ok in lossy.items()) and not LogitsProcessing.needed(config)


@dataclass
class EngineRun:
    """One engine to time, with the bytes it is judged by; `run_bench` builds and owns it.

    run(n) generates n tokens greedily from the prompt and returns them, [1, T + n], with the bytes
    of the KV cache the run held (the cache grows with n: the N-token run's is the one reported).
    """
    run: Callable[[int], tuple[torch.Tensor, int]]
    weight_bytes: int  # the weights the engine holds
    step_bytes: int  # what one of its decode steps reads at the mid-run context: its own roofline
    step: str = ""  # minigen's engines: the step that ran (GenerationStats.step: "eager", "fused", ...)
    stats: object = None  # minigen's engines: the GenerationStats of the last run


def _time_engines(runs: dict[str, Callable], new_tokens: int, repeats: int, progress) -> dict[str, dict]:
    """Time each engine's `run(n)` -> (tokens, KV bytes) for n = 1 and n = new_tokens, median of `repeats`.

    The engines take turns within each round, so a slow spell of a shared machine (another
    tenant on the memory bus) falls on both engines instead of on one engine's block of runs.
    """
    for run in runs.values():
        run(2)  # warm-up: first-call allocations and kernel selection are not part of the numbers
    times = {name: {"ttft": [], "total": [], "peak": []} for name in runs}
    tokens, kv = {}, {}
    for _ in range(repeats):
        for name, run in runs.items():
            progress.set_postfix_str(name)
            t = time.perf_counter()
            run(1)
            times[name]["ttft"].append(time.perf_counter() - t)
            with PeakRSS() as mem:
                t = time.perf_counter()
                tokens[name], kv[name] = run(new_tokens)
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
                         "run_peak_added_bytes": max(r["peak"]), "kv_cache_bytes": kv[name], "tokens": tokens[name]}
    return results


def run_bench(model_name: str = "smollm2-135m", config: GenerationConfig | None = None, prompt_len: int = 64,
              new_tokens: int = 128, repeats: int = 3, dtype: torch.dtype = torch.float32,
              baseline: bool = True, compute_dtype: torch.dtype | str | None = None,
              weight_bits: int | None = None, llama_cpp: bool = False, grounded: bool = False,
              draft: str | None = None, llama_formats=None, response_format: dict | None = None) -> dict:
    """Benchmark minigen (with `config`) against transformers on one model and prompt -> results dict.

    compute_dtype: minigen's activations (precision.py; default fp32 on a CPU). transformers runs
    in the weights' dtype. weight_bits (8 or 4) quantizes minigen's weights (weight_quant.py) and
    adds minigen in the unquantized dtype to the same run, for the ratio. llama_cpp adds llama.cpp
    (llama-cpp-python) on the bundled GGUF, one engine per llama_formats (default Q4_1, Q4_0, Q8_0;
    gguf_formats.py). grounded: the prompt asks the model to repeat the text (prompt_ids). A config
    with speculative_method adds minigen without it to the run ("minigen plain") and, for "draft",
    the draft alone ("minigen draft"; `draft` is a drafts.parse spec such as "layers:20"), for the
    speed-up, alpha and the speed model's prediction. response_format (OpenAI's shape) masks minigen's
    tokens to it and adds minigen without the mask ("minigen unmasked"), for the mask's cost. Every
    setting is checked before the weights load: the run sizes, then the model's context."""
    from ..paths import bar
    from ..run_rules import Run, check_run
    from ..loading import check_dtype, load_tokenizer, read_config, read_safetensors, resolve_folder
    check_bench_args(prompt_len, new_tokens, repeats)
    dtype = check_dtype(dtype)
    if weight_bits is not None:
        check_weight_bits(weight_bits, "--weight-bits")
    llama_formats = check_llama_cpp(model_name, llama_formats) if llama_cpp else ()
    compute = dtype_of(compute_dtype, "compute_dtype") if compute_dtype is not None else None
    config = config or GenerationConfig()
    if config.do_sample:
        raise BenchError("bench times greedy decoding, on which minigen and transformers must agree token "
                         "for token: drop do_sample and the sampling settings")
    if config.n > 1:
        raise BenchError(f"bench times one greedy row a prompt, and n={config.n} would copy it {config.n} times: drop n")
    config = config.replace(max_new_tokens=new_tokens, stop_token_ids=[],
                            **({"response_format": response_format} if response_format else {}))
    folder = resolve_folder(model_name)
    model_config = read_config(folder)
    if prompt_len + new_tokens > model_config.max_seq_len:
        raise BenchError(f"--prompt-len {prompt_len} + --new-tokens {new_tokens} exceeds the model's context of "
                         f"{model_config.max_seq_len} tokens: lower one of them")
    check_run(config, Run.of_shapes(model_config))  # e.g. a quant_group_size that the head dim refuses
    if (draft is not None) != (config.speculative_method == "draft"):
        raise BenchError("--draft names the draft of speculative_method=draft, and needs it: set both "
                         "(--set speculative_method=draft --draft layers:20), or neither")
    if draft is not None:
        drafts.check_spec(draft, model_config.n_layers)
    tokenizer = load_tokenizer(folder)
    ids = prompt_ids(tokenizer, prompt_len, grounded)
    prompt_len = ids.shape[1]
    if prompt_len + new_tokens > model_config.max_seq_len:
        raise BenchError(f"the grounded prompt ({prompt_len} tokens) + --new-tokens {new_tokens} exceeds the "
                         f"model's context of {model_config.max_seq_len} tokens: lower one of them")
    state = read_safetensors(folder)
    model = _minigen_model(model_config, state, dtype, compute)
    hw = hardware_info()
    paths = measurements(model) if model.device.type == "cpu" else None  # each fast path against its reference
    hw["fastpaths"] = None if paths is None else {"machine": paths.machine, "threads": paths.threads,
                                                  "measured": [asdict(m) for m in paths.measured.values()]}
    kv_elem = DTYPES[config.kv_dtype].itemsize if config.kv_dtype else dtype.itemsize
    engines, model, compile_s = _build_engines(model, model_config, state, folder, ids, config, dtype=dtype,
                                               compute=compute, weight_bits=weight_bits, baseline=baseline,
                                               llama_formats=llama_formats, new_tokens=new_tokens, kv_elem=kv_elem,
                                               draft=draft, tokenizer=tokenizer)
    progress = bar(total=repeats * len(engines), desc="bench", unit="run")
    timed = _time_engines({name: e.run for name, e in engines.items()}, new_tokens, repeats, progress)
    progress.close()
    # A shared machine's bandwidth moves: probe again after the runs and take the better reading, so
    # a probe that met a busy neighbour does not put an engine "above" its roofline.
    hw["memory_read_gb_s_probes"] = [hw["memory_read_gb_s"], memory_read_bandwidth()]
    hw["memory_read_gb_s"] = max(hw["memory_read_gb_s_probes"])
    per_token = bytes_per_decode_step(model, prompt_len + new_tokens // 2, kv_elem)  # packed weights when quantized
    result = {"hardware": hw, "model": model_name, "dtype": str(dtype).removeprefix("torch."),
              "weight_bits": weight_bits, "precision": model.precision.describe(model.dtype),
              "compile_s": max(compile_s), "prompt_len": prompt_len, "new_tokens": new_tokens,
              "repeats": repeats, "config": config.to_dict(), "exact": exact(config) and weight_bits is None,
              "grounded": grounded, "draft": draft,
              "bytes_per_token": per_token, "roofline_tokens_per_s": hw["memory_read_gb_s"] * 1e9 / per_token}
    return _report(result, engines, timed, dtype)


def _minigen_model(model_config, state: dict, dtype: torch.dtype, compute: torch.dtype | None):
    from ..loading import build_model
    model = build_model(model_config, state, dtype)
    if compute is not None:
        model.precision = model.precision.replace(compute=compute)
    return model


def _minigen_engine(model, ids: torch.Tensor, config: GenerationConfig, context: int, kv_elem: int,
                    compile_s: list[float], draft_model=None, tokenizer=None) -> EngineRun:
    """minigen on `model`; each run adds its compile seconds to `compile_s`."""
    def run(n: int):
        out = generate(model, ids, config, max_new_tokens=n, draft_model=draft_model, tokenizer=tokenizer)
        compile_s.append(out.stats.compile_s)  # the warm-up compiles; later runs reuse it
        engine.step, engine.stats = out.stats.step, out.stats
        return out.tokens, out.stats.kv_cache_bytes
    engine = EngineRun(run, weight_bytes(model), bytes_per_decode_step(model, context, kv_elem))
    return engine


def _transformers_engine(folder: Path, ids: torch.Tensor, dtype: torch.dtype, step_bytes: int) -> EngineRun:
    """transformers `generate` on the same weights, in their dtype, for exactly n tokens."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # run exactly N tokens, as minigen does
    hf.generation_config.pad_token_id = 0
    mask = torch.ones_like(ids)

    def run(n: int):
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                              return_dict_in_generate=True)
        return out.sequences, sum(t.nbytes for layer in out.cache.layers for t in (layer.keys, layer.values))
    return EngineRun(run, weight_bytes(hf), step_bytes)


def _build_engines(model, model_config, state: dict, folder: Path, ids: torch.Tensor, config: GenerationConfig, *,
                   dtype: torch.dtype, compute: torch.dtype | None, weight_bits: int | None, baseline: bool,
                   llama_formats: tuple, new_tokens: int, kv_elem: int, draft: str | None = None, tokenizer=None):
    """-> (the engines to time, in the order they take turns; the model of the engine "minigen";
    the list that minigen's runs add their compile seconds to).

    `model` is minigen's model in `dtype`. A ratio between two minigen settings is taken within
    one run, on one machine state: weight_bits times minigen unquantized beside the quantized
    model, and a dtype other than fp32 times minigen in fp32 too (chapter 9)."""
    from ..loading import build_model
    prompt_len = ids.shape[1]
    context = prompt_len + new_tokens // 2  # the rooflines: the bytes of the average step, mid-run
    compile_s: list[float] = []
    engines, floats = {}, model  # floats: the unquantized weights, which transformers reads too
    if weight_bits is not None:
        engines[f"minigen {_DTYPE_NAMES[dtype]}"] = _minigen_engine(model, ids, config, context, kv_elem, compile_s)
        model = quantize_weights(_minigen_model(model_config, state, dtype, compute), weight_bits)
    elif dtype != torch.float32:
        floats32 = build_model(model_config, state, torch.float32)
        engines["minigen float32"] = _minigen_engine(floats32, ids, config, context, kv_elem, compile_s)
    draft_model = None
    if config.speculative_method is not None:  # the same step without speculation, for the speed-up
        plain = config.replace(**{k: GenerationConfig.__dataclass_fields__[k].default for k in SPECULATIVE_KEYS})
        engines["minigen plain"] = _minigen_engine(model, ids, plain, context, kv_elem, compile_s)
        if draft is not None:  # the draft decoding alone: its cost c against the target's step
            draft_model = drafts.parse(draft, model)
            engines["minigen draft"] = _minigen_engine(draft_model, ids, plain, context, kv_elem, compile_s)
    if config.guide_spec() is not None:  # the same step without the mask: its cost, side by side
        engines["minigen unmasked"] = _minigen_engine(model, ids, config.replace(response_format=None, guided_regex=None,
                                                      guided_grammar=None, guided_backend="auto"), context, kv_elem, compile_s)
    engines["minigen"] = _minigen_engine(model, ids, config, context, kv_elem, compile_s, draft_model, tokenizer)
    if baseline:
        engines["transformers"] = _transformers_engine(folder, ids, dtype,
                                                       bytes_per_decode_step(floats, context, kv_elem))
    for name, (run, gguf_bytes) in llama_cpp_engines(ids, prompt_len + new_tokens, llama_formats).items():
        # the GGUF file's weights, and an fp16 cache
        engines[name] = EngineRun(run, gguf_bytes, gguf_bytes + context * model.config.kv_bytes_per_token(2))
    return engines, model, compile_s


def _report(result: dict, engines: dict[str, EngineRun], timed: dict[str, dict], dtype: torch.dtype) -> dict:
    """Add each engine's row and the ratios to `result` (the run's settings and minigen's roofline).

    Each engine is held to the bytes its own step reads. greedy_token_agreement compares the tokens
    of minigen's and transformers' last N-token runs."""
    bandwidth = result["hardware"]["memory_read_gb_s"] * 1e9
    rows = result["engines"] = {}
    for name, t in timed.items():
        e = engines[name]
        rows[name] = {"ttft_s": t["ttft_s"], "total_s": t["total_s"], "decode_tokens_per_s": t["decode_tokens_per_s"],
                      "prefill_tokens_per_s": result["prompt_len"] / t["ttft_s"],  # prompt tokens / TTFT
                      "run_peak_added_bytes": t["run_peak_added_bytes"], "weight_bytes": e.weight_bytes,
                      "kv_cache_bytes": t["kv_cache_bytes"],
                      "peak_memory_bytes": e.weight_bytes + t["run_peak_added_bytes"],
                      "bytes_per_token": e.step_bytes,
                      "roofline_fraction": t["decode_tokens_per_s"] * e.step_bytes / bandwidth}
        if e.step:
            rows[name]["step"] = e.step
            rows[name]["plan"] = e.stats.plan  # what ran, in words (run_plan.py)
    speed = {name: row["decode_tokens_per_s"] for name, row in rows.items()}
    if result["weight_bits"] is not None:
        result["speedup_vs_unquantized"] = speed["minigen"] / speed[f"minigen {_DTYPE_NAMES[dtype]}"]
    elif "minigen float32" in rows:
        result["speedup_vs_float32"] = speed["minigen"] / speed["minigen float32"]
    if any(name.startswith("llama.cpp") for name in rows):  # one ratio per format
        result["speedup_vs_llama_cpp"] = {name: speed["minigen"] / s for name, s in speed.items()
                                          if name.startswith("llama.cpp")}
    if "minigen plain" in rows:
        result["speculation"] = speculation.summarize(result["config"], engines["minigen"].stats, speed)
    if "minigen unmasked" in rows:  # the reply: its tokens up to the first of the stop tokens the mask then repeats
        new = timed["minigen"]["tokens"][0, result["prompt_len"]:].tolist()
        end = len(new)
        while end > 1 and new[end - 2] == new[-1]:
            end -= 1
        result["structured"] = {"plan": engines["minigen"].stats.plan.splitlines()[-1].split(":", 1)[1].strip(),
                                "speedup_vs_unmasked": speed["minigen"] / speed["minigen unmasked"], "reply_tokens": end}
    if "transformers" in rows:
        prompt_len = result["prompt_len"]
        a, b = timed["minigen"]["tokens"], timed["transformers"]["tokens"]
        match = (a[:, prompt_len:] == b[:, prompt_len:]).float().mean().item()
        result["greedy_token_agreement"] = match
        result["speedup"] = speed["minigen"] / speed["transformers"]
        # Only fp32 is held to identical tokens: in bf16 or fp16 two correct implementations
        # round their sums differently, and a near-tie between two tokens may flip.
        if result["exact"] and dtype == torch.float32 and match < 1.0:
            raise AssertionError(f"minigen and transformers greedy tokens differ ({match:.1%} agree) "
                                 "under an exact config: this is a correctness bug")
    return result
