"""Gemma 3 (text), arch="gemma3" (issue 27): a tiny random Gemma3ForCausalLM against transformers.

Six layers, every third one full, a window of 8 tokens, query_pre_attn_scalar 24 (not head_dim 16)
and RoPE bases 1,000 (full layers) and 50 (sliding ones): a model that dropped any of Gemma's parts
(the (1 + w) norms, the four norms, q/k norms, sqrt(D), GeGLU, the scale, the local base) would
give other logits, and prompts longer than the window test each layer's own mask and cache.
"""

import pytest
import torch

import minigen
from minigen.caches.hybrid import HybridKVCache
from minigen.caches.make import make_cache
from minigen.errors import ModelLoadError
from minigen.checkpoints.hf_config import config_from_hf
from minigen.measure import roofline
from minigen.model import Model

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 8
PROMPT, NEW = 20, 16  # both longer than the window


def tiny_gemma3(seed: int = 0, **overrides):
    """A seeded Gemma3ForCausalLM, fp32, eager attention, weights drawn wide as conftest.tiny_hf
    draws them (norm weights around 0, Gemma's (1 + w) making them around 1) so greedy ties are unlikely."""
    import transformers as tf
    kw = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
              max_position_embeddings=128, rope_theta=1000.0, rope_local_base_freq=50.0,
              sliding_window_pattern=3, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
              pad_token_id=0)
    kw.update(overrides)
    cfg = tf.Gemma3TextConfig(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = tf.Gemma3ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((0.1 if "norm" in name else 0.2) * torch.randn(p.shape, generator=g))
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


@pytest.fixture(scope="module")
def gemma():
    """(hf_model, minigen_model, prompt [1, PROMPT], transformers' greedy ids [1, PROMPT + NEW])."""
    hf = tiny_gemma3()
    ids = torch.randint(0, 97, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    return hf, minigen.from_hf(hf), ids, want


def test_config_is_read_as_transformers_derives_it(gemma):
    hf, model, _, _ = gemma
    cfg = model.config
    assert cfg.arch == "gemma3"
    assert cfg.layer_types == tuple(hf.config.layer_types) == ("sliding_attention", "sliding_attention",
                                                               "full_attention") * 2
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar) == (WINDOW, 24.0)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1000.0, 50.0)
    assert cfg.max_seq_len == 128  # the checkpoint's context, not its window


def test_logits_match_transformers(gemma):
    """fp32 throughout: the two models differ by summation order only. Logits spread over ~5 units;
    1e-4 is about 30 fp32 ulps at that size through six layers."""
    hf, model, ids, _ = gemma
    with torch.no_grad():
        want = hf(ids).logits
    got = model(ids, torch.arange(PROMPT))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("settings", [dict(), dict(use_cache=False), dict(cache_chunk_size=4)],
                         ids=["hybrid_cache", "naive", "chunked_prefill"])
def test_greedy_tokens_equal_transformers_beyond_the_window(gemma, settings):
    _, model, ids, want = gemma
    got = minigen.generate(model, ids, max_new_tokens=NEW, stop_token_ids=[], **settings).tokens
    assert torch.equal(got, want)


@pytest.mark.slow
def test_compiled_greedy_tokens_equal_transformers(gemma):
    _, model, ids, want = gemma
    got = minigen.generate(model, ids, max_new_tokens=NEW, stop_token_ids=[], compile=True).tokens
    assert torch.equal(got, want)


def test_default_cache_is_hybrid(gemma):
    _, model, _, _ = gemma
    assert isinstance(make_cache(model, minigen.GenerationConfig(), 1, 64), HybridKVCache)


