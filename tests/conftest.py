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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA (``gpu(n)``: n devices): skipped where there is none (e.g. CI)."""
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.args[0] if marker.args else 1
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA device(s), found {have}"))
