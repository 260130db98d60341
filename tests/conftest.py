"""Shared fixtures: the real SmolLM2-135M model and a passage of real English text.

Both are session-scoped: loading SmolLM2 takes a few seconds, so every test file that needs it
shares one copy. Tests must not modify the model's weights.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import uvicorn

import minigen
from minigen.errors import ModelLoadError

ENGLISH_TXT = Path(minigen.__file__).resolve().parent / "data" / "english.txt"


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct in fp32; skips when the default is not installed."""
    try:
        model, tokenizer = minigen.load("smollm2-135m")
    except ModelLoadError as e:
        pytest.skip(f"SmolLM2 is not available: {e}")
    return model, tokenizer


@pytest.fixture(scope="session")
def english_text() -> str:
    """About 1,600 words of public-domain English prose (Pride and Prejudice, chapters 1-2)."""
    return ENGLISH_TXT.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def english_text_ids(smollm2, english_text) -> torch.Tensor:
    """The English passage tokenized by SmolLM2's tokenizer: LongTensor [T], T about 2,000."""
    _, tokenizer = smollm2
    ids = tokenizer(english_text, return_tensors="pt").input_ids[0]
    return ids.long()


# ---------------------------------------------------------------- tiny random transformers models
TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_hf(kind: str = "llama", seed: int = 0, **overrides):
    """A seeded, randomly initialized fp32 `transformers` model small enough to run in milliseconds.

    kind: "llama" (grouped-query: 4 heads, 2 KV heads, untied head), "qwen2" (q/k/v biases),
    "gpt2", or "mistral". Weights are drawn wider than transformers' own init (std 0.02) so that
    logits spread over several units: greedy ties, which would make token comparisons flaky,
    become vanishingly unlikely, and every bias and norm weight is nonzero so a dropped one shows.
    """
    import transformers as tf
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                            bos_token_id=None, eos_token_id=None, **overrides)
        cls = tf.GPT2LMHeadModel
    else:
        cfg_cls, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                        "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[kind]
        kw = dict(TINY, tie_word_embeddings=False)
        kw.update(overrides)
        cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = cls(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name or "ln_" in name:  # norm weights near 1, norm biases near 0
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens unless told otherwise
    hf.generation_config.pad_token_id = 0
    return hf


@pytest.fixture(scope="session")
def tiny_llama():
    """(hf_model, minigen_model): a tiny random Llama with grouped-query attention, fp32."""
    hf = tiny_hf("llama")
    return hf, minigen.from_hf(hf)


@pytest.fixture(scope="module")
def one_thread():
    """Run a test module with one intra-op thread, then restore the count.

    Tiny models do microseconds of work per op; with two threads on a busy two-core machine,
    OpenMP's hand-offs cost far more than the work (measured: 7 s instead of 0.12 s for 20 tokens
    of a 2-layer model; SmolLM2's 64-token forward: 15 s instead of 1 s under load). Use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`; being module-scoped and listed first,
    it is set up before the module's own fixtures.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skip them with a notice on a CPU-only machine."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.py on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------- issue 25, items 10-12 (files)
@pytest.fixture
def files_tiny_cache(tmp_path, monkeypatch):
    """MINIGEN_CACHE in tmp_path holding a tiny Llama converted as the default model (with its
    digest, as `prepare` writes it), and a `prepare` whose conversion writes that tiny model again
    instead of reading the bundled GGUF -> (cache, weights, conversions: the folders converted since)."""
    from minigen import loading
    from test_loading import save_tiny_tokenizer
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("MINIGEN_CACHE", str(cache))
    hf = tiny_hf("llama")
    conversions = []

    def convert(gguf, folder):  # loading._convert's writing half, on the tiny model
        conversions.append(folder)
        loading.write_converted(folder, hf.config.to_dict(), hf.state_dict(), save_tiny_tokenizer)
    monkeypatch.setattr(loading, "_convert", convert)
    monkeypatch.setattr(loading, "default_gguf_path", lambda: tmp_path / "bundled.gguf")  # never read
    convert(None, cache / loading.DEFAULT_MODEL)
    conversions.clear()
    return SimpleNamespace(cache=cache, weights=cache / loading.DEFAULT_MODEL / "model.safetensors",
                           conversions=conversions)


@pytest.fixture(scope="session")
def files_built_kernel(tmp_path_factory):
    """A kernels folder holding the C kernel built by this minigen, with its digest (built in a
    subprocess into its own cache: ~30 s on two busy cores) -> the folder."""
    import subprocess
    import sys
    from pathlib import Path
    import minigen
    cache = tmp_path_factory.mktemp("files-kernel")
    env = {**os.environ, "MINIGEN_CACHE": str(cache), "PYTHONPATH": str(Path(minigen.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", "from minigen.kernels import build; print(build.status())"],
                          env=env, capture_output=True, text=True, timeout=600)
    if not done.stdout.startswith("built"):
        pytest.skip(f"the C kernel does not build here: {done.stdout}{done.stderr[-300:]}")
    return cache / "kernels"


# ---------------------------------------------------------------- fast paths measured here
def skip_where_aside(path: str, model=None) -> None:
    """Skip the calling test where the fast path `path` stands aside on this machine (kernels/fastpaths.py:
    it measured slower than its reference), naming the ratio: a test of what "auto" runs has nothing to
    check there, and a slow path must not eat CI's time."""
    from minigen.kernels import fastpaths, probes
    from minigen.steps import choose, fused
    paths = (choose.measurements(model) if model is not None
             else fastpaths.measured(probes.Shapes(**probes.FLOOR), probes.PROBES + fused.PROBES))
    m = paths.best_int8() if path == "int8" else paths.get(path)
    if path == "int8" and m is None:
        pytest.skip("no int8 prompt product runs here")
    if m is not None and m.stands_aside:
        pytest.skip(f"{m.fast} stands aside on this machine: {m.ratio:.2f}x its reference ({m.reference}), "
                    f"measured by minigen's kernels/fastpaths.py ({m.path})")


# ---------------------------------------------------------------- a server for the serving tests
def free_port() -> int:
    """A port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """An ASGI app (minigen serve's make_app) served by uvicorn in a daemon thread on 127.0.0.1 at a
    free port, started before the constructor returns (30 s at most); `stop()` ends it."""

    def __init__(self, app, engine=None, async_engine=None):
        self.app, self.engine, self.async_engine = app, engine, async_engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
