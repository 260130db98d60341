"""Beam search: keep the k most likely sequences, not the one most likely token (generate's num_beams).

Shapes: B prompts, k beams a prompt (num_beams), T prompt tokens, n new tokens at most, V vocabulary,
K candidates ranked a prompt each step.

Greedy decoding keeps the most likely next token at every step, and can walk past a sequence that
is more likely as a whole. Beam search keeps k running sequences (beams) a prompt, each scored by
the sum of its tokens' log-probabilities. At every step each beam proposes all V tokens, the k x V
sums of a prompt are ranked, and the best continuations become the next beams: one beam may be
continued twice while another is dropped, so the cache's rows follow them (cache.reorder_rows: an
index_select of every layer's keys and values, in place). A continuation that ends in a stop token
is a finished hypothesis, scored sum / new_tokens ** length_penalty; each prompt keeps its k best,
and the best of them is the output.

The rules are transformers' (`GenerationMixin._beam_search`, transformers 5.x), followed exactly,
so the tokens equal its generate(num_beams=k, do_sample=False, length_penalty=...) on the same model
(tests/test_beam.py):
- every beam starts as the prompt, and only beam 0 proposes at the first step (the others score
  -1e9), so the first step's k beams are the prompt's k best first tokens;
- K = max(2, 1 + number of stop ids) x k candidates are ranked, so that k unfinished ones remain
  even when as many stop;
- a candidate that stops is a finished hypothesis only when it ranks among the top k; either way it
  runs no further. At max_new_tokens every candidate stops;
- a hypothesis's length counts its new tokens, the stop token included;
- early_stopping=False (transformers' default): a prompt is done once it holds k finished
  hypotheses and its best running beam, scored at the current length, does not beat the worst of
  them; from then on it takes no new hypothesis. The batch stops when every prompt is done, every
  candidate stopped, or at max_new_tokens.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from .errors import ConfigError
from .run_plan import Plan
from .stats import GenerationStats, finish_timing, record_cache

NEG = -1.0e9  # transformers' score for what must not be chosen: the empty beams, the stopped candidates


def beam_search(model, input_ids: Tensor, plan: Plan, stats: GenerationStats) -> Tensor:
    """Beam search of each prompt of input_ids [B, T] with `plan` (built for B x k rows) ->
    [B, T + m]: each prompt then its best hypothesis, a shorter one padded with its stop token
    (m: the longest best hypothesis's new tokens, as transformers returns them). Fills `stats`."""
    config, step = plan.config, plan.step
    k, n, lp = config.num_beams, config.max_new_tokens, config.length_penalty
    (B, T), device = input_ids.shape, input_ids.device
    assert plan.batch == B * k, "beam search runs k rows a prompt: make_plan(model, config, B * num_beams)"
    if plan.observers:
        raise ConfigError(f"observers with num_beams={k}: they would see the attention of beams that are then "
                          "dropped. Fix: num_beams=1 to observe attention.")
    stats.step, stats.plan = step.name, str(plan)
    if n == 0:
        return input_ids.clone()
    stop_list = config.stop_token_ids if config.stop_token_ids is not None else model.config.eos_token_ids
    stop_ids = torch.tensor(stop_list, dtype=torch.long, device=device)
    pad = stop_list[0] if stop_list else 0  # after a hypothesis's stop token
    K = max(2, 1 + len(stop_list)) * k
    first_k = torch.arange(K, device=device) < k  # [K]: the candidates that may become hypotheses
    row_of = torch.arange(B, device=device)[:, None] * k  # [B, 1]: each prompt's first row

    running = torch.zeros(B, k, device=device)  # [B, k] the running beams' log-prob sums
    running[:, 1:] = NEG  # every beam holds the prompt: only beam 0 proposes at first
    seqs = torch.full((B, k, n), pad, dtype=torch.long, device=device)  # [B, k, n] their new tokens
    done_seqs = seqs.clone()  # [B, k, n] each prompt's best finished hypotheses,
    done_scores = torch.full((B, k), NEG, device=device)  # [B, k] their scores, best first,
    done_lens = torch.zeros(B, k, dtype=torch.long, device=device)  # [B, k] their new tokens,
    done = torch.zeros(B, k, dtype=torch.bool, device=device)  # [B, k] and which slots hold one
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)  # [B, 1] a prompt not yet done

    cache = plan.make_cache(model)
    start = last = time.perf_counter()
    with step.grad_mode():
        policy = plan.make_policy(cache)
        rows = input_ids.repeat_interleave(k, dim=0)  # [B * k, T]: row b * k + j is prompt b's beam j
        logits = step.prefill(model, rows, torch.arange(T, device=device), cache, policy, ops=plan.prompt_ops)
        stats.prefill_s = time.perf_counter() - start
        for i in range(n):
            V = logits.shape[-1]
            sums = torch.log_softmax(logits.float(), dim=-1).view(B, k, V) + running[:, :, None]  # [B, k, V]
            scores, flat = torch.topk(sums.view(B, k * V), K)  # [B, K], best first
            beam, token = flat // V, flat % V  # [B, K]: which beam each candidate continues, with which token
            cand = seqs.gather(1, beam[:, :, None].expand(B, K, n)).clone()  # [B, K, n]
            cand[:, :, i] = token
            stops = torch.isin(token, stop_ids) | (i == n - 1)  # [B, K]
            # the k best candidates that did not stop run on; the cache's rows follow them
            alive = scores + stops.float() * NEG
            pick = torch.topk(alive, k).indices  # [B, k]
            running, seqs = alive.gather(1, pick), cand.gather(1, pick[:, :, None].expand(B, k, n))
            cache.reorder_rows((beam.gather(1, pick) + row_of).flatten())
            # the top k candidates that stopped are hypotheses, merged into the prompt's k best
            new = stops & first_k
            score = torch.where(new & improvable, scores / ((i + 1) ** lp), NEG)  # [B, K]
            best = torch.topk(torch.cat([done_scores, score], dim=1), k).indices  # [B, k]
            done_scores = torch.cat([done_scores, score], dim=1).gather(1, best)
            done_seqs = torch.cat([done_seqs, cand], dim=1).gather(1, best[:, :, None].expand(B, k, n))
            done_lens = torch.cat([done_lens, torch.full_like(score, i + 1, dtype=torch.long)], dim=1).gather(1, best)
            done = torch.cat([done, new], dim=1).gather(1, best)
            # a prompt is done when its best running beam, at this length, cannot beat its worst hypothesis
            worst = torch.where(done, done_scores.min(dim=1, keepdim=True).values, NEG)  # [B, k]
            improvable &= (running[:, :1] / ((i + 1) ** lp) > worst).any(dim=1, keepdim=True)
            now = time.perf_counter()
            if i == 0:
                stats.ttft_s = now - start
            stats.token_latencies_s.append(now - last)
            last = now
            if not bool(improvable.any()) or bool(stops.all()):
                break
            logits = step.decode(model, seqs[:, :, i].reshape(B * k, 1), torch.tensor([T + i], device=device),
                                 cache, policy, ops=plan.decode_ops)  # [B * k, V]
    m = int(done_lens[:, 0].max())
    stats.new_tokens = m
    record_cache(stats, cache)
    step.report(stats)
    finish_timing(stats.timing, start)
    return torch.cat([input_ids, done_seqs[:, 0, :m].to(input_ids.dtype)], dim=1)
