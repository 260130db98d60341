"""The memory planner: its KV bytes are what `generate` holds, its answer fits, its refusals name a fix."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch

import minigen
from minigen import GenerationConfig
from minigen.__main__ import main
from minigen.errors import CacheFullError, ConfigError
from minigen.caches.contiguous import KVCache
from minigen.caches.blocks import BlockAllocator

pytestmark = pytest.mark.usefixtures("one_thread")
planner = importlib.import_module("minigen.measure.plan")  # the module: `minigen.measure.plan` is the function
from minigen.measure import profiling

CONFIGS = [{}, dict(cache_chunk_size=16), dict(cache_chunk_size=4), dict(quant_bits=8, quant_group_size=8),
           dict(quant_bits=4, quant_group_size=8), dict(quant_bits=4, quant_group_size=8, cache_chunk_size=8),
           dict(window_size=16), dict(window_size=16, cache_chunk_size=8), dict(kv_dtype="bfloat16")]


@pytest.mark.parametrize("fields", CONFIGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "contiguous")
def test_the_planned_kv_bytes_are_what_generate_holds(tiny_llama, fields):
    """Within 5% (the issue's bound); the planner builds the same cache on the meta device, so exact here."""
    _, model = tiny_llama
    prompt, new = 39, 50
    config = GenerationConfig(max_new_tokens=new, stop_token_ids=[], **fields)
    held = minigen.generate(model, torch.arange(1, prompt + 1)[None].repeat(2, 1), config).stats.kv_cache_bytes
    planned = planner.kv_cache_bytes(model.config, config, batch=2, context=prompt + new, prompt_len=prompt)
    assert abs(planned - held) <= 0.05 * held, (planned, held)


def test_on_smollm2_without_the_prompt_length(smollm2, english_text_ids):
    """The CLI does not know the prompt's length: the estimate still holds within 5%."""
    model, _ = smollm2
    for fields in ({}, dict(cache_chunk_size=16), dict(quant_bits=4)):
        config = GenerationConfig(max_new_tokens=6, stop_token_ids=[], **fields)
        held = minigen.generate(model, english_text_ids[None, :40], config).stats.kv_cache_bytes
        planned = planner.kv_cache_bytes(model.config, config, batch=1, context=46)
        assert abs(planned - held) <= 0.05 * held, (fields, planned, held)


def test_the_weights_are_counted(tiny_llama):
    _, model = tiny_llama
    assert planner.weights_bytes(model.config) == sum(p.nbytes for p in model.parameters())
    assert planner.weights_bytes(model.config, "bfloat16") * 2 == planner.weights_bytes(model.config)


def test_the_answer_fits_and_costs_the_least_quality(tiny_llama):
    _, model = tiny_llama
    cfg = model.config
    roomy = planner.plan(cfg, batch=4, context=128, budget_bytes=2**30)
    assert roomy.fits and roomy.expected_loss_pct == 0.0  # 8-bit KV (+0.00%, chapter 06) or full precision
    assert roomy.config in ({}, {"quant_bits": 8, "quant_group_size": 8})  # head dim 8: groups of 8
    # a budget that the full-precision cache misses by a little: 4-bit KV (QUALITY_LOSS: +0.37%) beats any window
    full = roomy.weights_bytes + roomy.activation_bytes + planner.kv_cache_bytes(cfg, GenerationConfig(), 4, 128)
    int8 = [o for o in roomy.options if o.config.get("quant_bits") == 8][0].total_bytes
    tight = planner.plan(cfg, batch=4, context=128, budget_bytes=int8 - 1)
    assert tight.fits and tight.total_bytes <= int8 - 1 < full
    assert tight.config in ({"quant_bits": 4, "quant_group_size": 8}, {"kv_dtype": "bfloat16"}), tight.config
    assert all(o.expected_loss_pct >= tight.expected_loss_pct for o in tight.options if o.fits)
    # only the smallest option fits (4-bit KV here: with 2-byte scales and zeros, a byte an element at
    # head dim 8, below a 64-token window in bf16 over 128 tokens): it is the answer
    smallest = min(roomy.options, key=lambda o: o.total_bytes)
    assert smallest.config == {"quant_bits": 4, "quant_group_size": 8}
    assert planner.plan(cfg, batch=4, context=128, budget_bytes=smallest.total_bytes).config == smallest.config
    # nothing fits, but the weights do: fits False and the smallest budget that would
    none = planner.plan(cfg, batch=4, context=128, budget_bytes=roomy.weights_bytes)
    assert not none.fits and none.smallest_budget == min(o.total_bytes for o in roomy.options)


def test_the_articles_oom_remedies_in_bytes(smollm2):
    """What smaller chunks, 4-bit KV and capping the length free from the article's paged cache
    (blocks of 256 tokens), batch 8, SmolLM2 in fp32."""
    model, _ = smollm2
    cfg = model.config
    per_token = cfg.kv_bytes_per_token(4)
    freed = planner.oom_remedies(model, batch=8, context=8000, cache_chunk_size=256, smaller_chunk=16,
                                 max_length=4096)
    base = freed["baseline_bytes"]
    assert base >= 8 * 8000 * per_token
    # smaller chunks free only the last block's unused tail per row: 8 x (8192 - 8000) token slots,
    # less a little bookkeeping (block tables, the gather buffer)
    assert abs(freed["cache_chunk_size=16"] - 8 * 192 * per_token) <= 0.05 * 8 * 192 * per_token
    # 4-bit codes with a bf16 scale and zero per 32 elements: 5 bits of 32, at most 84% freed (chapter 06);
    # each row's open 256-token block stays fp32, so ~82% (fp32 scales and zeros: 6 bits, ~79%)
    assert 0.80 * base < freed["quant_bits=4"] < 0.84 * base
    # capping the length at 4,096: the pool for 8,000 tokens (32 blocks) shrinks to 16 blocks
    assert abs(freed["max_length=4096"] - base / 2) <= 0.01 * base
    # at a context that fills whole blocks, smaller chunks free nothing (they cost a few table entries)
    assert planner.oom_remedies(model, context=8192)["cache_chunk_size=16"] <= 0


def test_a_full_cache_names_the_planner():
    with pytest.raises(CacheFullError, match="python -m minigen plan .*--context 5"):
        KVCache(n_layers=1, batch=1, n_kv_heads=1, max_len=4, head_dim=8).prepare(torch.tensor([4]))
    pool = BlockAllocator(n_blocks=1, block_size=2)
    with pytest.raises(CacheFullError, match="python -m minigen plan"):
        pool.write(pool.add_sequence(), 0, 5)


def test_the_command_prints_and_writes_json(tmp_path, capsys, tiny_llama, monkeypatch):
    _, model = tiny_llama
    monkeypatch.setattr(planner, "model_config", lambda name: model.config)
    rc = main(["plan", "--model", "tiny", "--batch", "2", "--context", "100", "--budget-bytes", "10000000",
               "--json", str(tmp_path / "plan.json")])
    assert rc == 0 and "fits" in capsys.readouterr().out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["fits"] is True and {"config", "kv_cache_bytes", "weights_bytes", "activation_bytes"} <= set(data)
    assert main(["plan", "--model", "tiny", "--budget-bytes", "10"]) == 2  # below the weights: refused


def test_a_budget_below_the_weights_names_a_budget_that_works(tiny_llama, capsys, monkeypatch):
    """Issue 13's bad input: the refusal's smallest budget is one the planner then fits, and a byte less
    is not enough (every option needs more); the command line prints the same number."""
    _, model = tiny_llama
    weights = planner.weights_bytes(model.config)
    with pytest.raises(ConfigError, match="below the model's weights alone") as refused:
        minigen.plan(model.config, batch=2, context=100, budget_bytes=weights - 1)
    smallest = int(str(refused.value).split("could work is ")[1].split(" bytes")[0].replace(",", ""))
    assert smallest > weights
    assert minigen.plan(model.config, batch=2, context=100, budget_bytes=smallest).fits
    assert not minigen.plan(model.config, batch=2, context=100, budget_bytes=smallest - 1).fits
    monkeypatch.setattr(planner, "model_config", lambda name: model.config)
    assert main(["plan", "--model", "tiny", "--batch", "2", "--context", "100", "--budget-bytes", "1000"]) == 2
    assert f"could work is {smallest:,} bytes" in capsys.readouterr().err


def test_minigen_plan_is_the_planner(tiny_llama):
    _, model = tiny_llama
    assert minigen.plan(model.config, context=64, budget_bytes=2**30).fits


def test_a_bad_dtype_is_refused(tiny_llama):
    _, model = tiny_llama
    with pytest.raises(ConfigError, match="dtype='int8' is invalid"):
        planner.weights_bytes(model.config, "int8")


def test_a_model_with_its_own_window_is_planned_with_the_hybrid_cache():
    """A tiny Qwen2 whose first layer is full and the next two slide over 8 tokens (issue 27): the
    defaults' KV bytes are what generate holds, each sliding layer a ring of 8 slots and the full layer
    every position; the plan states that rule and format_plan prints it."""
    from conftest import tiny_hf
    model = minigen.from_hf(tiny_hf("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                    num_hidden_layers=3))
    cfg = model.config
    prompt, new = 30, 20
    config = GenerationConfig(max_new_tokens=new, stop_token_ids=[])
    held = minigen.generate(model, torch.arange(1, prompt + 1)[None].repeat(2, 1), config).stats.kv_cache_bytes
    planned = planner.kv_cache_bytes(cfg, config, batch=2, context=prompt + new)
    # K and V of 2 rows x (1 full layer x 50 positions + 2 rings x 8 slots), fp32; plus the position each of
    # the 8 ring slots holds (int64), which the sliding layers and rows share
    count = 2 * 2 * (1 * (prompt + new) + 2 * 8) * cfg.n_kv_heads * cfg.head_dim * 4
    assert planned == held == count + 8 * 8, (planned, held, count)
    p = planner.plan(cfg, batch=2, context=prompt + new, budget_bytes=2**30)
    assert p.hybrid == {"sliding_layers": 2, "sliding_window": 8, "full_layers": 1, "context": 50}, p.hybrid
    assert "hybrid (the model's own window): 2 sliding layers x 8 + 1 full layers x 50" in planner.format_plan(p)
    assert planner.plan(cfg, context=50, budget_bytes=2**30, cache_chunk_size=16).hybrid == {}  # paged: every position


def test_the_planner_offers_no_window_wider_than_the_models_own():
    """Regression: for a Mistral with sliding_window=8 the planner built window_size=64 on the meta device,
    and the combination rules refused it: plan() raised ConfigError instead of answering."""
    from conftest import tiny_hf
    cfg = minigen.from_hf(tiny_hf("mistral", sliding_window=8)).config
    p = planner.plan(cfg, batch=1, context=128, budget_bytes=2**30)
    assert p.fits and all("window_size" not in o.config for o in p.options), [o.config for o in p.options]
    assert p.kv_cache_bytes == planner.kv_cache_bytes(cfg, GenerationConfig(), 1, 128)
    # the same model with every layer full is offered windows: the rule reads the model's own window
    every_layer_full = dataclasses.replace(cfg, layer_types=None, sliding_window=None)
    assert any("window_size" in o.config for o in planner.plan(every_layer_full, context=128, budget_bytes=2**30).options)


def test_the_paged_waste_is_each_rows_last_block(tiny_llama):
    """A pool sized to the context leaves only each row's last block partly empty: at 100 tokens,
    blocks of 16 leave 12 slots a row and blocks of 256 leave 156."""
    _, model = tiny_llama
    cfg = model.config
    waste = planner.paged_waste(cfg, {}, batch=3, context=100)
    for bs, empty in ((16, 12), (256, 156)):
        assert waste[bs]["waste_bytes"] == 3 * empty * cfg.kv_bytes_per_token(4)
        paged = GenerationConfig(cache_chunk_size=bs)
        assert waste[bs]["kv_cache_bytes"] == planner.kv_cache_bytes(cfg, paged, batch=3, context=100)
    # a quantized block must hold whole groups of tokens (keys per channel): groups of 8 fit both sizes
    assert list(planner.paged_waste(cfg, {"quant_bits": 4, "quant_group_size": 8}, 3, 100)) == [16, 256]
    assert list(planner.paged_waste(cfg, {"quant_bits": 8, "quant_key_axis": "token", "quant_group_size": 8},
                                    3, 100)) == [16, 256]
    assert planner.plan(cfg, batch=3, context=100, budget_bytes=2**30).paged


# ---------------------------------------------------------------- prefill chunks (chapter 3)
def _random_model(cfg, n_layers: int = 2, seed: int = 0) -> minigen.Model:
    """A model of `cfg`'s shapes with n_layers layers and random weights: the activations of one
    layer are what the estimate counts; two layers keep the test fast."""
    import dataclasses
    model = minigen.Model(dataclasses.replace(cfg, n_layers=n_layers))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.ones(p.shape) if p.dim() == 1 else torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


PEAK_CASES = [(1, 1536, {}), (1, 1536, dict(prefill_chunk_size=256)), (3, 1024, dict(prefill_chunk_size=512)),
              (2, 1024, dict(window_size=256)), (2, 1024, dict(cache_chunk_size=16, prefill_chunk_size=256)),
              (2, 1024, dict(quant_bits=8, prefill_chunk_size=256)), (2, 1024, dict(kv_dtype="bfloat16"))]


@pytest.mark.parametrize("batch,context,fields", PEAK_CASES,
                         ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else str(v))
def test_the_planned_kv_and_activations_are_what_a_generation_allocates(smollm2, batch, context, fields):
    """The issue's bound: within 10% of the peak bytes of tensors a generation holds at once
    (profiling.peak_tensor_bytes counts every storage torch's ops create). SmolLM2's shapes, 2 layers."""
    model = _random_model(smollm2[0].config)
    new = 4
    config = GenerationConfig(max_new_tokens=new, stop_token_ids=[], **fields)
    ids = torch.randint(0, 1000, (batch, context - new), generator=torch.Generator().manual_seed(1))
    peak, _ = profiling.peak_tensor_bytes(lambda: minigen.generate(model, ids, config))
    planned = (planner.kv_cache_bytes(model.config, config, batch, context, prompt_len=context - new)
               + planner.activation_bytes(model.config, batch, context, config=config))
    assert abs(planned - peak) <= 0.10 * peak, (planned, peak)


@pytest.mark.parametrize("requests,prompt,budget", [(1, 1020, None), (2, 508, None), (1, 1020, 256), (2, 508, 128),
                                                    (4, 252, 64)])
def test_the_planned_engine_bytes_are_what_the_engine_allocates(smollm2, requests, prompt, budget):
    """engine_bytes against the peak bytes of tensors an Engine holds (its pool, gather buffers and the
    largest forward), within 10%: whole prompts arriving together, and prompts chunked by a budget.
    SmolLM2's shapes, 2 layers."""
    model = _random_model(smollm2[0].config)
    new = 4
    ids = [torch.randint(0, 1000, (prompt,), generator=torch.Generator().manual_seed(i)) for i in range(requests)]

    def serve():
        engine = minigen.Engine(model, GenerationConfig(stop_token_ids=[]), max_batch_size=requests,
                                max_num_batched_tokens=budget)
        for x in ids:
            engine.add_request(x, max_new_tokens=new, arrival_s=0.0)
        engine.run()
        return engine

    peak, engine = profiling.peak_tensor_bytes(serve)
    kv, activations = planner.engine_bytes(model.config, GenerationConfig(), requests, prompt + new, budget,
                                           num_blocks=engine.num_blocks)
    assert abs(kv + activations - peak) <= 0.10 * peak, (kv, activations, peak)
    if budget is not None:  # the budget bounds the activations: the whole prompts' are larger
        assert activations < planner.engine_bytes(model.config, GenerationConfig(), requests, prompt + new)[1]


@pytest.mark.parametrize("num_blocks,budget", [(None, None), (None, 7), (12, 7)])
def test_engine_bytes_count_a_sliding_model_as_its_engine_holds(num_blocks, budget):
    """A model with sliding layers (tiny Qwen2: layer 0 full, layers 1 and 2 sliding with a window of
    8): engine_bytes' pools are exactly the tensors the Engine's hybrid cache holds (the full layer
    x its blocks, the sliding layers x the pool of windows), by default sizing and with num_blocks
    given; the gather buffers the run grew (by doubling) stay within twice the ones counted."""
    from conftest import tiny_hf
    model = minigen.from_hf(tiny_hf("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                    num_hidden_layers=3))
    config, rows, context = GenerationConfig(stop_token_ids=[], cache_chunk_size=4), 3, model.config.max_seq_len
    engine = minigen.Engine(model, config, max_batch_size=rows, num_blocks=num_blocks, max_num_batched_tokens=budget)
    g = torch.Generator().manual_seed(0)
    for n in (5, 30, 12, 21):
        engine.add_request(torch.randint(0, 97, (n,), generator=g), max_new_tokens=16, arrival_s=0.0)
    engine.run()
    kv, _ = planner.engine_bytes(model.config, config, rows, context, budget, num_blocks)
    pool, gathered = planner.engine_pool_bytes(model.config, config, rows, context, budget, num_blocks)
    assert kv == pool + gathered
    assert pool == sum(t.nbytes for t in engine.cache.layer_tensors())
    assert 0 < engine.cache.nbytes - pool <= 2 * gathered  # no rows left: the rest is the gather buffers
    uniform = 2 * model.config.n_layers * 4 * model.config.n_kv_heads * model.config.head_dim * 4 * engine.num_blocks
    if budget is not None and num_blocks is None:  # windows of 8 + 7 tokens, not the context: less than uniform
        assert pool < uniform


def test_the_peak_counter_sees_what_is_held_and_forgets_what_is_freed():
    def hold():
        a = torch.empty(1000, dtype=torch.float32)  # 4,000 bytes, freed on return
        b = torch.empty(250, dtype=torch.float64)  # 2,000 bytes, returned
        return b
    peak, kept = profiling.peak_tensor_bytes(hold)
    assert peak == 6000 and kept.nbytes == 2000


def test_a_prefill_chunk_makes_the_issues_request_fit(smollm2):
    """Batch 4 x 8,192 tokens in 1 GiB: every option with the whole prompt misses (its activations
    alone are ~1 GiB); with a chunk, the planner fits one at no expected quality loss."""
    cfg = smollm2[0].config
    p = planner.plan(cfg, batch=4, context=8192, budget_bytes=2**30)
    assert p.fits and p.expected_loss_pct == 0.0 and p.config.get("prefill_chunk_size") in planner.PREFILL_CHUNKS
    whole = [planner.weights_bytes(cfg) + kv + planner.activation_bytes(cfg, 4, 8192, config=GenerationConfig(**f))
             for f, kv, *_ in planner.options(cfg, 4, 8192)]
    assert min(whole) > 2**30
    # the chunk is the largest that fits: the next larger one would not
    chunk = p.config["prefill_chunk_size"]
    larger = [c for c in planner.PREFILL_CHUNKS if c > chunk]
    if larger:
        bigger = GenerationConfig(**{**p.config, "prefill_chunk_size": min(larger)})
        assert (p.weights_bytes + planner.kv_cache_bytes(cfg, bigger, 4, 8192)
                + planner.activation_bytes(cfg, 4, 8192, config=bigger)) > 2**30
    # and where the whole prompt fits, nothing is chunked
    assert "prefill_chunk_size" not in planner.plan(cfg, batch=1, context=2048, budget_bytes=2**31).config
