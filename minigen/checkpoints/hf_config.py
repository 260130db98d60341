"""config.json -> ModelConfig: what each family's checkpoint config says, read as `transformers` reads it.

Llama, Mistral and Qwen2 share Llama's parts (and Mistral and Qwen2 their windows, attention_layers);
Gemma 3 adds its own (model.py's arch="gemma3"); GPT-2 is its own family. Anything minigen cannot
run exactly is refused with a ModelLoadError that names the key.
"""

from __future__ import annotations

from ..errors import ModelLoadError
from .model_config import LAYER_TYPES, ModelConfig

SUPPORTED = ("llama", "mistral", "qwen2", "gemma3_text", "gpt2")
# config.json keys without which the model's shapes are unknown
REQUIRED = {"gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"),
            "llama": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")}


def config_from_hf(hf: dict) -> ModelConfig:
    """A transformers config.json dict -> ModelConfig, or a clear error for what we cannot run."""
    kind = hf.get("model_type")
    if kind == "gemma3" and isinstance(hf.get("text_config"), dict):  # Gemma 3 with vision: its text model
        hf = {**hf["text_config"], "model_type": "gemma3_text"}
        kind = "gemma3_text"
    if kind not in SUPPORTED:
        raise ModelLoadError(f"model_type={kind!r} is not supported: minigen runs {', '.join(SUPPORTED)}. "
                             "Pick a checkpoint of one of those architectures.")
    for key in REQUIRED["gpt2" if kind == "gpt2" else "llama"]:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            found = "has no" if value is None else f"has {key}={value!r}, not a positive integer, for"
            raise ModelLoadError(f"config.json {found} {key!r}, which a {kind} model needs: the file is "
                                 "incomplete or edited. Restore the config.json that came with the weights.")
    eos = hf.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if kind == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"GPT-2 activation {hf['activation_function']!r} is not supported (gelu_new is)")
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise ModelLoadError("GPT-2 variants with scale_attn_by_inverse_layer_idx or "
                                 "reorder_and_upcast_attn are not supported")
        D, H = hf["n_embd"], hf["n_head"]
        return ModelConfig(arch="gpt2", vocab_size=hf["vocab_size"], dim=D, n_layers=hf["n_layer"],
                           n_heads=H, n_kv_heads=H, head_dim=D // H, hidden_dim=hf.get("n_inner") or 4 * D,
                           max_seq_len=hf["n_positions"], norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                           qkv_bias=True, out_bias=True, tie_embeddings=True, eos_token_ids=eos)
    if kind == "gemma3_text":
        return _gemma3_config(hf, eos)
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias"):
        raise ModelLoadError(f"{kind} with hidden_act={hf.get('hidden_act')!r} or mlp_bias is not supported")
    # transformers 5 keeps RoPE settings in `rope_parameters`; older config.json files use
    # `rope_theta` plus `rope_scaling`.
    theta, scaling = _rope(dict(hf.get("rope_parameters") or {}), hf.get("rope_theta", 10000.0), hf.get("rope_scaling"))
    layer_types, window = attention_layers(hf, kind)
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    bias = kind == "qwen2" or bool(hf.get("attention_bias"))
    return ModelConfig(arch="llama", vocab_size=hf["vocab_size"], dim=D, n_layers=hf["num_hidden_layers"],
                       n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
                       head_dim=hf.get("head_dim") or D // H, hidden_dim=hf["intermediate_size"],
                       max_seq_len=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-6),
                       rope_theta=float(theta), rope_scaling=scaling, qkv_bias=bias,
                       out_bias=kind != "qwen2" and bool(hf.get("attention_bias")),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), eos_token_ids=eos,
                       layer_types=layer_types, sliding_window=window)


def _rope(params: dict, theta: float, scaling: dict | None) -> tuple[float, dict | None]:
    """(base, scaling or None) of one RoPE: `params` from rope_parameters, else the older
    `theta` and `scaling` (rope_theta, rope_scaling); ModelLoadError for a kind minigen lacks."""
    theta = params.pop("rope_theta", theta)
    scaling = params or scaling or None
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
        elif scaling["rope_type"] not in ("linear", "llama3"):
            raise ModelLoadError(f"rope_type={scaling['rope_type']!r} is not supported: minigen knows "
                                 "default, linear and llama3 RoPE. Pick a checkpoint that uses one of those.")
    return float(theta), scaling


