"""How a model's state is spread over the ranks beyond DDP's replicas: FSDP2 sharding and its DCP checkpoints
(fsdp.py), with evaluation in step over the ranks' shares (lockstep.py), which the trainer reaches as
vlmtrain.Trainer's ``sharding`` part (trainer/sharding.py)."""
