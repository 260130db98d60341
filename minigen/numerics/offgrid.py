"""Weights that are not on a 4-bit grid, and a quantizer that compensates its errors (chapter 10).

minigen's SmolLM2 is the dequantized Q4_1 GGUF: its "fp32" linear weights already sit on a 4-bit grid
of groups of 32, so requantizing them to int4 in groups of 32 loses nothing by construction, and
larger groups measure a mismatch of grids rather than quantization. This module makes honest
off-grid weights and quantizes them two ways.

- `rotate(model)`: a random orthogonal rotation Q of the residual stream, the RMSNorm weights folded
  into the linears that read them (QuaRot, Ashkboos et al. 2024; SpinQuant, Liu et al. 2024). The
  stream x becomes xQ; RMSNorm(xQ) = RMSNorm(x)Q because Q keeps lengths, so every product gives
  the same numbers up to rounding, while every weight is mixed with 575 others: off the grid.
- `gptq_matrix` / `gptq_quantize`: GPTQ (Frantar et al. 2022). Column by column, each rounding error
  is pushed onto the columns not yet rounded, weighted by the inverse Hessian of the layer's
  inputs, so the layer's output on calibration data moves less than round-to-nearest moves it.
  The result is minigen's own group-wise format (`QuantizedWeight`): the same kernels run it.
- `bf16_weight_kl`: chapter 9's bf16-weight study (the weights rounded to bf16, fp32 activations)
  on any model, e.g. the rotated one.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .weight_quant import BLOCK, QuantizedWeight, check_weight_bits, linear_weights, pack4, quantize_matrix


# ---------------------------------------------------------------- the rotation
def random_orthogonal(dim: int, seed: int = 0) -> Tensor:
    """A random orthogonal matrix [dim, dim] in float64, drawn uniformly (QR of a Gaussian, signs fixed)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))  # the sign fix makes the draw uniform (Haar)


def rotate(model, seed: int = 0):
    """A copy of `model` whose residual stream is rotated by a random orthogonal Q -> the copy.

    Same function, other weights (float64 arithmetic, stored in the model's dtype):
      embedding E -> E Q;  a linear that reads a norm, W [n, D] -> W diag(g) Q, the norm's g -> 1;
      a linear that writes the stream, W [D, k] -> Q^T W;  the head H -> H diag(g_final) Q.
    A tied head is untied: the embedding and the head are rotated differently.
    """
    cfg = model.config
    if cfg.arch != "llama" or cfg.qkv_bias or cfg.out_bias or model.pos_embed is not None:
        raise ConfigError("rotate needs a Llama-family model without biases (RMSNorm, no learned positions)")
    if any(isinstance(m, QuantizedWeight) for m in model.modules()):
        raise ConfigError("rotate a float model: its weights are about to be mixed, not its codes")
    dtype = model.embed.dtype
    Q = random_orthogonal(cfg.dim, seed)  # [D, D]
    out = copy.deepcopy(model)

    def reads(w: Tensor, g: Tensor) -> Tensor:  # W [n, D] reads norm(x) g: W diag(g) Q reads norm(xQ)
        return ((w.double() * g.double()) @ Q).to(dtype)

    def writes(w: Tensor) -> Tensor:  # W [D, k] adds to the stream: Q^T W adds to the rotated one
        return (Q.T @ w.double()).to(dtype)

    with torch.no_grad():
        head = out.head.detach().clone()  # read before the embedding changes (tied: the same tensor)
        # the two tables [V, D] in fp32 arithmetic (float64 would take seconds for 49,152 rows)
        out.embed = nn.Parameter((out.embed.float() @ Q.float()).to(dtype), requires_grad=False)
        for block in out.blocks:
            block.attn.wqkv.copy_(reads(block.attn.wqkv, block.attn_norm.weight))
            block.mlp.w_gate_up.copy_(reads(block.mlp.w_gate_up, block.mlp_norm.weight))
            block.attn.wo.copy_(writes(block.attn.wo))
            block.mlp.w_down.copy_(writes(block.mlp.w_down))
            block.attn_norm.weight.fill_(1.0)
            block.mlp_norm.weight.fill_(1.0)
        head = (head.float() * out.norm.weight.float()) @ Q.float()  # [V, D], untied
        out.lm_head = nn.Parameter(head.to(dtype), requires_grad=False)
        out.norm.weight.fill_(1.0)
    out.config = replace(cfg, tie_embeddings=False)
    return out


