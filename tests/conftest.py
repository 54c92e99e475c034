"""Shared test setup: paths to the contract files beside the project."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The contract folder (spec and vectors) that sits beside the repository."""
    if not SHARED.is_dir():
        pytest.skip("../shared is not beside the repository")
    return SHARED
