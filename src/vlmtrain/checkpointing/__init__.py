"""Ways of writing the trainer's checkpoints beyond its own synchronous write: a background writer
(async_writer.py, `train.async_checkpoint`), which the trainer reaches through its ``checkpoint_writer`` slot
(trainer/plugins.py)."""
