"""A regular expression -> an automaton over bytes: the first step of minigen's own structured output.

A tokenizer's tokens are byte strings, and one token may end halfway through a UTF-8 character, so
the automaton reads bytes, not characters: a character class such as [^"] becomes the UTF-8 byte
sequences of its code points. The pipeline is the textbook one (Thompson 1968; Rabin and Scott 1959):
parse the pattern into a tree, build an NFA from it, turn the NFA into a DFA by subset construction,
then keep only the states from which an accepting state can still be reached. After that pruning a
text is a valid prefix exactly when the DFA has not died on it, the property token_mask.py needs.

The subset (the whole pattern must match, as re.fullmatch):
- literal characters (any Unicode), and escapes: \\. \\\\ \\* and any other escaped punctuation,
  \\n \\t \\r \\f \\v, \\xNN, \\uNNNN; \\d \\w \\s and \\D \\W \\S as ASCII classes (like re.ASCII);
  `.` any character but a newline;
- classes [abc] [a-z] [^"\\\\] (escapes and \\d \\w \\s inside);
- groups (...) and (?:...), alternation |;
- quantifiers ? * + {m} {m,n} {m,} (greedy: in a whole match laziness changes nothing, so it is refused);
- ^ at the very start and $ at the very end (no-ops under whole-string matching).
Anything else (backreferences, lookaround, \\b, lazy or possessive quantifiers, a lone {) is a
ConfigError naming the construct.
"""

from __future__ import annotations

from dataclasses import dataclass

from minigen.errors import ConfigError

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters; UTF-8 cannot encode them
MAX_REPEAT = 1000  # {m,n} copies the NFA of its operand n times
MAX_DFA_STATES = 20000  # a DFA past this is a pattern for llguidance, not for this course's automaton
DEAD = -1  # the DFA's table entry for "no transition"

DIGIT = [(0x30, 0x39)]
WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
SPACE = [(0x09, 0x0D), (0x20, 0x20)]  # \t \n \v \f \r and the space, as Python's re.ASCII
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}


def refuse(pattern: str, construct: str, setting: str = "guided_regex") -> ConfigError:
    """`setting`: where the pattern came from (guided_regex, or response_format through schema.py)."""
    shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
    return ConfigError(f"{setting} {shown!r}: {construct} is outside minigen's regex subset (literals, "
                       "escapes, classes, groups, |, ? * + {m,n}; decoding/automaton.py); "
                       "use guided_backend=\"llguidance\" for the full language")


# --- Character sets: sorted, disjoint code point ranges ---------------------------------------------

