"""The speed model of speculative decoding (Leviathan et al. 2023, section 3), and its check against
what a run measured (chapter 13, `bench`).

Each proposed token is accepted with probability α, independently of the others (the model's
simplification). A round proposes k tokens and emits the accepted prefix plus one token of the
target's, so it emits on average

    E(α, k) = 1 + α + α² + ... + α^k = (1 - α^(k+1)) / (1 - α)

tokens. It costs k draft steps of relative cost c (a draft step's time over a target step's) and
one verify forward of relative cost v (the paper assumes v = 1: at batch 1 the forward of k + 1
tokens reads the weights once, like a step of one). The speed-up over plain decoding is then

    S(α, k, c, v) = E(α, k) / (k c + v).

It pays when E exceeds k c + v: a good draft (α near 1) that costs little (c near 0). Prompt lookup
has c ≈ 0 (a search in the text); a layer-skipping draft of n of L layers has c ≈ n / L.
"""

from __future__ import annotations


def expected_tokens(alpha: float, k: int) -> float:
    """E(α, k): tokens one round emits on average, the target's own token included (1 .. k + 1)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha={alpha} is a probability: use a number in [0, 1]")
    if alpha == 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """S(α, k, c, v) = E(α, k) / (k c + v): decode speed with speculation over decode speed without."""
    return expected_tokens(alpha, k) / (k * c + v)


def alpha_from_length(mean_length: float, k: int) -> float:
    """The α whose E(α, k) is a measured mean acceptance length (tokens per target forward), by
    bisection (E rises with α). This reads α off the rounds as the model sees them; the plain ratio
    accepted / proposed (stats.acceptance_rate) is lower, because a round stops at its first rejection."""
    if not 1 <= mean_length <= k + 1:
        raise ValueError(f"mean_length={mean_length} is outside [1, {k + 1}], what rounds of k={k} can emit")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < mean_length else (lo, mid)
    return (lo + hi) / 2


def best_k(alpha: float, c: float, v: float = 1.0, k_max: int = 16) -> int:
    """The k in 1..k_max with the highest predicted speed-up."""
    return max(range(1, k_max + 1), key=lambda k: predicted_speedup(alpha, k, c, v))


def summarize(config: dict, stats, speed: dict[str, float]) -> dict:
    """bench's report of a speculative run: what speculation did (the stats of its last N-token run)
    and what the speed model predicts from it: alpha read off the mean acceptance length, c the
    target's plain decode rate over the draft's (prompt lookup: 0, a search), and v = 1 (a verify
    forward costs one step, Leviathan et al.'s assumption)."""
    k, length = config["num_speculative_tokens"], stats.mean_acceptance_length
    alpha = alpha_from_length(min(max(length, 1.0), k + 1.0), k)
    c = speed["minigen plain"] / speed["minigen draft"] if "minigen draft" in speed else 0.0
    return {"method": config["speculative_method"], "k": k, "acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": length, "alpha": alpha, "draft_cost": c,
            "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
            "speedup_vs_plain": speed["minigen"] / speed["minigen plain"],
            "predicted_speedup": predicted_speedup(alpha, k, c)}
