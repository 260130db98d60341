"""Tensor parallelism (issue 45, parallel/tensor.py and parallel/group.py): a model split over 2 or 3
gloo ranks on 127.0.0.1 decodes the same greedy tokens as one process, for every family.

Each tiny model has 12 query heads, 6 key/value heads and an MLP of 96: all divide by 2 and by 3, and
both splits keep grouped-query attention (2 query heads a key/value head on every rank). Ranks are
spawned processes (tests/tp_workers.py runs in them) with one thread each; a test that starts ranks
costs a few seconds of imports, so each starts one group.
"""

from __future__ import annotations

import time

import pytest
import torch

import minigen
import tp_workers
from conftest import tiny_hf
from minigen.checkpoints.hf_config import config_from_hf
from minigen.checkpoints.model_config import ModelConfig
from minigen.errors import ConfigError, RankError
from minigen.kernels import build
from minigen.loading import build_model
from minigen.parallel import check_tp_size, local_config, run_ranks, shard_model, working_sizes
from minigen.parallel.tensor import head_rows
from minigen.run_rules import Run, run_refusals
from test_gemma3 import tiny_gemma3

pytestmark = pytest.mark.usefixtures("one_thread")

SPLITTABLE = dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=6, intermediate_size=96)
PROMPT, NEW = 9, 16
GROUP_TIMEOUT = 60  # seconds a group may take; a tiny model's takes about 4 (4 models: about 8)


def tiny(kind: str):
    """(ModelConfig, HF state dict) of a tiny random model of `kind` whose heads and MLP divide by 2 and 3."""
    if kind == "gemma3":  # six layers, every third full, a window of 8: the prompt and the new tokens pass it
        hf = tiny_gemma3(**SPLITTABLE, head_dim=4)
    else:
        hf = tiny_hf(kind, **SPLITTABLE)
    return config_from_hf(hf.config.to_dict()), {k: v.clone() for k, v in hf.state_dict().items()}


