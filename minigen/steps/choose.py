"""Which step object a generation runs: chosen once, before the prompt, from the config, the model
and the batch (eager.py lists the kinds).

The default is the fastest exact step the config allows. `fused_decode="auto"` (the default) runs
the fused C step wherever it applies: on a CPU, a Llama-family model in fp32 precision, batch 1
(or a tensor batch of up to 16 rows with fp32 weights), the contiguous cache in fp32 or bf16 (and the
serving engine's paged pool: up to 16 rows at their own positions, any weights), no feature that the
combination table refuses beside fused_decode (combinations.REFUSED), no observers; elsewhere the
eager step. `fused_decode=True`
demands it (refused, with the reason, where it cannot run) and `False` forbids it. Both steps
give the same greedy tokens (tests/test_fused.py), so "auto" changes the speed, never the text.
The rules are data in combinations.py (REFUSED, RUN_RULES); this module reads the model and the
machine for them (run_of), and checks them here, once per generation.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..attention import attend_blocks
from ..caches.contract import BlockView
from ..combinations import refused_with
from ..run_rules import Run, check_run, run_refusals
from ..places import RAGGED_REFUSED, check_rows
from ..config import GenerationConfig
from ..errors import ConfigError
from ..kernels import build as kernel_build
from ..kernels import cpu, fastpaths, int8, probes, triton_attention
from ..numerics.precision import FP32, prompt_format
from ..numerics.weight_quant import QuantizedWeight, quantized
from ..sampling import Generators
from . import fused, speculative
from .eager import EagerStep, NaiveStep
from .graphs import CompiledStep, GraphedStep


def run_of(model, config: GenerationConfig, batch: int, observers: tuple = ()) -> Run:
    """What run_rules.RUN_RULES reads of the model and the machine for this generation. The C
    kernel is built (once per machine) only where the fused step could run."""
    p = model.precision
    run = Run(arch=model.config.arch, head_dim=model.config.head_dim, model_window=model.config.own_window,
              device=model.device.type, tp_size=model.config.tp_size,
              fp32_compute=p.compute == torch.float32 and p.fp32_norms and p.fp32_softmax and p.fp32_logits,
              precision=p.describe(model.dtype), kv_dtype=config.kv_dtype or _name(model.dtype), batch=batch,
              observers=bool(observers), paged=config.cache_chunk_size is not None,
              triton="missing" if not triton_attention.AVAILABLE else
              "interpreted" if triton_attention.INTERPRETED else "compiled")
    run = dataclasses.replace(run, quantized=quantized(model))
    if run.arch == "llama":  # the weights the fused step would read (another family is refused by its arch)
        run = dataclasses.replace(run, weight_dtypes=frozenset(map(fused.weight_kind, fused.weights(model))))
    if config.cuda_graphs:
        run = dataclasses.replace(run, cuda=torch.cuda.is_available())
    if config.prefill_precision == "bfloat16" and run.device == "cpu":
        run = dataclasses.replace(run, bf16_dot=cpu.bf16_dot_products())
    if config.prefill_precision == "int8" and run.device == "cpu":
        run = dataclasses.replace(run, int8_product=any(map(int8.available, int8.BACKENDS)),
                                  int8_dot=cpu.int8_dot_products())
    if ((config.fused_decode is not False and run.device == "cpu" and not run_refusals(config, run, "fused_decode"))
            or config.int8_activations is True):
        run = dataclasses.replace(run, c_kernel_ok=kernel_build.available(), c_kernel=kernel_build.status())
    return run


def measurements(model) -> fastpaths.FastPaths:
    """This machine's measurements of the kernels and the fused step at `model`'s shapes (fastpaths.py)."""
    return fastpaths.measured(probes.Shapes.of(model.config), probes.PROBES + fused.PROBES)


def measured_fast(model, path: str) -> bool:
    """Whether `path` may run on "auto" for `model` here: a CPU model whose measurement does not stand aside."""
    return model.device.type != "cpu" or not kernel_build.available() or measurements(model).allowed(path)


def prompt_attention_bf16(model, config: GenerationConfig) -> bool:
    """Whether a bf16 prompt's attention runs in bf16 (SDPA on bf16 q, k, v) for `model` here: where it
    measured no slower than fp32 (fastpaths' bf16_attention); the products stay bf16 either way."""
    return config.prefill_precision != "bfloat16" or measured_fast(model, "bf16_attention")


def ops_for(model, config: GenerationConfig, prompt: bool, bf16_attention: bool | None = None,
            int8_act: bool = False):
    """The ops a forward of `model` runs under `config` (Model.forward(..., ops=...)): model.ops
    configured with the prompt format (prompt=True: prefill_precision's, whose weight copies are made
    the first time, precision.prompt_format; False: fp32, a decode step's), reads_blocks
    (attention_backend='triton') and int8_act (int8_activations: int8_activations() decides).
    bf16_attention: a bf16 prompt's attention in bf16 (None: prompt_attention_bf16 decides).
    model.ops itself where it already runs that way."""
    fmt = FP32
    if prompt:
        bf16 = prompt_attention_bf16(model, config) if bf16_attention is None else bf16_attention
        fmt = prompt_format(config.prefill_precision, model, bf16)
    reads_blocks = config.attention_backend == "triton"
    if fmt == model.ops.prompt and reads_blocks == model.ops.reads_blocks and int8_act == model.ops.int8_act:
        return model.ops  # the same object: a compiled step's guards keep holding
    return model.ops.configured(prompt=fmt, reads_blocks=reads_blocks, int8_act=int8_act)



def block_bits(model) -> int | None:
    """The bits of the blocks' quantized weights (load's weight_bits), or None for fp32 / bf16 blocks."""
    found = [w.bits for w in model.blocks.modules() if isinstance(w, QuantizedWeight)]
    return found[0] if found else None


def int8_activations(model, config: GenerationConfig, run: Run) -> tuple[bool, bool]:
    """(decode, prompt): whether a decode step's products, and a prompt's, multiply the int4 / int8 weight
    codes by int8 activations (config.int8_activations, numerics/int8_act.py). True: both, where
    run_rules.RUN_RULES allow it (ConfigError otherwise), with a warning where one measured slower;
    "auto": each where it measured probes.LOSSY_GAIN times fp32 activations' C kernel here, on a CPU, outside
    torch.compile and CUDA graphs; a prompt in a prefill_precision other than float32 keeps its format."""
    mode = config.int8_activations
    if mode is True:
        refusals = run_refusals(config, run, "int8_activations")
        if refusals:
            raise ConfigError(refusals[0])
    bits = block_bits(model)
    if mode is False or bits is None or run.device != "cpu" or config.compile or config.cuda_graphs \
            or not kernel_build.available():
        return False, False
    paths, plain = measurements(model), config.prefill_precision == "float32"
    decode, prompt = f"c_matvec_q{bits}_s8", f"gemm_q{bits}_s8"
    if mode is True:
        for path in (decode, prompt):
            fastpaths.demanded(paths.get(path), "int8_activations=True")
        return True, plain
    return paths.gains(decode), plain and paths.gains(prompt)


def _triton_probe(context: int):
    """attention_backend='triton' on a GPU: the fused decode kernel against the torch path it replaces
    (attention.attend_blocks: gather the blocks, SDPA), one row of `context` positions in blocks of 16,
    in the model's dtype and heads. A demanded backend: measured where it runs, to warn, never to refuse."""
    def make(s: probes.Shapes, rows: int, device: str = "cuda", dtype=torch.bfloat16):
        bs, n = 16, -(-context // 16)
        g = torch.Generator(device=device).manual_seed(0)
        pool = [torch.randn(n, bs, s.kv_heads, s.head_dim, generator=g, device=device).to(dtype) for _ in range(2)]
        view = BlockView(pool[0], pool[1], torch.arange(n, device=device)[None], bs,
                         torch.tensor([context], device=device), torch.tensor([context], device=device))
        q = torch.randn(1, s.heads, s.head_dim, generator=g, device=device).to(dtype)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        plan = triton_attention.plan_decode(q, view)  # once per step in a model: a layer's call is its launch
        return ((lambda: (triton_attention.decode_attention(q, view, plan=plan), sync())[0]),
                (lambda: (attend_blocks(q, view), sync())[0]))
    return probes.Probe(f"triton_decode_{context}", f"Triton's paged decode attention ({context:,} positions)",
                        "gather + SDPA (attention.attend_blocks)", make)


TRITON_PROBES = (_triton_probe(4096),)


def warn_demanded(model, config: GenerationConfig) -> None:
    """A prompt format the config demands (prefill_precision) that measured slower than fp32 here still
    runs: say so with the ratio. The int8 products run by the fastest int8 backend measured."""
    if config.attention_backend == "triton" and model.device.type == "cuda":
        paths = fastpaths.measured(probes.Shapes.of(model.config), TRITON_PROBES)
        fastpaths.demanded(paths.get(TRITON_PROBES[0].path), "attention_backend='triton'")
    if model.device.type != "cpu" or config.prefill_precision == "float32":
        return
    paths = measurements(model)
    if config.prefill_precision == "bfloat16":
        fastpaths.demanded(paths.get("bf16_prompt"), "prefill_precision='bfloat16'")
    else:
        fastpaths.demanded(paths.best_int8(), "prefill_precision='int8'")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fused_applies(config: GenerationConfig, run: Run, ragged: bool = False) -> bool:
    """Whether fused_decode="auto" runs the fused step (the module docstring's rules): no feature
    beside it that the table refuses, and none of its RUN_RULES broken (c_kernel_ok read)."""
    return (not ragged and not refused_with(config, "fused_decode") and run.c_kernel_ok is not None
            and not run_refusals(config, run, "fused_decode"))


def choose_step(model, config: GenerationConfig, batch: int, observers: tuple = (),
                sample: Callable | None = None, generators: Generators = None,
                ragged: bool = False, draft_model=None, draft_plan=None, int8_act: bool | None = None,
                engine: bool = False) -> EagerStep:
    """The step object for one generation of `batch` rows (sample and generators, one per row: for
    a CUDA graph, which samples inside the graph, and for speculative sampling). Here, once, the config meets the
    model and the machine (run_rules.check_run): a setting they cannot run is refused with
    ConfigError and the fix. Speculative decoding wraps the target's step (speculative.py); a draft
    model runs the draft_plan that run_plan.make_plan built for it; several rows run at their own positions.
    int8_act: whether the decode step's products take int8 activations (None: int8_activations() decides).
    engine: the serving engine's rows (ragged, in its paged pool), which the fused step decodes in place."""
    speculative.check_draft(config, model, draft_model)
    if config.speculative_method is not None:
        if batch > 1 and not ragged:
            check_rows(config, "speculative decoding of several rows (each accepts its own count of tokens, so "
                       "the rows move apart)", RAGGED_REFUSED)
        target = _choose(model, config, batch, observers, sample, generators, ragged or batch > 1, int8_act)
        if config.speculative_method == "ngram":
            proposer = speculative.NgramProposer(config)
        else:  # the draft's own plan (run_plan.make_plan, where="draft"): its fastest step and its cache
            proposer = speculative.DraftProposer(draft_model, draft_plan.config, draft_plan.step, batch,
                                                 draft_plan.make_cache(draft_model))
        return speculative.SpeculativeStep(target, proposer, config, generators, ragged or batch > 1)
    return _choose(model, config, batch, observers, sample, generators, ragged, int8_act, engine)


def _choose(model, config: GenerationConfig, batch: int, observers: tuple, sample: Callable | None,
            generators: Generators, ragged: bool, int8_act: bool | None = None, engine: bool = False) -> EagerStep:
    """choose_step's plain steps (and a speculative step's target). The fused step on "auto": generate's
    contiguous cache where its probe measured it faster (fused_step), and the serving engine's paged
    rows where theirs did (fused_paged); generate's paged cache (cache_chunk_size) runs it when
    fused_decode=True (no probe measures that one)."""
    if ragged:  # the engine's rows sit in its paged pool, which the fused step reads at their own positions
        check_rows(config, "a ragged batch (rows at different positions)",
                   {k: why for k, why in RAGGED_REFUSED.items() if not (engine and k == "fused_decode")})
    run = run_of(model, config, batch, observers)
    check_run(config, run)
    warn_demanded(model, config)
    if not config.use_cache:
        return NaiveStep()  # (prefill_chunk_size needs a cache: the config refuses it here)
    if config.cuda_graphs:
        step = GraphedStep(sample, config, generators)
    elif config.compile:
        step = CompiledStep(model)
    elif config.fused_decode is True or (config.fused_decode == "auto"
                                         and fused_applies(config, run, ragged and not engine)
                                         and (engine or not run.paged)
                                         and measured_fast(model, "fused_paged" if engine else "fused_step")):
        step = fused.FusedStep(verify_in_c=measured_fast(model, "fused_verify"),  # ragged: refused True above
                               int8_act=int8_activations(model, config, run)[0] if int8_act is None else int8_act,
                               # the engine's prompts (and the decodes beside them) in one C call: for int8 /
                               # int4 blocks, whose products run the batch GEMMs there too
                               prompts_in_c=engine and block_bits(model) is not None
                               and measured_fast(model, "fused_paged_prompt"))
        if config.fused_decode is True:
            fastpaths.demanded(measurements(model).get("fused_paged" if engine else "fused_step"), "fused_decode=True")
    else:
        step = EagerStep()
    step.prefill_chunk_size = config.prefill_chunk_size  # every step prefills eagerly, in pieces or whole
    return step
