"""Compatibility with transformers' Trainer API, above the trainer core: vlmtrain.TrainingArguments with
transformers' other names and what they mean in vlmtrain (arguments.py, arguments_fields.py), vlmtrain.Trainer
with transformers' counts (counts.py) and public methods beyond the loop (trainer_methods.py), its stock
EarlyStoppingCallback (callbacks.py), label smoothing and batch_eval_metrics (loss_extras.py), and
Seq2SeqTrainer / Seq2SeqTrainingArguments (seq2seq.py)."""
