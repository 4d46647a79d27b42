"""Training objectives beyond the language-model loss: modules that wrap the policy (and its reference) and
whose forward returns the model-output contract (``loss``, ``num_items``, logged ``metrics``), so the trainer
core trains them like any model."""
