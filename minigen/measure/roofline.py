"""The roofline: how fast a step can go, from the FLOPs it computes and the bytes it reads.

    attainable FLOP/s = min(peak FLOP/s, bandwidth x arithmetic intensity),  intensity = FLOPs / bytes

A step whose intensity sits left of the ridge (peak / bandwidth) is bound by memory: it finishes
no sooner than bytes / bandwidth, whatever the FLOP/s. A decode step at batch 1 reads every weight
once to do two FLOPs with it (a multiply and an add), so with 2-byte weights its intensity is
about 1 FLOP/byte, two orders of magnitude left of a GPU's ridge. Batching B sequences reuses each
weight B times (intensity ~B); a 4-bit weight is read in a quarter of the bytes (intensity x4).

FLOPs come from `ModelConfig.forward_flops` (matmuls, 2 per multiply-add); bytes are the weights a
step streams plus the KV cache it reads (or, for a prefill, writes). The ceilings of the GPUs are
their spec sheets' dense numbers (no 2:4 sparsity); this CPU's are measured (`cpu_ceiling`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .machine import memory_read_bandwidth
from ..checkpoints.model_config import ModelConfig


@dataclass(frozen=True)
class Ceiling:
    name: str
    peak_flops: float  # FLOP/s of dense matrix products, in the precision named in `precision`
    bandwidth: float  # bytes/s read from the memory the weights live in
    memory_bytes: float  # capacity of that memory
    precision: str  # the dtype of peak_flops
    source: str  # the spec sheet (URL), or "measured on this machine"

    @property
    def ridge(self) -> float:
        """FLOP/byte where the slope meets the flat roof: below it a step is bound by memory."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """FLOP/s the roofline allows at `intensity` FLOP/byte."""
        return min(self.peak_flops, self.bandwidth * intensity)

    def step_seconds(self, flops: float, nbytes: float) -> float:
        """The least time a step can take: compute or memory, whichever is longer (perfect overlap)."""
        return max(flops / self.peak_flops, nbytes / self.bandwidth)


# Spec sheets, dense BF16 Tensor Core numbers: NVIDIA prints the 2:4-sparsity figure first for
# Hopper (1,979 TFLOPS for H100/H200 SXM), with a footnote; the dense number is half of it.
A100_80GB = Ceiling(
    "A100-80GB SXM", 312e12, 2.039e12, 80e9, "bf16",
    "NVIDIA A100 Tensor Core GPU datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), 80GB SXM "
    "HBM2e 2,039 GB/s (80GB PCIe: 1,935 GB/s). https://www.nvidia.com/content/dam/en-zz/Solutions/"
    "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
H100_SXM = Ceiling(
    "H100 SXM", 989e12, 3.35e12, 80e9, "bf16",
    "NVIDIA H100 Tensor Core GPU datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, i.e. 989 dense; "
    "HBM3 3.35 TB/s, 80 GB. https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
H200_SXM = Ceiling(
    "H200 SXM", 989e12, 4.8e12, 141e9, "bf16",
    "NVIDIA H200 product page and datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, i.e. 989 dense "
    "(the H100's GH100 compute); HBM3e 4.8 TB/s, 141 GB. https://www.nvidia.com/en-us/data-center/h200/")
GPUS = (A100_80GB, H100_SXM, H200_SXM)

# Model shapes (each checkpoint's config.json). GPT-3 175B: Brown et al. 2020, table 2.1 (96 layers,
# d_model 12,288, 96 heads of 128; the MLP is 4 x d_model; learned positions: arch "gpt2").
SMOLLM2_135M = ModelConfig(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           head_dim=64, hidden_dim=1536, max_seq_len=8192)
LLAMA2_7B = ModelConfig(arch="llama", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                        head_dim=128, hidden_dim=11008, max_seq_len=4096, tie_embeddings=False)
LLAMA2_70B = ModelConfig(arch="llama", vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                         head_dim=128, hidden_dim=28672, max_seq_len=4096, tie_embeddings=False)
GPT3_175B = ModelConfig(arch="gpt2", vocab_size=50257, dim=12288, n_layers=96, n_heads=96, n_kv_heads=96,
                        head_dim=128, hidden_dim=4 * 12288, max_seq_len=2048, qkv_bias=True, out_bias=True)
SHAPES = {"SmolLM2-135M": SMOLLM2_135M, "Llama-2-7B": LLAMA2_7B, "Llama-2-70B": LLAMA2_70B,
          "GPT-3 175B": GPT3_175B}


def n_params(cfg: ModelConfig) -> int:
    """Parameters of the model (`Model(cfg)`'s, counted by formula: tests/test_roofline.py checks it)."""
    D, F = cfg.dim, cfg.hidden_dim
    qkv = D * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    out = cfg.n_heads * cfg.head_dim * D
    if cfg.arch == "llama":
        layer = qkv + out + 3 * D * F + 2 * D  # q/k/v, o, gate/up/down, two RMSNorm weights
        layer += (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim if cfg.qkv_bias else 0
        extra = D  # the final norm
    elif cfg.arch == "gemma3":  # Llama's matrices; four norms a block and one over each head's q and k
        layer = qkv + out + 3 * D * F + 4 * D + 2 * cfg.head_dim
        extra = D
    else:  # GPT-2: fc and proj with biases, two LayerNorms (weight, bias), learned positions
        layer = qkv + out + 2 * D * F + F + D + 4 * D
        layer += (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim if cfg.qkv_bias else 0
        layer += D if cfg.out_bias else 0
        extra = 2 * D + cfg.max_seq_len * D
    head = 0 if cfg.tie_embeddings else D * cfg.vocab_size
    return cfg.n_layers * layer + cfg.vocab_size * D + head + extra


def streamed_params(cfg: ModelConfig) -> int:
    """Parameters a step reads in full: all but the embedding tables, of which it reads a row per token
    (a tied output head reads the whole embedding as its matrix)."""
    tables = cfg.vocab_size * cfg.dim * (0 if cfg.tie_embeddings else 1)
    tables += cfg.max_seq_len * cfg.dim if cfg.arch == "gpt2" else 0
    return n_params(cfg) - tables


@dataclass(frozen=True)
class Point:
    label: str
    flops: float  # FLOPs of the step
    bytes: float  # bytes it moves from memory: weights + KV cache
    tokens: int  # tokens it produces (decode: the batch) or processes (prefill: batch x prompt)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def decode_point(cfg: ModelConfig, batch: int, context: int, weight_bytes: float = 2, kv_bytes: float = 2,
                 label: str = "") -> Point:
    """One decode step of `batch` sequences, each attending `context` cached positions: every weight read
    once for the whole batch (`weight_bytes` per parameter), each row's keys and values read once."""
    flops = batch * cfg.forward_flops(1, context)
    nbytes = streamed_params(cfg) * weight_bytes + batch * context * cfg.kv_bytes_per_token(kv_bytes)
    return Point(label or f"decode B={batch}", flops, nbytes, batch)


def prefill_point(cfg: ModelConfig, batch: int, prompt: int, weight_bytes: float = 2, kv_bytes: float = 2,
                  label: str = "") -> Point:
    """A prefill of `batch` prompts of `prompt` tokens: each weight read once for all of them, the KV
    cache written once; activations are assumed to stay on chip (an optimistic count of bytes)."""
    flops = batch * cfg.forward_flops(prompt, prompt)
    nbytes = streamed_params(cfg) * weight_bytes + batch * prompt * cfg.kv_bytes_per_token(kv_bytes)
    return Point(label or f"prefill B={batch}", flops, nbytes, batch * prompt)


def tokens_per_s(ceiling: Ceiling, point: Point) -> float:
    """The roofline's upper bound on tokens/s for `point` (all sequences of the batch together)."""
    return point.tokens / ceiling.step_seconds(point.flops, point.bytes)


def roofline_points(shapes: dict[str, ModelConfig] | None = None, batches=(1, 8, 64), context: int = 1024,
                    prompt: int = 512, weight_bytes: float = 2, kv_bytes: float = 2) -> list[tuple[str, Point]]:
    """(model name, point) for the prefill and decode of each model at each batch size."""
    shapes = shapes if shapes is not None else {k: SHAPES[k] for k in ("SmolLM2-135M", "Llama-2-7B", "Llama-2-70B")}
    out = []
    for name, cfg in shapes.items():
        for b in batches:
            out.append((name, prefill_point(cfg, b, prompt, weight_bytes, kv_bytes)))
            out.append((name, decode_point(cfg, b, context, weight_bytes, kv_bytes)))
    return out


# ---------------------------------------------------------------- this machine, measured
def matmul_flops(n: int = 2048, threads: int = 2, repeats: int = 5) -> float:
    """FLOP/s of an fp32 [n, n] @ [n, n] product on `threads` threads, best of `repeats` (2n^3 FLOPs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        a @ b  # warm-up: the BLAS picks its kernel, pages are touched
        best = float("inf")
        for _ in range(repeats):
            began = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - began)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / best


def format_peaks(threads: int = 2, n: int = 1024, repeats: int = 5) -> dict[str, float]:
    """Multiply-adds per nanosecond of an [n, n] @ [n, n] product in each number format, on `threads`
    threads, best of `repeats` (chapter 3): fp32 and bf16 through oneDNN's GEMM (the product a
    prompt runs: bf16 inputs meet in vdpbf16ps or AMX tiles, with fp32 sums), int8 x int8 with int32
    sums through torch._int_mm (VNNI's vpdpbusd or AMX). A format this torch cannot multiply is left out."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    qa, qb = (torch.randint(-127, 128, (n, n), generator=g, dtype=torch.int8) for _ in range(2))
    a16, b16 = a.bfloat16(), b.bfloat16()
    products = {"float32": lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""),
                "bfloat16": lambda: torch.ops.mkldnn._linear_pointwise(a16, b16, None, "none", [], ""),
                "int8": lambda: torch._int_mm(qa, qb.t())}
    peaks = {}
    try:
        for name, product in products.items():
            try:
                product()  # warm-up: the library picks its kernel, pages are touched
            except (RuntimeError, AttributeError):  # no oneDNN, or no int8 GEMM in this torch
                continue
            best = float("inf")
            for _ in range(repeats):
                began = time.perf_counter()
                product()
                best = min(best, time.perf_counter() - began)
            peaks[name] = n**3 / best / 1e9
    finally:
        torch.set_num_threads(before)
    return peaks


def cpu_ceiling(threads: int = 2, n: int = 2048) -> Ceiling:
    """This CPU's roofline, measured now on `threads` threads: an fp32 matmul's FLOP/s and a streaming
    read's bytes/s (machine.memory_read_bandwidth)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = memory_read_bandwidth() * 1e9
    finally:
        torch.set_num_threads(before)
    return Ceiling(f"this CPU ({threads} threads, measured)", matmul_flops(n, threads), bandwidth, 0.0, "fp32",
                   "measured on this machine: fp32 matmul (peak) and a streaming sum (bandwidth)")
