"""Every ART call in tests/compat/probe.py works (the probe the README's porting table is checked by)."""

from __future__ import annotations

import pytest

from . import probe


@pytest.mark.parametrize("name", [name for name, _ in probe.CHECKS])
def test_art_call_works(name: str) -> None:
    dict(probe.CHECKS)[name]()
