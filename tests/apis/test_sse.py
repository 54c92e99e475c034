"""SSEParser: the WHATWG event-stream rules, fed in any split."""

from __future__ import annotations

import itertools

import pytest

from llmp.apis.sse import SSEParser


def parse(*pieces: bytes) -> tuple[list[str], bool]:
    """Feed the pieces in order; return all dispatched data and close()'s verdict."""
    parser = SSEParser()
    out: list[str] = []
    for piece in pieces:
        out.extend(parser.feed(piece))
    return out, parser.close()


def events(*pieces: bytes) -> list[str]:
    return parse(*pieces)[0]


# A short llama-server stream (role delta, content, keep-alive ping, finish,
# [DONE]) with a multi-byte character and CRLF endings mixed in on purpose.
LLAMA_STREAM = (
    b'data: {"choices":[{"finish_reason":null,"index":0,'
    b'"delta":{"role":"assistant","content":null}}],"object":"chat.completion.chunk"}\n\n'
    b":\n\n"
    b'data: {"choices":[{"index":0,"delta":{"content":"h\xc3\xa9 \xe2\x82\xac"}}]}\r\n\r\n'
    b'data: {"choices":[{"finish_reason":"stop","index":0,"delta":{}}]}\r\r'
    b"data: [DONE]\n\n"
)
LLAMA_EVENTS = [
    '{"choices":[{"finish_reason":null,"index":0,'
    '"delta":{"role":"assistant","content":null}}],"object":"chat.completion.chunk"}',
    '{"choices":[{"index":0,"delta":{"content":"hé €"}}]}',
    '{"choices":[{"finish_reason":"stop","index":0,"delta":{}}]}',
    "[DONE]",
]


def test_llama_server_stream_whole() -> None:
    assert parse(LLAMA_STREAM) == (LLAMA_EVENTS, False)


def test_every_two_piece_split_gives_the_same_events() -> None:
    for i in range(len(LLAMA_STREAM) + 1):
        got = parse(LLAMA_STREAM[:i], LLAMA_STREAM[i:])
        assert got == (LLAMA_EVENTS, False), i


# Short enough for all O(n^2) three-piece splits; it has a 3-byte character,
# a 2-byte one, CRLF pairs, a lone CR, a comment and a multi-line event.
SHORT = b"data: \xe2\x82\xac1\r\n\r\n: c\r\ndata:\xc3\xa92\rdata: x\r\rdata:3\n\n"
SHORT_EVENTS = ["€1", "é2\nx", "3"]


def test_every_three_piece_split_gives_the_same_events() -> None:
    assert parse(SHORT) == (SHORT_EVENTS, False)
    n = len(SHORT)
    for i, j in itertools.combinations_with_replacement(range(n + 1), 2):
        got = parse(SHORT[:i], SHORT[i:j], SHORT[j:])
        assert got == (SHORT_EVENTS, False), (i, j)


def test_byte_by_byte() -> None:
    assert parse(*(bytes([b]) for b in LLAMA_STREAM)) == (LLAMA_EVENTS, False)


# --------------------------------------------------------------- line endings


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_each_line_ending(eol: bytes) -> None:
    stream = b"data: a" + eol + b"data: b" + eol + eol + b"data: c" + eol + eol
    assert events(stream) == ["a\nb", "c"]


def test_cr_at_end_of_piece_then_lf_is_one_line_ending() -> None:
    # If the LF were a second line ending, the blank line would dispatch "a" alone.
    assert events(b"data: a\r", b"\ndata: b\r\n\r\n") == ["a\nb"]


def test_cr_at_end_of_piece_then_cr_is_two_line_endings() -> None:
    assert events(b"data: a\r", b"\rdata: b\n\n") == ["a", "b"]


def test_cr_then_empty_piece_then_lf() -> None:
    assert events(b"data: a\r", b"", b"\n", b"data: b\n\n") == ["a\nb"]


def test_cr_then_split_character_then_lf_is_not_swallowed_later() -> None:
    # The piece after the CR decodes to nothing (half a character); the CR
    # flag must not eat the LF after that character, which ends its own line
    # ("é", an unknown field); the next LF is the blank line.
    assert events(b"data: a\r", b"\xc3", b"\xa9\n\ndata: b\n\n") == ["a", "b"]


def test_lone_cr_is_a_line_ending_inside_a_piece() -> None:
    assert events(b"data: a\rdata: b\r\r") == ["a\nb"]


# ----------------------------------------------------------------- encoding


def test_one_leading_bom_is_dropped() -> None:
    assert events(b"\xef\xbb\xbfdata: x\n\n") == ["x"]


def test_bom_split_across_pieces() -> None:
    assert events(b"\xef", b"\xbb", b"\xbfdata: x\n\n") == ["x"]


