"""Pipeline parallelism (issue 45, parallel/pipeline.py): a model's layers split over 2 or 3 gloo ranks on
127.0.0.1, its batch in micro-batches, decodes the same tokens as one process, greedy and sampled.

Each tiny model has 6 layers (2 stages of 3, or 3 of 2). Ranks are spawned processes (tests/pp_workers.py
runs in them) with one thread each; a group costs a few seconds of imports, so each test starts one
group and runs every setting in it.

Logits: a stage runs exactly the ops one process runs on the same rows, in the same order (Model.forward
is embed_tokens, run_blocks, logits_of), so with one micro-batch the logits are equal bit for bit. With
m > 1 a product runs on b = B/m rows instead of B, and a matrix product blocks (and so sums, and rounds)
another row count in another order: there they differ by a few ulps, measured at most 6.2e-6 on these
models (logits of a few units, whose ulp is 2.4e-7 to 1.9e-6), and are compared within LOGITS_ATOL.
"""

from __future__ import annotations

import time

import pytest
import torch

import minigen
import pp_workers
from conftest import tiny_hf
from minigen.caches.contiguous import KVCache
from minigen.checkpoints.hf_config import config_from_hf
from minigen.errors import ConfigError, RankError
from minigen.kernels import build
from minigen.loading import build_model
from minigen.parallel import (bubble, check_stages, make_stage, pipeline_generate, run_ranks, stage_layers,
                              stage_of)
from minigen.parallel.pipeline import micro_batch_rows
from test_gemma3 import tiny_gemma3

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, BATCH, PROMPT, NEW = 6, 4, 9, 16
GROUP_TIMEOUT = 60  # seconds a group may take; a tiny model's takes about 6
LOGITS_ATOL = 5e-5  # m > 1: about 8x the largest difference measured (module docstring)
GREEDY = dict(max_new_tokens=NEW)
SAMPLED = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=40, top_p=0.95, seed=7)
# (micro-batches, settings): m = 1 (the whole batch), 2, and m = B (one row each); 3 splits 4 rows unevenly
SETTINGS = [(1, GREEDY), (2, GREEDY), (4, GREEDY), (1, SAMPLED), (3, SAMPLED)]


def tiny(kind: str, seed: int = 0):
    """(ModelConfig, HF state dict) of a tiny random 6-layer model of `kind`."""
    hf = tiny_gemma3(seed) if kind == "gemma3" else tiny_hf(kind, seed, num_hidden_layers=LAYERS)
    return config_from_hf(hf.config.to_dict()), {k: v.clone() for k, v in hf.state_dict().items()}


def prompts(seed: int = 1, rows: int = BATCH, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, 97, (rows, length), generator=torch.Generator().manual_seed(seed))


