"""Mixed precision (chapter 9): what each number is stored in, and what it is computed in.

    weights      model.dtype           fp32, bf16 or fp16: minigen.load(name, dtype=...)
    activations  model.precision       fp32, or the weights' dtype: the residual stream between ops
    KV cache     config.kv_dtype       fp32, bf16 or fp16 storage (None: the weights' dtype)
    critical     model.precision       norms, softmax and logits in fp32 whatever the rest

A product of 16-bit weights and fp32 activations keeps the activations exact: one row (a decode
step at batch 1) runs on the C kernel, which widens each bf16 weight to fp32 in a register; several
rows (a prompt, a batch) widen the weights to fp32 for the product. The default policy follows
the hardware: on a CPU, fp32 activations (its small ops are fast in fp32, and the kernel reads bf16
weights at the price of bf16 bytes); on a GPU, the weights' dtype (native 16-bit arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError
from . import bf16_copies, w8a8
from .copies import WeightCopies

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_of(value, key: str) -> torch.dtype:
    """torch.float32/bfloat16/float16, or its name -> the torch dtype; anything else raises
    ConfigError naming `key` and the choices (an integer dtype would round every weight to 0)."""
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    raise ConfigError(f"{key}={value!r} is not supported: use torch.float32, torch.bfloat16 or torch.float16 "
                      f"(or the strings {', '.join(map(repr, DTYPES))})")


@dataclass(frozen=True)
class Precision:
    """How a model computes: the activations' dtype, and which critical paths stay in fp32."""
    compute: torch.dtype = torch.float32  # activations between ops (the residual stream, q, k, v)
    fp32_norms: bool = True  # RMSNorm / LayerNorm: a mean of squares over the model width
    fp32_softmax: bool = True  # attention's probabilities: many small numbers that must sum to 1
    fp32_logits: bool = True  # the output head's sums, and the logits sampling reads

    @classmethod
    def default(cls, weights: torch.dtype, device: torch.device | str) -> "Precision":
        """fp32 activations on a CPU, the weights' dtype on a GPU (see the module docstring)."""
        return cls(compute=torch.float32 if torch.device(device).type == "cpu" else weights)

    def replace(self, **changes) -> "Precision":
        if "compute" in changes:
            changes["compute"] = dtype_of(changes["compute"], "compute")
        for key in ("fp32_norms", "fp32_softmax", "fp32_logits"):
            if key in changes and not isinstance(changes[key], bool):
                raise ConfigError(f"{key}={changes[key]!r} is invalid: use True or False")
        return replace(self, **changes)

    def describe(self, weights: torch.dtype) -> str:
        """One line for reports: e.g. 'bf16 weights, fp32 activations, fp32 norms/softmax/logits'."""
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        low = [p for p, keep in (("norms", self.fp32_norms), ("softmax", self.fp32_softmax),
                                 ("logits", self.fp32_logits)) if not keep]
        critical = "fp32 norms, softmax and logits" if not low else f"{', '.join(low)} in {name[self.compute]}"
        return f"{name[weights]} weights, {name[self.compute]} activations, {critical}"


# ---------------------------------------------------------------- a prompt's products (chapter 3)
# A prompt's matrix products are bound by arithmetic, a decode step's by memory: the format that
# pays differs. GenerationConfig.prefill_precision picks the prompt's: `prompt_format` turns it into
# a `PromptFormat`, which the ops of a prompt's forward carry (model.TorchOps.prompt,
# kernels/dispatch.KernelOps.prompt: ops.configured(prompt=...), steps/choose.ops_for), and the
# linear op asks it for the format of each product. Up to SHORT_PROMPT_ROWS rows stay fp32: the C
# several-row kernel reads the weights once, so a short prompt is bound by memory like a decode step.
SHORT_PROMPT_ROWS = 16
PROMPT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True)
class PromptFormat:
    """The format of a prompt's products and attention: what a forward's ops carry (FP32: none).

    name "bfloat16": products of more than SHORT_PROMPT_ROWS rows take bf16 inputs (fp32 sums, the
    result rounded to bf16 by the GEMM), on the weights' bf16 copies in `copies`; the attention's
    SDPA takes bf16 q, k and v with an fp32 softmax where attention_bf16 (attention.attend).
    "int8": those products take int8 codes (int32 sums; numerics/w8a8.py), against the int8 copies
    in `copies`. "float32": every product and the attention as the model computes them."""
    name: str = "float32"  # "float32", "bfloat16" or "int8" (PROMPT_DTYPES)
    attention_bf16: bool = False  # "bfloat16" only: the prompt's attention in bf16 too
    copies: WeightCopies | None = None  # the model's weight copies (model.weight_copies); None: convert per call

    def dtype(self, rows: int) -> torch.dtype:
        """The input format of a product of `rows` rows: torch.bfloat16 or torch.int8 past
        SHORT_PROMPT_ROWS rows under "bfloat16" or "int8"; else torch.float32."""
        return PROMPT_DTYPES[self.name] if rows > SHORT_PROMPT_ROWS else torch.float32

    def attention_dtype(self, rows: int) -> torch.dtype:
        """The q, k and v dtype of a prompt's attention over `rows` query rows: torch.bfloat16 under
        "bfloat16" with attention_bf16, past SHORT_PROMPT_ROWS rows; else torch.float32."""
        bf16 = self.name == "bfloat16" and self.attention_bf16 and rows > SHORT_PROMPT_ROWS
        return torch.bfloat16 if bf16 else torch.float32

    def describe(self) -> str:
        """In words, for reports: "fp32", "bf16 products (bf16 attention)", "int8 products"..."""
        if self.name == "bfloat16":
            return f"bf16 products ({'bf16' if self.attention_bf16 else 'fp32'} attention)"
        return "int8 products" if self.name == "int8" else "fp32"


FP32 = PromptFormat()  # every product and the attention in fp32: a decode step's, and the default


def prompt_format(name: str = "float32", model=None, bf16_attention: bool = True) -> PromptFormat:
    """The PromptFormat that prefill_precision=`name` selects for `model`, whose weight copies it
    makes the first time: the int8 copies for "int8" (numerics/w8a8.py, calibrated here), the bf16
    copies of the block weights for "bfloat16" (numerics/bf16_copies.py; without a model each
    product converts its weight). bf16_attention=False keeps a "bfloat16" prompt's attention in fp32
    (where bf16 SDPA measured slower than fp32 on this machine: steps/choose.py's
    prompt_attention_bf16). An unknown name raises ConfigError."""
    if name not in PROMPT_DTYPES:
        raise ConfigError(f"prefill_precision={name!r} is invalid: use {', '.join(map(repr, PROMPT_DTYPES))}")
    if name == "float32":
        return FP32
    if name == "int8":
        if model is None:
            raise ConfigError("prompt_format('int8') needs the model, whose weights it quantizes once")
        w8a8.prepare(model)
    if name == "bfloat16" and model is not None:
        bf16_copies.prepare(model)
    return PromptFormat(name, name == "bfloat16" and bf16_attention, None if model is None else model.weight_copies)
