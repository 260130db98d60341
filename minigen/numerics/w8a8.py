"""int8 prompt products (chapter 3): int8 weights times int8 activations, prefill_precision="int8".

Shapes: T rows (a prompt's tokens, over every batch row), n outputs, k inputs (a weight is [n, k]),
m outlier columns of k.

A prompt's products are bound by arithmetic, and a CPU with int8 dot products (x86's AVX512-VNNI and
AVX-VNNI `vpdpbusd`, or AMX-INT8 tiles) multiplies int8 numbers into int32 sums several times faster
than fp32. Both operands become int8 codes, each side with its own scales (W8A8, as SmoothQuant,
Xiao et al. 2023, and llama.cpp's Q8_0 dot products), except m input channels, the outliers, which
stay fp32 in a second, small product (as LLM.int8(), Dettmers et al. 2022, does with the channels it
finds in each batch; here they are fixed per weight):

    y[t, n] = a[t] * b[n] * sum_{k not outlier} qx[t, k] * qw[n, k]     (exact int32 sums)
              + sum_{k outlier} x[t, k] * w[n, k]                         (fp32, m = 32 of 576 or 1,536)
    qx[t, k] = round(x[t, k] / a[t])   a[t] = max_{k not outlier} |x[t, k]| / 127   per row (token)
    qw[n, k] = round(w[n, k] / b[n])   b[n] = max_{k not outlier} |w[n, k]| / 127   per output channel

- Why outliers: a transformer's activations have a few channels far larger than the rest (the
  residual stream's, which RMSNorm keeps, and the MLP's, after SiLU). With one scale per row those
  few would take the row's whole int8 range and round every other channel to a handful of levels.
  Each weight's m input channels with the largest max|x_k| on calibration text stay fp32.
- Activations: one scale per row, computed in every product from that row alone, and the outlier
  columns fixed per weight, so a row of a batch gets the same codes as alone: rows never influence
  each other (a scale or an outlier set found in the batch would make one prompt's numbers depend
  on another's).
- Weights: one scale per output channel, so the GEMM is a plain int8 one (a scale per group along
  k would need one GEMM per group: no fast kernel takes it). The codes are made once per model
  (`prepare`, into the model's own `model.weight_copies`: numerics/copies.py) and kept once,
  blocked for csrc/gemm_s8.c (16 channels x 4 bytes, with each row's code sum): an fp32 model gains
  a quarter of its blocks' weight bytes, and the outlier columns in fp32. The product measured
  fastest here runs them (kernels/int8.py); oneDNN's or torch._int_mm's layout of a weight is made
  the first time that product runs it and kept in its Int8Weight (`layouts`), so only the backend
  in use adds its own copy.
- Calibration: max|x_k| of every product's input, over a forward of the last CALIBRATION_CHARS
  characters of data/english.txt, through the tokenizer `minigen.load` returned with the model (for
  SmolLM2 they lie past the 2,048 tokens that scripts/prefill_speeds.py and the tests score); a model loaded without one calibrates on seeded random ids.
- Measured on SmolLM2 (the dequantized Q4_1 file), this Xeon: the mean KL divergence from fp32's
  next-token distribution over 1,024 tokens was 13e-3 with SmoothQuant's smoothing (alpha 0.5, on
  the norm-fed products) and no outlier columns, 9e-3 of it from w_down's input; 3.4-4.3e-3 with 32
  outlier columns per product and no smoothing; bf16's 0.15e-3. Perplexity over seven slices of
  512-2,048 tokens of data/english.txt: -0.22% to +0.49% (smoothing: up to +1.2%), through
  oneDNN's product; every product computes the same sums within 4e-6, yet on the first 512 tokens C's,
  torch._int_mm's and the reference give +0.61% where oneDNN's gives -0.10% (a last bit moves the next
  layer's codes at rounding boundaries).
- The output head keeps fp32: a prefill needs the last row's logits only (one row, the decode
  step's kernel), and the logits are the most sensitive product (chapter 10). A product without
  an int8 copy runs as it would under "float32".

`reference_linear` is the scheme in plain torch (codes back to floats, an fp32 GEMM); the fast paths
are kernels/int8.py's `int8_linear` backends (our vpdpbusd GEMM in C, oneDNN's int8 GEMM,
torch._int_mm), chosen per call by kernels/dispatch.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .weight_quant import QuantizedWeight

QMAX = 127  # symmetric codes in [-127, 127]: -128 unused, so that -q is a code too
OUTLIER_COLUMNS = 32  # input channels per weight kept fp32 (at most k // 8 of them: a tiny model's k)
CALIBRATION_CHARS = 800  # of data/english.txt, its end: SmolLM2 makes 209 tokens of them
CALIBRATION_TOKENS = 256  # seeded random ids where the model came without a tokenizer


@dataclass(frozen=True)
class Int8Weight:
    """A weight [n, k] as int8 codes with one fp32 scale per output channel, but for its outlier
    input columns, which it keeps in fp32 (none: `outliers` empty and `keep` None)."""
    scales: Tensor  # b [n] fp32
    keep: Tensor | None  # [k] fp32, 1 and 0 at the outliers: multiplies the activations before they are quantized
    outliers: Tensor  # [m] int64: the input channels kept fp32
    outlier_weights: Tensor  # w[:, outliers] [n, m] fp32
    zero_points: Tensor  # [n] int64 zeros: symmetric codes (oneDNN's call asks for them)
    blocked: Tensor  # the codes for csrc/gemm_s8.c: [n64 / 16, k4 / 4, 16, 4] int8 (block_codes)
    code_sums: Tensor  # [n] int32: 128 sum_k qw[n, k], what gemm_s8's activations + 128 add to each sum
    shape: tuple[int, int]  # (n, k) of the weight
    # the codes in another product's layout, made the first time that product runs this weight
    # (kernels/int8.py: "onednn", "int_mm"): a weight whose prompts run another backend keeps none
    layouts: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        keep = 0 if self.keep is None else self.keep.nbytes
        return (self.scales.nbytes + keep + self.outliers.nbytes + self.outlier_weights.nbytes
                + self.zero_points.nbytes + self.blocked.nbytes + self.code_sums.nbytes)

    def codes(self) -> Tensor:
        """qw [n, k] int8, a copy in torch's layout (the reference's and the tests' way to read them)."""
        return unblock_codes(self.blocked, *self.shape)


