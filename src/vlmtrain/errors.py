"""Errors a user can act on. Below every other module: trainer/, models/ and data/ all import from here."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which key and what to change."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing or incomplete; the message names the directory and what is missing."""


class DataError(RuntimeError):
    """The data cannot be trained on as it is (e.g. more bad samples than train.max_bad_sample_fraction); the
    message names the samples (file:line or id) and what to change."""


# What the command line prints as one line (`error: ...`, no traceback): the user fixes a setting or the data.
USER_ERRORS = (ConfigError, CheckpointError, DataError)
