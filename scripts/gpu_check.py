"""The one GPU acceptance script: run it on a CUDA machine, get one JSON file (and a figure) naming
the hardware, under figures/gpu/.

    python scripts/gpu_check.py [--only decode offload kernel prefill fastpaths parallel] [--out figures/gpu]
    python scripts/gpu_check.py --smoke     # the same code on tiny shapes on the CPU (CI runs this)

No network: the models are Llama-family models with the real shapes of SmolLM2-135M, Llama-3.2-1B
and Llama-3.1-8B and random bf16 weights (speed does not depend on the values). Each check is a
function `check_<name>(device, smoke) -> dict` registered in CHECKS; add yours there. Without CUDA
(and without --smoke) the script prints a notice and exits 0: the CPU test suite proves
correctness, this script times what needs a GPU. Budget: under 8 minutes on one GPU (BUDGET_S): the
optional measurements (torch.compile's reduce-overhead, transformers' static-cache generate beside
minigen's decode) run only while the budget leaves their allowance, and say "skipped" otherwise.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "scripts"))  # transformers_decode.py, beside this file

import minigen  # noqa: E402
from minigen import GenerationConfig  # noqa: E402
from minigen.caches.make import make_cache
from minigen.steps.eager import decode_step, prefill  # noqa: E402
from minigen.model import Model  # noqa: E402
from minigen.checkpoints.model_config import ModelConfig
from minigen.caches.contract import BlockView
from minigen.numerics.precision import Precision  # noqa: E402
from minigen.numerics.quant import QuantizedTensor, dequantize, quantize  # noqa: E402
from minigen.kernels.triton_attention import decode_attention, plan_decode  # noqa: E402
from minigen.kernels.triton_prefill import prefill_attention  # noqa: E402
from transformers_decode import hf_decode  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# The shapes of the real checkpoints (their config.json), with random weights.
SHAPES = {
    "SmolLM2-135M": dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                         hidden_dim=1536, max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True),
    "Llama-3.2-1B": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                         hidden_dim=8192, max_seq_len=131072, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                         tie_embeddings=True),
    "Llama-3.1-8B": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                         hidden_dim=14336, max_seq_len=131072, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                         tie_embeddings=False),
}
SMOKE_SHAPE = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                   max_seq_len=512, tie_embeddings=True)


BUDGET_S = 450  # the checks' seconds on one GPU: with start-up and the report, under 8 minutes
# Allowances of the optional measurements, per model shape: compile times the H200 run recorded
# (figures from ../shared/gpu/NVIDIA_H200.json: reduce-overhead 11-46 s) plus the generations.
ALLOWANCE_S = {"reduce-overhead": 60, "transformers": 90}
_budget = {"deadline": float("inf"), "reserve": 0.0}  # main sets both: the end, and the later checks' share


def optional(what: str) -> str | None:
    """None when the budget leaves `what` its allowance (beside the later checks' reserve), else why not."""
    left = _budget["deadline"] - time.perf_counter() - _budget["reserve"]
    return None if left > ALLOWANCE_S[what] else f"skipped: {left:.0f} s left of the time budget"


def hardware(device: str) -> dict:
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    return {"gpu": gpu, "cuda": torch.version.cuda, "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version()}


def random_model(shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> Model:
    """A Llama-family model with these shapes and random weights (std 0.02, norms 1), built on the device."""
    model = Model(ModelConfig(arch="llama", eos_token_ids=(), **shape)).to(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = (torch.ones(p.shape, device=device) if p.dim() == 1 else
                      torch.randn(p.shape, generator=g, device=device) * 0.02).to(dtype)
    model.precision = Precision.default(dtype, device)
    return model.eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def read_bandwidth_gb_s(device: str, nbytes: int = 2**30) -> float:
    """Device memory bandwidth measured by a large copy (reads + writes), best of 5."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        y.copy_(x)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * x.nbytes / best / 1e9


# ---------------------------------------------------------------- chapters 9 and 11: decode, compiled, graphed
def check_decode(device: str, smoke: bool) -> dict:
    """Eager, compiled and CUDA-graph decode of each model shape in bf16: tok/s, TTFT, compile or
    capture time, peak memory, and the fraction of the device's bandwidth the step uses."""
    shapes = {"smoke": SMOKE_SHAPE} if smoke else SHAPES
    prompt_len, new = (16, 8) if smoke else (128, 64)
    bandwidth = read_bandwidth_gb_s(device, 2**22 if smoke else 2**30)
    results = {"bandwidth_gb_s": bandwidth, "prompt_len": prompt_len, "new_tokens": new, "models": {}}
    modes = {"eager": {}, "compile": {"compile": True}}
    if device == "cuda":
        modes["cuda_graphs"] = {"cuda_graphs": True}
    for name, shape in shapes.items():
        model = random_model(shape, torch.bfloat16, device)
        ids = torch.randint(0, shape["vocab_size"], (1, prompt_len), device=device,
                            generator=torch.Generator(device=device).manual_seed(1))
        weights = sum(p.nbytes for p in model.parameters())
        per_token = weights + (prompt_len + new // 2) * model.config.kv_bytes_per_token(2)
        row = {"weights_bytes": weights, "bytes_per_token": per_token, "modes": {}}
        tokens = {}
        for mode, overrides in modes.items():
            config = GenerationConfig(max_new_tokens=new, stop_token_ids=[], **overrides)
            warm = minigen.generate(model, ids, config)  # compiles or captures
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            out = minigen.generate(model, ids, config)
            s = out.stats
            tokens[mode] = out.tokens
            row["modes"][mode] = {
                "decode_tokens_per_s": s.decode_tokens_per_s, "ttft_s": s.ttft_s,
                "compile_s": warm.stats.compile_s, "latency_p50_s": s.latency_p50_s, "latency_p99_s": s.latency_p99_s,
                "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
                "bandwidth_fraction": s.decode_tokens_per_s * per_token / (bandwidth * 1e9),
                "tokens_equal_eager": bool(torch.equal(out.tokens, tokens["eager"]))}
        if device == "cuda":  # the alternative: torch.compile's own CUDA graphs, side by side
            skip = optional("reduce-overhead")
            row["modes"]["reduce-overhead"] = ({"skipped": skip} if skip else
                                               _reduce_overhead(model, ids, new, tokens["eager"], per_token, bandwidth))
        results["models"][name] = row
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        row["transformers"] = _transformers_beside(shape, ids, new, row["modes"])
    return results


def _transformers_beside(shape: dict, ids: torch.Tensor, new: int, modes: dict) -> dict:
    """transformers' generate with its static cache (compiled on a GPU) on the same shapes, prompt
    and token count, in the same process once minigen's model is freed: its tok/s, and each minigen
    mode's tok/s over it (minigen_over_transformers > 1: minigen decodes faster)."""
    skip = optional("transformers")
    if skip:
        return {"skipped": skip}
    hf = hf_decode(shape, ids, new)
    rate = hf.get("decode_tokens_per_s") or 0.0
    hf["minigen_over_transformers"] = {mode: m["decode_tokens_per_s"] / rate for mode, m in modes.items()
                                       if rate > 0 and "decode_tokens_per_s" in m}
    return hf


def _reduce_overhead(model, ids, new: int, eager_tokens, per_token: int, bandwidth: float) -> dict:
    """Greedy decode with decode_step compiled by torch.compile(mode="reduce-overhead"), which
    captures the compiled step in CUDA graphs itself (its static inputs are copied in for us)."""
    step = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    T = ids.shape[1]
    config = GenerationConfig(max_new_tokens=new, stop_token_ids=[])

    def run() -> tuple[torch.Tensor, list[float]]:
        with torch.no_grad():
            cache = make_cache(model, config, 1, T + new)
            token = prefill(model, ids, cache).argmax(-1)
            out, times = [ids, token[:, None]], []
            for i in range(new - 1):
                t = time.perf_counter()
                token = step(model, token[:, None].clone(), torch.tensor([T + i], device=ids.device), cache,
                             None).argmax(-1)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                out.append(token[:, None])
        return torch.cat(out, dim=1), times

    started = time.perf_counter()
    run()  # compiles and records the graphs
    compile_s = time.perf_counter() - started
    tokens, times = run()
    rate = 1 / statistics.median(times)
    return {"decode_tokens_per_s": rate, "compile_s": compile_s, "latency_p50_s": statistics.median(times),
            "bandwidth_fraction": rate * per_token / (bandwidth * 1e9),
            "tokens_equal_eager": bool(torch.equal(tokens, eager_tokens))}


# ---------------------------------------------------------------- chapter 5: paged cache and offload
def _decode_ms(model, prompt: torch.Tensor, config: GenerationConfig, steps: int, device: str):
    """Median ms of a decode step (synchronized) and the greedy tokens [B, steps]."""
    B, T = prompt.shape
    times, tokens = [], []
    with torch.inference_mode():
        cache = make_cache(model, config, B, T + steps + 1)
        token = prefill(model, prompt, cache).argmax(-1)
        for i in range(steps):
            _sync(device)
            t = time.perf_counter()
            token = decode_step(model, token[:, None], torch.tensor([T + i], device=device), cache).argmax(-1)
            _sync(device)
            times.append(time.perf_counter() - t)
            tokens.append(token)
    return 1e3 * statistics.median(times[2:]), torch.stack(tokens, dim=1)


def check_offload(device: str, smoke: bool) -> dict:
    """Decode with the KV cache resident, paged, and offloaded to pinned CPU memory with prefetch
    depths 0..4: step time, tokens identical to resident, device bytes and bytes moved per step.
    Depth 0 fetches each layer just in time; deeper prefetch should hide the copies behind compute."""
    shape = SMOKE_SHAPE if smoke else SHAPES["SmolLM2-135M"]
    batch, prompt_len, steps = (2, 32, 6) if smoke else (8, 1024, 32)
    model = random_model(shape, torch.float32 if smoke else torch.bfloat16, device)
    prompt = torch.randint(0, shape["vocab_size"], (batch, prompt_len), device=device,
                           generator=torch.Generator(device=device).manual_seed(0))
    base_ms, base_tokens = _decode_ms(model, prompt, GenerationConfig(), steps, device)
    results = {"batch": batch, "prompt_len": prompt_len, "steps": steps, "resident": {"step_ms": base_ms}}
    paged_ms, paged_tokens = _decode_ms(model, prompt, GenerationConfig(cache_chunk_size=16), steps, device)
    results["paged_16"] = {"step_ms": paged_ms, "speed_vs_resident": base_ms / paged_ms,
                           "tokens_identical": bool(torch.equal(paged_tokens, base_tokens))}
    for depth in (0, 1, 2, 4):
        config = GenerationConfig(prefetch_depth=depth)
        ms, tokens = _decode_ms(model, prompt, config, steps, device)
        cache = make_cache(model, config, batch, prompt_len + steps + 1)
        results[f"offload_depth_{depth}"] = {
            "step_ms": ms, "slowdown_vs_resident": ms / base_ms,
            "tokens_identical": bool(torch.equal(tokens, base_tokens)),
            "device_kv_bytes": cache.device_nbytes, "host_kv_bytes": cache.nbytes - cache.device_nbytes,
            "bytes_moved_per_step": 2 * model.config.n_layers * cache.layer_nbytes}
    return results


# ---------------------------------------------------------------- chapter 12: the Triton decode-attention kernel
def _median_ms(fn, device: str, reps: int) -> float:
    """Median wall time of fn() in ms, synchronized, after one warm-up call (which compiles)."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _gather_sdpa(q: torch.Tensor, view: BlockView) -> torch.Tensor:
    """The torch backend's way over the same blocks: gather them through the table, dequantize the
    copy, then SDPA. q [B, H, Dh] -> [B, H, Dh]."""
    B, n = view.block_table.shape
    ids = view.block_table.flatten()

    def read(x):  # -> [B, Hkv, S, Dh] in q's dtype
        if isinstance(x, QuantizedTensor):
            x = dequantize(QuantizedTensor(x.data[ids], x.scales[ids], x.zeros[ids], x.bits, x.group_size, x.axis,
                                           q.dtype))
        else:
            x = x[ids]
        return x.reshape(B, n * view.block_size, *x.shape[2:]).transpose(1, 2)

    k, v = read(view.k), read(view.v)
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
    return out[:, :, 0]


def check_kernel(device: str, smoke: bool) -> dict:
    """One Llama-3.1-8B-shaped attention layer decoding one token (32 query heads on 8 key/value heads
    of 128 dims) over 1k, 4k and 16k cached tokens in paged blocks, bf16 / int8 / int4: the Triton
    kernel against gather + dequantize + SDPA on the same blocks. Time, and bandwidth achieved on the
    bytes the step must read (codes, scales, zeros, the query); the gather's copies are not counted."""
    H, Hkv, Dh = (4, 2, 16) if smoke else (32, 8, 128)
    bs, group_size, batch = 16, 16, 1
    contexts = (48, 96) if smoke else (1024, 4096, 16384)
    reps = 2 if smoke else 20
    bandwidth = read_bandwidth_gb_s(device, 2**22 if smoke else 2**30)
    g = torch.Generator(device=device).manual_seed(0)
    results = {"layer": {"n_heads": H, "n_kv_heads": Hkv, "head_dim": Dh}, "block_size": bs,
               "group_size": group_size, "batch": batch, "copy_bandwidth_gb_s": bandwidth, "runs": {}}
    for S in contexts:
        n = S // bs
        k, v = (torch.randn(batch * n, bs, Hkv, Dh, generator=g, device=device).to(torch.bfloat16) for _ in range(2))
        table = torch.randperm(batch * n, generator=g, device=device).view(batch, n)  # blocks scattered in the pool
        lens = torch.full((batch,), S, device=device)
        q = torch.randn(batch, H, Dh, generator=g, device=device).to(torch.bfloat16)
        for fmt, bits in (("bf16", None), ("int8", 8), ("int4", 4)):
            kq, vq = (k, v) if bits is None else (quantize(k, bits, group_size, -3), quantize(v, bits, group_size, -1))
            view = BlockView(kq, vq, table, bs, lens, lens)
            read = q.nbytes + sum(t.nbytes for x in (kq, vq) for t in ((x,) if bits is None else (x.data, x.scales, x.zeros)))
            plan = plan_decode(q, view)  # once per step in a model: each layer's call is its launch alone
            kernel_ms = _median_ms(lambda: decode_attention(q, view, plan=plan), device, reps)
            torch_ms = _median_ms(lambda: _gather_sdpa(q, view), device, reps)
            diff = (decode_attention(q, view).float() - _gather_sdpa(q, view).float()).abs().max().item()
            results["runs"][f"{fmt}_{S}"] = {
                "context": S, "format": fmt, "bytes_read": read, "kernel_ms": kernel_ms, "gather_sdpa_ms": torch_ms,
                "speedup": torch_ms / kernel_ms, "kernel_gb_s": read / kernel_ms / 1e6,
                "gather_sdpa_gb_s": read / torch_ms / 1e6, "kernel_bandwidth_fraction": read / kernel_ms / 1e6 / bandwidth,
                "max_abs_diff": diff}
    return results


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """SDPA over contiguous keys with is_causal=True, chosen once: torch's flash kernel on a GPU (the
    grouped-query heads expanded first where that kernel refuses enable_gqa) -> (a function that
    runs it and returns [B, H, T, Dh], the path taken)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if q.device.type != "cuda":
        return lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), "sdpa"

    def flash(k, v, gqa):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, v, is_causal=True, enable_gqa=gqa)

    try:
        flash(k, v, True)
        return lambda: flash(k, v, True), "flash, enable_gqa"
    except RuntimeError:  # no flash kernel for grouped-query heads in this torch
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        return lambda: flash(k, v, False), "flash, heads expanded"


def check_prefill(device: str, smoke: bool) -> dict:
    """One Llama-3.1-8B-shaped attention layer running a prompt of 1k, 4k and 16k tokens from position 0:
    the Triton FlashAttention kernel (triton_prefill.py) reading its keys from scattered paged blocks
    (bf16, and 4-bit codes), against SDPA's flash kernel with is_causal=True on contiguous bf16 keys.
    Time, TFLOP/s on the causal half of the scores, and the largest difference from SDPA's output.
    At 4k, a few tile sizes (queries x heads rows, keys) say which default to keep."""
    H, Hkv, Dh = (4, 2, 16) if smoke else (32, 8, 128)
    bs, group_size = 16, 16
    prompts = (48, 96) if smoke else (1024, 4096, 16384)
    reps = 2 if smoke else 10
    g = torch.Generator(device=device).manual_seed(0)
    results = {"layer": {"n_heads": H, "n_kv_heads": Hkv, "head_dim": Dh}, "block_size": bs, "runs": {}}
    for T in prompts:
        n = T // bs
        k, v = (torch.randn(n, bs, Hkv, Dh, generator=g, device=device).to(torch.bfloat16) for _ in range(2))
        table = torch.randperm(n, generator=g, device=device)[None]  # [1, n]: blocks scattered in the pool
        lens = torch.full((1,), T, device=device)
        q = torch.randn(1, H, T, Dh, generator=g, device=device).to(torch.bfloat16)
        pos = torch.arange(T, device=device)[None]
        # The same keys, contiguous in position order, for SDPA: [1, Hkv, T, Dh]
        order = table[0]
        k_flat, v_flat = (x[order].reshape(T, Hkv, Dh).transpose(0, 1)[None].contiguous() for x in (k, v))
        sdpa, path = _sdpa_causal(q, k_flat, v_flat)
        sdpa_out, sdpa_ms = sdpa(), _median_ms(sdpa, device, reps)
        flops = 4 * H * Dh * T * (T + 1) / 2  # q.k and p.v over the causal half, 2 FLOPs a multiply-add
        results["runs"][f"sdpa_{T}"] = {"prompt": T, "path": path, "ms": sdpa_ms, "tflop_s": flops / sdpa_ms / 1e9}
        tiles = [(None, None)] + ([(16, 64), (32, 32), (16, 32)] if T == 4096 else [])  # (queries, keys) per tile
        for fmt, bits in (("bf16", None), ("int4", 4)):
            kq, vq = (k, v) if bits is None else (quantize(k, bits, group_size, -3), quantize(v, bits, group_size, -1))
            view = BlockView(kq, vq, table, bs, lens, lens)
            for block_m, block_n in (tiles if bits is None else tiles[:1]):
                run = lambda: prefill_attention(q, view, pos, block_m=block_m, block_n=block_n)  # noqa: E731
                ms = _median_ms(run, device, reps)
                # int4: compared with SDPA over the dequantized keys, so the difference is the kernel's alone
                ref = sdpa_out if bits is None else _sdpa_causal(q, *(
                    dequantize(x).to(q.dtype)[order].reshape(T, Hkv, Dh).transpose(0, 1)[None] for x in (kq, vq)))[0]()
                diff = (run().float() - ref.float()).abs().max().item()
                name = f"{fmt}_{T}" + (f"_m{block_m}_n{block_n}" if block_m else "")
                results["runs"][name] = {"prompt": T, "format": fmt, "block_m": block_m, "block_n": block_n,
                                         "ms": ms, "tflop_s": flops / ms / 1e9, "vs_sdpa": sdpa_ms / ms,
                                         "max_abs_diff_vs_sdpa": diff, "close_to_sdpa": diff < 2e-2}
    return results


def check_fastpaths(device: str, smoke: bool) -> dict:
    """What minigen measures before it runs attention_backend='triton' on this GPU (kernels/fastpaths.py,
    steps/choose.py's TRITON_PROBES): the Triton decode kernel against attention.attend_blocks at
    Llama-3.1-8B's heads over 4,096 positions, and whether the backend would warn as slower."""
    from minigen.kernels import probes
    from minigen.steps import choose
    shapes = probes.Shapes(**probes.FLOOR) if smoke else probes.Shapes(4096, 14336, 32, 8, 128)
    probe = choose._triton_probe(64) if smoke else choose.TRITON_PROBES[0]
    dtype = torch.float32 if smoke else torch.bfloat16
    here = probes.Probe(probe.path, probe.fast, probe.reference,
                        lambda s, rows: probe.make(s, rows, device=device, dtype=dtype))
    m = probes.run_probe(here, shapes)
    return {"path": m.path, "fast_ms": m.fast_s * 1e3, "reference_ms": m.reference_s * 1e3, "ratio": m.ratio,
            "stands_aside": m.stands_aside}


def check_parallel(device: str, smoke: bool) -> dict:
    """Tensor parallelism through NCCL, one GPU a rank (tests/test_parallel_gpu.py, pytest -m gpu) where this
    machine has 2 or more GPUs; with fewer (or --smoke) it says so and runs nothing."""
    gpus = torch.cuda.device_count()
    if smoke or gpus < 2:
        return {"gpus": gpus, "skipped": "needs 2 or more GPUs" if not smoke else "smoke run"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:randomly",
                          str(ROOT / "tests" / "test_parallel_gpu.py")], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    return {"gpus": gpus, "tp_size": gpus, "passed": run.returncode == 0, "output": run.stdout[-2000:]}


CHECKS = {"decode": check_decode, "offload": check_offload, "kernel": check_kernel, "prefill": check_prefill,
          "fastpaths": check_fastpaths, "parallel": check_parallel}


def plot(report: dict, path: Path) -> None:
    """Decode tok/s per model and mode, with the share of the bandwidth roofline on each bar."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    decode = report["checks"].get("decode")
    if not decode:
        return
    models = list(decode["models"])
    modes = [mode for mode in next(iter(decode["models"].values()))["modes"]  # a skipped mode has no rate
             if all("decode_tokens_per_s" in m["modes"].get(mode, {}) for m in decode["models"].values())]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        rates = [decode["models"][m]["modes"][mode]["decode_tokens_per_s"] for m in models]
        bars = ax.bar([j + width * (i - (len(modes) - 1) / 2) for j in range(len(models))], rates, width, label=mode)
        ax.bar_label(bars, labels=[f"{decode['models'][m]['modes'][mode]['bandwidth_fraction']:.0%}" for m in models],
                     fontsize=7)
    ax.set_xticks(range(len(models)), models)
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s, batch 1, bf16 (bar label: share of the bandwidth roofline)")
    ax.set_title(f"measured by scripts/gpu_check.py on {report['hardware']['gpu'] or 'the CPU (smoke run)'}",
                 fontsize=9)
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "figures" / "gpu"), help="folder for <device>.json and .png")
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run only these checks")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script itself")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the checks (optional parts yield)")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() or args.smoke):
        print("Notice: CUDA is not available on this machine, so the GPU checks are skipped "
              "(the CPU test suite proves correctness; run this script on a GPU to time them).")
        return 0
    device = "cpu" if args.smoke else "cuda"
    report = {"hardware": hardware(device), "smoke": args.smoke, "checks": {}}
    started = time.perf_counter()
    names = list(args.only or CHECKS)
    _budget["deadline"] = started + args.budget_s
    for i, name in enumerate(names):
        _budget["reserve"] = 60.0 * len(names[i + 1:])  # each later check's share of the budget
        print(f"running {name} ...", flush=True)
        report["checks"][name] = CHECKS[name](device, args.smoke)
    report["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "smoke" if args.smoke else report["hardware"]["gpu"].replace(" ", "_").replace("/", "_")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / f"{stem}.png")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
