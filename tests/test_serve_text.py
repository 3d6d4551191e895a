"""Tokens to text for the server (megadecode/serve/text.py): characters split over tokens come out whole, stop
strings end the text before them (also across tokens), and a tail that may grow into one is held back while
streaming. The byte-level tokenizer makes the token boundaries explicit: one byte per token."""

from __future__ import annotations

from megadecode.serve.text import TextStream
from megadecode.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def feed(stream: TextStream, text: str) -> list[str]:
    """The pieces a stream returns for `text`, one byte (token) at a time, then the rest at the end."""
    out = [stream.add([b]) for b in text.encode()]
    return out + [stream.finish()]


def test_multibyte_characters_are_never_split():
    pieces = feed(TextStream(TOK), "aé€😀b")
    assert "".join(pieces) == "aé€😀b"
    assert all("\ufffd" not in p for p in pieces)
    assert [p for p in pieces if p] == ["a", "é", "€", "😀", "b"]


def test_an_incomplete_last_character_is_flushed_at_the_end():
    s = TextStream(TOK)
    assert s.add(list("x€".encode())[:-1]) == "x"
    assert s.finish() == "\ufffd"


def test_stop_string_across_tokens():
    s = TextStream(TOK, ("STOP",))
    pieces = feed(s, "abcSTOPdef")
    assert "".join(pieces) == "abc" and s.stopped
    assert s.tokens_used == len("abcSTOP")  # the token that completed the stop string is the last one counted
    assert s.add([ord("z")]) == ""  # nothing after a stop


def test_a_possible_stop_prefix_is_held_back_then_released():
    s = TextStream(TOK, ("<end>",))
    assert [s.add([b]) for b in b"ab<en"] == ["a", "b", "", "", ""]
    assert s.add([ord("x")]) == "<enx"  # not a stop string after all
    assert s.finish() == "" and not s.stopped


def test_first_of_several_stop_strings_wins():
    s = TextStream(TOK, ("yy", "x"))
    assert "".join(feed(s, "12yyx3")) == "12"
    s = TextStream(TOK, ("yy", "x"))
    assert "".join(feed(s, "12xyy3")) == "12"


def test_stop_string_found_at_finish():
    s = TextStream(TOK, ("ab",))
    assert s.add([ord("a")]) == ""
    s.add([ord("b")])
    assert s.stopped and s.text == "" and s.finish() == ""


def test_no_stop_strings_streams_everything():
    s = TextStream(TOK)
    assert feed(s, "hello")[:5] == list("hello") and s.tokens_used == 5
