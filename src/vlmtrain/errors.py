"""Errors a user can act on. Below every other module: trainer/, models/ and data/ all import from here."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which key and what to change."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing or incomplete; the message names the directory and what is missing."""


class DataError(RuntimeError):
    """The data cannot be trained on as it is (e.g. more bad samples than train.max_bad_sample_fraction); the
    message names the samples (file:line or id) and what to change."""


# What the command line prints as one line (`error: ...`, no traceback): the user fixes a setting or the data.
USER_ERRORS = (ConfigError, CheckpointError, DataError)


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside vlmtrain (the user's script or test line that
    called into the package; ``<frozen runpy>`` under ``python -m vlmtrain``), however deep in vlmtrain the
    warning arises: a fixed stacklevel names whichever vlmtrain frame happens to sit there."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
