"""Ways of writing and resuming the trainer's checkpoints beyond its own: a background writer (async_writer.py,
`train.async_checkpoint`) and the resume of a checkpoint that another number of processes or data loader workers
wrote (reposition.py), which the trainer reaches as vlmtrain.Trainer's ``checkpoint_writer`` and ``reposition``
parts (trainer/parts.py)."""
