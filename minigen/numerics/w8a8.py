"""int8 prompt products (chapter 16): int8 weights times int8 activations, prefill_precision="int8".

Shapes: T rows (a prompt's tokens, over every batch row), n outputs, k inputs (a weight is [n, k]).

A prompt's products are bound by arithmetic, and a CPU with int8 dot products (x86's AVX512-VNNI and
AVX-VNNI `vpdpbusd`, or AMX-INT8 tiles) multiplies int8 numbers into int32 sums several times faster
than fp32. Both operands become int8 codes, each side with its own scales (W8A8, as SmoothQuant,
Xiao et al. 2023, and llama.cpp's Q8_0 dot products):

    y[t, n] = a[t] * b[n] * sum_k qx[t, k] * qw[n, k]     (exact int32 sums, then two fp32 scales)
    qx[t, k] = round(x[t, k] / s[k] / a[t])   a[t] = max_k |x[t, k] / s[k]| / 127   per row (token)
    qw[n, k] = round(w[n, k] * s[k] / b[n])   b[n] = max_k |w[n, k] * s[k]| / 127   per output channel

- Activations: one scale per row, computed in every product from that row alone, so a row of a
  batch gets the same codes as alone: rows never influence each other (a scale or an outlier set
  shared by the batch would make one prompt's numbers depend on another's).
- Weights: one scale per output channel, so the GEMM is oneDNN's plain int8 one (a scale per
  group along k would need one GEMM per group: no fast kernel takes it). The codes are made once
  per model (`prepare`) and kept: an fp32 model gains a quarter of its blocks' weight bytes.
- Smoothing s[k], for the products that read an RMSNorm's output (wqkv and w_gate_up): the normed
  residual stream has a few channels far larger than the rest, and with one scale per row those
  few channels would take the row's whole int8 range and round the others to a handful of
  levels. SmoothQuant divides channel k by s[k] = sqrt(max|x_k| / max|w_k|) and multiplies the
  weights' column k by it: the product is unchanged, and the range moves into the weights, whose
  scales are per output channel. max|x_k| is calibrated once per model, on English text: the
  last CALIBRATION_CHARS characters of data/english.txt, through the tokenizer `minigen.load`
  returned with the model (for SmolLM2 they lie past the 2,048 tokens that scripts/prefill_speeds.py
  scores, and the 512 the tests score); a model loaded without one calibrates on seeded random
  ids, which measured worse on SmolLM2 (their maxima are not text's). The inputs of wo and w_down
  have no such channels, and smoothing them with factors from a short calibration cost quality.
- The output head keeps fp32: a prefill needs the last row's logits only (one row, the decode
  step's kernel), and the logits are the most sensitive product (chapter 14). A product without
  an int8 copy runs as it would under "float32".

`reference_linear` is the scheme in plain torch (codes back to floats, an fp32 GEMM); the fast path
is kernels/cpu.py's `int8_linear` (oneDNN's int8 GEMM), chosen per call by kernels/dispatch.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import ConfigError
from .weight_quant import QuantizedWeight

QMAX = 127  # symmetric codes in [-127, 127]: -128 unused, so that -q is a code too
SMOOTHING_ALPHA = 0.5  # s[k] = max|x_k|^alpha / max|w_k|^(1 - alpha): SmoothQuant's default
CALIBRATION_CHARS = 800  # of data/english.txt, its end: SmolLM2 makes 209 tokens of them
CALIBRATION_TOKENS = 256  # seeded random ids where the model came without a tokenizer


@dataclass(frozen=True)
class Int8Weight:
    """A weight [n, k] as int8 codes with one fp32 scale per output channel, and the smoothing
    factors its input is divided by (None: not smoothed)."""
    packed: Tensor  # the codes qw [n, k], in oneDNN's layout (torch.ops.onednn.qlinear_prepack)
    scales: Tensor  # b [n] fp32
    inv_smooth: Tensor | None  # 1 / s [k] fp32: multiplies the activations before they are quantized
    zero_points: Tensor  # [n] int64 zeros: symmetric codes (oneDNN's call asks for them)

    @property
    def nbytes(self) -> int:
        smooth = 0 if self.inv_smooth is None else self.inv_smooth.nbytes
        return self.packed.numel() + self.scales.nbytes + smooth + self.zero_points.nbytes

    def codes(self) -> Tensor:
        """qw [n, k] int8, a copy in torch's layout (the reference's and the tests' way to read them)."""
        return self.packed.to_dense().t().contiguous()


# the int8 copy of each weight that has one, keyed by the weight tensor itself: a model's copies
# live as long as its weights, and a weight without one (the head) is not a key
_COPIES = WeakIdKeyDictionary()
_CALIBRATION = WeakIdKeyDictionary()  # model -> a function that gives its calibration ids (calibrate_on)


def calibrate_on(model, tokenizer) -> None:
    """Calibrate `model`'s smoothing, when it is first needed, on the end of data/english.txt through
    `tokenizer` (minigen.load calls this; nothing is tokenized until an int8 prompt runs)."""
    def ids() -> Tensor:
        text = (Path(__file__).resolve().parent.parent / "data" / "english.txt").read_text(encoding="utf-8")
        return tokenizer(text[-CALIBRATION_CHARS:], return_tensors="pt").input_ids[0]
    _CALIBRATION[model] = ids


def copy_of(w) -> Int8Weight | None:
    """The int8 copy `prepare` made of weight w, or None (the head; a model never prepared)."""
    return _COPIES.get(w)


