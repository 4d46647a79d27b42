"""Shared fixtures."""

from __future__ import annotations

import os
import re

import pytest
import torch
from optional_extras import RequiredExtras


def _selects_gpu_tests(config) -> bool:
    return bool(re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr") or ""))


def pytest_configure(config):
    """CUDA is hidden unless the run selects the ``gpu`` tests (``-m gpu``): the rest of the suite is a CPU
    suite (bitwise resume, CPU-tensor comparisons, the no-GPU warnings) and would otherwise train on a GPU
    machine's CUDA device; torch reads CUDA_VISIBLE_DEVICES when CUDA first initializes, after this hook.

    Under pytest-xdist (scripts/test.sh runs two workers on CI's 2 cores) each test process, and every
    process a test starts, computes on one thread: two workers with two torch threads each oversubscribe the
    cores, and spinning intra-op threads then made tiny-model training 3x slower (measured: 0.47 vs 1.37
    steps/s for the demo's model beside a running suite)."""
    if not _selects_gpu_tests(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[name] = "1"
        torch.set_num_threads(1)
    # CI=true or VLMTRAIN_REQUIRE_EXTRAS=1: a test skipped for a missing optional package fails the run
    # (optional_extras.py)
    config.pluginmanager.register(RequiredExtras(), "vlmtrain-required-extras")


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread (no oversubscription on a shared 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_hub(tmp_path_factory):
    """family name -> (family, checkpoint dir, processor) of its tiny random-init checkpoint (seed 0), built on
    first use and shared by the test files of one process."""
    from vlmtrain.models.families import get_family

    built = {}

    def get(name):
        if name not in built:
            fam = get_family(name)
            path = fam.build_tiny(str(tmp_path_factory.mktemp(name)), seed=0)
            built[name] = (fam, path, fam.load_processor(path))
        return built[name]

    return get


# The longest tests first, longest first (CI durations, seconds on a loaded 2-core machine): with two xdist
# workers under --dist worksteal (scripts/test.sh) each runs beside the rest of the suite instead of starting near
# its end. A test over ~2 minutes belongs here.
LONGEST_FIRST = (
    "test_vlm_demo_learns_shapes_vqa_from_the_images",  # 1,105
    "test_tiny_qwen3vl_learns_the_motion_in_moving_shapes",  # 435
    "test_addition_example_reaches_95_percent_on_held_out_sums",  # 235
    "test_tiny_qwen3vl_score_heads_learn_through_the_cli",  # 225
    "test_the_grpo_demo_learns",  # 97 at load ~4 (39 CPU-s: SFT, 60 GRPO steps, two held-out evaluations)
    "test_the_two_stage_preference_demo_learns",  # 87 at load ~3-5 (three trainings: SFT, DPO, reward head)
)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA (``gpu(n)``: n devices) and ``-m gpu``: skipped otherwise (e.g. CI). The
    longest tests are moved to the front."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.name, len(rank)))  # stable: the rest keep their order
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.args[0] if marker.args else 1
        if not _selects_gpu_tests(config):
            item.add_marker(pytest.mark.skip(reason="gpu test: run the gpu tests with -m gpu (CUDA is hidden "
                                                    "from the rest of the suite)"))
            continue
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA device(s), found {have}"))
