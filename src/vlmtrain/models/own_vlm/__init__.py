"""vlmtrain's own vision-language model (model.kind: vlm): vision tower, pixel-shuffle projector, causal LM
decoder, and its building from Hub names, local directories or config dicts."""
