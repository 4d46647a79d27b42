"""A model's weights on disk: the checkpoint layouts (full weights, FSDP's DCP shards, a LoRA adapter, score
heads beside a base) and `vlmtrain export`."""
