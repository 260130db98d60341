"""Text out of tokens, one token at a time, and stop strings matched across token boundaries.

A streaming server sends text, not ids, and a token is not a piece of text: a byte-level BPE
(GPT-2, SmolLM2, Llama 3) or byte-fallback vocabulary (Llama 2, Gemma) splits one emoji over
several tokens, each of which decodes alone to U+FFFD; a SentencePiece word start "▁Hello" decodes
to "Hello" when it comes first and to " Hello" after other text. So the Detokenizer decodes a
short window of recent ids and sends only the text that the newest token completed (vLLM's
`detokenize_incrementally`, its prefix_offset and read_offset):

    ids:     ... | prefix_offset ........ read_offset ........ newest |
    text:          decode(ids[prefix:read])  = already sent (context)
                   decode(ids[prefix:])      = context + the new piece, sent unless it ends in U+FFFD

StopStrings then cuts the text at the first stop string (OpenAI's `stop`), which may be spread
over several pieces, and holds back the text that might still become one.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from ..errors import ConfigError

REPLACEMENT = "\ufffd"  # what a decoder gives for an unfinished (or invalid) UTF-8 sequence
# Prompt tokens decoded before the first output token, so its leading space comes out whole
# (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
CONTEXT_TOKENS = 5
# A character is at most 4 UTF-8 bytes and a token holds at least one, so valid text ends inside a
# character for at most 3 tokens in a row. Past this many held tokens (only invalid bytes or a run
# of skipped special tokens get here) the text is sent as decoded, to bound each push's work.
MAX_HELD_TOKENS = 16
MAX_STOPS = 4  # OpenAI's limit on `stop`


class Detokenizer:
    """Incremental detokenization of one sequence (vLLM's prefix/read offsets).

    Invariant, for the output ids `out` (the prompt only gives context):
        "".join(d.push(t) for t in out) + d.flush()
            == tokenizer.decode(out, skip_special_tokens=s, clean_up_tokenization_spaces=False)
    It is exact for byte-level BPE tokenizers (GPT-2, SmolLM2, Llama 3, Qwen), and for every
    tokenizer when prompt_ids is empty. The exceptions, each by design:
    - a decoder that strips the first token's leading space (SentencePiece's Strip after
      Replace("▁", " "): Llama 2, Mistral, Gemma): after a prompt the output keeps it (" Hello",
      as it reads after the prompt) where decode(out) alone gives "Hello";
    - a tokenizer whose decode cleans up spaces before punctuation (clean_up_tokenization_spaces,
      WordPiece-era; transformers 5 ignores it for BPE): the pieces keep " ." as decoded, since a
      piece already sent cannot lose its space when the "." arrives;
    - more than MAX_HELD_TOKENS tokens in a row that leave the text inside a character (invalid
      UTF-8, or skipped special tokens): the held text is sent as decoded, U+FFFD included.
    A prompt that ends inside a character gives no context from those tokens, so the output's first
    bytes decode as in decode(out) instead of completing the prompt's character.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [int(i) for i in list(prompt_ids)[-CONTEXT_TOKENS:]]
        while context and self._decode(context).endswith(REPLACEMENT):
            context.pop()  # the prompt's unfinished character: its bytes must not join the output's
        # The window is ids[prefix_offset:]; ids before prefix_offset are never decoded again, so
        # the window starts at 0 and read_offset counts the ids whose text has been sent.
        self.window: list[int] = context
        self.read_offset = len(context)
        self.prefix_text = self._decode(context)  # decode(window[:read_offset]): sent or context

    def _decode(self, ids: list[int]) -> str:
        # No cleanup: " ." cannot become "." once " " has been sent (see the class docstring).
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _emit(self, text: str) -> str:
        """Send text's part past prefix_text; the sent ids become the next window's context."""
        piece = text[len(self.prefix_text):]
        self.window = self.window[self.read_offset:]  # prefix_offset moves to read_offset
        self.read_offset = len(self.window)
        self.prefix_text = self._decode(self.window)
        return piece

    def push(self, token_id: int) -> str:
        """The new text this token completes: "" while a character is unfinished (U+FFFD at the end)."""
        self.window.append(int(token_id))
        text = self._decode(self.window)
        # Hold while the text ends inside a character, or has not grown (a skipped special token, a
        # lone "▁" that a SentencePiece decoder strips): sending then would cut the window's context.
        unfinished = text.endswith(REPLACEMENT) or len(text) <= len(self.prefix_text)
        if unfinished and len(self.window) - self.read_offset < MAX_HELD_TOKENS:
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """The text still held at the end (an unfinished character as decoded: U+FFFD)."""
        if len(self.window) == self.read_offset:
            return ""
        return self._emit(self._decode(self.window))


