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


# The longest test first: with two xdist workers (scripts/test.sh) it then runs beside the rest of the suite
# instead of starting after a worker's share of it.
LONGEST_FIRST = ("test_vlm_demo_learns_shapes_vqa_from_the_images",)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA (``gpu(n)``: n devices): skipped where there is none (e.g. CI). The
    longest tests are moved to the front."""
    items.sort(key=lambda item: item.name not in LONGEST_FIRST)  # stable: the rest keep their order
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.args[0] if marker.args else 1
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA device(s), found {have}"))
