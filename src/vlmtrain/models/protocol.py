"""The attribute names the trainer reads on a model (its duck-typed interfaces), spelled here so that models
set them without importing the trainer. tests/test_model_protocol.py checks that both sides spell them alike."""

from __future__ import annotations

from torch import nn

MODULE_GROUPS_ATTR = "vlmtrain_module_groups"
"""{alias: (parameter-name prefixes, ...)} a model kind attaches (trainer/optim.py reads it for the aliases of
module_learning_rates; LoRA's modules_to_save and the FLOP counter read it here)."""
STEP_HOOK_ATTR = "vlmtrain_step_hook"
"""A module carries under this attribute an object with ``before_optimizer_step(module, any_rank)`` (called by the
trainer on every rank at each optimizer step, before the gradients are scaled, clipped and counted;
``any_rank(flag) -> bool``: whether the flag is set on any rank) and ``clear()`` (called where the forwards since the
last step are dropped). The dummy vision input's VisionInput is one (models/vision/dummy_vision.py)."""
REGIONAL_COMPILE_ATTR = "vlmtrain_regional_compile"
"""True: ``torch_compile`` compiles the model layer by layer (models/speed/training_prep.py, in the trainer's
``compile_model`` part)."""


def module_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The {alias: prefixes} of `model` or of the first submodule that declares them ({} when none does)."""
    for module in model.modules():
        groups = getattr(module, MODULE_GROUPS_ATTR, None)
        if groups:
            return {alias: (prefixes,) if isinstance(prefixes, str) else tuple(prefixes)
                    for alias, prefixes in groups.items()}
    return {}