def share_on_4bit_grid(model, group_size: int = BLOCK) -> float:
    """The share of the linear layers' groups of `group_size` weights that hold 16 distinct values
    or fewer: 1.0 for weights dequantized from Q4_1, about 0 for weights that are not on a grid."""
    on, total = 0, 0
    for m, name in linear_weights(model):
        g = getattr(m, name).detach().float().reshape(-1, group_size)  # [groups, G]
        distinct = (g.sort(-1).values.diff(dim=-1) != 0).sum(-1) + 1  # [groups]
        on += int((distinct <= 16).sum())
        total += g.shape[0]
    return on / total


# ---------------------------------------------------------------- GPTQ, one matrix
def _round_column(w: Tensor, scale: Tensor, low: Tensor | None, bits: int) -> Tensor:
    """One column w [n] onto its group's grid (minigen's format) -> the codes [n] as floats."""
    step = torch.where(scale > 0, scale, torch.ones_like(scale))
    if bits == 8:
        return (w / step).round().clamp(-127, 127)
    return ((w - low) / step).round().clamp(0, 15)


def gptq_matrix(w: Tensor, hessian: Tensor, bits: int, group_size: int, damp: float = 0.01,
                block: int = 128) -> QuantizedWeight:
    """GPTQ (Frantar et al. 2022) of w [n, k] given its inputs' Hessian [k, k] (2 X^T X / tokens).

    Columns are rounded left to right; column j's error, divided by the diagonal of the inverse
    Hessian's Cholesky factor U (H^-1 = U^T U), is subtracted from the later columns through U's row
    j. Each group's scale and minimum are set, by quantize_matrix's rule, when its first column is
    reached, from the weights as corrected by then. `damp` adds damp * mean(diag H) to the diagonal
    so that H is invertible when some input channel never varies. `block` columns are corrected
    together before the rest of the matrix is updated (the paper's lazy batch: same result, fewer
    passes over the matrix).
    """
    check_weight_bits(bits)
    n, k = w.shape
    G = group_size
    if k % G or G % BLOCK:
        raise ConfigError(f"group_size={G} must be a multiple of {BLOCK} that divides the width {k}")
    block = max(G, block // G * G)  # a block holds whole groups, so a group's columns are up to date
    W = w.detach().double().clone()  # [n, k]
    H = hessian.double().clone()  # [k, k]
    dead = torch.diagonal(H) == 0  # an input that is always 0: its weights do not matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diagonal(H).mean() * torch.eye(k, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # H^-1 = U^T U
    codes = torch.zeros(n, k, dtype=torch.float64)
    scales = torch.zeros(n, k // G, dtype=torch.float16)
    mins = torch.zeros(n, k // G, dtype=torch.float16) if bits == 4 else None
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        Wb, Ub = W[:, b0:b1], U[b0:b1, b0:b1]  # a view: corrected in place
        errors = torch.zeros(n, b1 - b0, dtype=torch.float64)
        for i in range(b1 - b0):
            j = b0 + i
            if j % G == 0:  # a new group: its grid from the corrected weights
                q = quantize_matrix(Wb[:, i:i + G].float(), bits, G)
                scales[:, j // G] = q.scales[:, 0]
                if bits == 4:
                    mins[:, j // G] = q.mins[:, 0]
                scale = scales[:, j // G].double()
                low = mins[:, j // G].double() if bits == 4 else None
            c = _round_column(Wb[:, i], scale, low, bits)  # [n]
            codes[:, j] = c
            rounded = c * scale + (low if bits == 4 else 0.0)
            err = (Wb[:, i] - rounded) / Ub[i, i]  # [n]
            Wb[:, i + 1:] -= err[:, None] * Ub[i, i + 1:][None, :]  # feed the error forward in the block
            errors[:, i] = err
        W[:, b1:] -= errors @ U[b0:b1, b1:]  # and to the rest of the matrix, once per block
    if bits == 8:
        packed = codes.to(torch.int8)
    else:
        packed = pack4(codes.to(torch.uint8))
    return QuantizedWeight(packed, scales, mins, bits, G, (n, k), w.dtype)


# ---------------------------------------------------------------- GPTQ, a model
def input_hessians(model, token_ids: Tensor) -> dict[int, Tensor]:
    """Feed token_ids [T] through `model` once -> {id(weight): H [k, k] = 2 X^T X / T} for every
    linear layer's weight, X [T, k] the inputs that layer saw (the float model's activations)."""
    targets = {id(getattr(m, name)) for m, name in linear_weights(model)}
    sums: dict[int, Tensor] = {}
    ops = model.ops
    plain = ops.linear

    def recording(x: Tensor, w: Tensor, out_dtype=None) -> Tensor:
        if id(w) in targets:
            X = x.reshape(-1, x.shape[-1]).double()  # [T, k]
            sums[id(w)] = sums.get(id(w), 0) + 2 * X.T @ X
        return plain(x, w, out_dtype)

    ids = token_ids.reshape(1, -1)
    ops.linear = recording  # an instance attribute: shadows the method for this one pass
    try:
        with torch.inference_mode():
            model(ids, torch.arange(ids.shape[1]))
    finally:
        del ops.linear
    return {key: s / ids.shape[1] for key, s in sums.items()}


def gptq_quantize(model, calibration_ids: Tensor, bits: int = 4, group_size: int = 32, head_bits: int = 8,
                  damp: float = 0.01):
    """Quantize `model`'s linear layers in place with GPTQ, the head by round-to-nearest -> the model.

    The Hessians come from one pass of the float model over `calibration_ids` [T] (every layer sees
    the float model's activations, not its quantized predecessors': the simpler, one-pass variant).
    The head (`head_bits`, as quantize_weights) is rounded to nearest: its input is the final norm.
    """
    check_weight_bits(bits)
    check_weight_bits(head_bits, "head_bits")
    if any(isinstance(m, QuantizedWeight) for m in model.modules()):
        raise ConfigError("the model's weights are already quantized: GPTQ needs the float weights")
    hessians = input_hessians(model, calibration_ids)
    for m, name in linear_weights(model):
        w = getattr(m, name)
        q = gptq_matrix(w, hessians[id(w)], bits, group_size, damp)
        delattr(m, name)
        setattr(m, name, q)
    head = "lm_head" if model.lm_head is not None else "embed"
    q = quantize_matrix(getattr(model, head), head_bits, group_size)
    delattr(model, head)
    setattr(model, head, q)
    return model


# ---------------------------------------------------------------- chapter 9's study, any weights
def bf16_weight_kl(model, text_ids: Tensor) -> dict[str, float]:
    """Round `model`'s weights to bf16, keep fp32 activations (chapter 9's default policy), and
    compare with the float model on text_ids [T], one forward pass each without a cache ->
    {"KL": mean over positions of KL(p_float || p_bf16) in nats, "top-1 agreement": share}."""
    ids = text_ids.reshape(1, -1)
    pos = torch.arange(ids.shape[1])
    rounded = copy.deepcopy(model).to(torch.bfloat16)
    rounded.precision = model.precision  # fp32 activations, as the float model computes
    with torch.inference_mode():
        ref = model(ids, pos)[0].float()  # [T, V]
        got = rounded(ids, pos)[0].float()
    log_p, log_q = F.log_softmax(ref, -1), F.log_softmax(got, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    return {"KL": kl, "top-1 agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item()}