def normalize(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort and merge overlapping or touching ranges."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Every character (surrogates excluded) not in `ranges`."""
    out, nxt = [], 0
    for lo, hi in normalize(ranges + [SURROGATES]):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return out


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The code points lo..hi as UTF-8 byte-range sequences: [[(0xC3, 0xC3), (0x80, 0xBF)], ...]. Each
    sequence matches a contiguous block of code points (the splitting rule of Rust's regex-syntax)."""
    if lo <= SURROGATES[1] and hi >= SURROGATES[0]:  # cut the surrogates out
        return ((utf8_sequences(lo, SURROGATES[0] - 1) if lo < SURROGATES[0] else [])
                + (utf8_sequences(SURROGATES[1] + 1, hi) if hi > SURROGATES[1] else []))
    for boundary in (0x7F, 0x7FF, 0xFFFF):  # split where the encoded length changes
        if lo <= boundary < hi:
            return utf8_sequences(lo, boundary) + utf8_sequences(boundary + 1, hi)
    if hi < 0x80:
        return [[(lo, hi)]]
    for i in range(1, 4):  # split until every trailing byte runs over a whole 0x80..0xBF span or one value
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m != 0:
                return utf8_sequences(lo, lo | m) + utf8_sequences((lo | m) + 1, hi)
            if hi & m != m:
                return utf8_sequences(lo, (hi & ~m) - 1) + utf8_sequences(hi & ~m, hi)
    a, b = chr(lo).encode(), chr(hi).encode()
    return [list(zip(a, b))]


# --- The parser: pattern -> tree ---------------------------------------------------------------------
# A tree node is ("chars", ranges) | ("seq", [nodes]) | ("alt", [nodes]) | ("repeat", node, m, n or None).

class Parser:
    """Recursive descent over the grammar  alt := seq ('|' seq)*;  seq := (atom quantifier?)*."""

    def __init__(self, pattern: str):
        self.pattern, self.pos = pattern, 0

    def peek(self) -> str | None:
        return self.pattern[self.pos] if self.pos < len(self.pattern) else None

    def take(self) -> str:
        if self.pos >= len(self.pattern):
            raise refuse(self.pattern, "a pattern that ends too early")
        self.pos += 1
        return self.pattern[self.pos - 1]

    def parse(self):
        if self.peek() == "^":
            self.pos += 1
        tree = self.alternation()
        if self.peek() == "$" and self.pos == len(self.pattern) - 1:
            self.pos += 1
        if self.pos != len(self.pattern):
            raise refuse(self.pattern, f"{self.pattern[self.pos]!r} at position {self.pos}")
        return tree

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self):
        items = []
        while self.peek() not in (None, "|", ")") and not (self.peek() == "$" and self.pos == len(self.pattern) - 1):
            items.append(self.quantified(self.atom()))
        return ("seq", items)

    def quantified(self, node):
        while self.peek() in ("?", "*", "+", "{"):
            c = self.take()
            if c == "{":
                m, n = self.counts()
            else:
                m, n = {"?": (0, 1), "*": (0, None), "+": (1, None)}[c]
            if self.peek() in ("?", "+"):
                raise refuse(self.pattern, f"the lazy or possessive quantifier {c}{self.peek()}")
            node = ("repeat", node, m, n)
        return node

    def counts(self) -> tuple[int, int | None]:
        """After '{': m}, m,} or m,n}."""
        close = self.pattern.find("}", self.pos)
        body = self.pattern[self.pos:close] if close >= 0 else ""
        parts = body.split(",")
        if close < 0 or len(parts) > 2 or not parts[0].isdigit() or (len(parts) == 2 and parts[1] and not parts[1].isdigit()):
            raise refuse(self.pattern, "a '{' that is not a quantifier {m}, {m,n} or {m,} (write \\{ for a brace)")
        self.pos = close + 1
        m = int(parts[0])
        n = m if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
        if (n is not None and n < m) or max(m, n or 0) > MAX_REPEAT:
            raise refuse(self.pattern, f"the quantifier {{{body}}} (counts must satisfy m <= n <= {MAX_REPEAT})")
        return m, n

    def atom(self):
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                if self.pattern[self.pos:self.pos + 2] != "?:":
                    raise refuse(self.pattern, f"the group {self.pattern[self.pos - 1:self.pos + 3]!r}... "
                                 "(lookaround and named groups)")
                self.pos += 2
            inner = self.alternation()
            if self.take() != ")":
                raise refuse(self.pattern, "an unclosed group")
            return inner
        if c == "[":
            return ("chars", self.char_class())
        if c == ".":
            return ("chars", complement([(0x0A, 0x0A)]))
        if c == "\\":
            return ("chars", self.escape())
        if c in "*+?{":
            raise refuse(self.pattern, f"a quantifier {c!r} with nothing to repeat")
        if c in ")]}^$":
            raise refuse(self.pattern, f"{c!r} at position {self.pos - 1}")
        return ("chars", [(ord(c), ord(c))])

    def escape(self) -> list[tuple[int, int]]:
        """After a backslash: a class (\\d), a control (\\n), a code (\\x41, \\u00e9) or escaped punctuation."""
        c = self.take()
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c.lower() in CLASS_ESCAPES:
            return complement(CLASS_ESCAPES[c.lower()])
        if c in CHAR_ESCAPES:
            return [(ord(CHAR_ESCAPES[c]),) * 2]
        if c in ("x", "u"):
            digits = self.pattern[self.pos:self.pos + (2 if c == "x" else 4)]
            if len(digits) != (2 if c == "x" else 4) or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise refuse(self.pattern, f"the escape \\{c}{digits}")
            self.pos += len(digits)
            return [(int(digits, 16),) * 2]
        if c.isascii() and not c.isalnum():
            return [(ord(c), ord(c))]
        raise refuse(self.pattern, f"the escape \\{c}")

    def char_class(self) -> list[tuple[int, int]]:
        """After '[': members up to ']', with ranges a-z and a leading ^ for the complement."""
        negate = self.peek() == "^"
        self.pos += negate
        ranges: list[tuple[int, int]] = []
        while True:
            c = self.take()
            if c == "]" and ranges:
                break
            if c == "]" or (c == "[" and self.peek() == ":"):
                raise refuse(self.pattern, "an empty class [] or a POSIX class [:name:]")
            lo = self.escape() if c == "\\" else [(ord(c), ord(c))]
            if self.peek() == "-" and self.pattern[self.pos + 1:self.pos + 2] not in ("]", ""):
                self.pos += 1
                h = self.take()
                hi = self.escape() if h == "\\" else [(ord(h), ord(h))]
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1] or hi[0][0] < lo[0][0]:
                    raise refuse(self.pattern, f"the class range ending at position {self.pos}")
                lo = [(lo[0][0], hi[0][0])]
            ranges += lo
        return complement(ranges) if negate else normalize(ranges)


