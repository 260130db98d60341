"""Which implementation runs each op of the model: the one place that decides.

The model (model.py) is the math in plain torch and calls its few replaceable ops through
`model.ops`; its own `TorchOps` is the reference. `install(model)` (loading.py calls it for every
model it builds) puts `KernelOps` there instead, which takes each call to the fastest kernel that
accepts it and otherwise to the reference:

    op                 kernel (when it takes the call)                               else
    linear             one row: C matrix-vector (fp32, bf16, int8, int4 weights)      reference
                       2..16 fp32 rows: the C several-row kernel (reads W once)       (F.linear,
                       more fp32 rows on a CPU: oneDNN's GEMM                          dequantized)
                       int8 / int4 rows: C, a panel of codes widened per thread
                       a prompt's 17+ rows in a "bfloat16" format (ops.prompt):       F.linear in bf16
                       oneDNN's bf16 GEMM on the weight's bf16 copy (fp32 weights:
                       ops.prompt.copies, the model's; bf16_copies.py) or bf16
                       tiles of its codes
                       int8 / int4 codes with int8_act (int8_activations): C's       int8_act's
                       integer dot products, one row or a prompt's (int8_act.py)      reference
                       a prompt's 17+ rows in an "int8" format, a block's weight:     w8a8's
                       the rows as int8 codes against its int8 copy, by the int8      reference
                       product measured fastest here (kernels/int8.py: C's
                       vpdpbusd, oneDNN, _int_mm)
    rms_norm           up to 64 fp32 rows on a CPU: one C call                        F.rms_norm
    decode_attention   one query per row, fp32 on a CPU: the C loop                   SDPA
    attend_blocks      Triton's fused kernel over the paged blocks (chapter 12)        gather + attend
    attend_prompt_blocks
                       a prompt's T queries: Triton's FlashAttention over the blocks  gather + attend

A kernel runs only where fastpaths.py measured it on this machine, at the model's shapes, not clearly
slower than its reference (KernelOps.on): a CPU flag says an instruction exists, not that a kernel is
fast here. Each path that stands aside says so once, with its ratio. The prompt formats
(prefill_precision) are the user's demand: they run whatever they measured (steps/choose.py warns).

The ops carry how one forward runs, as model.TorchOps does: `prompt`, the prompt format
(precision.PromptFormat), `reads_blocks` (attention_backend='triton': the attend_blocks ops read
the paged cache in place) and `int8_act` (int8_activations: int4 / int8 codes meet int8 activations, for
a decode step or a prompt, each where it measured faster here: steps/choose.py). `configured` gives a new KernelOps with them replaced, sharing this one's
measurements, whose reference is configured alike (every call it declines runs in the same format).

Each kernel function in cpu.py returns None where it does not apply (not on the CPU, autograd,
torch.compile or a dispatch mode that must see the op, the kernels switched off: build.enabled),
so the choice is made per call, and the same results come back up to rounding
(tests/test_cpu_kernel.py compares every kernel with its reference).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from ..numerics.precision import FP32, PromptFormat
from ..numerics.weight_quant import QuantizedWeight
from . import build, cpu, fastpaths, int8, triton_attention, triton_prefill
from .probes import FLOOR, Shapes


class KernelOps:
    """The reference's ops (model.TorchOps), each run by a kernel where one takes the call."""
    prompt: PromptFormat = FP32  # the format of a prompt's products (prefill_precision, chapter 3)
    reads_blocks: bool = False  # attention reads a paged cache's blocks in place (attention_backend='triton')
    int8_act: bool = False  # int4/int8 weights meet int8 activations (int8_activations, numerics/int8_act.py)

    def __init__(self, reference, shapes: Shapes | None = None):
        self.reference = reference  # the plain torch ops: every call a kernel declines goes there
        self.shapes = shapes  # the model's, for the measurements (None: SmolLM2's)
        self.measured: fastpaths.FastPaths | None = None  # read at the first choice
        self.read_at = -1  # fastpaths.generation() when read

    def configured(self, prompt: PromptFormat | None = None, reads_blocks: bool | None = None,
                   int8_act: bool | None = None) -> "KernelOps":
        """A new KernelOps with `prompt`, `reads_blocks` and `int8_act` replaced where given (None: kept),
        its reference configured alike; this one is unchanged."""
        ops = copy.copy(self)
        ops.reference = self.reference.configured(prompt, reads_blocks, int8_act)
        for name, value in (("prompt", prompt), ("reads_blocks", reads_blocks), ("int8_act", int8_act)):
            setattr(ops, name, getattr(self, name) if value is None else value)
        return ops

    def paths(self) -> fastpaths.FastPaths:
        """The fast paths' measurements at this model's shapes (fastpaths.measured: once per machine)."""
        if self.measured is None or self.read_at != fastpaths.generation():
            self.measured, self.read_at = fastpaths.measured(self.shapes or Shapes(**FLOOR)), fastpaths.generation()
        return self.measured

    def on(self, path: str, x: Tensor) -> bool:
        """Whether the fast path `path` may take this call: it measured no slower than its reference here.
        Off the CPU, with the kernels switched off, or while torch.compile or a dispatch mode watches,
        the kernels' own rules decide (they stand aside there), and nothing is measured."""
        if x.device.type != "cpu" or not build.is_enabled() or not fastpaths.applies():
            return True
        return self.paths().allowed(path)

    def int8_backend(self) -> str | None:
        """The int8 prompt product measured fastest here (kernels/int8.py), or None where none was measured."""
        best = self.paths().best_int8()
        return None if best is None else best.path.removeprefix("int8_")

    def linear(self, x: Tensor, w, out_dtype: torch.dtype | None = None) -> Tensor:
        """x [..., in] @ w [out, in].T -> [..., out] in out_dtype (default x's), as the reference."""
        out_dtype = out_dtype or x.dtype
        fmt, copies = self.prompt.dtype(x.numel() // x.shape[-1]), self.prompt.copies
        if fmt == torch.bfloat16:  # prefill_precision="bfloat16": demanded, so it runs (steps/choose.py warns)
            kept = copies.bf16_of(w) if copies is not None else None  # a block's weight: its bf16 copy
            y = cpu.bf16_linear(x.float(), w, kept)  # bf16 dot products on the copy, or tiles of codes
            return y.to(out_dtype) if y is not None else self.reference.linear(x, w, out_dtype)
        if fmt == torch.int8 and copies is not None and (w8 := copies.int8_of(w)) is not None:  # prefill_precision="int8"
            # int8 dot products against the weights' int8 copy, by the product measured fastest here
            backend = self.int8_backend() if x.device.type == "cpu" else None
            y = int8.int8_linear(x.float(), w8, backend) if backend is not None else None
            return y.to(out_dtype) if y is not None else self.reference.linear(x, w, out_dtype)
        quantized = isinstance(w, QuantizedWeight)
        if quantized and self.int8_act:  # int8 activations: integer dot products with the codes (int8_activations)
            one = x.numel() == x.shape[-1]
            y = cpu.matvec_s8(x.float(), w) if one else cpu.quantized_linear_s8(x.float(), w)
            return (y.view(*x.shape[:-1], w.shape[0]).to(out_dtype) if y is not None
                    else self.reference.linear(x, w, out_dtype))
        one_row = _ONE_ROW.get(w.bits if quantized else w.dtype, "c_matvec")  # the measurement of its one-row loop
        if x.numel() == x.shape[-1] and self.on(one_row, x):
            y = cpu.matvec(x.float(), w)  # one row (a decode step at batch 1): stream the weights once
            if y is not None:
                return y.view(*x.shape[:-1], w.shape[0]).to(out_dtype)
        rows = x.numel() // x.shape[-1]
        # the several-row loop gives each row the bits the one-row loop gives it alone: it runs only beside it
        if (rows <= cpu.MAX_ROWS and x.dtype == torch.float32 and not quantized and self.on(one_row, x)
                and self.on("c_rows", x)):
            y = cpu.matmul_rows(x.reshape(rows, x.shape[-1]), w)  # a batch's rows read each weight once
            if y is not None:
                return y.view(*x.shape[:-1], w.shape[0]).to(out_dtype)
        if quantized:  # several rows (a prompt, a batch): a tile of codes at a time
            y = cpu.quantized_linear(x.float(), w) if self.on("gemm_q", x) else None
            if y is not None:
                return y.to(out_dtype)
            w = w.dequantize()
        if x.dtype != w.dtype or (out_dtype == torch.float32 and x.dtype != torch.float32):
            x, w = x.float(), w.float()  # fp32 sums and result, as the reference
        y = cpu.linear(x, w) if self.on("onednn_fp32", x) else None  # a prompt's fp32 rows: oneDNN's GEMM
        return y.to(out_dtype) if y is not None else self.reference.linear(x, w, out_dtype)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        # a decode step's few rows: one C call instead of torch's ops
        y = cpu.rms_norm(x, weight, eps) if self.on("c_rms_norm", x) else None
        return y if y is not None else self.reference.rms_norm(x, weight, eps)

    def decode_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, fp32_softmax: bool = True) -> Tensor:
        # the same softmax as SDPA's, each (row, head) alone
        out = cpu.attend_decode(q, k, v, mask) if self.on("c_attention", q) else None
        return out if out is not None else self.reference.decode_attention(q, k, v, mask, fp32_softmax)

    def plan_blocks(self, q: Tensor, view, window_size: int | None, sink_tokens: int):
        return triton_attention.plan_decode(q, view, window_size, sink_tokens)

    def attend_blocks(self, q: Tensor, view, window_size: int | None, sink_tokens: int, plan=None) -> Tensor:
        return triton_attention.decode_attention(q, view, window_size, sink_tokens, plan=plan)

    def attend_prompt_blocks(self, q: Tensor, view, query_pos: Tensor, window_size: int | None,
                             sink_tokens: int) -> Tensor:
        return triton_prefill.prefill_attention(q, view, query_pos, window_size, sink_tokens)


# the one-row measurement that decides each weight format's matrix-vector product
_ONE_ROW = {torch.float32: "c_matvec", torch.bfloat16: "c_matvec_bf16", 4: "c_matvec_q4", 8: "c_matvec_q8"}


def install(model) -> None:
    """Run `model`'s ops on the kernels from now on (idempotent): what every loaded model gets."""
    if not isinstance(model.ops, KernelOps):
        model.ops = KernelOps(model.ops, Shapes.of(model.config))
