"""oneDNN's per-shape caches in a long-running server (kernels/cpu.py, bound_onednn_caches): every new
row count of a prompt's fp32 GEMM (torch.ops.mkldnn._linear_pointwise) keeps a primitive in oneDNN's
cache and in ideep's, up to 1024 each by default, so `minigen serve`'s RSS grew with each new
prompt-batch shape (~500 MiB with SmolLM2-135M once full). serve() caps both before any oneDNN call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minigen.kernels import cpu
from minigen.serving import server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# In a fresh process (each library reads its capacity once): RSS growth, in MiB, over 200 row counts
# of a prompt's products with SmolLM2's MLP weight, after or without bound_onednn_caches().
SCRIPT = """
import ctypes, sys, torch
from minigen.kernels import cpu
if sys.argv[1] == "bound":
    cpu.bound_onednn_caches()
def rss():  # after malloc_trim: glibc's free pages are not what this measures
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
w = torch.randn(1536, 576)
x = torch.randn(2048, 576)
rows = range(18, 18 + 200 * 5, 5)
for m in (17, rows[-1] + 1):  # the libraries loaded, and the allocator warm at the largest product
    cpu.linear(x[:m], w)
before = rss()
for m in rows:
    assert cpu.linear(x[:m], w) is not None
print(rss() - before)
"""


def growth_mib(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not (sys.platform.startswith("linux") and cpu.linear(torch.ones(17, 8), torch.ones(8, 8)) is not None),
                    reason="needs oneDNN's fp32 GEMM and /proc")
def test_bounded_caches_keep_rss_flat_over_new_row_counts():
    bounded, default = growth_mib("bound"), growth_mib("default")
    # measured: ~125 MiB by default (~0.6 MiB a row count), ~30 MiB bounded (64 entries)
    assert bounded < 48, (bounded, default)
    assert default > bounded + 48, (bounded, default)  # the default caches do grow: the test measures them


def test_serve_bounds_the_caches_before_it_loads_the_model(monkeypatch):
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def load(*args, **kwargs):
        seen.update({k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")})
        raise RuntimeError("stop here")
    monkeypatch.setattr(server, "load", load)
    with pytest.raises(RuntimeError, match="stop here"):
        server.serve("smollm2-135m", None)
    assert seen == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(cpu.ONEDNN_CACHE_CAPACITY),
                    "LRU_CACHE_CAPACITY": str(cpu.ONEDNN_CACHE_CAPACITY)}


def test_a_capacity_the_user_sets_is_kept(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    cpu.bound_onednn_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(cpu.ONEDNN_CACHE_CAPACITY)
