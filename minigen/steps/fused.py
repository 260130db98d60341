"""The fused decode step (`fused_decode`): every layer of a decode token in one C call.

A decode step at batch 1 is 4 matrix-vector products a layer and, between them, small operations:
two norms, RoPE, the cache write, attention over the cached tokens, SiLU and two residual adds.
In torch each small operation is a dispatch of a few microseconds around a few hundred
multiply-adds, and with their views, splits and conversions they come to ~150 dispatches a layer:
6 to 9 ms of a 25 ms SmolLM2 step on this course's CPU (chapter 11's profile). That time does not
shrink when the weights do, so it caps what bf16 (chapter 9) and int4 (chapter 10) weights can
buy. torch.compile removes part of it; llama.cpp's answer is to write the whole step in C.
`csrc/decode.c: decode_layers` does that for the Llama family: the products through the same
kernels as eager decoding, everything in between on the calling thread in fp32, attention over
one head per thread once the context is long enough to share out. A tensor batch (B rows at one
shared position, up to 16) runs in the same call: with fp32 weights its products meet every row in
one pass of the several-row kernel, as the eager step's do (int8 and int4 rows of codes are widened
once for every row: decode.c's product), and everything else loops over the rows.
Speculative decoding's verify (chapter 13) is the same call on a chunk of one sequence
(`verify_layers`): T tokens at consecutive positions, each its own row, every row's keys and
values written before any row attends, so that the chunk is causal.
The serving engine's decode step (chapter 14) is the same body over its paged pool
(`decode_paged`): up to 16 sequences, each at its own position, whose blocks C reads and writes in
place through the block tables (the eager step gathers them into a buffer every layer,
PagedKVCache.update); its rows are separate sequences, so their int8 / int4 products run the
batch GEMMs the eager step runs for them (csrc/gemm_q_s8.c, gemm_q.c), whose rows never mix.

What it takes (everything else is refused up front with the reason, never run another way:
run_rules.RUN_RULES and REFUSED):
a Llama-family model (RMSNorm, RoPE, SwiGLU, grouped-query attention, q/k/v biases) on the CPU
with the default precision (fp32 activations, norms, softmax and logits) and weights in fp32, bf16,
int8 or int4 at batch 1, fp32 for a batch of up to 16 rows in lockstep (not a ragged batch); the
contiguous cache (chapter 2) in fp32 or bf16, or a paged one (any weights, rows at their own positions
in the serving engine); no window, sparse selection, observers or compile.
A prompt of up to 16 tokens of one sequence is a verify chunk at positions 0..T-1: in one C call
too, where a short prompt's products, bound by reading the weights like a decode step, read each
weight once for every row and never widen int8 / int4 codes into an fp32 tile (chapter 3). A
longer prompt runs through torch's GEMMs. A decode token runs in C from its embedding row to its
logits (the final norm and the output head included: after the layers, torch's first small
operations run with cold caches, ~0.2 ms a norm).

The arithmetic is the eager step's, in another order: norms and attention sum in C rather than in
torch's kernels, so logits agree to ~1e-5 and greedy tokens match (tests/test_fused.py).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from ..checkpoints.model_config import ModelConfig
from ..run_rules import FUSED_MAX_ROWS
from ..kernels import build as kernel_build
from ..kernels import dispatch
from ..kernels.probes import Probe, Shapes
from ..numerics.precision import FP32
from ..errors import PromptError
from ..caches.contiguous import KVCache
from ..caches.paged import PagedKVCache
from .eager import EagerStep
from ..model import Model
from ..numerics.weight_quant import QuantizedWeight, quantize_weights

# the C kinds of weight; run_rules.FUSED_WEIGHTS / FUSED_CACHE say what the step takes, and
# run_rules.RUN_RULES refuses the rest before a step is chosen
KINDS = {torch.float32: 0, torch.bfloat16: 1}  # and QuantizedWeight: 2 (int8) or 3 (int4); with int8
# activations (numerics/int8_act.py) 4 (int8) or 5 (int4)
CACHE_DTYPES = (torch.float32, torch.bfloat16)


class _Weight(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("pad", ctypes.c_int32), ("W", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("G", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                ("wqkv", _Weight), ("wo", _Weight), ("wgu", _Weight), ("wdown", _Weight),
                ("bqkv", ctypes.c_void_p), ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p)]


class _Dims(ctypes.Structure):
    _fields_ = [("D", ctypes.c_int64), ("H", ctypes.c_int64), ("Hkv", ctypes.c_int64), ("Dh", ctypes.c_int64),
                ("F", ctypes.c_int64), ("S", ctypes.c_int64), ("cache_bf16", ctypes.c_int32),
                ("threads", ctypes.c_int32), ("eps", ctypes.c_float), ("embed", _Weight),
                ("embed_bf16", ctypes.c_int32), ("inv_freq", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p), ("head", _Weight), ("logits", ctypes.c_void_p)]


def weight_kind(w) -> str:
    """How the C step reads a weight: "float32", "bfloat16", "int8" or "int4" (run_rules.FUSED_WEIGHTS)."""
    return f"int{w.bits}" if isinstance(w, QuantizedWeight) else str(w.dtype).removeprefix("torch.")


def weights(model: Model) -> list:
    """Every weight the C step reads: each layer's four matrices, the embedding and the head."""
    return [*(w for b in model.blocks for w in (b.attn.wqkv, b.attn.wo, b.mlp.w_gate_up, b.mlp.w_down)),
            model.embed, model.head]


