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
                       a prompt's 17+ rows under prefill_precision="bfloat16":        F.linear in bf16
                       bf16 tiles of any weight format, oneDNN's bf16 GEMM
                       a prompt's 17+ rows under prefill_precision="int8", a block's   w8a8's
                       weight: the rows as int8 codes (C), oneDNN's int8 GEMM          reference
    rms_norm           up to 64 fp32 rows on a CPU: one C call                        F.rms_norm
    decode_attention   one query per row, fp32 on a CPU: the C loop                   SDPA
    attend_blocks      Triton's fused kernel over the paged blocks (chapter 9)        gather + attend
    attend_prompt_blocks
                       a prompt's T queries: Triton's FlashAttention over the blocks  gather + attend

Each kernel function in cpu.py returns None where it does not apply (not on the CPU, autograd,
torch.compile or a dispatch mode that must see the op, the kernels switched off: build.enabled),
so the choice is made per call, and the same results come back up to rounding
(tests/test_cpu_kernel.py compares every kernel with its reference).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..numerics import w8a8
from ..numerics.precision import prompt_dtype
from ..numerics.weight_quant import QuantizedWeight
from . import cpu, triton_attention, triton_prefill


class KernelOps:
    """The reference's ops (model.TorchOps), each run by a kernel where one takes the call."""

    def __init__(self, reference):
        self.reference = reference  # the plain torch ops: every call a kernel declines goes there

    def linear(self, x: Tensor, w, out_dtype: torch.dtype | None = None) -> Tensor:
        """x [..., in] @ w [out, in].T -> [..., out] in out_dtype (default x's), as the reference."""
        out_dtype = out_dtype or x.dtype
        fmt = prompt_dtype(x.numel() // x.shape[-1])
        if fmt == torch.bfloat16:  # prefill_precision="bfloat16"
            y = cpu.bf16_linear(x.float(), w)  # bf16 dot products, the weights a tile at a time
            return y.to(out_dtype) if y is not None else self.reference.linear(x, w, out_dtype)
        if fmt == torch.int8 and (w8 := w8a8.copy_of(w)) is not None:  # prefill_precision="int8"
            y = cpu.int8_linear(x.float(), w8)  # int8 dot products against the weights' int8 copy
            return y.to(out_dtype) if y is not None else self.reference.linear(x, w, out_dtype)
        if x.numel() == x.shape[-1]:  # one row (a decode step at batch 1): stream the weights once
            y = cpu.matvec(x.float(), w)
            if y is not None:
                return y.view(*x.shape[:-1], w.shape[0]).to(out_dtype)
        rows = x.numel() // x.shape[-1]
        if rows <= cpu.MAX_ROWS and x.dtype == torch.float32 and not isinstance(w, QuantizedWeight):
            y = cpu.matmul_rows(x.reshape(rows, x.shape[-1]), w)  # a batch's rows read each weight once
            if y is not None:
                return y.view(*x.shape[:-1], w.shape[0]).to(out_dtype)
        if isinstance(w, QuantizedWeight):  # several rows (a prompt, a batch): a tile of codes at a time
            y = cpu.quantized_linear(x.float(), w)
            if y is not None:
                return y.to(out_dtype)
            w = w.dequantize()
        if x.dtype != w.dtype or (out_dtype == torch.float32 and x.dtype != torch.float32):
            x, w = x.float(), w.float()  # fp32 sums and result, as the reference
        y = cpu.linear(x, w)  # a prompt's fp32 rows: oneDNN's GEMM (cpu.linear says why)
        return y.to(out_dtype) if y is not None else self.reference.linear(x, w, out_dtype)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y = cpu.rms_norm(x, weight, eps)  # a decode step's few rows: one C call instead of torch's ops
        return y if y is not None else self.reference.rms_norm(x, weight, eps)

    def decode_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, fp32_softmax: bool = True) -> Tensor:
        out = cpu.attend_decode(q, k, v, mask)  # the same softmax as SDPA's, each (row, head) alone
        return out if out is not None else self.reference.decode_attention(q, k, v, mask, fp32_softmax)

    def attend_blocks(self, q: Tensor, view, window_size: int | None, sink_tokens: int) -> Tensor:
        return triton_attention.decode_attention(q, view, window_size, sink_tokens)

    def attend_prompt_blocks(self, q: Tensor, view, query_pos: Tensor, window_size: int | None,
                             sink_tokens: int) -> Tensor:
        return triton_prefill.prefill_attention(q, view, query_pos, window_size, sink_tokens)


def install(model) -> None:
    """Run `model`'s ops on the kernels from now on (idempotent): what every loaded model gets."""
    if not isinstance(model.ops, KernelOps):
        model.ops = KernelOps(model.ops)
