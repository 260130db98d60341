"""minigen's own structured-output backend: a byte DFA walked against the vocabulary -> a token mask.

A token may follow the text exactly when the DFA (automaton.py), fed the token's bytes after the
text, does not die: the DFA keeps only states that can still reach acceptance, so "not dead" means
"some valid continuation exists". Walking every token separately (allowed_reference) costs the whole
vocabulary's bytes per state; a trie of the vocabulary shares their prefixes, so each distinct prefix
is read once, and all the prefixes of one length are read in one array step.
The masks depend only on the DFA state, so each state's mask is computed once, the first time a row
reaches it, and every later step is a dictionary lookup.

Legend: V the model's vocabulary size (embedding rows; may exceed the tokenizer's length).
"""

from __future__ import annotations

import time
from functools import lru_cache

import numpy as np
import torch

from minigen.decoding.automaton import Dfa
from minigen.decoding.guide import GuideSpec
from minigen.decoding.schema import schema_to_regex
from minigen.errors import ConfigError


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte -> the printable character that stands for it in a byte-level BPE
    vocabulary (printable Latin-1 bytes stand for themselves, the rest are shifted past U+0100)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}


def byte_fallback(token: str) -> int | None:
    """A sentencepiece byte token "<0x41>" -> 0x41; None for any other token."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes each token id writes into the text; None for special tokens (<|im_end|> and the
    like), which a guided text never contains (a stop id ends it instead)."""
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}  # added tokens are plain text
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    ordinary = [p for i, p in enumerate(pieces) if i not in added and p is not None]
    # A byte-level BPE vocabulary (GPT-2, SmolLM2, Llama 3) is written entirely in the table's stand-ins;
    # otherwise it is sentencepiece's: "▁" for a space and <0xNN> for a raw byte.
    byte_level = all(c in BYTE_OF_CHAR for p in ordinary for c in p)
    out: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(None)
        elif i in added:
            out.append(added[i].encode())
        elif byte_level:
            out.append(bytes(BYTE_OF_CHAR[c] for c in piece))
        elif byte_fallback(piece) is not None:
            out.append(bytes([byte_fallback(piece)]))
        else:
            out.append(piece.replace("\u2581", " ").encode())
    return out


class VocabularyTrie:
    """The vocabulary's byte strings as a trie stored in arrays, its nodes in order of depth.

    Node 0 is the empty prefix; every other node is one byte (`byte[n]`) after its `parent[n]`, and
    `levels[d]` is the slice of nodes d + 1 bytes deep. `end_node[t]`: the node where token t's bytes
    end (0 for a token that writes nothing or never may appear)."""

    def __init__(self, vocabulary: list[bytes | None]):
        self.vocabulary = vocabulary  # id -> bytes (None: never allowed)
        prefixes = sorted({data[:n] for data in vocabulary if data for n in range(1, len(data) + 1)},
                          key=lambda p: (len(p), p))
        node = {b"": 0} | {p: i + 1 for i, p in enumerate(prefixes)}
        self.parent = np.array([0] + [node[p[:-1]] for p in prefixes], dtype=np.int64)  # [N]
        self.byte = np.array([0] + [p[-1] for p in prefixes], dtype=np.int64)  # [N]
        depth_ends = np.cumsum(np.bincount([len(p) for p in prefixes])) + 1  # node 0 is depth 0
        self.levels = [slice(a, b) for a, b in zip(depth_ends[:-1], depth_ends[1:]) if b > a]
        self.end_node = np.array([node[data] if data else 0 for data in vocabulary], dtype=np.int64)  # [len]

    def allowed(self, table: np.ndarray, state: int) -> np.ndarray:
        """bool [len(vocabulary)]: the tokens whose bytes the DFA reads from `state` without dying.

        `table`: int [S + 1, 256], the DFA's table with DEAD written as S, whose own row is all S (a
        sink). All nodes of one depth step at once, from their parents' states: a breadth-first
        walk of the whole trie in one gather per depth, where a Python walk would visit node by node."""
        sink = table.shape[0] - 1
        states = np.empty(len(self.parent), dtype=np.int64)  # [N]: the DFA state after each node's bytes
        states[0] = state
        for level in self.levels:
            states[level] = table[states[self.parent[level]], self.byte[level]]
        return (states[self.end_node] != sink) & (self.end_node != 0)


def allowed_reference(dfa: Dfa, state: int, vocabulary: list[bytes | None]) -> list[bool]:
    """The plain definition the trie computes: walk every token's bytes from `state` on their own."""
    return [bool(data) and dfa.walk(state, data) is not None for data in vocabulary]