def test_bf16_weights_run_close_to_fp32(gemma):
    """bf16 weights: each weight rounded to 8 bits of mantissa (relative error <= 2^-9 each), so the
    logits move by a few percent of their spread at most; 10% of the largest logit is a loose bound
    that a dropped norm or a wrongly rounded sqrt(D) would still exceed by far."""
    hf, model, ids, _ = gemma
    bf16 = minigen.from_hf(hf, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    full = model(ids, torch.arange(PROMPT))
    got = bf16(ids, torch.arange(PROMPT))
    assert torch.isfinite(got).all()
    assert (got - full).abs().max() < 0.1 * full.abs().max()
    out = minigen.generate(bf16, ids, max_new_tokens=4, stop_token_ids=[]).tokens
    assert out.shape == (1, PROMPT + 4)


def test_final_logit_softcapping_matches_transformers():
    hf = tiny_gemma3(final_logit_softcapping=2.0)
    model = minigen.from_hf(hf)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids).logits
    got = model(ids, torch.arange(12))
    assert got.abs().max() < 2.0  # squashed into (-cap, cap): the uncapped logits reach ~5
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_layer_types_written_out_and_rope_parameters_read():
    """transformers 5 writes layer_types and rope_parameters into config.json; both are read as written."""
    hf = tiny_gemma3(layer_types=["full_attention", "sliding_attention"] * 3, sliding_window_pattern=None)
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.layer_types == ("full_attention", "sliding_attention") * 3
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1000.0, 50.0)


def test_older_config_json_with_sliding_window_pattern():
    """A config.json without layer_types: every `sliding_window_pattern`-th layer is full, as
    Gemma3TextConfig derives it; rope_local_base_freq is the sliding layers' base."""
    old = {"model_type": "gemma3_text", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 6,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
           "sliding_window": 8, "sliding_window_pattern": 2, "rope_theta": 1000.0, "rope_local_base_freq": 50.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 24}
    cfg = config_from_hf(old)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 3
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}  # the full layers' only
    assert (cfg.rope_local_theta, cfg.rope_local_scaling) == (50.0, None)


def test_multimodal_gemma3_config_reads_its_text_config():
    import transformers as tf
    text = tiny_gemma3().config
    both = tf.Gemma3Config(text_config=text.to_dict()).to_dict()
    assert both["model_type"] == "gemma3"
    assert config_from_hf(both) == config_from_hf(text.to_dict())


@pytest.mark.parametrize("key,value", [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True),
                                       ("hidden_activation", "relu")])
def test_what_minigen_does_not_apply_is_refused_naming_the_key(key, value):
    cfg = tiny_gemma3().config.to_dict()
    cfg[key] = value
    with pytest.raises(ModelLoadError, match=key):
        config_from_hf(cfg)


def test_unknown_layer_type_is_refused_naming_the_field():
    cfg = tiny_gemma3().config.to_dict()
    cfg["layer_types"] = ["sliding_attention"] * 5 + ["chunked_attention"]
    with pytest.raises(ModelLoadError, match="layer_types"):
        config_from_hf(cfg)


def test_parameter_count_and_flops_formulas_hold_for_gemma3(gemma):
    """roofline.n_params counts the four norms and the q/k norms; forward_flops counts GeGLU's three matrices."""
    _, model, _, _ = gemma
    cfg = model.config
    with torch.device("meta"):
        built = Model(cfg)
    assert roofline.n_params(cfg) == sum(p.numel() for p in built.parameters())
    D, F_ = cfg.dim, cfg.hidden_dim
    llama_like = cfg.forward_flops(1, 1) - 2 * D * cfg.vocab_size
    assert llama_like == cfg.n_layers * (2 * D * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
                                         + 2 * cfg.n_heads * cfg.head_dim * D + 6 * D * F_ + 4 * cfg.n_heads * cfg.head_dim)


def test_gemma3_config_without_its_scale_is_refused_naming_the_fields():
    from minigen.checkpoints.model_config import ModelConfig
    with pytest.raises(ValueError, match="query_pre_attn_scalar and rope_local_theta"):
        ModelConfig(arch="gemma3", vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    hidden_dim=64, max_seq_len=128)