def test_only_one_bom_is_dropped() -> None:
    # The second BOM becomes part of the field name "\ufeffdata": unknown, ignored.
    assert events(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\ndata: y\n\n") == ["y"]


def test_bom_later_in_the_stream_is_kept() -> None:
    assert events(b"data: x\n\ndata: \xef\xbb\xbfy\n\n") == ["x", "\ufeffy"]


def test_character_split_across_pieces() -> None:
    euro = "€".encode()
    assert events(b"data: " + euro[:1], euro[1:2], euro[2:] + b"\n\n") == ["€"]


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert events(b"data: a\xffb\n\n") == ["a\ufffdb"]


def test_cut_character_at_end_of_stream_is_replaced() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: x\n\ndata: \xe2\x82") == ["x"]
    assert parser.close() is True
    assert parser.pending == "\ufffd"


# ------------------------------------------------------------------- fields


def test_one_leading_space_removed_only() -> None:
    assert events(b"data:x\n\ndata: x\n\ndata:  x\n\n") == ["x", "x", " x"]


def test_data_lines_joined_with_lf() -> None:
    assert events(b"data: a\ndata:\ndata: b\n\n") == ["a\n\nb"]


def test_comments_are_ignored() -> None:
    stream = b":\n\n: keep-alive\n\n: OPENROUTER PROCESSING\n\ndata: x\n: mid\ndata: y\n\n"
    assert events(stream) == ["x\ny"]


def test_keepalive_pings_between_events() -> None:
    assert events(b'data: {"a":1}\n\n:\n\n:\n\ndata: {"a":2}\n\n') == ['{"a":1}', '{"a":2}']


def test_line_without_colon_is_a_field_with_empty_value() -> None:
    # "data" alone appends an empty line to the data; "foo" is an unknown field.
    assert events(b"data: a\ndata\ndata: b\n\nfoo\n\n") == ["a\n\nb"]


def test_empty_data_is_not_dispatched() -> None:
    assert events(b"data:\n\ndata\n\ndata: \n\nevent: x\n\n\n\n") == []


def test_two_empty_data_lines_are_a_newline() -> None:
    assert events(b"data:\ndata:\n\n") == ["\n"]


def test_event_id_retry_and_unknown_fields_ignored() -> None:
    stream = (
        b"event: message\nid: 7\nretry: 1000\nfoo: bar\ndata: x\n\nevent: error\n\nid\nretry\n\n"
    )
    assert events(stream) == ["x"]


def test_field_names_are_case_sensitive_and_exact() -> None:
    assert events(b"Data: a\ndata : b\n data: c\ndatax: d\ndata: e\n\n") == ["e"]


def test_value_keeps_later_colons() -> None:
    assert events(b'data: {"a":"b:c"}\n\n') == ['{"a":"b:c"}']


def test_data_survives_across_pieces_until_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\n") == []
    assert parser.feed(b"data: b\n") == []
    assert parser.feed(b"\n") == ["a\nb"]


# -------------------------------------------------------------------- close


def test_close_reports_unterminated_event_with_data() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"a":1}\n\ndata: {"error":{"code":500}}\n') == ['{"a":1}']
    assert parser.close() is True
    assert parser.pending == '{"error":{"code":500}}'


def test_close_counts_an_unterminated_last_line() -> None:
    assert parse(b'data: {"a":1}\n\ndata: {"a":2') == (['{"a":1}'], True)


def test_close_with_only_a_comment_or_empty_data_pending() -> None:
    assert parse(b"data: a\n\n: ping") == (["a"], False)
    assert parse(b"data: a\n\ndata:\n") == (["a"], False)
    assert parse(b"data: a\n\nevent: x\nid: 1\n") == (["a"], False)


def test_close_on_complete_and_empty_streams() -> None:
    assert parse(b"data: a\n\n") == (["a"], False)
    assert parse() == ([], False)
    assert parse(b"") == ([], False)


def test_close_is_idempotent_and_feed_after_close_is_ignored() -> None:
    parser = SSEParser()
    parser.feed(b"data: a\n")
    assert parser.close() is True
    assert parser.close() is False
    assert parser.feed(b"\n\ndata: b\n\n") == []


def test_trailing_cr_at_end_of_stream_ends_the_line_only() -> None:
    # The CR ends the data line; the event still lacks its blank line.
    assert parse(b"data: a\r") == ([], True)
    assert parse(b"data: a\r\r") == (["a"], False)


def test_memoryview_and_bytearray_pieces() -> None:
    parser = SSEParser()
    assert parser.feed(bytearray(b"data: a\n")) == []
    assert parser.feed(memoryview(b"\n")) == ["a"]


def test_long_line_in_many_small_pieces() -> None:
    payload = "x" * 200_000
    data = f"data: {payload}\n\n".encode()
    parser = SSEParser()
    out: list[str] = []
    for i in range(0, len(data), 7):
        out.extend(parser.feed(data[i : i + 7]))
    assert out == [payload]
