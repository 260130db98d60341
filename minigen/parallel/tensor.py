"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): one model split over N ranks by heads and MLP width.

Shapes: D model width, H query heads, Hkv key/value heads, Dh head dim, F MLP width, V vocabulary,
N ranks (tp_size), r this rank. Local sizes carry a prime: H' = H/N, Hkv' = Hkv/N, F' = F/N.

Each block's two sublayers are split so that a rank computes a partial sum of their output alone:

    attention  wqkv [(H+2Hkv)Dh, D]  by rows ("column-parallel": whole heads) -> [(H'+2Hkv')Dh, D]
               wo   [D, H Dh]        by columns ("row-parallel": the same heads) -> [D, H' Dh]
               output: a partial sum [B, T, D]; all-reduce (sum over ranks)
    MLP        w_gate_up [2F, D]     gate rows and up rows alike -> [2F', D]
               w_down    [D, F]      by columns -> [D, F']
               output: a partial sum [B, T, D]; all-reduce

so a block costs two all-reduces of [B, T, D] and nothing else moves. Rank r holds query heads
r H', ..., (r+1) H' - 1 and key/value heads r Hkv', ..., (r+1) Hkv' - 1: with grouped-query attention
query head h reads key/value head h // (H/Hkv), so a rank's query heads read exactly its own
key/value heads, and its cache holds only those (the sharded config says Hkv').

The embedding, the final norm and the output head stay whole on every rank (replicated): every rank
computes the same logits [B, T, V] and samples the same token, with no gather and no broadcast.
docs/design/tensor_parallel.md says why, and what a vocabulary-sharded head would cost.

The all-reduce runs in a forward hook on each Attention and MLP module: model.py stays the
single-process math, and a sharded model's parameters keep their names (the kernels, the weight
copies and the plan read them as they are).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..checkpoints.model_config import ModelConfig
from ..errors import ConfigError
from ..model import Model

TP_ARCHS = ("llama", "gemma3")  # Llama, Qwen2, Mistral (arch "llama") and Gemma 3; GPT-2 is not split


# ---------------------------------------------------------------- which sizes split a model
def working_sizes(cfg: ModelConfig) -> list[int]:
    """Every tp_size that divides the query heads, the key/value heads and the MLP width of `cfg`."""
    return [n for n in range(1, cfg.n_kv_heads + 1)
            if cfg.n_heads % n == 0 and cfg.n_kv_heads % n == 0 and cfg.hidden_dim % n == 0]


def check_tp_size(cfg: ModelConfig, tp_size: int) -> None:
    """ConfigError, naming the sizes and the tp_sizes that work, unless `tp_size` splits `cfg` into
    whole heads and equal MLP slices."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"tp_size={tp_size!r} is invalid: the number of ranks, a positive int")
    if tp_size == 1:
        return  # the whole model, as it is
    if cfg.arch not in TP_ARCHS:
        raise ConfigError(f"tp_size={tp_size} splits the Llama family, Qwen2, Mistral and Gemma 3, not "
                          f"arch={cfg.arch!r}: use tp_size=1")
    if cfg.tp_size != 1:
        raise ConfigError(f"this model is already one of {cfg.tp_size} shards: shard the whole model")
    sizes = {"query heads": cfg.n_heads, "key/value heads": cfg.n_kv_heads, "MLP width": cfg.hidden_dim}
    broken = [f"{count} {what}" for what, count in sizes.items() if count % tp_size]
    if broken:
        raise ConfigError(f"tp_size={tp_size} does not divide this model's {' and '.join(broken)} (it has "
                          f"{cfg.n_heads} query heads, {cfg.n_kv_heads} key/value heads, MLP width "
                          f"{cfg.hidden_dim}): each rank must hold whole heads and an equal slice of the MLP. "
                          f"tp_size that work: {', '.join(map(str, working_sizes(cfg)))}")


def local_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The config of one of `tp_size` shards: H', Hkv', F' (its cache holds Hkv' heads), tp_size set."""
    check_tp_size(cfg, tp_size)
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // tp_size, n_kv_heads=cfg.n_kv_heads // tp_size,
                               hidden_dim=cfg.hidden_dim // tp_size, tp_size=tp_size)


# ---------------------------------------------------------------- the slices
def head_rows(cfg: ModelConfig, rank: int, tp_size: int) -> Tensor:
    """The rows of wqkv [(H+2Hkv)Dh, D] (and of bqkv) that rank `rank` keeps, in order: its H' query
    heads, then its Hkv' key heads, then its Hkv' value heads -> LongTensor [(H'+2Hkv')Dh]."""
    H, Hkv, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, kv = H // tp_size, Hkv // tp_size

    def heads(first_row: int, per_rank: int) -> Tensor:  # rows of heads rank*per_rank ... in a section
        start = first_row + rank * per_rank * Dh
        return torch.arange(start, start + per_rank * Dh)
    return torch.cat((heads(0, q), heads(H * Dh, kv), heads((H + Hkv) * Dh, kv)))


def gate_up_rows(cfg: ModelConfig, rank: int, tp_size: int) -> Tensor:
    """The rows of w_gate_up [2F, D] that rank `rank` keeps: its F' gate rows, then the same F' up
    rows (GatedMLP chunks the product in two halves) -> LongTensor [2F']."""
    F, part = cfg.hidden_dim, cfg.hidden_dim // tp_size
    gate = torch.arange(rank * part, (rank + 1) * part)
    return torch.cat((gate, gate + F))


def kept(w: Tensor, index: Tensor, dim: int) -> nn.Parameter:
    """A new contiguous parameter holding w's slices `index` along `dim` (no grad; the rest is freed)."""
    return nn.Parameter(w.index_select(dim, index.to(w.device)).contiguous(), requires_grad=False)


# ---------------------------------------------------------------- the all-reduce
def all_reduce_hook(group: dist.ProcessGroup | None):
    """A forward hook that sums a sublayer's partial output [B, T, D] over the ranks of `group`
    (None: the default group), in place; every rank gets the same sum."""
    def reduce(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out
    return reduce


# ---------------------------------------------------------------- a model, split in place
def shard_model(model: Model, rank: int, tp_size: int, group: dist.ProcessGroup | None = None) -> Model:
    """Keep rank `rank`'s slices of every block of `model` (in place) and all-reduce each sublayer's
    output over `group`; returns the model, whose config now says the local sizes (local_config).

    Every rank of `group` must call this with the same model and its own rank, and then run the same
    forwards in the same order: each forward meets 2 x n_layers all-reduces. tp_size=1 changes nothing."""
    cfg = model.config
    local = local_config(cfg, tp_size)  # checks tp_size first
    if tp_size == 1:
        return model
    if not 0 <= rank < tp_size:
        raise ConfigError(f"rank={rank} is not one of the {tp_size} ranks 0..{tp_size - 1}")
    if cfg.out_bias:  # a bias after wo would be added N times by the all-reduce
        raise ConfigError("tp_size > 1 splits models without an attention output bias; this one has one")
    qkv, gate_up = head_rows(cfg, rank, tp_size), gate_up_rows(cfg, rank, tp_size)
    q_cols = torch.arange(rank * local.n_heads * cfg.head_dim, (rank + 1) * local.n_heads * cfg.head_dim)
    f_cols = torch.arange(rank * local.hidden_dim, (rank + 1) * local.hidden_dim)
    hook = all_reduce_hook(group)
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        attn.wqkv = kept(attn.wqkv, qkv, 0)  # [(H'+2Hkv')Dh, D]
        if attn.bqkv is not None:
            attn.bqkv = kept(attn.bqkv, qkv, 0)  # [(H'+2Hkv')Dh]
        attn.wo = kept(attn.wo, q_cols, 1)  # [D, H'Dh]
        attn.cfg = local  # Attention.forward reads H and Hkv from its config
        mlp.w_gate_up = kept(mlp.w_gate_up, gate_up, 0)  # [2F', D]
        mlp.w_down = kept(mlp.w_down, f_cols, 1)  # [D, F']
        attn.register_forward_hook(hook)
        mlp.register_forward_hook(hook)
    model.config = local
    model.weight_copies = model.weight_copies.emptied()  # copies of the whole weights would be stale
    return model


def shard_of(model: Model, tp_size: int, group: dist.ProcessGroup | None = None) -> Model:
    """shard_model for this process's rank in `group` (torch.distributed must be initialized), after
    checking that the group has tp_size ranks."""
    if not dist.is_initialized():
        raise ConfigError(f"tp_size={tp_size} needs a torch.distributed process group of {tp_size} ranks: "
                          "start the ranks with minigen.parallel.run_ranks (or torchrun) and "
                          "torch.distributed.init_process_group first")
    if dist.get_world_size(group) != tp_size:
        raise ConfigError(f"tp_size={tp_size}, but the process group has {dist.get_world_size(group)} ranks: "
                          "they must be equal")
    return shard_model(model, dist.get_rank(group), tp_size, group)
