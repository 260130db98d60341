"""The claims ledger: the article's quantitative claims, our measurements and the verdicts, from
one data file (claims.toml), checked when it is read.

    load_claims() ─> [Claim, ...] ─> format_ledger (a table) | to_dict (python -m minigen ledger --json)
                                  ─> verdict_counts (what chapter 18's figures/18_ledger.png draws)
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..errors import LedgerError

CLAIMS = Path(__file__).resolve().parent / "claims.toml"
VERDICTS = ("verified", "refuted", "reframed", "not yet measured")
FIELDS = ("id", "claim", "article_value", "measured", "machine", "verdict", "chapter", "source")


@dataclass(frozen=True)
class Claim:
    id: str  # "C1", "C5b", ...: the id the chapters cite
    claim: str  # the claim, in our words
    article_value: str  # what the article reports
    measured: str  # our number ("" until measured)
    machine: str  # "2-core CPU" (timed here), "counted" (bytes or FLOPs), "" until measured
    verdict: str  # one of VERDICTS
    chapter: str  # "04": notebooks/04_*.ipynb measures it; "": no chapter yet
    source: str  # where the measured value is stated

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def load_claims(path: str | Path = CLAIMS) -> list[Claim]:
    """Read and check a claims file -> its claims in order; LedgerError names the entry and the field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LedgerError(f"cannot read the claims file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise LedgerError(f"the claims file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise LedgerError(f"the claims file {path} is not valid TOML: {e}") from None
    entries = data.get("claim")
    if not isinstance(entries, list) or not entries:
        raise LedgerError(f"the claims file {path} has no [[claim]] entries")
    claims, seen = [], set()
    for i, entry in enumerate(entries, 1):
        where = f"{path.name}, claim {i} ({entry.get('id', 'no id')!r})"
        missing = [k for k in FIELDS if k not in entry]
        unknown = [k for k in entry if k not in FIELDS]
        if missing or unknown:
            raise LedgerError(f"{where}: " + "; ".join(
                ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(unknown)}"] if unknown
                                                                           else []))
                + f". Each claim has exactly: {', '.join(FIELDS)}")
        bad = [k for k in FIELDS if not isinstance(entry[k], str)]
        if bad:
            raise LedgerError(f"{where}: {', '.join(bad)} must be strings (quote them)")
        c = Claim(**entry)
        if c.id in seen:
            raise LedgerError(f"{where}: the id {c.id!r} appears twice; ids are unique")
        seen.add(c.id)
        if c.verdict not in VERDICTS:
            raise LedgerError(f"{where}: verdict={c.verdict!r} is invalid: use one of {', '.join(map(repr, VERDICTS))}")
        measured = c.verdict != "not yet measured"
        if measured and not (c.measured and c.machine):
            raise LedgerError(f"{where}: verdict {c.verdict!r} needs the measured value and the machine "
                              "(\"2-core CPU\" or \"counted\")")
        if not measured and (c.measured or c.machine or c.chapter):
            raise LedgerError(f"{where}: a claim not yet measured has measured, machine and chapter empty")
        if c.chapter and not (len(c.chapter) == 2 and c.chapter.isdigit()):
            raise LedgerError(f"{where}: chapter={c.chapter!r} is invalid: use the notebook's two digits, e.g. \"04\"")
        claims.append(c)
    return claims


def to_dict(claims: list[Claim]) -> list[dict]:
    """The JSON of `python -m minigen ledger --json`: a list of {id, claim, article_value, measured,
    verdict, chapter, ...}."""
    return [c.to_dict() for c in claims]


def verdict_counts(claims: list[Claim]) -> dict[str, int]:
    """How many claims hold each verdict, in VERDICTS order (every verdict present, zero or not): the
    data behind the ledger's bar in chapter 18, so a test can compare the figure's data, not its pixels."""
    return {v: sum(c.verdict == v for c in claims) for v in VERDICTS}


def format_ledger(claims: list[Claim]) -> str:
    """A plain-text table, one claim per block, then the count of each verdict."""
    lines = []
    for c in claims:
        where = f"chapter {c.chapter}" if c.chapter else c.source
        lines += [f"{c.id:<4} {c.verdict.upper():<17} {c.claim}",
                  f"     article: {c.article_value}",
                  f"     measured: {c.measured or '-'}" + (f" [{c.machine}]" if c.machine else ""),
                  f"     where: {where}", ""]
    counts = verdict_counts(claims)
    lines.append(f"{len(claims)} claims: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    return "\n".join(lines)
