"""transformers' ``remove_unused_columns``: the columns of a ``datasets.Dataset`` that the model's forward does not
take are dropped before the collator sees them (in training, evaluation and prediction); with ``remove_unused_columns=False`` every
column reaches the collator. Other datasets reach the collator whole (transformers wraps the collator in
``RemoveColumnsCollator`` there; ``_get_collator_with_removed_columns`` does that for a subclass that asks). A mixin of :class:`vlmtrain.Trainer`
(vlmtrain/compat/trainer.py) that fills the trainer core's ``_loader_data`` hook (vlmtrain/trainer/setup.py).

vlmtrain's own collators (the VLM, Hub VLM, text, packing and task collators: ``keeps_columns = True``) take whole
samples in vlmtrain's sample format and build the model's inputs from fields that are not forward arguments
(``images``, ``texts``): their samples are never touched, whatever ``remove_unused_columns`` says."""

from __future__ import annotations

import inspect
import logging
from typing import Any

from transformers.utils import find_labels

from ..models.objectives.heads import WithHeads

logger = logging.getLogger(__name__)

KEEPS_COLUMNS = "keeps_columns"  # a collator's attribute: True when it reads whole samples (never trimmed)


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:  # (datasets is a dependency; a trimmed install simply has no such sets)
        return False
    return isinstance(dataset, datasets.Dataset)


def forward_columns(model: Any) -> list[str]:
    """The batch keys ``model``'s forward takes, as dataset columns: its forward's parameters; under a peft wrapper
    those of its base model (as transformers); under vlmtrain's score heads (WithHeads, whose forward hands its
    keywords on) those of the model they sit on plus each head's label column (``labels_<head>``)."""
    heads: list[str] = []
    while True:
        if isinstance(model, WithHeads):
            heads += model.head_label_columns
            model = model.base
        elif hasattr(model, "get_base_model"):  # a peft model
            model = model.get_base_model()
        else:
            return list(inspect.signature(model.forward).parameters) + heads


class TransformersColumns:
    """transformers' Trainer methods that drop the dataset columns the model's forward does not take, with its
    names (``_set_signature_columns_if_needed``, ``_remove_unused_columns``,
    ``_get_collator_with_removed_columns``), over TrainerCore's attributes (args, model, data_collator)."""

    _signature_columns: list[str] | None = None

    def _set_signature_columns_if_needed(self) -> None:
        """The names a dataset column may have to be kept: the forward's inputs (:func:`forward_columns`: of the
        model under a peft wrapper, with score heads their label columns too), ``label``, ``label_ids`` and the label
        names (``args.label_names``, else those of the model's forward)."""
        if self._signature_columns is not None:
            return
        self._signature_columns = forward_columns(self.model)
        label_names = self.args.label_names if self.args.label_names is not None else find_labels(type(self.model))
        self._signature_columns += list({"label", "label_ids", *label_names})

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        """``dataset`` (a ``datasets.Dataset``) without the columns the forward does not take (logged once per
        call, as transformers logs it); an error when none is left."""
        if not self.args.remove_unused_columns:
            return dataset
        self._set_signature_columns_if_needed()
        signature_columns = self._signature_columns
        ignored = list(set(dataset.column_names) - set(signature_columns))
        name = type(self.model).__name__
        if ignored:
            where = "" if description is None else f"in the {description} set"
            logger.info(f"The following columns {where} don't have a corresponding argument in `{name}.forward` and "
                        f"have been ignored: {', '.join(ignored)}. If {', '.join(ignored)} are not expected by "
                        f"`{name}.forward`,  you can safely ignore this message.")
        if not any(k in dataset.column_names for k in signature_columns):
            raise ValueError(
                f"No columns in the dataset match the model's forward method signature: "
                f"({', '.join(signature_columns)}). The following columns have been ignored: [{', '.join(ignored)}]. "
                "Please check the dataset and model. You may need to set `remove_unused_columns=False` in "
                "`TrainingArguments`.")
        return dataset.remove_columns(ignored)

    def _get_collator_with_removed_columns(self, data_collator: Any, description: str | None = None) -> Any:
        """``data_collator`` behind transformers' RemoveColumnsCollator: each dict sample keeps only the keys the
        forward takes."""
        if not self.args.remove_unused_columns:
            return data_collator
        # (imported here: transformers.trainer_utils imports peft, ~1 s of CPU for every process that imports
        # vlmtrain, e.g. each torchrun rank, while only this hook of a subclass needs it)
        from transformers.trainer_utils import RemoveColumnsCollator

        self._set_signature_columns_if_needed()
        return RemoveColumnsCollator(data_collator=data_collator, signature_columns=self._signature_columns,
                                     logger=logger, description=description, model_name=type(self.model).__name__)

    def _loader_data(self, dataset: Any, collator: Any, description: str) -> tuple[Any, Any]:
        """The dataset and collator a data loader reads: a ``datasets.Dataset`` without the unused columns, as
        transformers' ``_get_dataloader`` trims it; a collator of vlmtrain's that reads whole samples
        (``keeps_columns``) gets them untouched. Other datasets (lists, torch datasets, streams of dict samples)
        reach the collator whole, unlike transformers' (which wraps the collator in RemoveColumnsCollator): user
        collators over vlmtrain's samples read fields that are no forward argument (images, texts, ids)."""
        if getattr(collator, KEEPS_COLUMNS, False) or not _is_hf_dataset(dataset):
            return dataset, collator
        return self._remove_unused_columns(dataset, description=description), collator