def one_process(cfg: ModelConfig, state: dict, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The whole model in this process, on torch's own ops as the ranks run: (tokens, prompt logits, cache bytes)."""
    with build.enabled(False):
        model = build_model(cfg, state, copy=True)
        out = minigen.generate(model, ids, max_new_tokens=new, do_sample=False)
        with torch.inference_mode():
            logits = model(ids, torch.arange(ids.shape[1]))
    return out.tokens, logits, out.stats.kv_cache_bytes


def prompt(seed: int = 1, length: int = PROMPT, vocab: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the split itself, in one process
SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                      hidden_dim=1536, max_seq_len=8192)


@pytest.mark.parametrize("tp_size, broken", [(2, "3 key/value heads"), (4, "9 query heads and 3 key/value heads"),
                                             (9, "3 key/value heads")])
def test_a_size_that_does_not_divide_is_refused_naming_the_sizes_that_work(tp_size, broken):
    with pytest.raises(ConfigError, match=f"tp_size={tp_size} does not divide") as e:
        check_tp_size(SMOLLM2, tp_size)
    assert broken in str(e.value) and "tp_size that work: 1, 3" in str(e.value)
    assert working_sizes(SMOLLM2) == [1, 3]
    check_tp_size(SMOLLM2, 3)  # SmolLM2 splits over 3: 3 query heads, 1 key/value head, an MLP of 512 a rank


def test_load_refuses_a_size_before_reading_the_weights(smollm2):
    with pytest.raises(ConfigError, match="tp_size that work: 1, 3"):
        minigen.load("smollm2-135m", tp_size=2)


def test_load_outside_a_process_group_is_refused_with_the_fix(smollm2):
    with pytest.raises(ConfigError, match="needs a torch.distributed process group"):
        minigen.load("smollm2-135m", tp_size=3)


def test_gpt2_and_bad_sizes_are_refused():
    gpt2 = ModelConfig(arch="gpt2", vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8,
                       hidden_dim=128, max_seq_len=64)
    check_tp_size(gpt2, 1)  # the whole model always runs
    with pytest.raises(ConfigError, match="not arch='gpt2'"):
        check_tp_size(gpt2, 2)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="positive int"):
            check_tp_size(SMOLLM2, bad)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_each_rank_keeps_query_heads_that_read_its_own_key_value_heads(tp_size):
    """Grouped-query attention: query head h reads key/value head h // (H / Hkv). The rows a rank keeps
    must give its i-th local query head the global head whose key/value head is its local one."""
    cfg = ModelConfig(arch="llama", vocab_size=97, dim=48, n_layers=1, n_heads=12, n_kv_heads=6, head_dim=4,
                      hidden_dim=96, max_seq_len=64)
    local, Dh = local_config(cfg, tp_size), cfg.head_dim
    H, Hkv, group = cfg.n_heads, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    assert (local.n_heads, local.n_kv_heads, local.hidden_dim, local.tp_size) == (12 // tp_size, 6 // tp_size,
                                                                                   96 // tp_size, tp_size)
    every = []
    for rank in range(tp_size):
        rows = head_rows(cfg, rank, tp_size)
        q_heads = rows[: local.n_heads * Dh: Dh] // Dh  # the global head of each local query head
        k_heads = (rows[local.n_heads * Dh: (local.n_heads + local.n_kv_heads) * Dh: Dh] - H * Dh) // Dh
        v_heads = (rows[(local.n_heads + local.n_kv_heads) * Dh:: Dh] - (H + Hkv) * Dh) // Dh
        assert torch.equal(k_heads, v_heads)
        for i, h in enumerate(q_heads.tolist()):  # local query head i reads local key/value head i // group
            assert h // group == k_heads[i // group]
        every += rows.tolist()
    assert sorted(every) == list(range((H + 2 * Hkv) * Dh))  # the ranks hold every row once


# ---------------------------------------------------------------- ranks against one process
KINDS = ("llama", "qwen2", "mistral", "gemma3")


@pytest.fixture(scope="module")
def split_runs() -> dict:
    """{(kind, tp_size): (one process's (tokens, logits, cache bytes), each rank's greedy answer)}: every
    family's tiny model at tp_size 2 and 3, one group start per tp_size (starting ranks costs seconds)."""
    models = {kind: tiny(kind) for kind in KINDS}
    ids = prompt()
    cases = [(cfg, state, ids, NEW) for cfg, state in models.values()]
    runs = {}
    for tp_size in (2, 3):
        ranks = run_ranks(tp_workers.greedy_each, tp_size, args=(cases,), timeout=GROUP_TIMEOUT)
        for i, kind in enumerate(KINDS):
            runs[kind, tp_size] = (one_process(*models[kind], ids, NEW), [answers[i] for answers in ranks])
    return runs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp_size", [2, 3])
def test_greedy_tokens_equal_one_process(split_runs, kind, tp_size):
    cfg, _ = tiny(kind)
    (want, want_logits, want_kv), ranks = split_runs[kind, tp_size]
    for rank in ranks:
        assert torch.equal(rank["tokens"], want)
        # every rank holds only its own key/value heads: 1/tp_size of the cache (Gemma's hybrid cache also
        # keeps the position of each slot of its sliding layers, a few bytes that every rank holds whole)
        assert rank["kv_heads"] == cfg.n_kv_heads // tp_size
        assert 0 <= rank["kv_bytes"] * tp_size - want_kv <= 0.01 * want_kv, (rank["kv_bytes"], want_kv)
        # Logits: each sublayer's output is the same products summed in another order (tp_size partial
        # sums, then their sum: test_row_parallel_sum_is_within_the_reduction_order_bound). Over a tiny
        # model's 2-6 layers of O(1) activations the differences measured ~1e-6; 1e-4 of the largest
        # logit leaves a margin of ~100x and would still catch a head or slice off by one (errors O(1)).
        scale = want_logits.abs().max()
        assert (rank["logits"] - want_logits).abs().max() <= 1e-4 * scale
        assert torch.equal(rank["logits"], ranks[0]["logits"])  # the replicated head: the same bits everywhere
        assert f"one of {tp_size} ranks" in rank["plan"] and f"{12 // tp_size} of 12 query heads" in rank["plan"]


def test_sampled_tokens_with_a_seed_are_the_same_on_every_rank_and_as_one_process():
    """Every rank samples its own copy of the (bitwise equal) logits with generators seeded alike. Against
    one process: probabilities ~1e-6 apart flip a draw only when its uniform number falls within ~1e-6 of a
    boundary, about 16 x 1e-6 for 16 tokens; the seed is fixed, so the test is deterministic."""
    cfg, state = tiny("llama")
    ids, settings = prompt(), dict(do_sample=True, temperature=1.0, seed=7)
    with build.enabled(False):
        want = minigen.generate(build_model(cfg, state, copy=True), ids, max_new_tokens=NEW, **settings).tokens
    ranks = run_ranks(tp_workers.greedy, 2, args=(cfg, state, ids, NEW, settings), timeout=GROUP_TIMEOUT)
    for rank in ranks:
        assert torch.equal(rank["tokens"], want)


def test_sampling_without_a_seed_is_refused_on_a_shard():
    cfg, state = tiny("llama")
    model = shard_model(build_model(cfg, state, copy=True), 0, 2)  # no forward runs: no group needed
    with pytest.raises(ConfigError, match="seed=None on a tensor-parallel model.*Fix: set seed"):
        minigen.make_plan(model, minigen.GenerationConfig(do_sample=True))


@pytest.mark.parametrize("tp_size", [2, 3])
def test_row_parallel_sum_is_within_the_reduction_order_bound(tp_size):
    """o and down are row-parallel: y = sum_j h_j W_ij over n = F (or H Dh) products. One process sums
    them in one order, the ranks in tp_size partial sums and then over the ranks: two orders of the
    same n products. In fp32 (unit roundoff u = 2^-24) any order is within gamma_n sum_j |h_j W_ij| of
    the exact sum, gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability, 3.1), so the two differ
    by at most 2 gamma_n sum_j |h_j W_ij|: the bound, elementwise."""
    rows, dim, width = 4, 48, 1536  # SmolLM2's MLP width
    got = run_ranks(tp_workers.down_sums, tp_size, args=(0, rows, dim, width), timeout=GROUP_TIMEOUT)
    u = 2.0 ** -24
    gamma = width * u / (1 - width * u)
    for rank in got:
        bound = 2 * gamma * rank["abs"]
        assert ((rank["split"] - rank["whole"]).abs() <= bound).all()
        assert torch.equal(rank["split"], got[0]["split"])  # the all-reduce gives every rank the same sum


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_smollm2_at_tp3_decodes_32_tokens_as_one_process(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with build.enabled(False):
        want = minigen.generate(model, ids, max_new_tokens=32, do_sample=False, stop_token_ids=()).tokens
    assert want.shape[1] == ids.shape[1] + 32  # no stop token: all 32 new tokens compared
    got = run_ranks(tp_workers.smollm2, 3, args=(ids, 32), timeout=180)
    for tokens in got:
        assert torch.equal(tokens, want)


def test_fused_compiled_and_heavy_hitter_runs_are_refused_with_the_reason():
    cfg, state = tiny("llama")
    model = shard_model(build_model(cfg, state, copy=True), 0, 2)  # no forward runs: no group needed
    for key in ("fused_decode", "compile", "cuda_graphs"):
        with pytest.raises(ConfigError, match=f"{key}=True .*tensor-parallel model \\(tp_size=2\\)"):
            minigen.make_plan(model, minigen.GenerationConfig(**{key: True}))
    with pytest.raises(ConfigError, match="kv_budget=8 .*sees only its own heads"):
        minigen.make_plan(model, minigen.GenerationConfig(kv_budget=8))
    refusals = run_refusals(minigen.GenerationConfig(), Run(tp_size=2), "fused_decode")
    assert refusals and "one C call" in refusals[0]  # so "auto" never picks the fused step for a shard
    with build.enabled(False):  # (no measurement of the kernels at the shard's shapes)
        assert minigen.make_plan(model, minigen.GenerationConfig()).step.name == "eager"


# ---------------------------------------------------------------- failures end, with a clear error
def test_a_rank_killed_mid_generation_fails_the_group_within_its_timeout():
    cfg, state = tiny("llama")
    start = time.monotonic()
    with pytest.raises(RankError) as e:  # rank 1 dies in its 5th forward: the 4th decode step
        run_ranks(tp_workers.dies_mid_generation, 2, args=(cfg, state, prompt(), NEW, 1, 5), timeout=GROUP_TIMEOUT)
    took = time.monotonic() - start
    message = str(e.value)
    assert message.startswith("rank 1 of 2 failed: the process killed by SIGKILL without an answer"), message
    assert "rank 0:" in message  # the survivor said why it stopped (gloo: the connection closed)
    assert "every rank of the group was stopped" in message
    assert took < GROUP_TIMEOUT, took


def test_a_rank_that_raises_names_its_error_and_the_others_stop():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of 2 failed: ValueError: rank 1 found something wrong"):
        run_ranks(tp_workers.raises, 2, timeout=GROUP_TIMEOUT, grace=2)
    assert time.monotonic() - start < GROUP_TIMEOUT


def test_a_rank_that_hangs_fails_the_group_after_its_timeout_never_a_hang():
    """Rank 1 never reaches the barrier: rank 0's collective times out (torch.distributed's timeout, the
    group's), or the parent's deadline passes first; either way both are stopped within timeout + grace."""
    start = time.monotonic()
    with pytest.raises(RankError, match="every rank of the group was stopped"):
        run_ranks(tp_workers.hangs, 2, timeout=8, grace=2)
    assert time.monotonic() - start < 8 + 2 + 5  # + 5: stopping and reaping the processes
