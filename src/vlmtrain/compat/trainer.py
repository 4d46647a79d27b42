"""vlmtrain's public Trainer: the trainer core (vlmtrain/trainer/trainer.py: the loop, evaluation, checkpoints)
with transformers' model_init (model_init.py), counts (counts.py), its dropping of unused dataset columns
(columns.py), what its evaluation and predict report (evaluation.py) and its extra public methods
(trainer_methods.py), and :data:`PARTS`: every part the core takes from the layers above it (trainer/parts.py), set
here and nowhere else. A Trainer swaps one for
itself: ``Trainer(..., parts=dataclasses.replace(Trainer.parts, flop_counter=mine))``, or in a subclass
``parts = dataclasses.replace(vlmtrain.Trainer.parts, flop_counter=mine)``."""

from __future__ import annotations

from ..checkpointing.async_writer import AsyncCheckpointer
from ..checkpointing.reposition import REPOSITION
from ..data.collate import DefaultCollator
from ..data.step_data import step_sampling
from ..evaluation.async_eval import checkpoint_evaluator
from ..evaluation.gather import gather_shards
from ..logging.eval_samples import save_eval_samples
from ..logging.throughput import Throughput
from ..logging.writers import logging_callbacks
from ..models.files.model_files import MODEL_FILES
from ..models.generation import GREEDY
from ..models.speed.flops import flop_counter
from ..models.speed.fused_elementwise import fuse_elementwise_part
from ..models.speed.liger import liger_kernel_part
from ..models.speed.lm_loss import causal_lm_targets
from ..models.speed.training_prep import compile_model, enable_activation_checkpointing
from ..parallel.fsdp import FSDP_PLAN
from ..trainer.parts import TrainerParts
from ..trainer.trainer import TrainerCore
from .arguments import TrainingArguments
from .auto_batch_size import AutoBatchSize
from .callback_handler import TransformersCallbackHandler
from .callback_states import StatefulCallbacks
from .checkpoints import position_from_step
from .columns import TransformersColumns
from .counts import TransformersCounts
from .evaluation import TransformersEvaluation
from .loss_extras import BatchEvalMetrics, label_smoothing
from .model_init import TransformersModelInit
from .trainer_internals import TransformersTrainerInternals
from .trainer_methods import TransformersTrainerMethods

PARTS = TrainerParts(
    arguments_class=TrainingArguments,  # transformers' names and conventions (compat/arguments.py)
    default_collator=DefaultCollator,  # pads text, stacks images (data/collate.py)
    logging_callbacks=logging_callbacks,  # progress bar, metrics.jsonl, report_to's trackers (logging/writers.py)
    checkpoint_evaluator=checkpoint_evaluator,  # train.async_eval (evaluation/async_eval.py)
    eval_samples=save_eval_samples,  # per-sample evaluation results for the report (logging/eval_samples.py)
    eval_gather=gather_shards,  # each rank's share of an evaluation, put together (evaluation/gather.py)
    label_smoothing=label_smoothing,  # label_smoothing_factor (compat/loss_extras.py)
    batch_eval_metrics=BatchEvalMetrics,  # batch_eval_metrics=True (compat/loss_extras.py)
    step_sampling=step_sampling,  # datasets that follow the training step (data/step_data.py)
    loss_targets=causal_lm_targets,  # a transformers causal LM's target count (models/speed/lm_loss.py)
    flop_counter=flop_counter,  # tflops_per_second and mfu (models/speed/flops.py)
    window_stats=Throughput,  # samples, skips, tokens, FLOPs per second, data wait, pack fill (logging/throughput.py)
    liger_kernel=liger_kernel_part,  # use_liger_kernel (models/speed/liger.py)
    fuse_elementwise=fuse_elementwise_part,  # norms, gated MLPs, rotary compiled one by one (models/speed/fused_elementwise.py)
    activation_checkpointing=enable_activation_checkpointing,  # (models/speed/training_prep.py)
    compile_model=compile_model,  # torch_compile, layer by layer where a model asks for it (models/speed/training_prep.py)
    generation=GREEDY,  # predict_with_generate (models/generation.py)
    model_files=MODEL_FILES,  # Hugging Face layouts, LoRA adapters, score heads, DCP shards (models/files/model_files.py)
    sharding=FSDP_PLAN,  # train.fsdp (parallel/fsdp.py)
    checkpoint_writer=AsyncCheckpointer,  # train.async_checkpoint (checkpointing/async_writer.py)
    reposition=REPOSITION,  # resume with another number of processes or workers (checkpointing/reposition.py)
    step_position=position_from_step,  # resume of transformers' checkpoints (compat/checkpoints.py)
)


class Trainer(AutoBatchSize, TransformersModelInit, TransformersTrainerInternals, TransformersTrainerMethods, TransformersCounts,
              TransformersEvaluation, TransformersColumns, StatefulCallbacks,
              TrainerCore):
    """Trains any module whose forward returns a mapping (or ModelOutput) with `loss`, or a tuple `(loss, ...)`,
    on any map-style or iterable dataset of dict samples. Override the named steps to change behaviour."""

    callback_handler_class = TransformersCallbackHandler
    parts = PARTS