# --- Thompson's construction: tree -> NFA over bytes -------------------------------------------------

class Nfa:
    """States 0..n-1; `edges[s]`: (lo, hi, target) byte ranges; `epsilon[s]`: targets on no input."""

    def __init__(self):
        self.edges: list[list[tuple[int, int, int]]] = []
        self.epsilon: list[list[int]] = []

    def new(self) -> int:
        self.edges.append([])
        self.epsilon.append([])
        return len(self.edges) - 1

    def build(self, node, start: int) -> int:
        """Add the states that match `node` from `start`; return the state where a match ends."""
        kind = node[0]
        if kind == "chars":
            end = self.new()
            for lo, hi in node[1]:
                for seq in utf8_sequences(lo, hi):  # one path of byte ranges per UTF-8 block
                    s = start
                    for blo, bhi in seq[:-1]:
                        t = self.new()
                        self.edges[s].append((blo, bhi, t))
                        s = t
                    self.edges[s].append((seq[-1][0], seq[-1][1], end))
            return end
        if kind == "seq":
            for item in node[1]:
                start = self.build(item, start)
            return start
        if kind == "alt":
            end = self.new()
            for branch in node[1]:
                entry = self.new()  # a fresh entry per branch keeps a branch's loops to itself
                self.epsilon[start].append(entry)
                self.epsilon[self.build(branch, entry)].append(end)
            return end
        _, inner, m, n = node  # "repeat": m copies, then n - m optional ones or a loop
        for _ in range(m):
            start = self.build(inner, start)
        if n is None:
            loop = self.new()
            self.epsilon[start].append(loop)
            self.epsilon[self.build(inner, loop)].append(loop)
            return loop
        end = self.new()
        for _ in range(n - m):
            self.epsilon[start].append(end)
            start = self.build(inner, start)
        self.epsilon[start].append(end)
        return end

    def closure(self, states) -> frozenset[int]:
        """The states reachable from `states` on epsilon moves alone."""
        seen, stack = set(states), list(states)
        while stack:
            for t in self.epsilon[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)


# --- Subset construction and pruning: NFA -> DFA -----------------------------------------------------

@dataclass
class Dfa:
    """A DFA over bytes in which every state can still reach acceptance.

    `table[s][byte]`: the next state, or DEAD; `accept[s]`: s ends a whole match; `start`: state 0."""
    table: list[list[int]]
    accept: list[bool]
    start: int = 0

    @classmethod
    def from_regex(cls, pattern: str, setting: str = "guided_regex") -> "Dfa":
        """Compile a pattern of the subset (module docstring), else ConfigError naming the construct
        and `setting`, the field the pattern came from."""
        nfa = Nfa()
        final = nfa.build(Parser(pattern).parse(), nfa.new())
        return determinize(nfa, final, pattern, setting)

    def step(self, state: int, byte: int) -> int | None:
        """The state after one more byte, or None when no match can start with the text plus it."""
        nxt = self.table[state][byte]
        return None if nxt == DEAD else nxt

    def accepting(self, state: int) -> bool:
        return self.accept[state]

    def walk(self, state: int | None, data: bytes) -> int | None:
        """The state after every byte of `data` (None once dead)."""
        for byte in data:
            if state is None:
                return None
            state = self.step(state, byte)
        return state

    def matches(self, text: str | bytes) -> bool:
        """The whole text matches (re.fullmatch's question)."""
        state = self.walk(self.start, text.encode() if isinstance(text, str) else text)
        return state is not None and self.accept[state]


