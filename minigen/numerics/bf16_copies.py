"""bf16 copies of a model's block weights for bf16 prompts (chapter 3): prefill_precision="bfloat16".

A bf16 prompt multiplies bf16 inputs with fp32 sums (kernels/cpu.py's `bf16_linear`, oneDNN's bf16
GEMM). Its weights must be bf16 too: converting an fp32 matrix on every call (`w.bfloat16()`, a new
2-byte-a-weight tensor each time), or widening int8 / int4 codes a tile at a time, was a large
share of a bf16 prompt. So, as numerics/w8a8.py does for int8 prompts, the first bf16 prompt format
of a model (`precision.prompt_format("bfloat16", model)`) makes a bf16 copy of each block weight once,
into the model's own `model.weight_copies` (numerics/copies.py), and the prompt's products read it
there (`WeightCopies.bf16_of`, handed to kernels/cpu.py's `bf16_linear`) instead of converting.

- Which weights: every block's fp32 products (`block_weights`). Measured on this course's Xeon
  (AMX): a whole 512-token bf16 forward at 1 thread, 2.58x fp32's speed without copies and 2.97x
  with. int8 / int4 codes keep their tile-at-a-time widening (`_tiled`): a copy made their bf16
  prompts faster too (2.52x -> 3.00x, int4), but it costs 2 bytes a weight beside a model that was
  loaded with weight_bits=4 (or 8) to hold 0.5 (or 1): 212 MB beside SmolLM2's 97 MB of int4 weights
  (+220%), where the prompt's speed is not what the user chose. A bf16 weight is its own copy (none
  is made); fp16 weights do not take the bf16 path at all.
- The output head has none: a prefill computes the last row's logits only (one row: the decode
  step's fp32 kernel), so only a teacher-forced score (evaluate.score) or more than 16 prompts in
  one step reach it with many rows, and there `bf16_linear` converts it per call. A copy
  of SmolLM2's tied head would be 57 MB.
- The cost: 2 bytes a block weight (`nbytes`), kept beside the weights the decode steps read: on
  SmolLM2, 212 MB beside the fp32 model's 538 MB (+39%). Making them is the first bf16 prompt's
  cost, once: on SmolLM2, 79 ms on a quiet machine, 2.7 s measured next to busy processes.
- The same rounding: a copy holds exactly what the per-call conversion makes (round to nearest
  even, once, from fp32), so a product with it gives the same bits as without it.
- A weight changed in place after its copy was made (offgrid.rotate, a test) makes its copy stale:
  each copy remembers the weight's version counter, `bf16_of` answers None for a stale one (the
  product converts per call), and the next `prepare` makes it again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .copies import WeightCopies, version
from .weight_quant import QuantizedWeight


def takes(w) -> bool:
    """Whether a bf16 prompt keeps a copy of w: fp32 weights on the CPU (the module docstring says why
    not int8 / int4 codes). A bf16 weight is its own copy; an fp16 one runs the reference's path."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and not isinstance(w, QuantizedWeight)


def make(w: Tensor) -> Tensor:
    """w [n, k] fp32 -> its bf16 copy [n, k], contiguous: rounded to nearest even once, as the
    per-call conversion rounds it."""
    return w.bfloat16().contiguous()


def prepare(model) -> None:
    """Make the bf16 copy of every block weight that takes one, into model.weight_copies (once per
    model: a later call only checks that each copy is there and current)."""
    for w in block_weights(model):
        keep(model.weight_copies, w)


def keep(copies: WeightCopies, w) -> Tensor | None:
    """w's bf16 copy in `copies`, made now if it has none or a stale one; None where w takes none (`takes`)."""
    if not takes(w):
        return None
    if (kept := copies.bf16_of(w)) is None:
        with torch.inference_mode():
            kept = make(w)
        copies.bf16[w] = (version(w), kept)
    return kept


def nbytes(model) -> int:
    """Bytes held by the bf16 copies of `model`'s weights (0 before its first bf16 prompt)."""
    return sum(c.nbytes for w in block_weights(model) if (c := model.weight_copies.bf16_of(w)) is not None)


def block_weights(model) -> list:
    """Every block's weights that a prompt multiplies (weight_quant.linear_weights's, the head not
    among them), read directly: 0.1 ms for SmolLM2 where walking the modules takes 1.2 ms, and
    every bf16 prompt asks (`prepare`)."""
    gpt2 = model.config.arch == "gpt2"  # GeluMLP's w_fc and w_proj; else GatedMLP's (llama, gemma3)
    return [w for b in model.blocks for w in (b.attn.wqkv, b.attn.wo, *((b.mlp.w_fc, b.mlp.w_proj) if gpt2 else
                                                                         (b.mlp.w_gate_up, b.mlp.w_down)))]
