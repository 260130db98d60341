"""The data behind figures/18_ledger.png is the ledger's own count (ledger.verdict_counts)."""

from minigen.course.ledger import VERDICTS, load_claims, verdict_counts


def test_verdict_counts_are_the_ledger_figures_data():
    """figures/18_ledger.png draws verdict_counts(load_claims()): every verdict, in order, summing to the claims."""
    claims = load_claims()
    counts = verdict_counts(claims)
    assert list(counts) == list(VERDICTS) and sum(counts.values()) == len(claims)
    assert counts["verified"] == sum(c.verdict == "verified" for c in claims)
