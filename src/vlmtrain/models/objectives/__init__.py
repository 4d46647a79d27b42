"""Training objectives beyond the language-model loss: modules that wrap the policy (and its reference) and
whose forward returns the model-output contract (``loss``, ``num_items``, logged ``metrics``), so the trainer
core trains them like any model."""

from torch import nn


def disable_dropout(*models: nn.Module | None) -> None:
    """Set every dropout probability of ``models`` (None entries skipped) to 0, as TRL's ``disable_dropout``."""
    for model in models:
        for module in model.modules() if model is not None else ():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