def one_process(source: tuple, ids: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model in this process, on torch's own ops as the ranks run: (generate's tokens [B, T+n],
    the logits [B, n, V] each new token was sampled from, recomputed the obvious way: the prompt into a
    cache, then each new token at its position)."""
    T = ids.shape[1]
    with build.enabled(False), torch.inference_mode():
        model = build_model(*source, copy=True)
        tokens = minigen.generate(model, ids, **config).tokens
        cache = KVCache.for_model(model, ids.shape[0], tokens.shape[1])
        logits = [model(ids, torch.arange(T), cache, last_only=True)[:, -1]]
        for pos in range(T, tokens.shape[1] - 1):
            logits.append(model(tokens[:, pos:pos + 1], torch.tensor([pos]), cache)[:, -1])
    return tokens, torch.stack(logits, dim=1)


def check_runs(answers: list[list[dict]], sources: list[tuple], ids: torch.Tensor) -> None:
    """Every stage's tokens equal one process's for every source and setting; the last stage's logits
    equal its logits (bit for bit with one micro-batch)."""
    n_stages = len(answers)
    for k, (source, (m, config)) in enumerate((s, setting) for s in sources for setting in SETTINGS):
        want, want_logits = one_process(source, ids, config)
        for stage, answer in enumerate(answers):
            got = answer[k]
            assert torch.equal(got["tokens"], want), f"stage {stage}, m={m}, {config}"
            assert got["layers"] == (stage * LAYERS // n_stages, (stage + 1) * LAYERS // n_stages)
        logits = answers[-1][k]["logits"]
        if m == 1:
            assert torch.equal(logits, want_logits), f"m=1, {config}: not bit for bit"
        else:
            torch.testing.assert_close(logits, want_logits, rtol=0, atol=LOGITS_ATOL)


# ---------------------------------------------------------------- the split, in one process
def test_stages_split_the_layers_evenly_or_are_refused_naming_the_sizes():
    assert [stage_layers(30, r, 3) for r in range(3)] == [range(0, 10), range(10, 20), range(20, 30)]
    with pytest.raises(ConfigError, match="n_stages=4 does not divide this model's 30 layers.*1, 2, 3, 5, 6, 10, 15, 30"):
        check_stages(30, 4)
    with pytest.raises(ConfigError, match="n_stages=7 does not divide this model's 6 layers"):
        check_stages(6, 7)  # more stages than layers
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="positive int"):
            check_stages(6, bad)
    assert micro_batch_rows(5, 2) == [slice(0, 3), slice(3, 5)]
    with pytest.raises(ConfigError, match="a batch of 4 rows splits into 1 to 4 micro-batches"):
        micro_batch_rows(4, 5)


def test_a_stage_holds_its_layers_and_their_cache_only():
    source = tiny("llama")
    whole = build_model(*source, copy=True)
    stage = make_stage(build_model(*source, copy=True), 1, 3)  # layers 2 and 3
    model = stage.model
    assert stage.layers == range(2, 4) and model.config.n_layers == 2 and len(model.blocks) == 2
    assert [block.attn.layer for block in model.blocks] == [0, 1]  # the cache's layers 0 and 1
    assert torch.equal(model.blocks[0].attn.wqkv, whole.blocks[2].attn.wqkv)
    assert model.embed.numel() == 0 and model.lm_head.numel() == 0  # a middle stage neither embeds nor samples
    cache, whole_cache = KVCache.for_model(model, 4, 32), KVCache.for_model(whole, 4, 32)
    assert cache.nbytes * 3 == whole_cache.nbytes


def test_one_stage_is_generate_for_any_micro_batches():
    """N = 1 needs no group: the whole model, its batch in micro-batches, in this process."""
    source, ids = tiny("llama"), prompts()
    for m, config in SETTINGS:
        want, want_logits = one_process(source, ids, config)
        with build.enabled(False):
            out = pipeline_generate(make_stage(build_model(*source, copy=True), 0, 1), ids, m, logits=True, **config)
        assert torch.equal(out.tokens, want), f"m={m}, {config}"
        if m == 1:
            assert torch.equal(out.logits, want_logits)
        else:
            torch.testing.assert_close(out.logits, want_logits, rtol=0, atol=LOGITS_ATOL)


def test_stop_tokens_end_rows_as_generate_ends_them():
    """Every stage runs max_new_tokens steps; the tokens are cut where generate stops (every row stopped)."""
    source, ids = tiny("llama"), prompts()
    greedy, _ = one_process(source, ids, GREEDY)
    stops = tuple(int(greedy[r, PROMPT + 2 + r]) for r in range(BATCH))  # row r meets one by step 2 + r
    want, _ = one_process(source, ids, dict(GREEDY, stop_token_ids=stops))
    assert want.shape[1] < PROMPT + NEW
    with build.enabled(False):
        got = pipeline_generate(make_stage(build_model(*source, copy=True), 0, 1), ids, 2, stop_token_ids=stops,
                                **GREEDY).tokens
    assert torch.equal(got, want)


def test_bubble_of_a_drawn_schedule():
    """Two equal stages, 1 s a piece of work, steps 1 and 2. m = 1: stage 0 works, then stage 1, so each is
    busy half the window; m = 2 round the ring: each works 4 s of the window's 5, idle only while the pipe
    fills (stage 1's first second) or drains (stage 0's last)."""
    def times(pieces):  # [(step, micro-batch, start, end)] of one stage
        return {"work": torch.tensor(pieces, dtype=torch.float64)}
    one = [times([(1, 0, 0, 1), (2, 0, 2, 3)]), times([(1, 0, 1, 2), (2, 0, 3, 4)])]
    assert bubble(one, rows=4) == {"busy": [0.5, 0.5], "window_s": 4.0, "tok_per_s": 2.0}
    two = [times([(1, 0, 0, 1), (1, 1, 1, 2), (2, 0, 2, 3), (2, 1, 3, 4)]),
           times([(1, 0, 1, 2), (1, 1, 2, 3), (2, 0, 3, 4), (2, 1, 4, 5)])]
    assert bubble(two, rows=4) == {"busy": [0.8, 0.8], "window_s": 5.0, "tok_per_s": 1.6}
    with pytest.raises(ValueError, match="generate at least 2 new tokens"):
        bubble([times([(0, 0, 0, 1)])], rows=4)


def test_settings_a_pipeline_does_not_run_are_refused():
    stage = make_stage(build_model(*tiny("llama"), copy=True), 0, 1)
    with pytest.raises(ConfigError, match="drop repetition_penalty=1.3"):
        pipeline_generate(stage, prompts(), repetition_penalty=1.3)
    with pytest.raises(ConfigError, match="n_stages=2, but 1 processes run: start one per stage"):
        stage_of(build_model(*tiny("llama"), copy=True), 2)  # outside a group
    assert stage_of(build_model(*tiny("llama"), copy=True), 1).layers == range(LAYERS)


# ---------------------------------------------------------------- stages in processes
@pytest.mark.parametrize("n_stages", [2, 3])
def test_llama_stages_decode_as_one_process(n_stages):
    source, ids = tiny("llama"), prompts()
    answers = run_ranks(pp_workers.runs, n_stages, args=([source], ids, SETTINGS), timeout=GROUP_TIMEOUT)
    check_runs(answers, [source], ids)
    times = [answer[0]["times"] for answer in answers]  # m = 1: the stages take turns
    assert all(0 < busy < 1 for busy in bubble(times, BATCH)["busy"])


def test_qwen2_mistral_and_gemma3_stages_decode_as_one_process():
    """Qwen2's q/k/v biases, Mistral, and Gemma 3's sliding layers (each stage keeps its layers' types)."""
    sources, ids = [tiny("qwen2"), tiny("mistral"), tiny("gemma3")], prompts()
    answers = run_ranks(pp_workers.runs, 3, args=(sources, ids, SETTINGS), timeout=GROUP_TIMEOUT)
    check_runs(answers, sources, ids)


def test_a_stage_that_dies_mid_generation_fails_the_others_within_the_timeout():
    """Stage 1 of 3 is SIGKILLed at its 5th forward (a decode step): stage 2 waits on its activations
    and stage 0 on stage 2's tokens; both must fail, and run_ranks raise, well within the timeout."""
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of 3 failed: the process killed by SIGKILL") as info:
        run_ranks(pp_workers.dies_mid_generation, 3, args=(tiny("llama"), prompts(), 2, 64, 1, 5),
                  timeout=GROUP_TIMEOUT)
    assert time.monotonic() - start < GROUP_TIMEOUT / 2, str(info.value)
    for rank in (0, 2):  # each saw its peer's connection close and said so, before the parent stopped it
        assert f"rank {rank}: RuntimeError" in str(info.value), str(info.value)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_smollm2_at_3_stages_decodes_32_tokens_as_one_process(smollm2):
    model, tokenizer = smollm2
    texts = ["The capital of France is", "My favourite colour is"]
    rows = [tokenizer(text, return_tensors="pt").input_ids[0] for text in texts]
    length = min(len(r) for r in rows)
    ids = torch.stack([r[:length] for r in rows])  # [2, T]
    config = dict(max_new_tokens=32, stop_token_ids=())
    with build.enabled(False):
        want = minigen.generate(model, ids, **config).tokens
    assert want.shape[1] == length + 32  # no stop token: all 32 new tokens compared
    got = run_ranks(pp_workers.runs, 3, args=(["smollm2-135m"], ids, [(1, config), (2, config)]), timeout=180)
    for stage, answer in enumerate(got):
        assert [run["layers"] for run in answer] == [(10 * stage, 10 * stage + 10)] * 2
        for run in answer:
            assert torch.equal(run["tokens"], want), f"stage {stage}"
