"""A prompt's format and the attention backend travel with the ops, and each model owns its weight copies:

- no hidden state steers a forward: no ContextVar in minigen, and no module-level table of weight copies
  (read from the sources with ast);
- two models' copies are independent, and a model's copies go away with it;
- PromptFormat's rules: which rows take which dtype, for the products and for the attention;
- ops.configured returns new ops and leaves the original as it was; Model.forward runs the ops it is given.
"""

import ast
import copy
import gc
import weakref
from pathlib import Path

import pytest
import torch

import minigen
from minigen.attention import AttentionPolicy
from minigen.config import GenerationConfig
from minigen.errors import ConfigError
from minigen.kernels import dispatch
from minigen.model import TorchOps
from minigen.numerics import bf16_copies, w8a8
from minigen.numerics.copies import WeightCopies
from minigen.numerics.precision import FP32, SHORT_PROMPT_ROWS, PromptFormat, prompt_format
from minigen.steps.choose import ops_for

PACKAGE = Path(minigen.__file__).parent
WEAK_TABLES = {"WeakIdKeyDictionary", "WeakKeyDictionary", "WeakValueDictionary"}


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _called_name(node: ast.AST) -> str | None:
    """The name a call calls: f(...) -> "f", a.b.f(...) -> "f"; None for anything else."""
    if isinstance(node, ast.Call):
        return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
    return None


def test_no_context_variable_steers_minigen():
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.name.split(".")[-1] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                  for a in n.names}
        assert not names & {"ContextVar", "contextvars"}, path


def test_no_module_keeps_a_table_of_weight_copies():
    """No module-level weak table keyed by tensors anywhere, and no module-level dict at all in the
    modules that make copies (numerics/): a weight's copies live in its model's WeightCopies."""
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            where = f"{path.relative_to(PACKAGE)}:{node.lineno}"
            assert _called_name(value) != "WeakIdKeyDictionary", where
            if path.parent.name == "numerics":
                assert _called_name(value) not in WEAK_TABLES | {"dict"}, where
                assert not (isinstance(value, ast.Dict) and not value.keys), where  # an empty {} to fill


def _fresh(tiny_llama):
    """A tiny Llama of its own: new weight tensors, no copies."""
    return minigen.from_hf(tiny_llama[0])


def test_two_models_keep_their_own_copies(tiny_llama):
    a, b = _fresh(tiny_llama), _fresh(tiny_llama)
    assert isinstance(a.weight_copies, WeightCopies) and a.weight_copies is not b.weight_copies
    fmt = prompt_format("bfloat16", a)
    assert fmt.copies is a.weight_copies and bf16_copies.nbytes(a) > 0 and bf16_copies.nbytes(b) == 0
    assert all(b.weight_copies.bf16_of(w) is None for w in bf16_copies.block_weights(b))
    assert all(a.weight_copies.bf16_of(w) is None for w in bf16_copies.block_weights(b))  # b's weights: not a's
    w8a8.prepare(b, torch.arange(20))
    assert w8a8.nbytes(b) > 0 and w8a8.nbytes(a) == 0
    wqkv = b.blocks[0].attn.wqkv
    assert b.weight_copies.int8_of(wqkv) is not None and a.weight_copies.int8_of(wqkv) is None
    # cast or moved, a model drops its copies (the weights changed) and keeps how it calibrates
    calibration = a.weight_copies.calibration = lambda: torch.arange(20)
    a.to(torch.float32)
    assert bf16_copies.nbytes(a) == 0 and a.weight_copies.calibration is calibration
    # a deep copy holds new weights: it starts without copies, and the original keeps its own
    deep = copy.deepcopy(b)
    assert w8a8.nbytes(deep) == 0 and w8a8.nbytes(b) > 0


