"""transformers models from the Hub or a local directory: Hub VLMs (model.kind: hub_vlm) for training, evaluation
and inference, causal LMs (model.kind: causal_lm), local paths vs Hub ids, and LoRA adapters on them (peft)."""
