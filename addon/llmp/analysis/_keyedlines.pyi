"""The reader's lines and their sort keys, split and matched in C (`_keyedlines.c`)."""

from collections.abc import Callable, Iterator
from typing import Any

class KeyedLines(Iterator[tuple[tuple[int, int], Any, int, int]]):
    """A file's lines as `reader._keyed_lines` gives them: the recorder's plainest
    keys read here, every other line handed to `slow` (its item, or None to skip it)."""

    def __init__(
        self,
        read: Callable[[int], bytes],
        block: int,
        file: int,
        slow: Callable[[bytes], tuple[tuple[int, int], Any, int, int] | None],
        advance: Callable[[int], None] | None = None,
    ) -> None: ...
    def __next__(self) -> tuple[tuple[int, int], Any, int, int]: ...
