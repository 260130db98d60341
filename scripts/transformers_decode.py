"""transformers' fastest batch-1 decode of a model shape, for scripts/gpu_check.py's decode check to
set beside minigen's: `generate` with its static cache (cache_implementation="static"), which on a
GPU compiles the forward itself (torch.compile, mode "reduce-overhead": CUDA graphs), as its docs
recommend for speed. Random bf16 weights of the same shapes: speed does not depend on the values.

The decode rate comes from a streamer's timestamps: `generate` hands it the prompt, then each new
token as the host sees it, and its loop reads every token back (its stop check), so the host's
clock follows the device's. rate = (new - 1) / (time of the last token - time of the first).
"""

from __future__ import annotations

import time

import torch

try:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.generation.streamers import BaseStreamer
except ImportError:  # the check records that transformers is missing instead of failing
    transformers = None
    BaseStreamer = object


class Clock(BaseStreamer):
    """A streamer that keeps the time at which each call of `put` came (the first: the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_config(shape: dict) -> "LlamaConfig":
    """gpu_check's SHAPES entry as a transformers LlamaConfig (the rotation's scaling left out: it
    changes no byte a decode step reads)."""
    rope = {"rope_type": "default", "rope_theta": shape.get("rope_theta", 10000.0)}
    return LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=shape["dim"], intermediate_size=shape["hidden_dim"],
                       num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
                       num_key_value_heads=shape["n_kv_heads"], head_dim=shape["head_dim"],
                       max_position_embeddings=shape["max_seq_len"], tie_word_embeddings=shape["tie_embeddings"],
                       rope_parameters=rope, pad_token_id=0, eos_token_id=None, bos_token_id=None)


def hf_model(shape: dict, dtype: torch.dtype, device: str) -> "LlamaForCausalLM":
    """A LlamaForCausalLM of these shapes, built on the device in `dtype` (no fp32 copy first)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(hf_config(shape)).eval()
    finally:
        torch.set_default_dtype(before)


def hf_decode(shape: dict, ids: torch.Tensor, new: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Greedy decode of `new` tokens after ids [1, T] with transformers' static cache, twice (the
    first compiles on a GPU): the second's decode rate, the first's extra seconds, and the path."""
    if transformers is None:
        return {"skipped": "transformers is not installed"}
    device = ids.device.type
    model = hf_model(shape, dtype, device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              cache_implementation="static", pad_token_id=0)

    def run() -> tuple[float, list[float]]:
        clock = Clock()
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, streamer=clock, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started, clock.times

    first_s, _ = run()
    total_s, times = run()
    decode = times[-1] - times[1] if len(times) > 2 else 0.0  # times[0]: the prompt; times[1]: the first token
    result = {"transformers": transformers.__version__, "cache_implementation": "static",
              "compiled": device == "cuda",  # generate compiles the forward with a static cache on a GPU
              "decode_tokens_per_s": (len(times) - 2) / decode if decode > 0 else 0.0,
              "ttft_s": times[1] - times[0] if len(times) > 1 else 0.0, "total_s": total_s,
              "compile_s": max(0.0, first_s - total_s)}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result