def check_stops(stops) -> list[str]:
    """stops as a list, or ConfigError naming the field `stop` and the rule it breaks."""
    if not isinstance(stops, (list, tuple)):
        raise ConfigError(f"stop={stops!r} is invalid: give a list of at most {MAX_STOPS} non-empty "
                          f"strings (wrap a single string in a list)") from None
    if len(stops) > MAX_STOPS:
        raise ConfigError(f"stop has {len(stops)} strings: give at most {MAX_STOPS} (OpenAI's limit)") from None
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ConfigError(f"stop contains {s!r}: every stop must be a non-empty string") from None
    return list(stops)


class StopStrings:
    """Stop strings matched across token boundaries.

    The match is the stop occurrence that ends first in the whole text (the first point at which a
    streaming server can know it must stop); of several ending there, the one starting first. The
    result depends only on the concatenated text, never on how it was split into pieces.
    """

    def __init__(self, stops: list[str]):
        self.stops = check_stops(stops)  # [] = never stops
        self.held = ""  # text not sent yet: a suffix that might be the start of a stop
        self.matched = False

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send now, matched?); on a match the text ends right before the stop string.

        After a match every push gives ("", True): the stop and all text after it are cut.
        """
        if self.matched:
            return "", True
        buffer = self.held + text
        # A stop cannot start in text already sent: held is the longest suffix that is a stop's
        # prefix, so an occurrence that reaches into this push starts inside buffer.
        best = None  # (end, start) of the earliest-ending occurrence
        for stop in self.stops:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        if best is not None:
            self.matched, self.held = True, ""
            return buffer[:best[1]], True
        keep = self._partial(buffer)
        self.held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def _partial(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop (0 if none)."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """The held-back text at the end ("" after a match)."""
        held, self.held = self.held, ""
        return held


class StopText:
    """One row's text as its tokens come, cut at its stop strings: what generate's `stop` reads.

    push(token) -> whether a stop string has matched (the row then stops); text() -> the row's new
    text, ending right before the match (or whole, without one). The Detokenizer keeps characters
    whole; StopStrings finds a stop spread over several tokens."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stops: Sequence[str] | None):
        self.detok, self.cut = Detokenizer(tokenizer, prompt_ids), StopStrings(list(stops or []))
        self.parts: list[str] = []
        self.matched, self.done = False, False
        self.pushed = 0  # tokens taken, up to and including the one that completed a stop string

    def push(self, token_id: int) -> bool:
        if not self.matched:
            piece, self.matched = self.cut.push(self.detok.push(token_id))
            self.parts.append(piece)
            self.pushed += 1
        return self.matched

    def text(self) -> str:
        """The whole new text so far, the held-back tail included (call once the row has ended)."""
        if not self.done and not self.matched:
            piece, self.matched = self.cut.push(self.detok.flush())
            self.parts += [piece, self.cut.flush()]
        self.done = True
        return "".join(self.parts)


def echo_tokens(tokens: Iterable[int], tokenizer, prompt_ids: Sequence[int], stops: Sequence[str] | None,
                write: Callable[[str], None], first: str = "") -> int:
    """Write each token's new text as it comes (`first` before it: the prompt's echo), cut before a stop
    string, the text that may still begin one held back until it cannot (`minigen generate`'s output);
    -> the tokens taken."""
    text, sent, count = StopText(tokenizer, prompt_ids, stops), 0, 0
    for token in tokens:
        count += 1
        text.push(int(token))
        so_far = "".join(text.parts)
        write(first + so_far[sent:])
        first, sent = "", len(so_far)
    write(first + text.text()[sent:])
    return count
