"""Incremental detokenization and stop strings (minigen/decoding/detokenize.py).

The reference for the Detokenizer is the tokenizer's own decode of all output ids at once; for
StopStrings it is str.find on the whole text. Each is checked on hand-picked hard cases (an emoji
split over byte tokens, a stop split over pieces) and on random inputs with hypothesis.
"""

from __future__ import annotations

import copy
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from minigen.errors import ConfigError
from minigen.decoding.detokenize import MAX_HELD_TOKENS, REPLACEMENT, Detokenizer, StopStrings

# SmolLM2's chat template ends the prompt with this: the output is decoded after it.
CHAT_PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
HARD_TEXTS = {
    "emoji": "Sure 😀 and 🎉🎉!",                  # 4-byte characters over several byte-level tokens
    "zwj_family": "family: 👨\u200d👩\u200d👧 done",  # joiners between 4-byte characters
    "cjk": "你好，世界。日本語のテキスト",
    "accents": "café naïve Ångström über señor",
    "leading_spaces": "   three spaces, then  two",
    "newlines": "line one\n\nline two\n\t tab\r\n",
}


def stream(tokenizer, prompt_ids, out, skip_special_tokens=True):
    """The pieces that push gives for each output id, and flush's rest."""
    d = Detokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    return [d.push(t) for t in out], d.flush()


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2[1]


# ---------------------------------------------------------------- Detokenizer on SmolLM2 (byte-level BPE)
@pytest.mark.parametrize("name", HARD_TEXTS)
def test_pieces_concatenate_to_decode(tok, name):
    out = encode(tok, HARD_TEXTS[name])
    pieces, rest = stream(tok, encode(tok, CHAT_PROMPT), out)
    assert "".join(pieces) + rest == tok.decode(out, skip_special_tokens=True) == HARD_TEXTS[name]
    assert rest == ""
    assert not any(REPLACEMENT in p for p in pieces), pieces


def test_emoji_is_split_and_held_until_whole(tok):
    out = encode(tok, HARD_TEXTS["emoji"])
    # The test's premise: some token alone is half a character.
    assert any(REPLACEMENT in tok.decode([t]) for t in out)
    pieces, _ = stream(tok, [], out)
    assert "" in pieces  # a token that completes no character gives nothing yet
    assert any("😀" in p for p in pieces)


@pytest.mark.parametrize("name", ["emoji", "cjk", "accents", "newlines"])
def test_piece_is_sent_as_soon_as_whole(tok, name):
    """After k pushes the text sent is decode(out[:j]) for the largest j <= k whose decode ends on a
    whole character: a token's text waits only for the token that finishes its last character."""
    out = encode(tok, HARD_TEXTS[name])
    d = Detokenizer(tok, encode(tok, CHAT_PROMPT))
    sent, whole = "", ""
    for k, t in enumerate(out, start=1):
        sent += d.push(t)
        if not tok.decode(out[:k]).endswith(REPLACEMENT):
            whole = tok.decode(out[:k])
        assert sent == whole, k


def test_long_english_text_with_a_bounded_window(tok, english_text_ids):
    """Two thousand tokens: the invariant holds, and each push decodes only a few ids."""
    out = english_text_ids.tolist()
    d = Detokenizer(tok, [])
    pieces, longest = [], 0
    for t in out:
        pieces.append(d.push(t))
        longest = max(longest, len(d.window))
    assert "".join(pieces) + d.flush() == tok.decode(out)
    assert longest <= 8, longest  # English: every token finishes its text, so the window stays ~2 ids


def test_special_tokens_skipped_or_kept(tok):
    out = encode(tok, "Hi<|im_end|> there\n<|im_start|>x")
    assert tok.convert_tokens_to_ids("<|im_end|>") in out  # the special token is one id, not its text
    for skip in (True, False):
        pieces, rest = stream(tok, encode(tok, CHAT_PROMPT), out, skip_special_tokens=skip)
        assert "".join(pieces) + rest == tok.decode(out, skip_special_tokens=skip)
    assert "<|im_end|>" not in "".join(stream(tok, [], out, True)[0])


