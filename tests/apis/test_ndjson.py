"""NDJSONParser: complete non-blank lines, fed in any split."""

from __future__ import annotations

import itertools

from llmp.apis.ndjson import NDJSONParser


def parse(*pieces: bytes) -> tuple[list[bytes], list[bytes]]:
    """Feed the pieces; return the lines from feed and the lines from close."""
    parser = NDJSONParser()
    out: list[bytes] = []
    for piece in pieces:
        out.extend(parser.feed(piece))
    return out, parser.close()


def all_lines(*pieces: bytes) -> list[bytes]:
    fed, closed = parse(*pieces)
    return fed + closed


OLLAMA = (
    b'{"model":"qwen3","created_at":"2026-08-21T10:00:00.1234Z",'
    b'"message":{"role":"assistant","content":"","thinking":"Hm"},"done":false}\n'
    b'{"model":"qwen3","created_at":"2026-08-21T10:00:00.2234Z",'
    b'"message":{"role":"assistant","content":"H\xc3\xa9"},"done":false}\n'
    b'{"model":"qwen3","created_at":"2026-08-21T10:00:00.3234Z",'
    b'"message":{"role":"assistant","content":""},"done":true,"done_reason":"stop",'
    b'"total_duration":5043500667,"prompt_eval_count":26,"eval_count":290}\n'
)
OLLAMA_LINES = OLLAMA.split(b"\n")[:-1]


def test_ollama_stream_whole() -> None:
    assert parse(OLLAMA) == (OLLAMA_LINES, [])


def test_every_two_piece_split() -> None:
    for i in range(len(OLLAMA) + 1):
        assert all_lines(OLLAMA[:i], OLLAMA[i:]) == OLLAMA_LINES, i


SHORT = b'{"a":"\xe2\x82\xac"}\r\n\n  \n{"b":1}\r\n{"c":2}'
SHORT_LINES = [b'{"a":"\xe2\x82\xac"}', b'{"b":1}', b'{"c":2}']


def test_every_three_piece_split() -> None:
    assert all_lines(SHORT) == SHORT_LINES
    n = len(SHORT)
    for i, j in itertools.combinations_with_replacement(range(n + 1), 2):
        assert all_lines(SHORT[:i], SHORT[i:j], SHORT[j:]) == SHORT_LINES, (i, j)


def test_crlf_loses_one_cr_only() -> None:
    assert all_lines(b'{"a":1}\r\r\n') == [b'{"a":1}\r']


def test_blank_and_whitespace_only_lines_are_skipped() -> None:
    assert all_lines(b'\n\n \t \r\n{"a":1}\n\r\n   \n{"b":2}\n\n') == [b'{"a":1}', b'{"b":2}']


def test_non_json_whitespace_is_not_blank() -> None:
    # A form feed is not JSON whitespace: the line is a (bad) chunk, not blank.
    assert all_lines(b"\x0c\n") == [b"\x0c"]


def test_lines_keep_inner_whitespace() -> None:
    assert all_lines(b'  {"a": 1}  \n') == [b'  {"a": 1}  ']


def test_close_returns_unterminated_last_line() -> None:
    assert parse(b'{"a":1}\n{"error":"boom"}') == ([b'{"a":1}'], [b'{"error":"boom"}'])


def test_close_strips_cr_and_skips_blank_remainder() -> None:
    assert parse(b'{"a":1}\n{"b":2}\r') == ([b'{"a":1}'], [b'{"b":2}'])
    assert parse(b'{"a":1}\n  \r') == ([b'{"a":1}'], [])
    assert parse(b"") == ([], [])
    assert parse() == ([], [])


def test_close_is_idempotent_and_feed_after_close_ignored() -> None:
    parser = NDJSONParser()
    assert parser.feed(b'{"a":1}') == []
    assert parser.close() == [b'{"a":1}']
    assert parser.close() == []
    assert parser.feed(b"\n{}\n") == []


def test_leading_bom_dropped_once() -> None:
    assert all_lines(b'\xef\xbb\xbf{"a":1}\n\xef\xbb\xbf{"b":2}\n') == [
        b'{"a":1}',
        b'\xef\xbb\xbf{"b":2}',
    ]


def test_bom_split_across_pieces_and_on_unterminated_line() -> None:
    assert all_lines(b"\xef", b"\xbb", b'\xbf{"a":1}\n') == [b'{"a":1}']
    assert parse(b"\xef\xbb", b'\xbf{"a":1}') == ([], [b'{"a":1}'])


def test_bom_then_blank_first_line() -> None:
    assert all_lines(b'\xef\xbb\xbf\n{"a":1}\n') == [b'{"a":1}']


def test_invalid_utf8_passes_through_unchanged() -> None:
    # Decoding is the JSON parser's job; it will count the line as bad.
    assert all_lines(b'{"a":"\xff"}\n') == [b'{"a":"\xff"}']


def test_bytearray_and_memoryview_pieces() -> None:
    parser = NDJSONParser()
    assert parser.feed(bytearray(b'{"a"')) == []
    assert parser.feed(memoryview(b":1}\n")) == [b'{"a":1}']


def test_long_line_in_many_small_pieces() -> None:
    line = b'{"x":"' + b"y" * 200_000 + b'"}'
    data = line + b"\n"
    parser = NDJSONParser()
    out: list[bytes] = []
    for i in range(0, len(data), 7):
        out.extend(parser.feed(data[i : i + 7]))
    assert out == [line]
    assert parser.close() == []