def _gemma3_config(hf: dict, eos: tuple[int, ...]) -> ModelConfig:
    """A Gemma 3 text config.json (model_type gemma3_text) -> ModelConfig, read as transformers'
    Gemma3TextConfig reads it: layer_types, else every `sliding_window_pattern`-th layer full (6);
    RoPE per kind of layer from rope_parameters, else rope_theta + rope_scaling for the full layers
    and rope_local_base_freq for the sliding ones."""
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"gemma3_text with hidden_activation={hf['hidden_activation']!r} is not supported "
                             "(gelu_pytorch_tanh is)")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
        if hf.get(key):  # off in every Gemma 3 checkpoint; minigen's attention paths do not apply them
            raise ModelLoadError(f"config.json has {key}={hf[key]!r}: minigen's Gemma 3 does not apply it on its "
                                 f"attention paths. Set {key} to null/false only if the checkpoint was trained so.")
    n = hf["num_hidden_layers"]
    if hf.get("layer_types") is None:  # older config.json files: the pattern (transformers' default 6)
        pattern = hf.get("sliding_window_pattern", 6)
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]}
    hf = {**hf, "sliding_window": hf.get("sliding_window", 4096)}
    layer_types, window = attention_layers(hf, "gemma3_text")
    params = hf.get("rope_parameters") or {}
    if params and not {"full_attention", "sliding_attention"} & set(params):  # one RoPE for every layer
        params = {"full_attention": params, "sliding_attention": params}
    theta, scaling = _rope(dict(params.get("full_attention") or {}), hf.get("rope_theta", 1_000_000.0),
                           hf.get("rope_scaling"))
    local_theta, local_scaling = _rope(dict(params.get("sliding_attention") or {}),
                                       hf.get("rope_local_base_freq", 10_000.0), None)
    D, H = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or 256  # Gemma3TextConfig's default
    return ModelConfig(arch="gemma3", vocab_size=hf["vocab_size"], dim=D, n_layers=n, n_heads=H,
                       n_kv_heads=hf.get("num_key_value_heads") or H, head_dim=head_dim,
                       hidden_dim=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 131072),
                       norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
                       tie_embeddings=bool(hf.get("tie_word_embeddings", True)), eos_token_ids=eos,
                       layer_types=layer_types, sliding_window=window,
                       query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                       rope_local_theta=local_theta, rope_local_scaling=local_scaling,
                       final_logit_softcapping=hf.get("final_logit_softcapping"))


def attention_layers(hf: dict, kind: str) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window) of a config.json, derived as `transformers` derives them:
    Llama never slides; Mistral slides in every layer when `sliding_window` is set; Qwen2 only with
    `use_sliding_window`, in the layers from `max_window_layers` on; any other model reads
    `layer_types` as written.
    (None, None): every layer attends every earlier position."""
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    if kind == "llama":  # transformers' Llama has no sliding window: whatever config.json says
        types = None
    elif kind == "mistral":  # transformers' Mistral ignores layer_types (it warns): the window is every layer's
        types = ["sliding_attention"] * n if window is not None else None
    elif kind == "qwen2" and not hf.get("use_sliding_window", False):  # its window is then None, every layer full
        types = None
    elif kind == "qwen2" and hf.get("layer_types") is None:
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    else:
        types = hf.get("layer_types")
    if types is None:
        return None, None
    if not isinstance(types, list) or len(types) != n or not all(t in LAYER_TYPES for t in types):
        bad = sorted({repr(t) for t in types if t not in LAYER_TYPES}) if isinstance(types, list) else []
        why = (f"holds {', '.join(bad)}, which is not a layer type" if bad else
               f"has {len(types)} entries for num_hidden_layers={n}" if isinstance(types, list) else
               f"is {type(types).__name__}, not a list")
        raise ModelLoadError(f"config.json's layer_types {why}: it needs one of {', '.join(LAYER_TYPES)} per layer, "
                             f"{n} in all. Restore the config.json that came with the weights.")
    if "sliding_attention" not in types:
        return None, None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"config.json has sliding_window={window!r}, not a positive integer, for layers whose "
                             "layer_types say sliding_attention. Restore the config.json that came with the weights.")
    return tuple(types), window