def _weight(w, int8_act: bool = False) -> _Weight:
    """w's description; int8_act: a product's codes meet int8 activations (an embedding's lookups never do)."""
    if isinstance(w, QuantizedWeight):
        n, k = w.shape
        return _Weight((2 if w.bits == 8 else 3) + 2 * int8_act, 0, w.codes.data_ptr(), w.scales.data_ptr(),
                       w.mins.data_ptr() if w.mins is not None else None, n, k, w.group_size)
    assert w.is_contiguous() and w.dim() == 2
    return _Weight(KINDS[w.dtype], 0, w.data_ptr(), None, None, w.shape[0], w.shape[1], 0)


class _Plan:
    """The C descriptions of one (model, cache) pair, built at its first step; `keep` holds the fp32
    copies (norms, biases) whose addresses the descriptions point to."""

    def __init__(self, model: Model, cache: KVCache | PagedKVCache, int8_act: bool = False):
        cfg = model.config
        self.keep: list[Tensor] = []

        def fp32(t: Tensor | None):
            if t is None:
                return None
            t = t.detach().float().contiguous()
            self.keep.append(t)
            return t.data_ptr()

        # [L, B, Hkv, S, Dh] each, or a paged pool [L, N, bs, Hkv, Dh]: C writes layer i's slots in place
        k, v = cache.layer_tensors()
        layers = (_Layer * cfg.n_layers)()
        for i, b in enumerate(model.blocks):
            layers[i] = _Layer(fp32(b.attn_norm.weight), fp32(b.mlp_norm.weight),
                               *(_weight(w, int8_act) for w in (b.attn.wqkv, b.attn.wo, b.mlp.w_gate_up, b.mlp.w_down)),
                               fp32(b.attn.bqkv),
                               k[i].data_ptr(), v[i].data_ptr())
        self.layers = layers
        S = k.shape[3] if isinstance(cache, KVCache) else 0  # slots a head of the contiguous cache (paged: none)
        self.dims = _Dims(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim, S,
                          int(k.dtype == torch.bfloat16), 1, cfg.norm_eps, _weight(model.embed),
                          int(model.dtype == torch.bfloat16), fp32(model.inv_freq), fp32(model.norm.weight),
                          _weight(model.head, int8_act), None)
        self.x = torch.empty(FUSED_MAX_ROWS, cfg.dim)  # the residual stream of each row (or chunk token), written by C


