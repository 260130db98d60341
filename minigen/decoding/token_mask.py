"""minigen's own structured-output backend: a byte DFA walked against the vocabulary -> a token mask.

A token may follow the text exactly when the DFA (automaton.py), fed the token's bytes after the
text, does not die: the DFA keeps only states that can still reach acceptance, so "not dead" means
"some valid continuation exists". Walking every token separately would cost the whole vocabulary's
bytes per state; a trie of the vocabulary shares their prefixes, and a branch is cut the moment the
DFA dies (after '"' in a JSON number, every token that starts with a letter goes in one step).
The masks depend only on the DFA state, so each state's mask is computed once, the first time a row
reaches it, and every later step is a dictionary lookup.

Legend: V the model's vocabulary size (embedding rows; may exceed the tokenizer's length).
"""

from __future__ import annotations

import time
from functools import lru_cache

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
    """The vocabulary's byte strings as a trie: node 0 is the empty prefix; `children[n]` maps a byte
    to the next node; `ends[n]` lists the token ids whose bytes end at node n."""

    def __init__(self, vocabulary: list[bytes | None]):
        self.vocabulary = vocabulary  # id -> bytes (None: never allowed)
        self.children: list[dict[int, int]] = [{}]
        self.ends: list[list[int]] = [[]]
        for token, data in enumerate(vocabulary):
            if not data:  # None, or an empty token that writes nothing
                continue
            node = 0
            for byte in data:
                nxt = self.children[node].get(byte)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][byte] = nxt
                    self.children.append({})
                    self.ends.append([])
                node = nxt
            self.ends[node].append(token)

    def allowed_ids(self, dfa: Dfa, state: int) -> list[int]:
        """Every token whose bytes the DFA can read from `state` without dying (depth-first walk)."""
        ids: list[int] = []
        table, children, ends = dfa.table, self.children, self.ends
        stack = [(0, state)]
        while stack:
            node, s = stack.pop()
            row = table[s]
            for byte, child in children[node].items():
                t = row[byte]
                if t >= 0:  # automaton.DEAD is -1
                    ids.extend(ends[child])
                    stack.append((child, t))
        return ids


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
        self.vocab_size = vocab_size  # V: the mask's length
        self.stop_ids = [int(i) for i in stop_ids if 0 <= int(i) < min(vocab_size, len(self.trie.vocabulary))]
        self.masks: dict[int, torch.Tensor] = {}  # DFA state -> bool [V]
        self.stopped = torch.zeros(vocab_size, dtype=torch.bool)  # bool [V]: after a stop token
        self.stopped[self.stop_ids] = True
        self.compile_s = time.perf_counter() - start
        self.first_visit_s = 0.0  # seconds spent computing masks so far (a trie walk per new state)

    def mask(self, state: int) -> torch.Tensor:
        """bool [V]: the tokens allowed in `state`, plus the stop ids when `state` accepts. Cached."""
        if state not in self.masks:
            start = time.perf_counter()
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            ids = [i for i in self.trie.allowed_ids(self.dfa, state) if i < self.vocab_size]
            mask[torch.tensor(ids, dtype=torch.long)] = True
            mask[self.stop_ids] = self.dfa.accepting(state)  # a stop token is allowed only after a whole match
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
