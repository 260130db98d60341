"""Every cache kind and step beside tensor parallelism: what a shard runs gives one process's tokens under
the same config (exact kinds equal the plain cache's too), and what it refuses says so (issue 45).

One group of 2 ranks runs every config in turn (a group costs seconds to start). Each rank holds half the
key/value heads, so a cache of any kind holds that half: paged blocks, the offload tier's layers, the
quantized groups (per head), the window's ring, the sparse selection (per head and query)."""

from __future__ import annotations

import pytest
import torch

import minigen
import tp_cache_workers
from conftest import tiny_hf
from minigen import GenerationConfig
from minigen.checkpoints.hf_config import config_from_hf
from minigen.kernels import build
from minigen.loading import build_model
from minigen.parallel import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 12
EXACT = {"paged": {"cache_chunk_size": 4}, "offloaded": {"prefetch_depth": 0},
         "prompt in pieces": {"prefill_chunk_size": 3}, "speculative ngram": {"speculative_method": "ngram"},
         "no cache": {"use_cache": False}}
LOSSY = {"quantized 8-bit": {"quant_bits": 8, "quant_group_size": 4}, "window": {"window_size": 6, "sink_tokens": 2},
         "sparse": {"sparse_top_k": 4}}
REFUSED = {"heavy hitters": ({"kv_budget": 8}, "kv_budget=8")}


@pytest.fixture(scope="module")
def runs():
    hf = tiny_hf("llama", hidden_size=48, num_attention_heads=12, num_key_value_heads=6, intermediate_size=96)
    cfg, state = config_from_hf(hf.config.to_dict()), {k: v.clone() for k, v in hf.state_dict().items()}
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(4))
    every = {**EXACT, **LOSSY, **{k: v for k, (v, _) in REFUSED.items()}}
    configs = [dict(max_new_tokens=NEW, **fields) for fields in every.values()]
    ranks = run_ranks(tp_cache_workers.greedy_under, 2, args=(cfg, state, ids, configs), timeout=120)
    with build.enabled(False):
        model = build_model(cfg, state)
        alone = {name: minigen.generate(model, ids, GenerationConfig(**c)).tokens for name, c in zip(every, configs)}
        plain = minigen.generate(model, ids, max_new_tokens=NEW).tokens
    return {name: ([r[i] for r in ranks], alone[name]) for i, name in enumerate(every)}, plain


@pytest.mark.parametrize("name", [*EXACT, *LOSSY])
def test_a_cache_kind_on_a_shard_writes_one_process_tokens(runs, name):
    results, plain = runs
    ranks, alone = results[name]
    for tokens in ranks:
        assert isinstance(tokens, torch.Tensor), tokens  # not refused
        assert torch.equal(tokens, alone), name
    if name in EXACT:
        assert torch.equal(alone, plain), name


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_a_shard_cannot_run_is_refused_naming_the_setting(runs, name):
    results, _ = runs
    for said in results[name][0]:
        assert isinstance(said, str) and REFUSED[name][1] in said and "tp_size=2" in said, said
