"""Speed and memory of training: vlmtrain's chunked LM loss, variable-length text and vision attention,
activation checkpointing policies and regional compilation, Liger's kernels, and the FLOP count behind the
logged MFU."""
