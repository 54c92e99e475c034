"""The C writer of a report row's spill line (`_rowjson.c`)."""

from llmp.analysis.rows import Row

def spill_line(row: Row) -> bytes | None:
    """`row.spill_line()`'s bytes, or None where the Python writer must decide."""
