"""vlmtrain's public Trainer: the trainer core (vlmtrain/trainer/trainer.py: the loop, evaluation, checkpoints)
with transformers' counts (counts.py), its dropping of unused dataset columns (columns.py), what its evaluation
and predict report (evaluation.py) and its extra public methods (trainer_methods.py). ``import vlmtrain`` puts it in the trainer's ``trainer_class`` slot, so
``vlmtrain.trainer.Trainer`` is this class too."""

from __future__ import annotations

from ..trainer.trainer import TrainerCore
from .auto_batch_size import AutoBatchSize
from .callback_handler import TransformersCallbackHandler
from .columns import TransformersColumns
from .counts import TransformersCounts
from .evaluation import TransformersEvaluation
from .trainer_internals import TransformersTrainerInternals
from .trainer_methods import TransformersTrainerMethods


class Trainer(AutoBatchSize, TransformersTrainerInternals, TransformersTrainerMethods, TransformersCounts,
              TransformersEvaluation, TransformersColumns,
              TrainerCore):
    """Trains any module whose forward returns a mapping (or ModelOutput) with `loss`, or a tuple `(loss, ...)`,
    on any map-style or iterable dataset of dict samples. Override the named steps to change behaviour."""

    callback_handler_class = TransformersCallbackHandler
