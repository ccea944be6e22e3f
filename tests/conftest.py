"""Fixtures shared by several test files (pytest finds them here)."""
from collections import OrderedDict

import pytest

from eins.passes.synthesize import caches


@pytest.fixture
def fresh_cache(monkeypatch):
    """No synthesis result cached across the runs a test compares (each run must search
    for itself); calling the fixture's value clears the cache again."""
    def clear():
        monkeypatch.setattr(caches, "RESULTS", OrderedDict())
    clear()
    return clear
