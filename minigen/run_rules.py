"""What a config needs of the model and the machine it runs on: the rule table's second axis
(combinations.py holds the first, which features combine; places.py the third, where a plan runs).

`Run` is what a generation runs on beside its config, read once from the model and the machine
(steps/choose.py: run_of); RUN_RULES are the rules that read it, each with the fix, checked once per
generation when its step is chosen (check_run). fused_decode="auto" runs the fused step exactly where
none of its rules refuses. Every table is data: nothing here changes after import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import ConfigError


# ---------------------------------------------------------------- what a run needs of the model and machine
@dataclass(frozen=True)
class Run:
    """What a generation runs on beside its config, read once from the model and the machine
    (steps/choose.py: run_of). A field left None is not known yet, and the rules that read it wait:
    bench and the CLI check the model's shapes (Run.of_shapes) before the weights load."""
    arch: str | None = None  # the model family ("llama", ...)
    head_dim: int | None = None
    device: str | None = None  # the model's device type: "cpu", "cuda", "meta"
    fp32_compute: bool | None = None  # activations, norms, softmax and logits all in fp32
    precision: str | None = None  # Precision.describe, for messages
    weight_dtypes: frozenset[str] | None = None  # the weights' formats: "float32", "bfloat16", "int8", "int4"
    kv_dtype: str | None = None  # the cache's storage dtype
    batch: int | None = None
    observers: bool | None = None  # attention observers watch this run
    c_kernel: str | None = None  # kernels.build.status(): "loaded ..." or why it is not
    c_kernel_ok: bool | None = None
    triton: str | None = None  # "missing", "interpreted" or "compiled" (kernels/triton_attention.py)
    cuda: bool | None = None  # torch.cuda.is_available()
    bf16_dot: bool | None = None  # a CPU with bf16 dot products (AVX512-BF16 or AMX-BF16; ARM's BF16); None: unknown
    int8_dot: bool | None = None  # an x86 CPU with int8 dot products (AVX512-VNNI, AVX-VNNI or AMX-INT8); None: unknown
    int8_product: bool | None = None  # an int8 product runs here (kernels/int8.py: minigen's C, oneDNN's or torch._int_mm)
    model_window: int | None = None  # the window the model's sliding layers were trained with; 0: none slides
    quantized: bool | None = None  # the linear weights are int4 / int8 codes (load's weight_bits)
    tp_size: int | None = None  # ranks the model is split over (parallel/tensor.py); 1: the whole model here
    paged: bool | None = None  # the cache is paged (cache_chunk_size; the serving engine's pool)

    @classmethod
    def of_shapes(cls, model_config) -> "Run":
        return cls(arch=model_config.arch, head_dim=model_config.head_dim, model_window=model_config.own_window,
                   tp_size=model_config.tp_size)


FUSED_WEIGHTS = ("float32", "bfloat16", "int8", "int4")  # int8 / int4: QuantizedWeight codes
FUSED_MAX_ROWS = 16  # rows of one fused step: csrc/kernels.h's DECODE_MAX_ROWS (tests/test_combinations.py)
FUSED_CACHE = ("float32", "bfloat16")
_FUSED = "Fix: fused_decode=False."
# A tensor-parallel model all-reduces after every attention and MLP (parallel/tensor.py): a step that runs
# the layers where no Python hook runs, or that traces them, cannot make those calls.
_TP = "a tensor-parallel model (tp_size={}) sums each attention's and MLP's output over its ranks, between the layers"


def _group_fix(c: "GenerationConfig", r: Run) -> str:
    """quant_group_size must divide the head dim and fill whole bytes: the nearest size that does."""
    per_byte = 8 // c.quant_bits
    fits = [g for g in range(per_byte, r.head_dim + 1, per_byte) if r.head_dim % g == 0]
    if not fits:
        return "use quant_bits=8"
    return (f"use a divisor of {r.head_dim} that fills whole bytes, e.g. quant_group_size="
            f"{max([g for g in fits if g <= c.quant_group_size] or fits[:1])}")


# feature -> (the Run fields a rule reads, whether it refuses, the message with the fix). check_run
# applies the rules of every feature a config switches on; fused_decode="auto" runs the fused step
# exactly where none of fused_decode's rules refuses (steps/choose.py). A rule that reads only the
# config is checked when the config is built (check_combinations).
RunRule = tuple[str, tuple[str, ...], Callable[["GenerationConfig", Run], bool],
                Callable[["GenerationConfig", Run], str]]
