"""From minigen to a production engine: each setting's name in vLLM, TensorRT-LLM and TGI (chapter 15).

    load_settings()             -> the map in production.toml, one Setting per concept
    settings_table()            -> that map as a Markdown table (the chapter shows it)
    vllm_engine_args(config)    -> vLLM's engine arguments for a GenerationConfig (Triton's model.json)
    vllm_cli(args)              -> the same as `vllm serve` flags
    sampling_params(config)     -> vLLM's per-request SamplingParams fields

A feature with no vLLM equivalent is refused with a ConfigError that names its keys and the closest
setting, never dropped. The course's layer: the core never imports this module.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import GenerationConfig
from ..errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

MAP_PATH = Path(__file__).with_name("engines.toml")
ENGINES = ("vllm", "trtllm", "tgi")
ENGINE_NAMES = {"vllm": "vLLM", "trtllm": "TensorRT-LLM", "tgi": "TGI"}


@dataclass(frozen=True)
class Setting:
    """One concept: minigen's fields for it and each engine's argument, with what differs."""
    concept: str
    minigen: tuple[str, ...]  # GenerationConfig fields
    engine: tuple[str, ...]  # minigen.Engine arguments ("Engine": the Engine's own behaviour)
    minigen_note: str
    args: dict[str, str]  # engine -> argument name ("" when the engine has none)
    notes: dict[str, str]  # engine -> how it differs
    sources: tuple[str, ...]  # keys of SOURCES


def _load(path: Path) -> tuple[dict[str, str], list[Setting]]:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    settings = []
    for row in data["setting"]:
        settings.append(Setting(concept=row["concept"], minigen=tuple(row["minigen"]), engine=tuple(row["engine"]),
                                minigen_note=row["minigen_note"], args={e: row[e] for e in ENGINES},
                                notes={e: row[f"{e}_note"] for e in ENGINES}, sources=tuple(row["sources"])))
    return data["sources"], settings


SOURCES, SETTINGS = _load(MAP_PATH)


def load_settings(path: str | Path = MAP_PATH) -> list[Setting]:
    """The settings map (production.toml by default)."""
    return _load(Path(path))[1] if Path(path) != MAP_PATH else list(SETTINGS)


def settings_table(settings: list[Setting] | None = None, notes: bool = True) -> str:
    """A Markdown table: concept, minigen's names, each engine's argument (and how it differs)."""
    settings = SETTINGS if settings is None else settings
    head = ["concept", "minigen"] + [ENGINE_NAMES[e] for e in ENGINES]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in settings:
        names = [f"`{n}`" for n in s.minigen] + [f"Engine `{n}`" if n != "Engine" else "the Engine" for n in s.engine]
        cells = [s.concept, ", ".join(names) or "none"]
        for e in ENGINES:
            arg = f"`{s.args[e]}`" if s.args[e] else ""
            note = s.notes[e] if notes else ""
            cells.append(f"{arg}: {note}" if arg and note else arg or note or "none")
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


# ---------------------------------------------------------------- a config, as vLLM's arguments
# What minigen does that vLLM cannot be told to do, and the nearest thing it can.
NO_VLLM_EQUIVALENT = {
    "quant_bits": "group-wise int KV quantization; nearest: kv_cache_dtype 'fp8' (or int8_per_token_head / "
                  "int4_per_token_head in recent vLLM: one scale per token and head)",
    "prefetch_depth": "a second KV tier read layer by layer; nearest: kv_offloading_size (GiB of CPU memory "
                      "for evicted blocks)",
    "window_size": "a window imposed on any model; vLLM uses the model's own sliding_window "
                   "(disable_sliding_window turns it off)",
    "sparse_top_k": "top-k sparse attention; none",
    "sparsity_threshold": "thresholded sparse attention; none",
    "kv_budget": "heavy-hitter (H2O) eviction; none",
    "use_cache": "the naive loop without a cache; every engine caches",
    "prefill_precision": "a prompt's products in another format than the decode step's; vLLM runs both in the "
                         "model's --dtype and quantization",
}


def _switched_on(config: GenerationConfig, key: str) -> bool:
    """Whether `config` uses the feature of NO_VLLM_EQUIVALENT's `key` (set away from its default)."""
    if key == "use_cache":
        return not config.use_cache
    if key == "prefill_precision":
        return config.prefill_precision != "float32"
    return getattr(config, key) is not None


