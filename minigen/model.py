"""The transformer: Llama family (SmolLM2, Llama, Mistral, Qwen2), Gemma 3 (text) and GPT-2, leaf to root.

Shapes: B batch, T new tokens in this call, S cached key positions, D model width,
H query heads, Hkv key/value heads, Dh head dim, F MLP width, V vocabulary.

Weights are stored as checkpoints ship them, [out, in] (nn.Linear's layout): each output is one
contiguous row, which is what the C matrix-vector kernel of decoding streams (kernels/cpu.py),
and a tied output head is the embedding itself, not a copy. q/k/v are fused into one matrix and
gate/up into another, so a decode step launches fewer ops.
The model knows nothing about files: `loading.py` turns checkpoints into a `ModelConfig`
(checkpoints/model_config.py) and a state dict in this module's names.
Rotary positions (RoPE) are computed in rope.py; a pipeline's stages run the forward's three parts
(embed_tokens, run_blocks, logits_of) apart (parallel/pipeline.py).

This file is the math, in plain torch. The ops a kernel may run instead (a product, a norm,
attention) go through `ops` (Model.forward's `ops=`, else `model.ops`): `TorchOps` below, the
reference, or kernels/dispatch.py's `KernelOps`, which loading installs and which falls back to
these references. The ops also carry the forward's prompt format and attention backend.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import AttentionPolicy, Causal, attend, attend_blocks, attend_prompt_blocks, imposes_window, layer_mask
from .caches.contract import BlockView, key_positions, positions_of
from .checkpoints.model_config import ModelConfig
from .numerics import int8_act, w8a8
from .numerics.copies import WeightCopies
from .numerics.precision import FP32, Precision, PromptFormat
from .numerics.weight_quant import QuantizedWeight
from .rope import apply_rope, rope_frequencies, rope_tables


# ---------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 as Llama does (fp32=False: in x's dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor, ops: "TorchOps", fp32: bool = True) -> Tensor:
        if x.dtype == torch.float32:  # fp32 activations (a 16-bit weight is widened: 576 numbers)
            return ops.rms_norm(x, self.weight.float(), self.eps)
        if fp32:  # normalize in fp32, then scale in x's dtype, as Llama's reference does
            return self.weight.to(x.dtype) * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)  # left in 16 bits


class LayerNorm(nn.Module):
    """GPT-2's LayerNorm with weight and bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: Tensor, ops: "TorchOps", fp32: bool = True) -> Tensor:
        if fp32 and x.dtype != torch.float32:
            return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)
        return F.layer_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight), normalized and scaled in fp32 and then
    rounded to x's dtype, as transformers' Gemma3RMSNorm (the checkpoint stores weight around 0)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: Tensor, ops: "TorchOps", fp32: bool = True) -> Tensor:
        if fp32 or x.dtype == torch.float32:
            return ops.rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), 1.0 + self.weight.to(x.dtype), self.eps)  # left in 16 bits


