"""Compatibility with transformers' Trainer API: what its TrainingArguments names mean in vlmtrain (arguments.py)."""
