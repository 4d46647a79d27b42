"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread (no oversubscription on a shared 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
