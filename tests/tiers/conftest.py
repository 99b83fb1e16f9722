"""Fixtures for the tier tests."""

import pytest

from tierutil import Stack


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path)
    yield s
    s.tiers.close()