def test_flush_returns_an_unfinished_character(tok):
    first = encode(tok, "😀")[0]
    d = Detokenizer(tok, [])
    assert d.push(first) == ""
    held = d.flush()
    assert held == tok.decode([first]) and REPLACEMENT in held
    assert d.flush() == ""


def test_prompt_ending_inside_a_character(tok):
    """The prompt's half emoji gives no context: the output's bytes decode as decode(out) does."""
    ids = encode(tok, "ok 😀")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(REPLACEMENT))
    prompt, out = ids[:cut], ids[cut:] + encode(tok, " fine")
    pieces, rest = stream(tok, prompt, out)
    assert "".join(pieces) + rest == tok.decode(out)


def test_invalid_bytes_are_sent_after_max_held_tokens(tok):
    """A run of lone UTF-8 lead bytes never finishes a character: the window stays bounded."""
    lead = tok.convert_tokens_to_ids("ð")  # byte-level symbol of byte 0xF0, a 4-byte lead
    out = [lead] * (3 * MAX_HELD_TOKENS + 2)
    d = Detokenizer(tok, [])
    pieces = []
    for t in out:
        pieces.append(d.push(t))
        assert len(d.window) <= 2 * MAX_HELD_TOKENS
    assert "".join(pieces) + d.flush() == tok.decode(out)
    assert sum(1 for p in pieces if p) >= 2  # sent in bounded chunks, not all at the end


def test_space_cleanup_is_not_applied(tok):
    """The documented exception: a decode that cleans up " ." gives "." where the pieces keep " ."."""
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    out = encode(tok, "it 's a test , ok .")
    pieces, rest = stream(cleaning, [], out)
    assert cleaning.decode(out) == "it's a test, ok."
    assert "".join(pieces) + rest == cleaning.decode(out, clean_up_tokenization_spaces=False) == "it 's a test , ok ."


@settings(max_examples=100, deadline=None)
@given(prompt=st.text(max_size=20), text=st.text(max_size=40))
def test_random_text_round_trips(tok, prompt, text):
    out = encode(tok, text)
    pieces, rest = stream(tok, encode(tok, prompt), out)
    # decode(out) is text itself unless the text has characters that SmolLM2's vocabulary lacks
    # bytes for (U+40000 comes back as three U+FFFD): the reference is the decode, not the text.
    assert "".join(pieces) + rest == tok.decode(out)
    if REPLACEMENT not in tok.decode(out):
        assert not any(REPLACEMENT in p for p in pieces)