def onednn_int8() -> bool:
    """Whether this torch has oneDNN's int8 linear (torch.ops.onednn.qlinear_pointwise, x86 builds)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")
    except (AttributeError, RuntimeError):
        return False


def quantize_rows(x: Tensor, inv_smooth: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [T, k] fp32 -> (qx [T, k] int8, a [T, 1] fp32): each row smoothed (x * inv_smooth), then
    scaled by its own max to [-127, 127]. An all-zero row gets scale 1 and codes 0."""
    if inv_smooth is not None:
        x = x * inv_smooth
    a = x.abs().amax(-1, keepdim=True).div_(QMAX)
    a = torch.where(a > 0, a, torch.ones_like(a))
    return torch.round(x / a).to(torch.int8), a  # |x / a| <= 127: no clamp needed


def quantize_weight(w: Tensor, smooth: Tensor | None) -> Int8Weight:
    """w [n, k] (any float dtype) -> its Int8Weight: columns multiplied by smooth [k], then one
    scale per output channel."""
    w = w.float() if smooth is None else w.float() * smooth
    b = w.abs().amax(-1).div_(QMAX)
    b = torch.where(b > 0, b, torch.ones_like(b))
    codes = torch.round(w / b[:, None]).to(torch.int8)
    return Int8Weight(torch.ops.onednn.qlinear_prepack(codes, None), b,
                      None if smooth is None else (1 / smooth).contiguous(), torch.zeros(len(b), dtype=torch.long))


def reference_linear(x: Tensor, w8: Int8Weight) -> Tensor:
    """x [..., k] @ w.T under the scheme, in plain torch: the codes of both sides back to fp32, an
    fp32 GEMM, the two scales -> [..., n] fp32. The int32 sums of the kernel are exact; here each
    sum of k products of codes rounds in fp32 once it passes 2^24 (k * 127^2 can)."""
    k = x.shape[-1]
    qx, a = quantize_rows(x.reshape(-1, k).float(), w8.inv_smooth)
    y = (qx.float() @ w8.codes().float().T) * a * w8.scales
    return y.view(*x.shape[:-1], -1)


def _dense(w) -> Tensor:
    return w.dequantize().float() if isinstance(w, QuantizedWeight) else w.float()


def prepare(model, token_ids: Tensor | None = None) -> None:
    """Make the int8 copy of every block's products (once per model; a later call returns at once).

    A forward of `token_ids` [T] (default: the text of `calibrate_on`, else CALIBRATION_TOKENS seeded
    random ids) in fp32 records
    max|x_k| of the inputs of wqkv and w_gate_up (the norms' outputs); the smoothing factors follow
    from it and the weights. Text like the prompts to come calibrates better than random ids (call
    this before the first int8 prompt). A weight loaded as codes (weight_bits=8 or 4) is
    dequantized once here, not per call."""
    if all(_COPIES.get(w) is not None for w in _products(model)):
        return
    if not onednn_int8():
        raise ConfigError("prefill_precision='int8' needs oneDNN's int8 linear (torch.ops.onednn), which this "
                          "torch build lacks: use prefill_precision='bfloat16' or 'float32'")
    amax = {}
    smoothed = {id(w) for w in _norm_fed(model)}
    reference = model.ops

    class Record:  # the model's ops, recording max|x_k| of the smoothed products' inputs
        def __getattr__(self, name):
            return getattr(reference, name)

        def linear(self, x, w, out_dtype=None):
            if id(w) in smoothed:
                m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
                amax[id(w)] = torch.maximum(amax[id(w)], m) if id(w) in amax else m
            return reference.linear(x, w, out_dtype)

    if token_ids is None and model in _CALIBRATION:
        token_ids = _CALIBRATION[model]()
    if token_ids is None:
        g = torch.Generator().manual_seed(0)
        token_ids = torch.randint(0, model.config.vocab_size, (CALIBRATION_TOKENS,), generator=g)
    ids = token_ids.reshape(1, -1)
    T = min(ids.shape[1], model.config.max_seq_len)
    model.ops = Record()
    try:  # in the caller's prompt format: prompt_products calls this before it switches to int8
        with torch.inference_mode():
            model(ids[:, :T].to(model.device), torch.arange(T, device=model.device))
    finally:
        model.ops = reference
    for w in _products(model):
        dense = _dense(w)
        smooth = None
        if id(w) in amax:  # SmoothQuant's factors; a channel never seen (max 0) is left alone
            x_max, w_max = amax[id(w)].clamp_min(1e-5), dense.abs().amax(0).clamp_min(1e-5)
            smooth = x_max ** SMOOTHING_ALPHA / w_max ** (1 - SMOOTHING_ALPHA)
        _COPIES[w] = quantize_weight(dense, smooth)


def nbytes(model) -> int:
    """Bytes held by the int8 copies of a prepared model (0 if none)."""
    return sum(c.nbytes for w in _products(model) if (c := _COPIES.get(w)) is not None)


def _mlp(block, arch: str) -> tuple:
    """A block's MLP weights, (input side, output side): model.GatedMLP's for llama, GeluMLP's for gpt2."""
    return (block.mlp.w_gate_up, block.mlp.w_down) if arch == "llama" else (block.mlp.w_fc, block.mlp.w_proj)


def _norm_fed(model) -> list:
    """The products whose input is a norm's output: the ones smoothing helps."""
    return [w for b in model.blocks for w in (b.attn.wqkv, _mlp(b, model.config.arch)[0])]


def _products(model) -> list:
    """Every block's weights that a prompt multiplies (the head is not among them)."""
    return [w for b in model.blocks for w in (b.attn.wqkv, b.attn.wo, *_mlp(b, model.config.arch))]