def byte_classes(nfa: Nfa) -> list[tuple[int, int]]:
    """Ranges of bytes that every NFA edge treats alike: the DFA computes one move per range."""
    cuts = {0, 256}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts.update((lo, hi + 1))
    cuts = sorted(cuts)
    return list(zip(cuts[:-1], [c - 1 for c in cuts[1:]]))


def determinize(nfa: Nfa, final: int, pattern: str, setting: str) -> Dfa:
    """Subset construction (each DFA state is a set of NFA states), then dead-state removal."""
    classes = byte_classes(nfa)
    first = nfa.closure([0])
    index, sets, table = {first: 0}, [first], []
    while len(table) < len(sets):
        current, row = sets[len(table)], [DEAD] * 256
        for lo, hi in classes:
            moved = [t for s in current for elo, ehi, t in nfa.edges[s] if elo <= lo <= ehi]
            if not moved:
                continue
            target = nfa.closure(moved)
            if target not in index:
                if len(sets) >= MAX_DFA_STATES:
                    raise refuse(pattern, f"a pattern whose DFA passes {MAX_DFA_STATES} states", setting)
                index[target] = len(sets)
                sets.append(target)
            row[lo:hi + 1] = [index[target]] * (hi + 1 - lo)
        table.append(row)
    table, accept = prune(table, [final in s for s in sets], pattern, setting)
    return minimize(table, accept, [lo for lo, _ in classes])


def prune(table: list[list[int]], accept: list[bool], pattern: str, setting: str) -> tuple[list[list[int]], list[bool]]:
    """Drop the states from which no accepting state is reachable, and renumber the rest."""
    incoming: list[set[int]] = [set() for _ in table]
    for s, row in enumerate(table):
        for t in row:
            if t != DEAD:
                incoming[t].add(s)
    live = {s for s, a in enumerate(accept) if a}
    stack = list(live)
    while stack:
        for s in incoming[stack.pop()]:
            if s not in live:
                live.add(s)
                stack.append(s)
    if 0 not in live:
        raise ConfigError(f"{setting} {pattern[:80]!r} matches no string; write a pattern that some text matches")
    order = sorted(live)  # the start state 0 stays 0
    renumber = {s: i for i, s in enumerate(order)}
    new_table = [[renumber.get(t, DEAD) for t in table[s]] for s in order]
    return new_table, [accept[s] for s in order]


def minimize(table: list[list[int]], accept: list[bool], representatives: list[int]) -> Dfa:
    """Merge the states no text can tell apart (Moore's partition refinement), so that token_mask.py
    computes one mask per distinct future rather than one per path (a class such as [^"] leaves
    a state per UTF-8 lead byte otherwise). `representatives`: one byte of each byte class."""
    moves = [[row[b] for b in representatives] for row in table]  # DEAD is -1: block[-1] reads the sink
    block = [int(a) for a in accept] + [DEAD]  # start from {rejecting, accepting} (+ the dead sink)
    count = len(set(block))
    while True:
        signatures: dict[tuple, int] = {}
        block = [signatures.setdefault((block[s], *[block[t] for t in moves[s]]), len(signatures))
                 for s in range(len(table))] + [DEAD]
        if len(signatures) + 1 == count:
            break
        count = len(signatures) + 1
    block.pop()
    first = {}  # renumber blocks in order of their first state, so that the start state 0 stays 0
    for b in block:
        first.setdefault(b, len(first))
    rows: list[list[int]] = [[]] * len(first)
    accepting = [False] * len(first)
    for s, row in enumerate(table):
        rows[first[block[s]]] = [first[block[t]] if t != DEAD else DEAD for t in row]
        accepting[first[block[s]]] = accept[s]
    return Dfa(rows, accepting)