# ---------------------------------------------------------------- a SentencePiece-style (byte fallback) tokenizer
@pytest.fixture(scope="module")
def sp_tok():
    """Llama 2's decoder chain (Replace "▁", ByteFallback, Fuse, Strip one leading space) over a small
    vocabulary: ASCII characters, two whole words, and the 256 byte tokens <0x00>..<0xFF>."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *string.ascii_letters, *string.digits, *".,!?\n", "▁Hello", "▁world"]:
        vocab[piece] = len(vocab)
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_byte_fallback_emoji(sp_tok):
    out = encode(sp_tok, "Hi 😀 é!")
    assert "<0xF0>" in sp_tok.convert_ids_to_tokens(out)  # the emoji is four byte tokens
    pieces, rest = stream(sp_tok, [], out)
    assert "".join(pieces) + rest == sp_tok.decode(out) == "Hi 😀 é!"
    assert pieces.count("") >= 3 and not any(REPLACEMENT in p for p in pieces)


def test_leading_space_comes_out_whole_after_a_prompt(sp_tok):
    """The documented exception: decode(out) strips the first "▁"; after a prompt it is kept."""
    out = sp_tok.convert_tokens_to_ids(["▁Hello", "▁world", "!"])
    assert sp_tok.decode(out) == "Hello world!"
    assert "".join(stream(sp_tok, [], out)[0]) == "Hello world!"  # no prompt: exactly decode(out)
    pieces, rest = stream(sp_tok, encode(sp_tok, "Say"), out)
    assert pieces == [" Hello", " world", "!"] and rest == ""


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=30))
def test_random_text_round_trips_byte_fallback(sp_tok, text):
    out = encode(sp_tok, text)
    pieces, rest = stream(sp_tok, [], out)
    assert "".join(pieces) + rest == sp_tok.decode(out)


# ---------------------------------------------------------------- StopStrings
def run_stops(stops, pieces):
    """(text sent, matched) for pieces fed one by one, flushing when no stop matched."""
    s = StopStrings(stops)
    sent, matched = [], False
    for p in pieces:
        text, matched = s.push(p)
        sent.append(text)
    return "".join(sent) + s.flush(), matched, sent


def test_stop_split_across_pieces():
    text, matched, sent = run_stops(["STOP"], ["Hel", "lo ST", "OP now"])
    assert (text, matched) == ("Hello ", True)
    assert sent == ["Hel", "lo ", ""]  # "ST" was held back: it could start "STOP"


def test_stop_starting_inside_a_piece():
    assert run_stops(["STOP"], ["abcSTOPdef"])[:2] == ("abc", True)
    assert run_stops(["\n\n"], ["one\n", "\ntwo"])[:2] == ("one", True)


def test_several_stops_first_to_end_wins():
    assert run_stops(["world", "lo"], ["hello world"])[:2] == ("hel", True)
    assert run_stops(["xyz", "b"], ["ab", "c"])[:2] == ("a", True)


def test_overlapping_prefixes():
    # "ab" ends before "abc" can: the stream stops at "ab".
    text, matched, sent = run_stops(["ab", "abc"], ["x", "a", "b", "c"])
    assert (text, matched) == ("x", True) and sent == ["x", "", "", ""]
    # Both end at once: the longer (earlier-starting) one is cut.
    assert run_stops(["abc", "bc"], ["a", "b", "c"])[:2] == ("", True)


def test_prefix_that_diverges_is_released():
    s = StopStrings(["STOP"])
    assert s.push("go ST") == ("go ", False)
    assert s.push("O") == ("", False)
    assert s.push("RM") == ("STORM", False)
    assert s.flush() == ""


def test_no_match_flush_returns_the_rest():
    s = StopStrings(["STOP", "END"])
    assert s.push("first S") == ("first ", False)
    assert s.push("T") == ("", False)
    assert s.flush() == "ST"


def test_after_a_match_nothing_more_is_sent():
    s = StopStrings(["x"])
    assert s.push("axb") == ("a", True)
    assert s.push("more") == ("", True)
    assert s.flush() == ""


def test_no_stops_never_holds():
    s = StopStrings([])
    assert s.push("anything at all") == ("anything at all", False)
    assert s.flush() == ""


@pytest.mark.parametrize("stops, rule", [
    ("STOP", "list"), (["a", "b", "c", "d", "e"], "at most 4"), (["ok", ""], "non-empty"),
    ([3], "non-empty string"), (None, "list"),
])
def test_bad_stops_are_refused(stops, rule):
    with pytest.raises(ConfigError, match="stop") as err:
        StopStrings(stops)
    assert rule in str(err.value)


def reference_stop(whole: str, stops: list[str]) -> tuple[str, bool]:
    """str.find on the whole text: the occurrence that ends first (then starts first) is cut."""
    found = [(whole.find(s) + len(s), whole.find(s)) for s in stops if s in whole]
    if not found:
        return whole, False
    return whole[:min(found)[1]], True


@settings(max_examples=100, deadline=None)
@given(whole=st.text(alphabet="abc\n", max_size=30),
       stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=3), max_size=4),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_random_split_matches_find_on_the_whole(whole, stops, cuts):
    bounds = sorted({0, len(whole), *(c for c in cuts if c <= len(whole))})
    pieces = [whole[a:b] for a, b in zip(bounds, bounds[1:])]
    text, matched, _ = run_stops(stops, pieces)
    assert (text, matched) == reference_stop(whole, stops)