@lru_cache(maxsize=4)
def vocabulary_trie(tokenizer) -> VocabularyTrie:
    """One trie per tokenizer, shared by every guide compiled against it."""
    return VocabularyTrie(token_bytes(tokenizer))


def spec_regex(spec: GuideSpec) -> tuple[str, str]:
    """(the regex, the setting it came from) of a spec the own backend takes, else ConfigError."""
    if spec.kind == "regex":
        return spec.source, "guided_regex"
    if spec.kind == "json_schema":
        return schema_to_regex(spec.schema()), "response_format"
    what = "response_format={'type': 'json_object'} (any JSON object nests without bound, " \
           "beyond a regular expression)" if spec.kind == "json_object" else "guided_grammar"
    raise ConfigError(f"{what} is outside minigen's own backend (JSON schemas of a subset and regular "
                      "expressions); use guided_backend=\"llguidance\"")


class OwnGuide:
    """A GuideSpec compiled for minigen's own backend: the DFA, the vocabulary trie, and one mask
    per DFA state, filled in as rows reach the states."""
    backend = "minigen"

    def __init__(self, spec: GuideSpec, tokenizer, vocab_size: int, stop_ids):
        start = time.perf_counter()
        pattern, setting = spec_regex(spec)
        self.dfa = Dfa.from_regex(pattern, setting)
        self.trie = vocabulary_trie(tokenizer)
        sink = len(self.dfa.table)  # the table as an array, DEAD -> a sink row that stays in the sink
        self.table = np.array(self.dfa.table + [[sink] * 256], dtype=np.int64)  # [S + 1, 256]
        self.table[self.table < 0] = sink
        self.vocab_size = vocab_size  # V: the mask's length
        self.stop_ids = [int(i) for i in stop_ids if 0 <= int(i) < min(vocab_size, len(self.trie.vocabulary))]
        self.masks: dict[int, torch.Tensor] = {}  # DFA state -> bool [V]
        self.stopped = torch.zeros(vocab_size, dtype=torch.bool)  # bool [V]: after a stop token
        self.stopped[self.stop_ids] = True
        self.compile_s = time.perf_counter() - start  # the trie's build counts only for a tokenizer's first guide
        self.first_visit_s = 0.0  # seconds spent computing masks so far (a trie walk per new state)

    def mask(self, state: int) -> torch.Tensor:
        """bool [V]: the tokens allowed in `state`, plus the stop ids when `state` accepts. Cached."""
        if state not in self.masks:
            start = time.perf_counter()
            # numpy, then one zero-copy torch view: a small torch op can wait milliseconds on its thread pool
            mask = np.zeros(self.vocab_size, dtype=bool)
            found = self.trie.allowed(self.table, state)  # bool [len(tokenizer)]
            n = min(len(found), self.vocab_size)
            mask[:n] = found[:n]
            mask[self.stop_ids] = self.dfa.accepting(state)  # a stop token is allowed only after a whole match
            mask = torch.from_numpy(mask)
            self.masks[state] = mask
            self.first_visit_s += time.perf_counter() - start
        return self.masks[state]

    def matcher(self) -> "OwnMatcher":
        return OwnMatcher(self, self.dfa.start)


class OwnMatcher:
    """One row's text under an OwnGuide: its DFA state, or None once a stop token ended it."""

    def __init__(self, guide: OwnGuide, state: int | None):
        self.guide, self.state = guide, state

    def allowed(self) -> torch.Tensor:
        """bool [V], shared with every row in the same state: read it, never write to it (a copy per
        step would cost more than the lookup). Once a stop token ended the text, only the stop ids."""
        return self.guide.stopped if self.state is None else self.guide.mask(self.state)

    def advance(self, token: int) -> None:
        """Take a token that allowed() allowed; ValueError for any other (the caller's bug)."""
        token = int(token)
        if token in self.guide.stop_ids:
            if self.state is not None and not self.guide.dfa.accepting(self.state):
                raise ValueError(f"stop token {token} before the text is a whole match")
            self.state = None
            return
        if self.state is None:
            raise ValueError(f"token {token} after a stop token: only stop ids may follow")
        data = self.guide.trie.vocabulary[token] if 0 <= token < len(self.guide.trie.vocabulary) else None
        state = self.guide.dfa.walk(self.state, data) if data else None
        if state is None:
            raise ValueError(f"token {token} ({data!r}) cannot follow the text: allowed() did not allow it")
        self.state = state

    def is_complete(self) -> bool:
        return self.state is None or self.guide.dfa.accepting(self.state)

    def copy(self) -> "OwnMatcher":
        return OwnMatcher(self.guide, self.state)
