"""Errors a user can act on. Below every other module: trainer/, models/ and data/ all import from here."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which key and what to change."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing or incomplete; the message names the directory and what is missing."""