class FusedStep(EagerStep):
    """fused_decode: each decode token in one C call, and speculative decoding's verify of one
    sequence's chunk, and a short prompt (or a prompt's pieces of up to 16 tokens), in one C call
    too; a longer prompt through torch (EagerStep.prefill). The C descriptions of the
    (model, cache) pair are built at the first call and held here, by the step the caller owns, never
    on the cache."""
    name = "fused"

    def __init__(self, verify_in_c: bool = True, int8_act: bool = False, prompts_in_c: bool = False):
        self.verify_in_c = verify_in_c  # False where fastpaths measured the C verify slower than the eager one
        # a paged cache's prompt chunks in one C call (prefill_paged), where fastpaths measured it faster
        # (fused_paged_prompt) for a model whose blocks hold int8 / int4 codes (steps/choose.py)
        self.prompts_in_c = prompts_in_c
        self.int8_act = int8_act  # int4 / int8 codes meet int8 activations (int8_activations, steps/choose.py)
        self.plan: _Plan | None = None
        self.planned_for: tuple[int, int] | None = None  # (id(model), id(cache)) the plan describes

    def prefill(self, model: Model, input_ids: Tensor, input_pos: Tensor, cache: KVCache, policy=None,
                ops=None) -> Tensor:
        """EagerStep.prefill's contract. One sequence whose prompt (or each piece of it, with
        prefill_chunk_size) has 2..FUSED_MAX_ROWS tokens runs `verify`'s C call per piece: the logits
        of its last token [1, V]. A paged cache's chunks run `_prefill_paged` where prompts_in_c allows.
        Anything else runs EagerStep.prefill (torch's GEMMs)."""
        if type(cache) is PagedKVCache and self._prompt_in_c(input_ids, input_pos, policy, ops):
            return self._prefill_paged(model, input_ids, input_pos, cache)
        T = input_ids.shape[1]
        C = min(self.prefill_chunk_size or T, T)
        if not (self.verify_in_c and type(cache) is KVCache and input_ids.shape[0] == 1 and policy is None and input_pos.dim() == 1 and 2 <= C <= FUSED_MAX_ROWS):
            return super().prefill(model, input_ids, input_pos, cache, policy, ops)
        for start in range(0, T, C):  # a last piece of one token runs verify's torch fallback
            logits = self.verify(model, input_ids[:, start:start + C], input_pos[start:start + C], cache, ops=ops)
        return logits[:, -1]

    def decode(self, model: Model, tokens: Tensor, input_pos: Tensor, cache: KVCache | PagedKVCache, policy=None,
               ops=None) -> Tensor:
        """eager.decode_step's contract, fused: a token for each row [B, 1], every row at the one
        position input_pos [1] (a tensor batch decodes in lockstep) -> logits [B, V]. A paged cache
        (the serving engine's, or cache_chunk_size) also takes each row at its own position [B, 1]:
        `_run_paged`."""
        B = tokens.shape[0]
        assert policy is None and tokens.shape == (B, 1) and B <= FUSED_MAX_ROWS, \
            "fused_decode takes one token per row and no attention policy (the config refuses the rest)"
        if isinstance(cache, PagedKVCache):
            return self._run_paged(model, tokens[:, 0], input_pos, cache)
        assert input_pos.shape == (1,), "fused_decode decodes a contiguous cache's rows at one shared position"
        lib = kernel_build.library()
        return self._run(lib.decode_layers, model, tokens[:, 0], input_pos, cache, B)

    def verify(self, model: Model, tokens: Tensor, input_pos: Tensor, cache: KVCache, policy=None, ops=None) -> Tensor:
        """EagerStep.verify's contract: tokens [1, T] of one sequence at consecutive positions input_pos
        [T], 2 <= T <= FUSED_MAX_ROWS, in one C call (each token's keys and values written before any
        attends, so the chunk is causal) -> logits [1, T, V]. Anything else (several rows at their own
        positions, a longer chunk) runs EagerStep's torch forward."""
        B, T = tokens.shape
        if not (self.verify_in_c and type(cache) is KVCache and B == 1 and policy is None and input_pos.dim() == 1 and 2 <= T <= FUSED_MAX_ROWS
                and bool((input_pos.diff() == 1).all())):
            return super().verify(model, tokens, input_pos, cache, policy, ops)
        lib = kernel_build.library()
        return self._run(lib.verify_layers, model, tokens[0], input_pos, cache, 1)[None]

    def _run(self, entry, model: Model, ids: Tensor, input_pos: Tensor, cache: KVCache, rows: int) -> Tensor:
        """One C call of decode.c: `entry` (decode_layers or verify_layers) on token ids [M] at the
        positions input_pos ([1] shared, or [M] consecutive) in a cache of `rows` rows -> logits [M, V].
        Builds the plan of (model, cache) on first use and checks, before C reads or writes anything,
        the cache, the ids and the cache's room."""
        assert type(cache) is KVCache and cache.k.shape[1] == rows and cache.k.dtype in CACHE_DTYPES, \
            "fused_decode writes a contiguous cache in fp32 or bf16 (run_rules.RUN_RULES refuses the rest)"
        plan = self._plan(model, cache)
        cache.reserve(input_pos)  # the contract's moves (a contiguous cache has none to make) and its check:
        cache.prepare(input_pos)  # a position past the allocation raises CacheFullError
        ids, logits = self._ids(model, ids), self._logits(model, plan, ids.shape[0])
        # each row's embedding, every layer, the final norm and the head, in C (x: the last layer's output)
        if entry(plan.layers, model.config.n_layers, ctypes.byref(plan.dims), ids.data_ptr(), ids.shape[0],
                 plan.x.data_ptr(), int(input_pos[0])) != 0:
            raise MemoryError("fused_decode: the C step could not allocate its work buffers")
        return logits

    def _run_paged(self, model: Model, ids: Tensor, input_pos: Tensor, cache: PagedKVCache) -> Tensor:
        """One C call of decode.c's decode_paged: token ids [B] of the cache's rows (its sequences) at
        input_pos ([1] shared, or [B, 1] each row's own) -> logits [B, V]. C reads and writes the pool's
        blocks in place, through the block tables that `reserve` set (the step's own call, or the
        engine's scheduler's: reserves=False), where the eager step gathers them (PagedKVCache.update)."""
        assert type(cache) is PagedKVCache and cache.dtype in CACHE_DTYPES and cache.window_size is None, \
            "fused_decode reads a paged cache of fp32 or bf16 blocks, no window (run_rules.RUN_RULES refuses the rest)"
        plan = self._plan(model, cache)
        if self.reserves:
            cache.reserve(input_pos)
        tables, pos = cache.read_tables(input_pos)  # checks that every block read is held; copies on write
        ids, logits = self._ids(model, ids), self._logits(model, plan, ids.shape[0])
        if kernel_build.library().decode_paged(plan.layers, model.config.n_layers, ctypes.byref(plan.dims),
                                               ids.data_ptr(), ids.shape[0], plan.x.data_ptr(), pos.data_ptr(),
                                               tables.data_ptr(), tables.shape[1], cache.block_size) != 0:
            raise MemoryError("fused_decode: the C step could not allocate its work buffers")
        return logits

    def takes_decodes_with_prompts(self, ops) -> bool:
        """EagerStep's: a paged cache's prompts in C run every row through the one body of decode.c with the
        plan's weight kinds, so a decode row among them gets decode's arithmetic (its products in the same
        batch GEMMs, whose rows never mix: the bits of a decode step's row)."""
        return self.prompts_in_c and self.prefill_chunk_size is None and self._same_products(ops)

    def _same_products(self, ops) -> bool:
        """The prompt ops `ops` run fp32 products with the decode step's activations (the plan's weight kinds)."""
        return ops is None or (ops.prompt == FP32 and bool(ops.int8_act) == self.int8_act)

    def _prompt_in_c(self, input_ids: Tensor, input_pos: Tensor, policy, ops) -> bool:
        """Whether a paged cache's prompt chunks run in C: prompts_in_c, whole (no prefill_chunk_size), no
        policy, fp32 prompt products with the decode step's activations (the plan's weight kinds), and a
        token in every row."""
        pos = input_pos if input_pos.dim() == 2 else input_pos.expand(input_ids.shape[0], -1)
        return (self.prompts_in_c and self.prefill_chunk_size is None and policy is None and self._same_products(ops)
                and bool((pos >= 0).any(dim=1).all()))

    def _prefill_paged(self, model: Model, input_ids: Tensor, input_pos: Tensor, cache: PagedKVCache) -> Tensor:
        """Every row's prompt chunk ([B, T], input_pos [T] or [B, T] with -1 for left padding) in one C call of
        decode.c's prefill_paged: the chunks' tokens are its rows, no padding, each at its position in its
        sequence's blocks -> the logits of each row's last token [B, V]."""
        B, T = input_ids.shape
        pos = input_pos if input_pos.dim() == 2 else input_pos.expand(B, T)
        plan = self._plan(model, cache)
        if self.reserves:
            cache.reserve(input_pos)
        tables, _ = cache.read_tables(pos.max(dim=1).values[:, None])  # every block up to each row's last position
        seq, col = (pos >= 0).nonzero(as_tuple=True)  # row-major: each sequence's tokens in order
        ids, at = self._ids(model, input_ids[seq, col]), pos[seq, col].contiguous()
        last = (pos >= 0).sum(dim=1).cumsum(0) - 1  # each row's last token among the M
        logits = self._logits(model, plan, B)
        x = torch.empty(ids.shape[0], model.config.dim)
        if kernel_build.library().prefill_paged(plan.layers, model.config.n_layers, ctypes.byref(plan.dims),
                                                ids.data_ptr(), ids.shape[0], x.data_ptr(), at.data_ptr(),
                                                seq.contiguous().data_ptr(), tables.data_ptr(), tables.shape[1],
                                                cache.block_size, last.data_ptr(), B) != 0:
            raise MemoryError("fused_decode: the C prompt step could not allocate its work buffers")
        return logits

    def _plan(self, model: Model, cache) -> _Plan:
        """The C descriptions of (model, cache), built at their first step."""
        if self.planned_for != (id(model), id(cache)):
            self.plan, self.planned_for = _Plan(model, cache, self.int8_act), (id(model), id(cache))
        return self.plan

    @staticmethod
    def _ids(model: Model, ids: Tensor) -> Tensor:
        """Token ids as C reads them (int64, contiguous); PromptError for one outside the vocabulary (C
        would read past the embedding)."""
        ids = ids.to(torch.int64).contiguous()
        if not bool(((ids >= 0) & (ids < model.config.vocab_size)).all()):
            bad = int(ids[(ids < 0) | (ids >= model.config.vocab_size)][0])
            raise PromptError(f"token id {bad} is outside the vocabulary [0, {model.config.vocab_size})")
        return ids

    @staticmethod
    def _logits(model: Model, plan: _Plan, M: int) -> Tensor:
        """The step's logits [M, V], which C writes: a new tensor each step (a caller may keep the last);
        the threads the products share out to are torch's now."""
        plan.dims.threads = torch.get_num_threads()
        logits = torch.empty(M, model.config.vocab_size)
        plan.dims.logits = logits.data_ptr()
        return logits


