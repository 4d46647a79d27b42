"""Synthetic tasks, as data sources like any other: each brings its own options, metrics and demo report."""
