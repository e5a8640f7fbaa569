"""services.gateway.stop_span.HeldText: stop strings that span a migration point."""

from __future__ import annotations

from schemas.engine import Usage
from schemas.worker import TokenChunk

from services.gateway.stop_span import HeldText

USAGE = Usage(prompt_tokens=5, cached_prompt_tokens=0, completion_tokens=9)


def _feed(held: HeldText, chunks: list[TokenChunk]) -> tuple[list[TokenChunk], bool, int]:
    """Everything passed on, whether the stream ended, and how many chunks were fed."""
    out, n = [], 0
    for c in chunks:
        passed, ends = held.feed(c)
        out += passed
        n += 1
        if ends:
            return out, True, n
    return out, False, n


def test_a_stop_string_begun_in_the_held_text_ends_the_stream_at_it():
    h = HeldText("wor", ["world peace"])  # the dead worker held "wor" back: a possible start of the stop
    chunks = [TokenChunk(token_ids=[1], text="ld"), TokenChunk(token_ids=[2], text=" pea"),
              TokenChunk(token_ids=[3], text="ce and"), TokenChunk(token_ids=[4], text=" more")]
    out, ended, fed = _feed(h, chunks)
    assert ended and fed == 3  # "world peace" needs 10 characters after its "w": known after the third chunk
    [c] = out
    assert c.text == "" and c.finish_reason == "stop" and c.usage is None
    assert c.token_ids == [1, 2, 3]  # up to the chunk that completes the stop string, as one worker would


def test_text_before_the_stop_string_is_kept():
    h = HeldText("a wo", ["world"])
    out, ended, _ = _feed(h, [TokenChunk(token_ids=[7], text="rld!"), TokenChunk(token_ids=[8], text="x")])
    assert ended and [c.text for c in out] == ["a "] and out[0].token_ids == [7]


def test_no_stop_across_the_point_passes_everything_on_with_the_held_text_in_front():
    h = HeldText("wor", ["world"])
    chunks = [TokenChunk(token_ids=[1], text="m"), TokenChunk(token_ids=[2], text="s a"),
              TokenChunk(token_ids=[3], text="nd"), TokenChunk(token_ids=[4], text="!", finish_reason="length",
                                                             usage=USAGE)]
    out, ended, _ = _feed(h, chunks)
    assert ended
    assert "".join(c.text for c in out) == "worms and!"
    assert [t for c in out for t in c.token_ids] == [1, 2, 3, 4]
    assert out[-1].finish_reason == "length" and out[-1].usage == USAGE
    assert out[0].text == "worms a"  # held until 4 characters of new text (len("world") - 1) had come


def test_a_stop_string_wholly_in_the_new_text_is_the_new_workers_to_find():
    h = HeldText("wo", ["abc"])  # "wo" cannot start "abc": nothing spans, only the held text goes in front
    out, ended, _ = _feed(h, [TokenChunk(token_ids=[1], text="x ab", finish_reason=None)])
    assert not ended and out[0].text == "wox ab"


def test_the_stream_ending_early_releases_what_was_held():
    h = HeldText("wor", ["world peace"])
    out, ended, _ = _feed(h, [TokenChunk(token_ids=[1], text="ld", finish_reason="length", usage=USAGE)])
    assert ended and out[0].text == "world" and out[0].finish_reason == "length" and out[0].usage == USAGE


def test_without_stop_strings_or_held_text_chunks_pass_straight_through():
    c = TokenChunk(token_ids=[1], text="hi")
    assert HeldText("", ["x"]).feed(c) == ([c], False)
    h = HeldText("\u00e9", [])  # half a character recovered, no stops: goes in front of the first chunk
    [first], ended = h.feed(c)
    assert first.text == "\u00e9hi" and not ended
    assert h.feed(c) == ([c], False)


def test_the_earliest_spanning_stop_wins():
    h = HeldText("xab", ["abc", "bcd"])
    out, ended, _ = _feed(h, [TokenChunk(token_ids=[1], text="cd")])
    assert ended and out[0].text == "x"