def vllm_engine_args(config: GenerationConfig, *, max_batch_size: int | None = None,
                     num_blocks: int | None = None) -> dict[str, object]:
    """vLLM's engine arguments (EngineArgs field names: the keys of Triton's model.json) for the cache
    and compilation settings of `config`, plus the Engine's `max_batch_size` and `num_blocks`.
    Sampling fields are per request (sampling_params). Raises ConfigError naming every feature of
    `config` that vLLM cannot be told to use."""
    if not isinstance(config, GenerationConfig):
        raise ConfigError(f"config must be a GenerationConfig, got {type(config).__name__}")
    refused = [key for key in NO_VLLM_EQUIVALENT if _switched_on(config, key)]
    if refused:
        why = "; ".join(f"{k}={getattr(config, k)!r}: {NO_VLLM_EQUIVALENT[k]}" for k in refused)
        raise ConfigError(f"vLLM has no equivalent of {', '.join(refused)} ({why}). Remove "
                          f"{'them' if len(refused) > 1 else 'it'} from the config to serve it with vLLM")
    args: dict[str, object] = {}
    if config.cache_chunk_size is not None:
        args["block_size"] = config.cache_chunk_size
    if config.kv_dtype == "float32":  # vLLM's cache dtypes stop at 16 bits: an fp32 cache is an fp32 model's
        args["dtype"], args["kv_cache_dtype"] = "float32", "auto"
    else:
        args["kv_cache_dtype"] = config.kv_dtype or "auto"
    if config.cuda_graphs or config.fused_decode is True:  # fused_decode, minigen's C step: vLLM's own is compiled and graphed
        args["enforce_eager"] = False
    elif config.compile:  # compiled, not graphed
        args["enforce_eager"] = False
        args["compilation_config"] = {"cudagraph_mode": "NONE"}
    else:
        args["enforce_eager"] = True
    if config.prefill_chunk_size is not None:  # vLLM chunks by a step's token budget: one prompt alone, the same
        args["enable_chunked_prefill"], args["max_num_batched_tokens"] = True, config.prefill_chunk_size
    if max_batch_size is not None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"max_batch_size={max_batch_size!r} is invalid: use an integer >= 1")
        args["max_num_seqs"] = max_batch_size
    if num_blocks is not None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks={num_blocks!r} is invalid: use an integer >= 1")
        args["num_gpu_blocks_override"] = num_blocks
    return args


def vllm_cli(args: dict[str, object]) -> list[str]:
    """Engine arguments as `vllm serve` flags: underscores become dashes, True is a bare flag."""
    out = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            continue  # every boolean here defaults to False in vLLM
        elif isinstance(value, dict):
            out += [flag, "{" + ", ".join(f'"{k}": "{v}"' for k, v in value.items()) + "}"]
        else:
            out += [flag, str(value)]
    return out


def sampling_params(config: GenerationConfig) -> dict[str, object]:
    """The fields of vLLM's SamplingParams for `config`'s sampling (temperature 0 is greedy)."""
    params: dict[str, object] = {"max_tokens": config.max_new_tokens,
                                 "temperature": config.temperature if config.do_sample else 0.0}
    if config.do_sample and config.top_k is not None:
        params["top_k"] = config.top_k
    if config.do_sample and config.top_p is not None:
        params["top_p"] = config.top_p
    if config.do_sample and config.min_p is not None:
        params["min_p"] = config.min_p
    for key, off in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
        if getattr(config, key) != off:  # vLLM's names and rules (repetition over prompt and output)
            params[key] = getattr(config, key)
    if config.logit_bias:
        params["logit_bias"] = dict(config.logit_bias)
    if config.seed is not None:
        params["seed"] = config.seed
    if config.stop_token_ids is not None:
        params["stop_token_ids"] = list(config.stop_token_ids)
    return params
