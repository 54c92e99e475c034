"""Dollars as a person reads them: never an exponent, never a made-up precision."""

from __future__ import annotations

import pytest

from llmp.analysis.words import money


@pytest.mark.parametrize(
    ("usd", "text"),
    [
        (None, "an unknown amount"),
        (0.0, "$0.00"),
        (1234.5, "$1,234.50"),
        (0.1, "$0.10"),
        (0.0042, "$0.004"),
        (0.00042, "$0.00042"),
        (1.3e-05, "$0.000013"),
        (2e-06, "$0.0000020"),
        (4e-07, "under $0.000001"),
    ],
)
def test_money(usd: float | None, text: str) -> None:
    assert money(usd) == text
    assert "e-" not in money(usd)