# ---------------------------------------------------------------- measured where it runs (kernels/fastpaths.py)
VERIFY_TOKENS = 4  # a verify chunk of the probe: speculative decoding's k = 3 proposals and the last token


PAGED_ROWS, PAGED_POSITION = 8, 40  # the paged probe: the engine's default max_batch_size, each row at 40
PROMPT_ROWS, PROMPT_TOKENS = 2, 32  # the paged prompt probe: two prompts of 32 tokens


def _probe(kind: str):
    """fastpaths' probe of the fused step: a two-layer Llama of the model's shapes (random weights, a
    4,096-token vocabulary), one decode token (or a verify chunk of VERIFY_TOKENS) at position 8, in C
    and through the eager step, on one cache (each call rewrites the same slots); "paged": a decode
    token for each of PAGED_ROWS sequences of a paged cache at their own positions ([B, 1], the serving
    engine's decode step), blocks of 16 reserved once; "prompt": PROMPT_ROWS prompts of PROMPT_TOKENS
    tokens with int4 blocks (fp32 activations) over a paged cache, C's prefill_paged against the eager
    prefill."""
    def make(s: Shapes, rows: int):
        if not kernel_build.available():
            return None
        cfg = ModelConfig(arch="llama", vocab_size=4096, dim=s.dim, n_layers=2, n_heads=s.heads,
                          n_kv_heads=s.kv_heads, head_dim=s.head_dim, hidden_dim=s.hidden, max_seq_len=64)
        model = Model(cfg)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        dispatch.install(model)
        if kind == "prompt":  # int4 blocks: prompts run in C only for codes (choose.py)
            model = quantize_weights(model, 4)
            cache = PagedKVCache(2, PROMPT_ROWS, s.kv_heads, s.head_dim, 16, PROMPT_ROWS * 4)
            cache.reserve(torch.arange(PROMPT_TOKENS).expand(PROMPT_ROWS, -1))
            ids, pos = torch.arange(PROMPT_ROWS * PROMPT_TOKENS).view(PROMPT_ROWS, -1), torch.arange(PROMPT_TOKENS)
            fused, eager = FusedStep(prompts_in_c=True), EagerStep()
            fused.reserves = eager.reserves = False  # each call rewrites the same slots
            pos = pos.expand(PROMPT_ROWS, -1)  # each row at its own positions, as the engine's
            return (lambda: fused.prefill(model, ids, pos, cache)), (lambda: eager.prefill(model, ids, pos, cache))
        if kind == "paged":
            cache = PagedKVCache(2, PAGED_ROWS, s.kv_heads, s.head_dim, 16, PAGED_ROWS * 4)
            cache.reserve(torch.arange(PAGED_POSITION + 1).expand(PAGED_ROWS, -1))  # the blocks of every slot read
            ids, pos = torch.arange(1, PAGED_ROWS + 1)[:, None], torch.full((PAGED_ROWS, 1), PAGED_POSITION)
            fused, eager = FusedStep(), EagerStep()
            fused.reserves = eager.reserves = False  # as the engine's: the blocks are held already
            return (lambda: fused.decode(model, ids, pos, cache)), (lambda: eager.decode(model, ids, pos, cache))
        cache = KVCache.for_model(model, 1, 64)
        T = 1 if kind == "decode" else VERIFY_TOKENS
        ids, pos = torch.arange(1, T + 1)[None], torch.arange(8, 8 + T)
        fused, eager = FusedStep(), EagerStep()
        if kind == "decode":
            return (lambda: fused.decode(model, ids, pos[:1], cache)), (lambda: eager.decode(model, ids, pos[:1], cache))
        return (lambda: fused.verify(model, ids, pos, cache)), (lambda: eager.verify(model, ids, pos, cache))
    return make


PROBES = (Probe("fused_step", "the fused C step (a decode token)", "the eager step", _probe("decode")),
          Probe("fused_verify", f"the fused C verify ({VERIFY_TOKENS} tokens)", "the eager verify",
                          _probe("verify")),
          Probe("fused_paged", f"the fused C step over a paged cache ({PAGED_ROWS} rows at their own positions)",
                "the eager step", _probe("paged")),
          Probe("fused_paged_prompt", f"{PROMPT_ROWS} prompts of {PROMPT_TOKENS} tokens of int4 blocks in one C call "
                "over a paged cache", "the eager prefill", _probe("prompt")))