def test_a_models_copies_go_away_with_it(tiny_llama):
    model = _fresh(tiny_llama)
    prompt_format("bfloat16", model)
    w8a8.prepare(model, torch.arange(20))
    copies = weakref.ref(model.weight_copies)
    bf16 = weakref.ref(model.weight_copies.bf16_of(model.blocks[0].attn.wqkv))
    int8 = weakref.ref(model.weight_copies.int8_of(model.blocks[0].attn.wqkv).scales)
    del model
    gc.collect()
    assert copies() is None and bf16() is None and int8() is None


def test_prompt_format_rules():
    bf16, fp32_attention = PromptFormat("bfloat16", True), PromptFormat("bfloat16", False)
    int8 = PromptFormat("int8")
    for rows in (1, SHORT_PROMPT_ROWS):  # a short prompt is bound by memory: every format keeps fp32
        for fmt in (FP32, bf16, fp32_attention, int8):
            assert fmt.dtype(rows) == fmt.attention_dtype(rows) == torch.float32
    rows = SHORT_PROMPT_ROWS + 1
    assert (FP32.dtype(rows), bf16.dtype(rows), fp32_attention.dtype(rows), int8.dtype(rows)) == (
        torch.float32, torch.bfloat16, torch.bfloat16, torch.int8)
    assert (FP32.attention_dtype(rows), bf16.attention_dtype(rows), fp32_attention.attention_dtype(rows),
            int8.attention_dtype(rows)) == (torch.float32, torch.bfloat16, torch.float32, torch.float32)
    assert prompt_format("float32") is FP32 and prompt_format("bfloat16", None, False) == fp32_attention
    assert prompt_format("bfloat16") == bf16 and FP32.describe() == "fp32"
    with pytest.raises(ConfigError, match="prefill_precision='fp8' is invalid"):
        prompt_format("fp8")
    with pytest.raises(ConfigError, match="needs the model"):
        prompt_format("int8")


@pytest.mark.parametrize("kind", ["torch", "kernels"])
def test_configured_ops_are_new_and_leave_the_original_as_it_was(kind):
    ops = TorchOps() if kind == "torch" else dispatch.KernelOps(TorchOps())
    fmt = PromptFormat("bfloat16", True)
    new = ops.configured(prompt=fmt, reads_blocks=True)
    assert new is not ops and type(new) is type(ops)
    assert (new.prompt, new.reads_blocks) == (fmt, True)
    assert (ops.prompt, ops.reads_blocks) == (FP32, False)
    kept = new.configured(reads_blocks=False)  # None: kept as it is
    assert (kept.prompt, kept.reads_blocks) == (fmt, False) and (new.prompt, new.reads_blocks) == (fmt, True)
    if kind == "kernels":  # the reference is configured alike (the calls it takes run in the format too)
        assert new.reference is not ops.reference and type(new.reference) is TorchOps
        assert (new.reference.prompt, new.reference.reads_blocks) == (fmt, True)
        assert (ops.reference.prompt, ops.reference.reads_blocks) == (FP32, False)
        assert new.shapes is ops.shapes and new.measured is ops.measured


def test_forward_runs_the_ops_it_is_given_and_ops_for_reads_the_config(tiny_llama):
    model = tiny_llama[1]
    calls = []

    class Spy(TorchOps):
        def linear(self, x, w, out_dtype=None):
            calls.append(x.shape[-2])
            return super().linear(x, w, out_dtype)

    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(ids, torch.arange(20))
        got = model(ids, torch.arange(20), ops=Spy())
    assert len(calls) == 4 * model.config.n_layers + 1 and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert ops_for(model, GenerationConfig(), prompt=True) is model.ops  # nothing to change: the model's own
    triton = ops_for(model, GenerationConfig(attention_backend="triton", cache_chunk_size=4), prompt=False)
    assert triton.reads_blocks and triton.prompt == FP32 and not model.ops.reads_blocks
    # the policy says which keys; the backend is the ops': a config with only a backend has no policy
    assert AttentionPolicy.from_config(GenerationConfig(attention_backend="triton", cache_chunk_size=4)) is None
    assert not hasattr(AttentionPolicy(), "backend") and not hasattr(AttentionPolicy(), "reads_blocks")
