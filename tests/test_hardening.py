"""Issue 25's hardening, one case per reproducer: what hostile input found, and what it gets now.

Each `@case` here is a row of docs/bad_inputs.md, run by `test_row` in tests/test_bad_inputs.py
(which imports this module), exactly as that module's own cases are: an error row must raise its
named `MinigenError` with the quoted text, a behaviour row asserts the behaviour itself. Case
functions take pytest fixtures by name (tiny_model, tmp_path, monkeypatch, ...). The tests below
the cases (the Engine's property tests) run here.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from test_bad_inputs import case
from minigen.caches.quantized import QuantizedKVCache  # 14: the 4-bit cache's scales

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- 1, 2: sampled rows and tiny temperatures


# ---------------------------------------------------------------- 3, 4: the Engine's requests and sizes


# ---------------------------------------------------------------- 4-9: config, CLI integers, sizes, argument types


# ---------------------------------------------------------------- 10-12: output files and what is cached


# ---------------------------------------------------------------- 13, 15: interrupts and the profiler's sum


# ---------------------------------------------------------------- 14: the 4-bit cache's scales
@case("cache4-bytes")
def _():
    # An fp32 model, head dim 32, 4,096 tokens, 4-bit codes in groups of 32, a 32-token fp32 window.
    # Per quantized token, K and V each hold 32 / 2 = 16 bytes of codes and 4 of scale and zero (a
    # 2-byte pair per 32 channels for values, per channel per 32 tokens for keys: 32 x 4 / 32), 40
    # bytes for both; each of the window's 32 tokens holds 2 x 32 x 4 = 256. Total: 4,064 x 40 +
    # 32 x 256 = 170,752 bytes against fp16's 4,096 x 2 x 32 x 2 = 524,288: 3.07x smaller (fp32
    # scales and zeros gave 4,064 x 48 + 8,192 = 203,264: 2.58x).
    cache = QuantizedKVCache(1, 1, 1, 4096, 32, bits=4, group_size=32, residual=32, dtype=torch.float32,
                             device="meta")  # one layer, one head; sizes only
    assert cache.k.scales.dtype == cache.k.zeros.dtype == cache.v.scales.dtype == torch.bfloat16
    assert cache.nbytes == 4064 * 40 + 32 * 256 == 170_752
    assert 4096 * 2 * 32 * 2 / cache.nbytes > 3.07


# ---------------------------------------------------------------- the Engine's API, property tests (hypothesis)
