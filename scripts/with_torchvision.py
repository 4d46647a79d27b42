"""Run a script (or ``-m module``) with torchvision importable next to a CPU torch.

torchvision's PyPI wheel is built for CUDA torch: next to the CPU torch its C++ ops (nms, roi_align, ...) do not
load and ``import torchvision`` fails while registering their meta kernels. The video transforms transformers'
video processors use (resize, normalize on tensors) are Python over torch, so skipping those registrations is
enough for them. Use a separate virtual environment, never the project's (torchvision there breaks
transformers' model imports):

    python -m venv --system-site-packages /tmp/tvenv && /tmp/tvenv/bin/pip install --no-deps torchvision==0.28.0
    PYTHONPATH=src /tmp/tvenv/bin/python scripts/with_torchvision.py scripts/make_video_fixture.py
    PYTHONPATH=src /tmp/tvenv/bin/python scripts/with_torchvision.py -m pytest -p no:cacheprovider \
        tests/test_video_processing.py
"""
import runpy
import sys
import types

sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
import torchvision  # noqa
sys.argv = sys.argv[1:]
if sys.argv[0] == "-m":
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(sys.argv[0], run_name="__main__")