BLOCK_CHANNELS = 16  # output channels of a block of gemm_s8's codes: one 512-bit load, 16 channels x 4 bytes
PAD_CHANNELS = 64  # n rounded up to this (zero codes), so that a panel of the kernel's never reads past them


def block_codes(codes: Tensor) -> Tensor:
    """qw [n, k] int8 -> [n64 / 16, k4 / 4, 16, 4] (n64, k4: n and k rounded up to 64 and 4, zeros
    there): each 64 bytes are 16 channels' next 4 codes, one vpdpbusd's operand (csrc/gemm_s8.c)."""
    n, k = codes.shape
    n64, k4 = -(-n // PAD_CHANNELS) * PAD_CHANNELS, -(-k // 4) * 4
    padded = torch.zeros(n64, k4, dtype=torch.int8)
    padded[:n, :k] = codes
    return padded.view(n64 // 16, 16, k4 // 4, 4).transpose(1, 2).contiguous()  # [n64/16, k4/4, 16, 4]


def unblock_codes(blocked: Tensor, n: int, k: int) -> Tensor:
    """block_codes undone -> qw [n, k] int8."""
    b16, kq = blocked.shape[:2]
    return blocked.transpose(1, 2).reshape(b16 * 16, kq * 4)[:n, :k].contiguous()


def calibrate_on(model, tokenizer) -> None:
    """Calibrate `model`'s outlier columns, when it is first needed, on the end of data/english.txt through
    `tokenizer` (minigen.load calls this; nothing is tokenized until an int8 prompt runs)."""
    def ids() -> Tensor:
        text = (Path(__file__).resolve().parent.parent / "data" / "english.txt").read_text(encoding="utf-8")
        return tokenizer(text[-CALIBRATION_CHARS:], return_tensors="pt").input_ids[0]
    model.weight_copies.calibration = ids


def onednn_int8() -> bool:
    """Whether this torch has oneDNN's int8 linear (torch.ops.onednn.qlinear_pointwise, x86 builds)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")
    except (AttributeError, RuntimeError):
        return False


def quantize_rows(x: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [T, k] fp32 -> (qx [T, k] int8, a [T, 1] fp32): each row times keep (0 in the outlier
    columns), then scaled by its own max to [-127, 127]. An all-zero row gets scale 1 and codes 0."""
    if keep is not None:
        x = x * keep
    a = x.abs().amax(-1, keepdim=True).div_(QMAX)
    a = torch.where(a > 0, a, torch.ones_like(a))
    return torch.round(x / a).to(torch.int8), a  # |x / a| <= 127: no clamp needed


def quantize_weight(w: Tensor, outliers: Tensor | None = None) -> Int8Weight:
    """w [n, k] (any float dtype) -> its Int8Weight: the columns `outliers` (indices into k) kept
    in fp32, the rest as codes with one scale per output channel."""
    w = w.float()
    outliers = torch.zeros(0, dtype=torch.long) if outliers is None else outliers.long().sort().values
    keep = None
    if len(outliers):
        keep = torch.ones(w.shape[1])
        keep[outliers] = 0
    coded = w if keep is None else w * keep
    b = coded.abs().amax(-1).div_(QMAX)
    b = torch.where(b > 0, b, torch.ones_like(b))
    codes = torch.round(coded / b[:, None]).to(torch.int8)
    return Int8Weight(b, keep, outliers, w[:, outliers].contiguous(), torch.zeros(len(b), dtype=torch.long),
                      block_codes(codes), codes.sum(1, dtype=torch.int32) * 128, tuple(w.shape))


def reference_linear(x: Tensor, w8: Int8Weight) -> Tensor:
    """x [..., k] @ w.T under the scheme, in plain torch: the codes of both sides back to fp32, an
    fp32 GEMM, the two scales -> [..., n] fp32. The int32 sums of the kernel are exact; here each
    sum of k products of codes rounds in fp32 once it passes 2^24 (k * 127^2 can). The outlier
    columns: x's in fp32 against the weight's."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    qx, a = quantize_rows(x2, w8.keep)
    y = (qx.float() @ w8.codes().float().T) * a * w8.scales
    if len(w8.outliers):
        y = y + x2[:, w8.outliers] @ w8.outlier_weights.T
    return y.view(*x.shape[:-1], -1)


def _dense(w) -> Tensor:
    return w.dequantize().float() if isinstance(w, QuantizedWeight) else w.float()


def prepare(model, token_ids: Tensor | None = None) -> None:
    """Make the int8 copy of every block's products into model.weight_copies (once per model; a later
    call returns at once).

    A forward of `token_ids` [T] (default: the text of `calibrate_on`, else CALIBRATION_TOKENS seeded
    random ids) in fp32 records max|x_k| of every product's input; each weight's outlier columns
    are its input's largest. Text like the prompts to come calibrates better than random ids (call
    this before the first int8 prompt). A weight loaded as codes (weight_bits=8 or 4) is
    dequantized once here, not per call."""
    copies = model.weight_copies
    if all(copies.int8_of(w) is not None for w in _products(model)):
        return
    amax = {}
    products = {id(w) for w in _products(model)}
    reference = model.ops

    class Record:  # the model's ops, recording max|x_k| of the products' inputs
        def __getattr__(self, name):
            return getattr(reference, name)

        def linear(self, x, w, out_dtype=None):
            if id(w) in products:
                m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
                amax[id(w)] = torch.maximum(amax[id(w)], m) if id(w) in amax else m
            return reference.linear(x, w, out_dtype)

    if token_ids is None and copies.calibration is not None:
        token_ids = copies.calibration()
    if token_ids is None:
        g = torch.Generator().manual_seed(0)
        token_ids = torch.randint(0, model.config.vocab_size, (CALIBRATION_TOKENS,), generator=g)
    ids = token_ids.reshape(1, -1)
    T = min(ids.shape[1], model.config.max_seq_len)
    with torch.inference_mode():  # in model.ops's prompt format: fp32
        model(ids[:, :T].to(model.device), torch.arange(T, device=model.device), ops=Record())
    for w in _products(model):
        m = min(OUTLIER_COLUMNS, w.shape[1] // 8)
        copies.int8[w] = quantize_weight(_dense(w), amax[id(w)].topk(m).indices if m and id(w) in amax else None)


def nbytes(model) -> int:
    """Bytes held by the int8 copies of a prepared model (0 if none)."""
    return sum(c.nbytes for w in _products(model) if (c := model.weight_copies.int8_of(w)) is not None)


def _mlp(block, arch: str) -> tuple:
    """A block's MLP weights, (input side, output side): model.GatedMLP's (llama, gemma3), GeluMLP's (gpt2)."""
    return (block.mlp.w_fc, block.mlp.w_proj) if arch == "gpt2" else (block.mlp.w_gate_up, block.mlp.w_down)


def _products(model) -> list:
    """Every block's weights that a prompt multiplies (the head is not among them)."""
    return [w for b in model.blocks for w in (b.attn.wqkv, b.attn.wo, *_mlp(b, model.config.arch))]
