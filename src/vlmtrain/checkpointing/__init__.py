"""Ways of writing the trainer's checkpoints beyond its own synchronous write: a background writer
(async_writer.py, `train.async_checkpoint`), which the trainer reaches as vlmtrain.Trainer's ``checkpoint_writer``
part (trainer/parts.py)."""