RUN_RULES: tuple[RunRule, ...] = (
    ("fused_decode", ("tp_size",), lambda c, r: r.tp_size > 1, lambda c, r:
     f"fused_decode=True runs every layer of a token in one C call, and {_TP.format(r.tp_size)}. {_FUSED}"),
    ("compile", ("tp_size",), lambda c, r: r.tp_size > 1, lambda c, r:
     f"compile=True traces the decode step, and {_TP.format(r.tp_size)}: gloo's all-reduce breaks the graph at "
     "each of them (not supported yet). Fix: compile=False"),
    ("cuda_graphs", ("tp_size",), lambda c, r: r.tp_size > 1, lambda c, r:
     f"cuda_graphs=True captures the decode step, and {_TP.format(r.tp_size)}: capturing NCCL's collectives is "
     "not supported yet. Fix: cuda_graphs=False"),
    ("fused_decode", ("arch",), lambda c, r: r.arch != "llama", lambda c, r:
     f"fused_decode=True runs the Llama family (RMSNorm, RoPE, SwiGLU); this model is {r.arch!r}. {_FUSED}"),
    ("fused_decode", ("device",), lambda c, r: r.device != "cpu", lambda c, r:
     f"fused_decode=True is a CPU step (C kernels); the model is on {r.device}. {_FUSED} (on a GPU: "
     "cuda_graphs=True or compile=True)"),
    ("fused_decode", ("fp32_compute", "precision"), lambda c, r: not r.fp32_compute, lambda c, r:
     "fused_decode=True computes in fp32 (activations, norms, softmax, logits), and this model's precision "
     f"is {r.precision}. {_FUSED}"),
    ("fused_decode", ("weight_dtypes",), lambda c, r: not r.weight_dtypes <= set(FUSED_WEIGHTS), lambda c, r:
     f"fused_decode=True reads fp32, bf16, int8 or int4 weights, not {', '.join(sorted(r.weight_dtypes))}: load "
     f"the model with dtype=torch.bfloat16 or float32. {_FUSED}"),
    ("fused_decode", ("head_dim",), lambda c, r: r.head_dim > 1024 or r.head_dim % 2, lambda c, r:
     f"fused_decode=True takes an even head dim up to 1024, not {r.head_dim}. {_FUSED}"),
    ("fused_decode", ("c_kernel_ok", "c_kernel"), lambda c, r: not r.c_kernel_ok, lambda c, r:
     f"fused_decode=True needs minigen's C kernel, which is {r.c_kernel}. {_FUSED}"),
    ("fused_decode", ("batch", "weight_dtypes", "paged"),
     lambda c, r: r.batch > 1 and r.weight_dtypes != {"float32"} and not r.paged,
     lambda c, r: f"fused_decode=True decodes a batch of {r.batch} rows in a contiguous cache with fp32 weights only "
     f"(its products run the several-row fp32 kernel), and these are {', '.join(sorted(r.weight_dtypes))}. Fix: "
     "cache_chunk_size=16 (a paged cache's rows run the batch GEMMs of int8 / int4 codes), fused_decode=False, "
     "or one prompt per call."),
    ("fused_decode", ("batch",), lambda c, r: r.batch > FUSED_MAX_ROWS, lambda c, r:
     f"fused_decode=True decodes up to {FUSED_MAX_ROWS} rows at once, not {r.batch}: past that, torch's GEMM "
     "runs a batch's products faster. Fix: fused_decode=False, or smaller batches."),
    ("fused_decode", ("kv_dtype",), lambda c, r: r.kv_dtype not in FUSED_CACHE, lambda c, r:
     f"fused_decode=True keeps the cache in fp32 or bf16, not {r.kv_dtype}: set kv_dtype='float32' or "
     "'bfloat16', or fused_decode=False"),
    ("fused_decode", ("observers",), lambda c, r: r.observers, lambda c, r:
     "fused_decode=True with observers: the fused step keeps attention in C, where no observer sees it. "
     "Fix: fused_decode=False to observe attention."),
    ("fused_decode", ("model_window",), lambda c, r: r.model_window > 0, lambda c, r:
     f"fused_decode=True attends every cached position in every layer; this model's sliding layers attend only the last "
     f"{r.model_window} (its own sliding_window). {_FUSED}"),
    ("kv_budget", ("tp_size",), lambda c, r: r.tp_size > 1, lambda c, r:
     f"kv_budget={c.kv_budget} evicts the tokens that all heads together attended least (caches/h2o.py), and each "
     f"rank of a tensor-parallel model (tp_size={r.tp_size}) sees only its own heads: the ranks would evict "
     "different tokens. Fix: kv_budget=None, or tp_size=1"),
    ("window_size", ("model_window",), lambda c, r: c.window_size > r.model_window > 0, lambda c, r:
     f"window_size={c.window_size} is larger than this model's own sliding_window={r.model_window}, which its sliding "
     f"layers were trained to see. Fix: window_size <= {r.model_window} (it then masks every layer, sinks included), "
     "or window_size=None to run the model's own windows"),
    ("attention_backend", ("model_window",), lambda c, r: r.model_window > 0, lambda c, r:
     f"attention_backend='triton' masks every layer with one window; this model's sliding layers attend the last "
     f"{r.model_window} tokens and its full layers all: use attention_backend='torch'"),
    ("speculative_method", ("observers",), lambda c, r: r.observers, lambda c, r:
     "speculative decoding with observers: they would see the attention of proposals that are then rejected. "
     "Fix: speculative_method=None to observe attention."),
    *((step, ("observers",), lambda c, r: r.observers, lambda c, r, step=step:
       f"{step}=True with observers: an observer runs Python in every layer, which a compiled or captured "
       "step cannot call. Run the observers without compiling.") for step in ("compile", "cuda_graphs")),
    ("cuda_graphs", ("cuda",), lambda c, r: not r.cuda, lambda c, r:
     "cuda_graphs=True needs CUDA, and torch.cuda.is_available() is False on this machine: use compile=True, "
     "which compiles the decode step on a CPU too"),
    ("cuda_graphs", ("device",), lambda c, r: r.device != "cuda", lambda c, r:
     f"cuda_graphs=True needs the model on a CUDA device, not {r.device}: model.to('cuda'), or compile=True "
     "on a CPU"),
    ("prefill_precision", ("bf16_dot",), lambda c, r: c.prefill_precision == "bfloat16" and not r.bf16_dot,
     lambda c, r: "prefill_precision='bfloat16' needs bf16 dot products, and this CPU has none (no avx512_bf16 or "
     "amx_bf16 on x86, no bf16 on ARM): its bf16 products would run slower than fp32. Use "
     "prefill_precision='float32'"),
    ("prefill_precision", ("device",), lambda c, r: c.prefill_precision == "int8" and r.device != "cpu", lambda c, r:
     f"prefill_precision='int8' runs on a CPU, and the model is on {r.device}: use prefill_precision='bfloat16'"),
    ("prefill_precision", ("int8_product",), lambda c, r: c.prefill_precision == "int8" and not r.int8_product,
     lambda c, r: "prefill_precision='int8' needs an int8 product: minigen's C kernels (a C compiler), oneDNN's int8 "
     "linear or torch._int_mm, and none runs here: use 'float32'"),
    ("prefill_precision", ("int8_dot",), lambda c, r: c.prefill_precision == "int8" and not r.int8_dot,
     lambda c, r: "prefill_precision='int8' needs int8 dot products, and this CPU has none (no avx512_vnni, avx_vnni "
     "or amx_int8): its int8 products would run no faster than fp32. Use prefill_precision='float32' (or "
     "'bfloat16' where the CPU has bf16 dot products)"),
    ("attention_backend", ("triton",), lambda c, r: r.triton == "missing", lambda c, r:
     "attention_backend='triton' needs the triton package, which ships for Linux only: pip install triton, "
     "or use attention_backend='torch'"),
    ("attention_backend", ("triton", "device"), lambda c, r: r.device != "cuda" and r.triton != "interpreted",
     lambda c, r: f"attention_backend='triton' compiles its kernel for CUDA on this machine, and the model is on "
     f"{r.device}: model.to('cuda'), or set TRITON_INTERPRET=1 before importing minigen to run the kernel in "
     "Triton's interpreter (correct, slow)"),
    # int8_activations=True (not a feature of the table: checked by steps/choose.py, where it is demanded)
    ("int8_activations", ("quantized",), lambda c, r: not r.quantized, lambda c, r: "int8_activations=True "
     "multiplies int4/int8 weight codes by int8 activations, and this model's weights are not quantized: load it with "
     "weight_bits=4 or 8, or set int8_activations=False (fp32 and bf16 weights decode exactly)"),
    ("int8_activations", ("device",), lambda c, r: r.device != "cpu", lambda c, r: f"int8_activations=True runs "
     f"minigen's C kernels on a CPU, and the model is on {r.device}. Fix: int8_activations=False"),
    ("int8_activations", ("c_kernel_ok", "c_kernel"), lambda c, r: not r.c_kernel_ok, lambda c, r:
     f"int8_activations=True needs minigen's C kernel, which is {r.c_kernel}. Fix: int8_activations=False"),
    # values (and keys per token) are grouped over the channels of one head
    ("quant_bits", ("head_dim",), lambda c, r: r.head_dim % c.quant_group_size, lambda c, r:
     f"quant_group_size={c.quant_group_size} does not divide this model's head dim {r.head_dim}: values (and "
     f"keys with quant_key_axis='token') are grouped over the {r.head_dim} channels of a head, so at "
     f"quant_bits={c.quant_bits} {_group_fix(c, r)}"),
)


def run_refusals(c: "GenerationConfig", r: Run, feature: str | None = None) -> list[str]:
    """Why `r` cannot run the features `c` switches on (or, with `feature`, that feature whether on
    or not): one message per rule broken, in RUN_RULES' order. Rules that read an unknown field wait."""
    on = [feature] if feature is not None else c.features()
    return [message(c, r) for f, reads, refuses, message in RUN_RULES
            if f in on and all(getattr(r, name) is not None for name in reads) and refuses(c, r)]


def check_run(c: "GenerationConfig", r: Run) -> None:
    """Refuse, before any work, a config that this model and machine cannot run (RUN_RULES)."""
    refusals = run_refusals(c, r)
    if refusals:
        raise ConfigError(refusals[0])