# ---------------------------------------------------------------- the ops a kernel may run
class TorchOps:
    """The plain torch reference of each op that a kernel may run instead (kernels/dispatch.py): a
    decode step at batch 1 runs these ~120 times, so an op's cost is its dispatch and memory traffic.
    `prompt`: the format of a prompt's products and attention (prefill_precision, chapter 3);
    `reads_blocks`: attention reads a paged cache's blocks in place (attention_backend='triton');
    `int8_act`: int4/int8 weights meet int8 activations (int8_activations, numerics/int8_act.py)."""
    prompt: PromptFormat = FP32
    reads_blocks: bool = False
    int8_act: bool = False

    def configured(self, prompt: PromptFormat | None = None, reads_blocks: bool | None = None,
                   int8_act: bool | None = None) -> "TorchOps":
        """A new ops object, each of `prompt`, `reads_blocks`, `int8_act` replaced where given; this one is unchanged."""
        ops = copy.copy(self)
        for name, value in (("prompt", prompt), ("reads_blocks", reads_blocks), ("int8_act", int8_act)):
            setattr(ops, name, getattr(self, name) if value is None else value)
        return ops

    def linear(self, x: Tensor, w: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """x [..., in] times w [out, in] -> [..., out] in out_dtype (default x's), i.e. x @ w.T. fp32 activations
        against 16-bit weights sum in fp32 (chapter 9); int8/int4 weights are dequantized for the product, or
        meet int8 activations (chapter 10); a prompt's rows in `self.prompt`'s format (chapter 3)."""
        out_dtype = out_dtype or x.dtype
        fmt, copies = self.prompt.dtype(x.numel() // x.shape[-1]), self.prompt.copies
        if fmt == torch.int8 and copies is not None and (w8 := copies.int8_of(w)) is not None:  # its int8 copy
            return w8a8.reference_linear(x, w8).to(out_dtype)
        if fmt == torch.bfloat16 and copies is not None and (wb := copies.bf16_of(w)) is not None:  # its bf16 copy
            return F.linear(x.bfloat16(), wb).to(out_dtype)
        if isinstance(w, QuantizedWeight):
            if self.int8_act and fmt == torch.float32:  # int8 activations times the codes, fp32 result
                return int8_act.reference_linear(x, w).to(out_dtype)
            w = w.dequantize()
        if fmt == torch.bfloat16:
            return F.linear(x.bfloat16(), w.bfloat16()).to(out_dtype)
        if x.dtype != w.dtype or (out_dtype == torch.float32 and x.dtype != torch.float32):
            x, w = x.float(), w.float()  # fp32 sums and result
        return F.linear(x, w).to(out_dtype)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x / sqrt(mean(x^2) + eps) * weight over the last dim: one torch op instead of five."""
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def decode_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, fp32_softmax: bool = True) -> Tensor:
        """One new query per row: q [B, H, 1, Dh] over k, v [B, Hkv, S, Dh] -> [B, H, 1, Dh] (attention.attend)."""
        bf16 = self.prompt.attention_dtype(q.shape[0] * q.shape[2]) == torch.bfloat16
        return attend(q, k, v, mask, fp32_softmax, bf16)

    def plan_blocks(self, q: Tensor, view: BlockView, window_size: int | None, sink_tokens: int) -> object:
        """What every layer's attend_blocks of one step shares (the reference plans nothing)."""
        return None

    def attend_blocks(self, q: Tensor, view: BlockView, window_size: int | None, sink_tokens: int,
                      plan: object = None) -> Tensor:
        """One query per row q [B, H, Dh] over the blocks a paged cache holds, read in place -> [B, H, Dh]."""
        return attend_blocks(q, view, window_size, sink_tokens)

    def attend_prompt_blocks(self, q: Tensor, view: BlockView, query_pos: Tensor, window_size: int | None,
                             sink_tokens: int) -> Tensor:
        """T queries per row, q [B, H, T, Dh] at query_pos [B, T], over the blocks a paged cache holds,
        read in place -> [B, H, T, Dh]."""
        bf16 = self.prompt.attention_dtype(q.shape[2]) == torch.bfloat16  # each row's T queries alone
        return attend_prompt_blocks(q, view, query_pos, window_size, sink_tokens, bf16)


# ---------------------------------------------------------------- attention and MLP
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Parameter(torch.empty(qkv_out, cfg.dim), requires_grad=False)  # [(H+2Hkv)Dh, D]
        self.bqkv = nn.Parameter(torch.zeros(qkv_out), requires_grad=False) if cfg.qkv_bias else None
        self.wo = nn.Parameter(torch.empty(cfg.dim, cfg.n_heads * cfg.head_dim), requires_grad=False)
        self.bo = nn.Parameter(torch.zeros(cfg.dim), requires_grad=False) if cfg.out_bias else None
        # Gemma 3 normalizes each head's query and key before RoPE, and scores by
        # query_pre_attn_scalar^-1/2. That scale is folded into the queries, times sqrt(Dh /
        # query_pre_attn_scalar), so that every attention path (SDPA, the C decode kernel, the
        # paged kernels), each dividing by sqrt(Dh), scores as Gemma does without a scale argument.
        gemma = cfg.arch == "gemma3"
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps) if gemma else None
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps) if gemma else None
        self.q_gain = math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar) if gemma else 1.0

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None, mask: "Tensor | Causal | None", cache,
                ops: TorchOps, policy: AttentionPolicy | None = None, fp32_softmax: bool = True,
                plans: dict | None = None) -> Tensor:
        """plans: the forward's one dict for the whole step; the first layer that reads the blocks
        in place stores the step's decode plan there (ops.plan_blocks), and every layer reuses it."""
        B, T, _ = x.shape
        H, Hkv, Dh = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        qkv = ops.linear(x, self.wqkv)  # [B, T, (H+2Hkv)Dh]
        if self.bqkv is not None:
            qkv = qkv + self.bqkv.to(qkv.dtype)
        qk, v = qkv.split([(H + Hkv) * Dh, Hkv * Dh], dim=-1)
        qk = qk.view(B, T, H + Hkv, Dh)  # queries and keys side by side: one rotation for both
        if self.q_norm is not None:  # Gemma 3: RMSNorm over each head's Dh, the scale folded into q
            q, k = qk.split([H, Hkv], dim=2)
            qk = torch.cat((self.q_norm(q, ops) * self.q_gain, self.k_norm(k, ops)), dim=2)
        if rope is not None:
            qk = apply_rope(qk, *rope)
        q, k = qk.transpose(1, 2).split([H, Hkv], dim=1)  # [B, H, T, Dh], [B, Hkv, T, Dh]
        v = v.view(B, T, Hkv, Dh).transpose(1, 2)  # [B, Hkv, T, Dh]
        if cache is not None and ops.reads_blocks:  # attention reads the blocks in place
            view = cache.update_blocks(self.layer, k, v)  # a paged cache (the config refuses any other)
            window, sinks = (None, 0) if policy is None else (policy.window_size, policy.sink_tokens)
            if T == 1:  # a decode step: one query per row, at its last position
                plans = {} if plans is None else plans
                if "decode" not in plans:  # once per step: every layer's launch shares it
                    plans["decode"] = ops.plan_blocks(q[:, :, 0], view, window, sinks)
                out = ops.attend_blocks(q[:, :, 0], view, window, sinks, plans["decode"])[:, :, None]
            else:  # a prompt, a piece of one, or a verify step: the row's last T positions (rows share
                # one position vector here: the config refuses per-row positions with this backend)
                query_pos = view.seq_lens[:, None] - T + torch.arange(T, device=q.device)  # [B, T]
                out = ops.attend_prompt_blocks(q, view, query_pos, window, sinks)
            return self._project(out, ops)
        if cache is not None:  # write the new keys/values, read back everything cached: [B, Hkv, S, Dh]
            k, v = cache.update(self.layer, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)  # a cache stored in another dtype (kv_dtype, chapter 9)
        # [B, H, T, Dh]; a policy adds sparse key selection and observers (chapters 7-8)
        bf16 = ops.prompt.attention_dtype(B * T) == torch.bfloat16  # a bf16 prompt's attention (chapter 3)
        if policy is not None:
            out = policy.attend(q, k, v, mask, self.layer, bf16)
        elif T == 1:  # one new token per row: a decode step
            out = ops.decode_attention(q, k, v, mask, fp32_softmax)
        else:
            out = attend(q, k, v, mask, fp32_softmax, bf16)
        return self._project(out, ops)

    def _project(self, out: Tensor, ops: TorchOps) -> Tensor:
        """The heads' outputs [B, H, T, Dh] -> the output projection [B, T, D]."""
        B, H, T, Dh = out.shape
        out = ops.linear(out.transpose(1, 2).reshape(B, T, H * Dh), self.wo)  # [B, T, D]
        return out + self.bo.to(out.dtype) if self.bo is not None else out


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU in its tanh approximation (transformers' gelu_pytorch_tanh): Gemma's gate."""
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)), gate and up fused into one matmul.
    Gemma 3's GeGLU is the same with the tanh GELU as the gate."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.act = gelu_tanh if cfg.arch == "gemma3" else F.silu
        self.w_gate_up = nn.Parameter(torch.empty(2 * cfg.hidden_dim, cfg.dim), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(cfg.dim, cfg.hidden_dim), requires_grad=False)

    def forward(self, x: Tensor, ops: TorchOps) -> Tensor:
        gate, up = ops.linear(x, self.w_gate_up).chunk(2, dim=-1)  # [B, T, F] each
        return ops.linear(self.act(gate) * up, self.w_down)


class GeluMLP(nn.Module):
    """GPT-2's MLP: proj(gelu_tanh(fc(x))), with biases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_fc = nn.Parameter(torch.empty(cfg.hidden_dim, cfg.dim), requires_grad=False)
        self.b_fc = nn.Parameter(torch.zeros(cfg.hidden_dim), requires_grad=False)
        self.w_proj = nn.Parameter(torch.empty(cfg.dim, cfg.hidden_dim), requires_grad=False)
        self.b_proj = nn.Parameter(torch.zeros(cfg.dim), requires_grad=False)

    def forward(self, x: Tensor, ops: TorchOps) -> Tensor:
        hidden = F.gelu(ops.linear(x, self.w_fc) + self.b_fc.to(x.dtype), approximate="tanh")
        return ops.linear(hidden, self.w_proj) + self.b_proj.to(x.dtype)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        Norm = NORMS[cfg.arch]
        self.attn_norm, self.mlp_norm = Norm(cfg.dim, cfg.norm_eps), Norm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp = GeluMLP(cfg) if cfg.arch == "gpt2" else GatedMLP(cfg)

    def forward(self, x, rope, mask, cache, ops: TorchOps, policy=None, precision: Precision = Precision(), plans=None):
        p = precision
        x = x + self.attn(self.attn_norm(x, ops, p.fp32_norms), rope, mask, cache, ops, policy, p.fp32_softmax, plans)
        return x + self.mlp(self.mlp_norm(x, ops, p.fp32_norms), ops)


class GemmaBlock(Block):
    """Gemma 3's block: each sublayer's output is normalized again before the residual add (four
    norms: attn_norm and mlp_norm before, post_attn_norm and post_mlp_norm after)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.post_attn_norm, self.post_mlp_norm = GemmaRMSNorm(cfg.dim, cfg.norm_eps), GemmaRMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, mask, cache, ops: TorchOps, policy=None, precision: Precision = Precision(), plans=None):
        p = precision
        h = self.attn(self.attn_norm(x, ops, p.fp32_norms), rope, mask, cache, ops, policy, p.fp32_softmax, plans)
        x = x + self.post_attn_norm(h, ops, p.fp32_norms)
        h = self.mlp(self.mlp_norm(x, ops, p.fp32_norms), ops)
        return x + self.post_mlp_norm(h, ops, p.fp32_norms)


NORMS = {"llama": RMSNorm, "gemma3": GemmaRMSNorm, "gpt2": LayerNorm}  # each family's norm


# ---------------------------------------------------------------- the model
class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim), requires_grad=False)  # [V, D]
        self.pos_embed = (nn.Parameter(torch.empty(cfg.max_seq_len, cfg.dim), requires_grad=False)
                          if cfg.arch == "gpt2" else None)  # GPT-2's learned positions
        self.blocks = nn.ModuleList((GemmaBlock if cfg.arch == "gemma3" else Block)(cfg, i) for i in range(cfg.n_layers))
        self.norm = NORMS[cfg.arch](cfg.dim, cfg.norm_eps)
        # The output head [V, D]; a tied model (SmolLM2, GPT-2) has none and multiplies by `embed`.
        self.lm_head = (None if cfg.tie_embeddings else
                        nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim), requires_grad=False))
        if cfg.arch != "gpt2":
            self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
        if cfg.arch == "gemma3":  # the sliding layers' own RoPE base
            self.register_buffer("inv_freq_local", rope_frequencies(cfg, local=True), persistent=False)
        # Gemma 3 scales the embeddings by sqrt(D), rounded to the weights' dtype as transformers does
        self.register_buffer("embed_scale", torch.tensor(math.sqrt(cfg.dim)) if cfg.arch == "gemma3" else None,
                             persistent=False)
        self.precision = Precision()  # fp32 activations; loading.py sets the default for the weights' dtype
        self.ops = TorchOps()  # which implementation runs each op; loading.py installs the kernels' dispatch
        self.weight_copies = WeightCopies()  # the block weights' copies that prompt formats read (numerics/copies.py)

    def _apply(self, fn, recurse=True):
        """`model.to(...)` casts every tensor; RoPE's inverse frequencies stay fp32 whatever the
        weights (rounded to bf16, the angle of position 4,000 moves by radians), as load() keeps them.
        The weights' copies are dropped: the next prompt of each format makes them from the new weights."""
        super()._apply(fn, recurse)
        self.weight_copies = self.weight_copies.emptied()
        if self.config.arch != "gpt2":
            self.inv_freq = rope_frequencies(self.config).to(self.inv_freq.device)
        if self.config.arch == "gemma3":
            self.inv_freq_local = rope_frequencies(self.config, local=True).to(self.inv_freq.device)
        return self

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's attention, "full_attention" or "sliding_attention" (ModelConfig.layer_types)."""
        return self.config.layer_types or ("full_attention",) * self.config.n_layers

    @property
    def head(self) -> Tensor:
        """The output projection [V, D]: `lm_head`, or the token embedding when they are tied."""
        return self.embed if self.lm_head is None else self.lm_head

    dtype = property(lambda self: self.embed.dtype, doc="The weights' dtype (the embedding's).")
    device = property(lambda self: self.embed.device, doc="The model's device (the embedding's).")

    def forward(self, tokens: Tensor, input_pos: Tensor, cache=None, last_only: bool = False,
                policy: AttentionPolicy | None = None, ops: TorchOps | None = None) -> Tensor:
        """tokens [B, T] at positions input_pos [T] -> logits [B, T, V] (or [B, 1, V]), fp32.

        input_pos may also be [B, T], one per row (a ragged batch; -1 marks padding, never written or
        attended). With `cache`, the new keys/values are written at `input_pos` and attention reads
        every cached position; without, only these T tokens (the naive loop). Numbers flow in
        `self.precision` (precision.py); `ops` runs every op (None: `self.ops`)."""
        assert tokens.dim() == 2 and input_pos.shape in ((tokens.shape[1],), tuple(tokens.shape)), \
            f"tokens must be [B, T] and input_pos [T] or [B, T], got {tuple(tokens.shape)} and {tuple(input_pos.shape)}"
        ops = self.ops if ops is None else ops
        x = self.run_blocks(self.embed_tokens(tokens, input_pos), input_pos, cache, policy, ops)
        return self.logits_of(x[:, -1:] if last_only else x, ops)

    # The forward's three parts, which a pipeline's stages run apart (parallel/pipeline.py).
    def embed_tokens(self, tokens: Tensor, input_pos: Tensor) -> Tensor:
        """tokens [B, T] at input_pos [T] or [B, T] -> the first block's input [B, T, D], in precision.compute."""
        x = self.embed[tokens]  # [B, T, D]
        if self.embed_scale is not None:  # Gemma: sqrt(D), rounded to the weights' dtype first
            x = x * self.embed_scale.to(x.dtype)
        x = x.to(self.precision.compute)
        if self.pos_embed is not None:  # GPT-2's learned positions (padding: any position will do)
            x = x + self.pos_embed[input_pos.clamp(min=0)].to(self.precision.compute)
        return x

    def run_blocks(self, x: Tensor, input_pos: Tensor, cache=None, policy: AttentionPolicy | None = None,
                   ops: TorchOps | None = None) -> Tensor:
        """x [B, T, D] at input_pos through every block of this model (the cache's layers) -> [B, T, D]."""
        p, ops = self.precision, self.ops if ops is None else ops
        at = input_pos.clamp(min=0) if input_pos.dim() == 2 else input_pos  # padding: any position will do
        if self.pos_embed is not None:
            ropes = dict.fromkeys(self.layer_types)  # GPT-2: no rotation
        else:  # one rotation for every layer; Gemma 3's sliding layers have their own
            ropes = dict.fromkeys(self.layer_types, rope_tables(at, self.inv_freq, x.dtype))
            if self.config.arch == "gemma3" and "sliding_attention" in ropes:
                ropes["sliding_attention"] = rope_tables(at, self.inv_freq_local, x.dtype)
        # Masks come from positions, never from counters: query t sees slot s when it holds a position
        # <= input_pos[t]. `prepare` says, once for all layers, which position each slot holds
        # (caches/contract.py): {layer type: [S] or [B, S]}, or {ANY_LAYER: ...} for every layer.
        key_pos = cache.prepare(input_pos) if cache is not None else key_positions(input_pos)
        masks = {kind: layer_mask(input_pos, positions_of(key_pos, kind), policy,
                                  None if kind == "full_attention" or imposes_window(policy) else
                                  self.config.own_window or None, x.dtype, cache is not None and ops.reads_blocks)
                 for kind in dict.fromkeys(self.layer_types)}
        plans: dict = {}  # what the layers share beyond the masks, planned by the first (Attention.forward)
        for block, kind in zip(self.blocks, self.layer_types):
            x = block(x, ropes[kind], masks[kind], cache, ops, policy, p, plans)
        return x

    def logits_of(self, x: Tensor, ops: TorchOps | None = None) -> Tensor:
        """The last block's output x [B, T, D] -> logits [B, T, V], fp32: the final norm, then the head."""
        p, ops = self.precision, self.ops if ops is None else ops
        logits_dtype = torch.float32 if p.fp32_logits else p.compute
        logits = ops.linear(self.norm(x, ops, p.fp32_norms), self.head, logits_dtype).float()  # [B, T, V]
        if (cap := self.config.final_logit_softcapping) is not None:  # Gemma: squashed into (-cap, cap)
            logits = torch.tanh(logits / cap) * cap
        return logits
