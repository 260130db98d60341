"""Draft models made from the target itself, for speculative_method="draft" (chapter 13).

Only SmolLM2-135M is bundled, and a draft must share the target's tokenizer, so the course makes
its drafts from the target:

    layer_skip(model, n)      the first n layers, then the final norm and the head (Draft & Verify,
                              Zhang et al. 2023; LayerSkip, Elhoushi et al. 2024): the target's own
                              tensors, no copy, n / L of a step's weights
    quantized(model, bits)    the target's weights at fewer bits, through the fused int4 / int8 step.
                              SmolLM2's "fp32" weights are the dequantized Q4_1 GGUF, so bits=4 with
                              group_size=32 reproduces them exactly (the draft is the target); another
                              group size or 8 bits is a draft on another grid
    unrelated(model)          a tiny random model with the same vocabulary: the worst case

A draft may be in any dtype or weight format: the tokens come out distributed as the target's
whatever the draft proposes (steps/speculative.py); a worse draft only costs speed.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from .errors import ConfigError
from .kernels import dispatch
from .model import Model
from .checkpoints.model_config import ModelConfig
from .numerics import weight_quant


def layer_skip(model: Model, n_layers: int) -> Model:
    """The target's first `n_layers` layers, then its final norm and head: a draft that costs about
    n_layers / L of a step and shares every tensor (and module) with the target, whatever its format."""
    L = model.config.n_layers
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or not 1 <= n_layers <= L:
        raise ConfigError(f"n_layers={n_layers!r} is invalid: use an integer in [1, {L}] (the target has {L} layers)")
    draft = copy.copy(model)  # a new Module whose tables of children are copied below, not shared
    draft._modules, draft._parameters, draft._buffers = (dict(model._modules), dict(model._parameters),
                                                         dict(model._buffers))
    draft.blocks = nn.ModuleList(list(model.blocks)[:n_layers])
    draft.config = dataclasses.replace(model.config, n_layers=n_layers)
    return draft


def quantized(model: Model, bits: int = 4, group_size: int = 32, head_bits: int = 8) -> Model:
    """The target with its linear weights quantized to `bits` (numerics/weight_quant.py), the target
    left as it is: norms and biases shared, the matrices stored again as codes."""
    if weight_quant.quantized(model):
        raise ConfigError("drafts.quantized quantizes a target in float: this one is already quantized "
                          "(load it without weight_bits, or use drafts.layer_skip)")
    draft = Model(model.config)  # torch.empty parameters: nothing allocated is touched
    draft.load_state_dict(model.state_dict(), strict=True, assign=True)  # the target's storage, no copy
    draft.precision = model.precision
    draft.eval()
    if isinstance(model.ops, dispatch.KernelOps):
        dispatch.install(draft)
    return weight_quant.quantize_weights(draft, bits, group_size, head_bits)  # replaces the draft's matrices only


def unrelated(model: Model, dim: int = 64, n_layers: int = 2, seed: int = 0) -> Model:
    """A tiny random Llama with the target's vocabulary: proposals the target almost never accepts."""
    V = model.config.vocab_size
    cfg = ModelConfig(arch="llama", vocab_size=V, dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                      head_dim=dim // 4, hidden_dim=2 * dim, max_seq_len=model.config.max_seq_len,
                      eos_token_ids=model.config.eos_token_ids)
    draft = Model(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1 else torch.ones(p.shape))
    draft = draft.to(model.device).eval()
    dispatch.install(draft)
    return draft


# ---------------------------------------------------------------- drafts by name (the CLI's --draft)
SPECS = "layers:N (the first N layers), int4:G or int8:G (quantized, groups of G), unrelated"


def check_spec(spec: str, n_layers: int) -> tuple[str, int | None]:
    """Read a draft's name as the CLI gives it -> (kind, its number); ConfigError naming the forms."""
    kind, _, arg = str(spec).partition(":")
    bad = ConfigError(f"--draft {spec!r} is not a draft: use {SPECS}")
    if kind == "unrelated" and not arg:
        return kind, None
    if kind not in ("layers", "int4", "int8") or not (arg or kind != "layers"):
        raise bad
    try:
        number = int(arg) if arg else 32
    except ValueError:
        raise bad from None
    if kind == "layers" and not 1 <= number <= n_layers:
        raise ConfigError(f"--draft {spec!r}: the target has {n_layers} layers, so use layers:N with N in "
                          f"[1, {n_layers}]")
    return kind, number


def parse(spec: str, model: Model) -> Model:
    """The draft a CLI name describes, made from `model` (check_spec lists the names)."""
    kind, number = check_spec(spec, model.config.n_layers)
    if kind == "layers":
        return layer_skip(model, number)
    if kind == "unrelated":
        return unrelated(model)
    return quantized(model, 4 if kind == "int4" else 8, number)
