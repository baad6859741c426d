"""StreamingText (the gateway's detokenizer) with the embedded byte-level tokenizer: multi-byte
characters arrive whole, stop strings cut the text and nothing after them is ever sent."""

from __future__ import annotations

import pytest

from engine.loading.embedded_model import build_default_tokenizer
from gateway.text import StreamingText


@pytest.fixture(scope="module")
def tokenizer():
    return build_default_tokenizer()


def stream(tokenizer, text: str, stops: list[str], prompt: str = "Q: ") -> list[str]:
    """Feed `text`'s tokens one at a time (the last push is final); return the deltas."""
    ids = tokenizer.encode(text)
    st = StreamingText(tokenizer, tokenizer.encode(prompt), stops)
    return [st.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]


def test_multibyte_characters_are_never_split(tokenizer):
    text = "héllo wörld, 世界 🙂!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text), "the byte-level tokenizer splits these characters into several tokens"
    deltas = stream(tokenizer, text, [])
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas, "some tokens end inside a character: their delta waits for the next token"


def test_text_stops_before_the_stop_string_and_nothing_after_it_is_sent(tokenizer):
    deltas = stream(tokenizer, "alpha beta END gamma END", ["END"])
    assert "".join(deltas) == "alpha beta "
    assert not any("END" in d or "gamma" in d for d in deltas)


def test_a_partial_stop_string_is_held_back_then_released(tokenizer):
    st = StreamingText(tokenizer, [], ["\n\n"])
    assert st.push(tokenizer.encode("line")) == "lin"         # the last char could start "\n\n"
    assert st.push(tokenizer.encode("\n")) == "e"
    assert st.push(tokenizer.encode("x")) == "\n"             # "\nx" can no longer become "\n\n"
    assert st.push([], final=True) == "x"
    assert st.text == "line\nx"


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    assert "".join(stream(tokenizer, "one two three", ["three", "two"])) == "one "
