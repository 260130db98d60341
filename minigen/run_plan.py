"""The run plan: what a generation runs, decided once before the prompt, and said in words.

    plan = make_plan(model, config, batch, where="generate", max_len=T + n)
    print(plan)              # decode: the fused C step ...; prompt: ...; attention: ...; KV: ...
    cache = plan.make_cache(model)        # the cache the config selects, for plan.batch rows
    policy = plan.make_policy(cache)      # window, sinks, sparse selection, observers (or None)
    plan.step.prefill(...) / plan.step.decode(...)   # what generate's one loop runs

Every entry point builds one (generate, stream, a ragged batch, parallel_sample, score, the
profiler, the serving Engine, a speculative draft, bench and the CLI) or takes one it is given
(`plan=`). Building it is where the config meets the model and the machine, once:
- the rule table, on three axes: which features combine (combinations.REFUSED, checked when the
  config is built), what each needs of the model and the machine (run_rules.RUN_RULES), and what
  the place it runs cannot run (places.WHERE_REFUSED). A setting none of them allows is a
  ConfigError naming the key and the fix, before any work;
- the step (steps/choose.py): the fastest exact step the config allows, the fused C step only where
  it measured faster than the eager step here (kernels/fastpaths.py);
- the measurements of every machine-dependent fast path at the model's shapes (fastpaths.measured),
  which decide each op's kernel (kernels/dispatch.py) and which the plan reports.

`str(plan)` (and GenerationStats.plan, `python -m minigen generate --explain`, `bench --explain`)
says what runs, one line per part: the decode step, the prompt's products, attention and the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .attention import AttentionObserver, AttentionPolicy
from .caches.make import make_cache
from .run_rules import Run
from .decoding.guide import Guide
from .decoding.structured import compile_guide, require_tokenizer
from .errors import ConfigError
from .config import GenerationConfig
from .decoding.settings import check_vocabulary
from .kernels import build as kernel_build
from .kernels import fastpaths
from .places import check_where
from .sampling import Generators, greedy, make_generators, sample
from .steps.choose import block_bits, choose_step, int8_activations, measurements, ops_for, run_of
from .steps import graphs, speculative
from .steps.eager import EagerStep

DTYPE_WORDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
PARALLEL_BLOCK = 16  # parallel_sample's cache_chunk_size where its config names none
# Where a plan is made, the call that passes the tokenizer (named when a text setting lacks it).
TOKENIZER_CALLS = {"generate": "generate(model, ids, config, tokenizer=tok)",
                   "ragged": "generate(model, prompts, config, tokenizer=tok)",
                   "parallel_sample": "parallel_sample(model, ids, n, config, tokenizer=tok)",
                   "engine": "Engine(model, config, tokenizer=tok)"}
WEIGHT_WORDS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8", "int4": "int4"}


@dataclass
class Plan:
    """What one generation runs: chosen once by make_plan, read by the loop, printed for the reader."""
    where: str  # places.WHERES: "generate", "ragged", "engine", "parallel_sample", "score", "profile", "draft"
    config: GenerationConfig
    batch: int  # rows the step runs at once (the Engine: its max_batch_size)
    max_len: int  # positions each row's cache holds
    run: Run  # what the rules read of the model and the machine
    step: EagerStep  # prefill and decode (steps/eager.py lists the kinds)
    observers: tuple[AttentionObserver, ...] = ()
    generators: Generators = None  # one per row when sampling (row r: seed + r, sampling.py); None when greedy
    fast_paths: fastpaths.FastPaths | None = None  # this machine's measurements at the model's shapes (CPU)
    prompt_ops: object = None  # the model's ops for a prompt: its format (prefill_precision) and attention backend
    decode_ops: object = None  # the model's ops for a decode step: fp32 products, the attention backend
    parts: dict[str, str] = field(default_factory=dict)  # "decode", "prompt", "attention", "KV", "kernels": words
    tokenizer: object = None  # the model's tokenizer, for the settings that read text (stop, structured output)
    guide: Guide | None = None  # the compiled structure every row's mask follows (decoding/structured.py), or None

    @property
    def ragged(self) -> bool:
        """Rows at their own positions ([B, T] positions, -1 for padding): a ragged batch, the Engine,
        several rows of speculative decoding (each accepts its own count) and their draft."""
        if self.where in ("ragged", "engine"):
            return True
        return self.batch > 1 and (self.where == "draft" or self.config.speculative_method is not None)

    def make_cache(self, model, rows: int | None = None, pool_rows: int | None = None):
        """The cache the config selects for `rows` rows (default: the plan's batch) of `max_len`
        positions (caches/make.py); a paged pool for `pool_rows` (parallel_sample: the rows after its fork)."""
        with self.step.grad_mode():
            return make_cache(model, self.config, rows or self.batch, self.max_len, pool_rows=pool_rows,
                              ragged=self.ragged)

    def make_policy(self, cache) -> AttentionPolicy | None:
        """The attention policy (window, sinks, sparse selection, observers) with the cache's observers."""
        return make_policy(self.config, cache, self.observers)

    def check_fits(self, batch: int, max_len: int) -> "Plan":
        """This plan, for a call of `batch` rows of up to `max_len` positions; ConfigError if it was
        built for other rows or fewer positions."""
        if self.batch != batch or self.max_len < max_len:
            raise ConfigError(f"this plan runs {self.batch} rows of up to {self.max_len} positions; the call needs "
                              f"{batch} of {max_len}: make_plan(model, config, {batch}, max_len={max_len})")
        return self

    def __str__(self) -> str:
        width = max(map(len, self.parts))
        return "\n".join(f"{name + ':':<{width + 1}} {words}" for name, words in self.parts.items())

    def lines(self) -> list[str]:
        return str(self).splitlines()


def make_policy(config: GenerationConfig, cache,
                observers: tuple[AttentionObserver, ...] = ()) -> AttentionPolicy | None:
    """The attention policy (window, sinks, sparse, observers) that `config` selects, with the
    observers the cache needs; None: plain causal attention."""
    cache_observers = tuple(cache.observers) if cache is not None else ()
    return AttentionPolicy.from_config(config, (*observers, *cache_observers))


def given_plan(plan: Plan | None, config, overrides: dict, where: str, **beside) -> GenerationConfig | None:
    """The config of a plan the caller built (plan=), which runs as built: a config, overrides or
    anything else the plan already holds (`beside`: observers, a draft model) given with it is
    refused, as is a plan built for another place. None without a plan."""
    if plan is None:
        return None
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan={plan!r} is not a Plan: build one with minigen.make_plan(model, config, batch)")
    given = [key for key, value in beside.items() if value]
    if config is not None or overrides or given:
        keys = ", ".join(["config"] * (config is not None) + list(overrides) + given)
        raise ConfigError(f"give a plan or a config, not both ({keys} given beside plan=): the plan holds its "
                          "config, observers and draft model; build another with minigen.make_plan(model, config, "
                          "batch, observers=..., draft_model=...)")
    if plan.where != where:
        raise ConfigError(f"this plan was built for where={plan.where!r}, not {where!r}: "
                          f"make_plan(model, config, batch, where={where!r})")
    return plan.config



def make_plan(model, config: GenerationConfig | None = None, batch: int = 1, where: str = "generate", *,
              max_len: int | None = None, observers: tuple[AttentionObserver, ...] = (), draft_model=None,
              tokenizer=None) -> Plan:
    """The plan for `batch` rows of `model` under `config` at `where` (places.WHERES), each row's
    cache holding `max_len` positions (default: the model's context). Refuses (ConfigError) what the
    rule table does not allow here, before any work. `tokenizer`: the model's, which the settings
    that read text need (stop strings; response_format, guided_regex, guided_grammar: compiled here)."""
    config = config or GenerationConfig()
    check_where(config, where)
    if where == "engine" and model.config.tp_size > 1:
        raise ConfigError(f"the serving engine does not run a tensor-parallel model (tp_size={model.config.tp_size}): its "
                          "ranks must run the same forwards in the same order, and the engine schedules each step from "
                          "its own clock and queue in one process (a scheduler in rank 0 that broadcasts each step's "
                          "batch is not built). Fix: load the model with tp_size=1 for the engine, or generate in "
                          "every rank (minigen.parallel.launch.generate_over_ranks)")
    check_vocabulary(config, model.config.vocab_size)  # logit_bias's ids
    sampled = where not in ("score", "profile", "draft")  # the places that sample the text they make
    stops = config.stop_token_ids if config.stop_token_ids is not None else model.config.eos_token_ids
    if sampled:  # before the compile, so that the refusal names the call at hand
        require_tokenizer(config, tokenizer, TOKENIZER_CALLS.get(where, TOKENIZER_CALLS["generate"]))
    guide = compile_guide(config, tokenizer, model.config.vocab_size, stops) if sampled else None
    if where in ("score", "profile") and config.fused_decode == "auto":
        # score's chunked forward reads each weight once per chunk, not once per token; the profiler's
        # categories are torch's ops, which the fused step runs in one C call: both run the eager step
        config = config.replace(fused_decode=False)
    if where == "parallel_sample" and config.cache_chunk_size is None:
        config = config.replace(cache_chunk_size=PARALLEL_BLOCK)  # its rows share the prompt's blocks: paged
    max_len = max_len or model.config.max_seq_len
    ragged = where in ("ragged", "engine") or (where == "draft" and batch > 1)
    speculative.check_draft(config, model, draft_model)
    draft = (make_plan(draft_model, speculative.draft_config(config), batch, "draft", max_len=max_len)
             if config.speculative_method == "draft" else None)
    if model.config.tp_size > 1 and not greedy(config) and config.seed is None:
        raise ConfigError(f"do_sample=True with seed=None on a tensor-parallel model (tp_size={model.config.tp_size}): "
                          "every rank samples its own copy of the logits, and fresh entropy in each would draw "
                          "different tokens. Fix: set seed (every rank then draws the same tokens)")
    generators = make_generators(config, batch, model.device)  # row r: seed + r
    run = run_of(model, config, batch, tuple(observers))
    decode_i8, prompt_i8 = int8_activations(model, config, run)  # int4 / int8 codes times int8 activations
    step = choose_step(model, config, batch, tuple(observers), sample, generators, ragged=ragged,
                       draft_model=draft_model, draft_plan=draft, int8_act=decode_i8, engine=where == "engine")
    fast = measurements(model) if model.device.type == "cpu" and kernel_build.available() else None
    # the prompt's ops carry its format; a bf16 prompt's attention in bf16 where that measured no slower here
    plan = Plan(where, config, batch, max_len, run, step, tuple(observers), generators, fast,
                ops_for(model, config, prompt=True, int8_act=prompt_i8),
                ops_for(model, config, prompt=False, int8_act=decode_i8), tokenizer=tokenizer, guide=guide)
    plan.parts = describe(plan, model)
    return plan


# ---------------------------------------------------------------- the plan in words
def describe(plan: Plan, model) -> dict[str, str]:
    """{part: words}: beam search, the decode step, the prompt's products, attention, the cache and the kernels."""
    k = plan.config.num_beams
    beams = {"beams": f"beam search (beam.py): {k} beams a prompt, {plan.batch} rows, the cache's rows reordered "
                      "every step"} if k > 1 else {}
    c = plan.config
    text = {"text": _text_words(plan)} if plan.guide is not None or c.stop or c.n > 1 or c.logprobs is not None else {}
    parallel = {"parallel": _parallel_words(model)} if model.config.tp_size > 1 else {}
    return {**parallel, **beams, "decode": _decode_words(plan, model), "prompt": _prompt_words(plan, model),
            "attention": _attention_words(plan, model), "KV": _kv_words(plan, model),
            "kernels": _kernel_words(plan), **text}


def _parallel_words(model) -> str:
    """What this rank of a tensor-parallel model holds, and what its forwards exchange (parallel/tensor.py)."""
    c, n = model.config, model.config.tp_size
    backend = dist.get_backend() if dist.is_initialized() else "no process group yet"
    return (f"tensor parallel, one of {n} ranks ({backend}; parallel/tensor.py): this rank holds {c.n_heads} of "
            f"{c.n_heads * n} query heads, {c.n_kv_heads} of {c.n_kv_heads * n} key/value heads (its cache holds only "
            f"these) and {c.hidden_dim} of {c.hidden_dim * n} MLP columns, the embedding and the head whole; an "
            f"all-reduce of [B, T, {c.dim}] after each attention and MLP ({2 * c.n_layers} a forward)")


def _text_words(plan: Plan) -> str:
    """What reads or returns the text: the structure's mask and its backend, the stop strings, n, logprobs."""
    words = []
    if plan.guide is not None:
        spec = plan.config.guide_spec()
        what = {"json_schema": "a JSON schema", "json_object": "any JSON object", "regex": "a regex",
                "grammar": "a Lark grammar"}[spec.kind]
        words.append(f"structured output: {what}, a token mask per row from {plan.guide.backend} (compiled in "
                     f"{plan.guide.compile_s * 1e3:.1f} ms), applied before each sample")
    if plan.config.stop:
        words.append(f"stop strings {list(plan.config.stop)} matched on each row's text")
    n, k = plan.config.n, plan.config.logprobs
    if n > 1:
        words.append(f"n={n} samples a prompt: output row b * {n} + j is prompt b's sample j")
    if k is not None:
        words.append(f"logprobs: each new token's and the top {k}, from the raw logits")
    return "; ".join(words)


def _ratio(plan: Plan, path: str, against: str) -> str:
    m = plan.fast_paths.get(path) if plan.fast_paths is not None else None
    return f"; measured {m.ratio:.2f}x {against} here" if m is not None else ""


def _where_words(plan: Plan, model) -> str:
    weights = plan.run.weight_dtypes or {str(model.dtype).removeprefix("torch.")}
    rows = f"batch {plan.batch}" + (", rows at their own positions" if plan.ragged else "")
    acts = f"{DTYPE_WORDS.get(model.precision.compute, str(model.precision.compute))} activations"
    if plan.decode_ops is not None and plan.decode_ops.int8_act:
        acts = "int8 activations (a scale per 32; integer dot products" + _ratio(plan, _s8(model, "c_matvec"),
                                                                                  "fp32 activations") + ")"
    return (f"{rows}, {model.device.type.upper()}, {'/'.join(sorted(WEIGHT_WORDS.get(w, w) for w in weights))} "
            f"weights, {acts}")


def _s8(model, kind: str) -> str:
    """The measurement of int8 activations' kernel for the blocks' weights: c_matvec_q4_s8, gemm_q8_s8..."""
    return f"{kind}_q{block_bits(model)}_s8"


def step_words(step, plan: Plan) -> str:
    """One step object in words (steps/eager.py lists the kinds)."""
    name = step.name
    if name == "naive":
        return "the naive loop (no cache: every step runs the whole sequence so far, chapter 1)"
    if name == "fused" and plan.where == "engine":
        return ("the fused C step over the paged pool (every layer of every running sequence's token in one C "
                "call, the blocks read in place, chapter 10" + _ratio(plan, "fused_paged", "the eager step") + ")")
    if name == "fused":
        return "the fused C step (every layer of a token in one C call, chapter 10" + \
            _ratio(plan, "fused_step", "the eager step") + ")"
    if name == "compiled":
        return "the eager step compiled by torch.compile (chapter 11)"
    if name == "graphed":
        return (f"the eager step captured in a CUDA graph with sampling and stop checks inside; the host reads the "
                f"stop flags every {graphs.STOP_CHECK_EVERY} tokens (chapter 11)")
    if name.startswith("speculative"):
        c = plan.config
        proposer = (f"a draft model's {step_words(step.proposer.step, plan)}" if c.speculative_method == "draft"
                    else "prompt lookup (n-grams of the text so far)")
        return (f"speculative decoding (chapter 13): {proposer} proposes {c.num_speculative_tokens} tokens, "
                f"{step_words(step.target, plan)} verifies them in one forward")
    return "the eager step (torch, op by op; each op on the kernel measured fastest here, chapter 2)"


def _decode_words(plan: Plan, model) -> str:
    return f"{step_words(plan.step, plan)} ({_where_words(plan, model)})"


def _prompt_words(plan: Plan, model) -> str:
    c, cpu = plan.config, model.device.type == "cpu"
    if not c.use_cache:
        return "the whole sequence every step, fp32 products"
    pieces = f", in pieces of {c.prefill_chunk_size} tokens" if c.prefill_chunk_size else ""
    short = "; a prompt of 16 tokens or fewer runs fp32 on the several-row C kernel" if cpu else ""
    if c.prefill_precision == "bfloat16":
        attention = ("bf16 attention" if plan.prompt_ops.prompt.attention_bf16
                     else "fp32 attention (bf16's measured slower here)")
        return (f"bf16 products with fp32 sums through oneDNN's bf16 GEMM{_ratio(plan, 'bf16_prompt', 'fp32')}, "
                f"{attention}{pieces}{short}")
    if c.prefill_precision == "int8":
        best = plan.fast_paths.best_int8() if plan.fast_paths is not None else None
        product = f"{best.fast}; measured {best.ratio:.2f}x fp32 here" if best is not None else "the int8 reference"
        return f"int8 weights and activations, int32 sums ({product}){pieces}{short}"
    if not cpu:
        return f"{DTYPE_WORDS.get(model.precision.compute)} products through torch's GEMM{pieces}"
    # the fused step runs a prompt (or piece) of 16 tokens or fewer in its own C call, as it decodes
    fused = "; a prompt of 16 tokens or fewer runs in the fused step's C call, as a decode step" \
        if plan.step.name == "fused" else ""
    if plan.step.name == "fused" and plan.where == "engine":
        fused = ("; each step's prompt chunks and decodes in one C call, no padding" +
                 _ratio(plan, "fused_paged_prompt", "the eager prefill")
                 if plan.step.takes_decodes_with_prompts(plan.prompt_ops) else "; in torch, op by op")
    if plan.run.quantized and plan.prompt_ops.int8_act:
        return (f"int8 activations (a scale per 32) times the weights' codes, int32 sums, C's GEMM"
                f"{_ratio(plan, _s8(model, 'gemm'), 'fp32 activations')}{pieces}{fused}")
    if plan.run.quantized:
        return f"fp32 activations times the weights' codes, widened in C's panels (gemm_q){pieces}{fused}"
    gemm = ("oneDNN's fp32 GEMM" if plan.fast_paths is None or plan.fast_paths.allowed("onednn_fp32")
            else "torch's fp32 GEMM (oneDNN's measured slower here)")
    return f"fp32 through {gemm}{pieces}{short}"


def _cache_words(c: GenerationConfig, model) -> str:
    if not c.use_cache:
        return "no cache"
    kind = (f"paged blocks of {c.cache_chunk_size}" if c.cache_chunk_size is not None else
            "heavy hitters' slots (H2O)" if c.kv_budget is not None else
            "a hybrid cache (a ring per sliding layer)" if model.config.sliding_layers and c.window_size is None
            and c.quant_bits is None else
            f"a ring of {c.window_size} window slots and {c.sink_tokens} sinks" if c.window_size is not None
            and c.quant_bits is None else "a contiguous cache")
    if c.window_size is not None and not kind.startswith("a ring"):
        kind += f", masked to a window of {c.window_size} with {c.sink_tokens} sinks"
    if c.quant_bits is not None:
        kind += f", {c.quant_bits}-bit codes"
    if c.prefetch_depth is not None:
        kind += f", offloaded ({c.prefetch_depth + 1} layers on the device)"
    return kind


def _attention_words(plan: Plan, model) -> str:
    c = plan.config
    where = _cache_words(c, model)
    if not c.use_cache:
        return "SDPA over the whole sequence"
    if c.attention_backend == "triton":
        return f"Triton's kernels read {where} in place (decode and prompt)"
    if plan.step.name == "fused":
        return f"C, inside the fused step, over {where}"
    policy = plan.config.sparse or plan.observers or c.window_size is not None
    if (model.device.type == "cpu" and not policy and plan.run.fp32_compute
            and (plan.fast_paths is None or plan.fast_paths.allowed("c_attention"))):
        return f"C's one-query loop for decode steps, SDPA for prompts, over {where}"
    return f"SDPA over {where}" + (" (sparse key selection)" if c.sparse else "")


def _kv_words(plan: Plan, model) -> str:
    c = plan.config
    if not c.use_cache:
        return "none (the naive loop recomputes every key and value)"
    dtype = c.kv_dtype or str(model.dtype).removeprefix("torch.")
    cache = plan_cache_bytes(model, c, plan.max_len)
    per_token = cache / plan.max_len if plan.max_len else 0
    store = f"{c.quant_bits}-bit codes with {WEIGHT_WORDS.get(dtype, dtype)} scales" if c.quant_bits else \
        WEIGHT_WORDS.get(dtype, dtype)
    return (f"{store}, {per_token:,.0f} bytes a token a row ({cache:,} bytes for {plan.max_len:,} positions, "
            f"{_cache_words(c, model)})")


def plan_cache_bytes(model, config: GenerationConfig, max_len: int) -> int:
    """Bytes one row's cache holds for `max_len` positions: the cache built on the meta device."""
    stub = SimpleNamespace(config=model.config, device=torch.device("meta"), dtype=model.dtype)
    with torch.inference_mode():
        cache = make_cache(stub, config.replace(prefetch_depth=None), 1, max_len)
    return int(cache.nbytes) if cache is not None else 0


def _kernel_words(plan: Plan) -> str:
    if plan.fast_paths is None:
        return "no C kernel here: every op runs torch's reference" if plan.run.device == "cpu" else \
            f"torch's ops on {plan.run.device}"
    aside = [m.path for m in plan.fast_paths.measured.values() if m.stands_aside]
    ran = len(plan.fast_paths.measured) - len(aside)
    return (f"{ran} fast paths measured no slower than their reference here, {len(aside)} stand aside"
            + (f" ({', '.join(sorted(aside))})" if aside else "") + " (python -m minigen bench --explain lists them)")

