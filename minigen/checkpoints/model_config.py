"""A model's shapes, as its checkpoint declares them: `ModelConfig`, which model.py builds the
transformer from, and the counts that follow from the shapes alone (a token's cache bytes, a
forward's FLOPs, the positions each layer keeps). hf_config.py reads it from a config.json.

Shapes: D model width, H query heads, Hkv key/value heads, Dh head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass


LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names, as config.json's layer_types


@dataclass
class ModelConfig:
    # "llama" (RMSNorm, RoPE, SwiGLU, GQA), "gemma3" (Llama's parts plus (1 + w) norms, four per block,
    # q/k norms, embeddings scaled by sqrt(D), GeGLU) or "gpt2" (LayerNorm, learned positions, GELU)
    arch: str
    vocab_size: int  # V
    dim: int  # D, the residual width
    n_layers: int
    n_heads: int  # H
    n_kv_heads: int  # Hkv; H // Hkv query heads share each key/value head (grouped-query attention)
    head_dim: int  # Dh
    hidden_dim: int  # F, the MLP width
    max_seq_len: int  # the context the model was trained for, in tokens
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # RoPE base; only for "llama"
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", ...}; None: plain RoPE
    qkv_bias: bool = False  # Qwen2 and GPT-2 have biases on q, k, v
    out_bias: bool = False  # GPT-2 has biases on the attention output and the MLP
    tie_embeddings: bool = True  # the output head reuses the token embedding
    eos_token_ids: tuple[int, ...] = ()  # default stop tokens
    # Attention each layer was trained with (Mistral, Qwen2, Gemma 3): "full_attention" sees every
    # earlier position, "sliding_attention" only the last `sliding_window` (itself included).
    # None: every layer full.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # tokens a sliding layer's query sees, itself included
    # Gemma 3 only (None elsewhere):
    query_pre_attn_scalar: float | None = None  # scores are q.k / sqrt(this), not / sqrt(Dh)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers ("local"); rope_theta: full ones
    rope_local_scaling: dict | None = None  # the sliding layers' RoPE scaling, as rope_scaling
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Tensor parallelism (parallel/tensor.py): this config is one of tp_size shards, and n_heads,
    # n_kv_heads and hidden_dim are one rank's (the checkpoint's divided by tp_size). 1: the whole model.
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gemma3", "gpt2"):
            raise ValueError(f"arch={self.arch!r}: use 'llama', 'gemma3' or 'gpt2'")
        if self.arch == "gemma3" and not (self.query_pre_attn_scalar and self.rope_local_theta):
            raise ValueError(f"arch='gemma3' needs query_pre_attn_scalar and rope_local_theta, got "
                             f"{self.query_pre_attn_scalar!r} and {self.rope_local_theta!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown or len(self.layer_types) != self.n_layers:
                raise ValueError(f"layer_types={list(self.layer_types)!r} is invalid: need one of {LAYER_TYPES} per "
                                 f"layer, {self.n_layers} in all" + (f"; unknown: {unknown}" if unknown else ""))
            if "sliding_attention" in self.layer_types and (
                    not isinstance(self.sliding_window, int) or self.sliding_window < 1):
                raise ValueError(f"sliding_window={self.sliding_window!r} is invalid: sliding layers need a "
                                 "positive window (tokens each query sees)")

    def window_of(self, layer: int) -> int | None:
        """The window layer `layer` was trained with (tokens each query sees), or None: full attention.
        A window that holds the whole context is full attention too (transformers' default Mistral:
        4,096 of 4,096 positions); its layers keep their type, which picks Gemma's RoPE base."""
        sliding = self.layer_types is not None and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding and self.sliding_window < self.max_seq_len else None

    @property
    def own_window(self) -> int:
        """The window its sliding layers were trained with; 0 when no layer slides (see window_of)."""
        slides = self.layer_types is not None and "sliding_attention" in self.layer_types
        return self.sliding_window if slides and self.sliding_window < self.max_seq_len else 0

    @property
    def sliding_layers(self) -> int:
        """How many layers attend a sliding window (0: a model of full attention only)."""
        return sum(self.window_of(i) is not None for i in range(self.n_layers))

    def kv_positions(self, layer: int, context: int) -> int:
        """Positions layer `layer`'s cache must hold for a context of `context` tokens: all of them
        for a full layer, at most its window for a sliding one (the hybrid cache, caches/hybrid.py)."""
        window = self.window_of(layer)
        return context if window is None else min(context, window)

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """2 (K and V) x layers x KV heads x head dim x bytes: the cache cost of one token."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_element

    def forward_flops(self, new_tokens: int, context: int, logits_tokens: int = 1) -> int:
        """Matmul FLOPs (2 per multiply-add) of one forward: `new_tokens` tokens through every
        projection and the MLP, each attending `context` keys, logits for `logits_tokens` positions.

        A naive step at length n is forward_flops(n, n); a cached decode step is forward_flops(1, S).
        The masked [n, n] score matrix is counted whole, as SDPA with a mask computes it. Norms,
        RoPE and softmax are O(T·D) and left out.
        """
        D, H, Hkv, Dh = self.dim, self.n_heads, self.n_kv_heads, self.head_dim
        projections = 2 * D * (H + 2 * Hkv) * Dh + 2 * H * Dh * D  # q, k, v and the output, per token
        mlp = 2 * D * self.hidden_dim * (2 if self.arch == "gpt2" else 3)  # gate, up, down (GPT-2: fc, proj)
        attention = 2 * 2 * context * H * Dh  # q·k scores and the weighted sum of v, per token
        return self.n_layers * new_tokens * (projections + mlp + attention) \
            + 2 * logits_tokens * D * self.vocab_size
