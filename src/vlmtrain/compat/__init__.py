"""Compatibility with transformers' Trainer API: what its TrainingArguments names mean in vlmtrain (arguments.py),
and its public Trainer methods beyond the loop (trainer_methods.py), which make vlmtrain.Trainer (trainer.py)."""
