"""vlmtrain: train vision-language models (and plain LMs) with the Trainer API you know."""

# The layers above the trainer fill its slots (trainer/plugins.py) as they are imported, here, so that
# `import vlmtrain.trainer` and `from vlmtrain import Trainer` see the same Trainer.
from . import tasks  # noqa: F401 - the synthetic tasks register their data sources with data/
from .compat.arguments import TrainingArguments
from .compat.callbacks import EarlyStoppingCallback
from .compat.seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments
from .compat.trainer import Trainer
from .evaluation import async_eval as _async_eval  # noqa: F401
from .inference import InferenceModel, load_for_inference
from .logging import eval_samples as _eval_samples  # noqa: F401
from .logging import writers as _writers  # noqa: F401
from .models.head_files import attach_heads
from .parallel import fsdp as _fsdp  # noqa: F401
from .trainer import (
    EvalPrediction,
    PredictionOutput,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainOutput,
)
from .trainer import plugins as _trainer_plugins


def _fill_trainer_slots() -> None:
    """What the trainer takes from the layers above it, which it never imports (trainer/plugins.py): the data,
    model and logging layers' parts, the background checkpoint writer, and the compat layer's public classes,
    transformers' options and the resume of transformers' checkpoints."""
    from .checkpointing.async_writer import AsyncCheckpointer
    from .compat.checkpoints import position_from_step
    from .compat.loss_extras import BatchEvalMetrics, LabelSmoothing
    from .data.collate import DefaultCollator
    from .data.step_data import step_sampling
    from .logging.throughput import WindowRates
    from .models.flops import flop_counter
    from .models.generation import GREEDY
    from .models.head_files import HEAD_PARTS
    from .models.liger import apply_liger_kernel
    from .models.lm_loss import causal_lm_targets
    from .models.lora_files import ADAPTER_PARTS
    from .models.model_files import HubModelFiles
    from .models.sharded_files import read_model_weights
    from .models.sharding import transformer_blocks
    from .models.training_prep import compile_model, enable_activation_checkpointing

    _trainer_plugins.register("trainer_class", Trainer)
    _trainer_plugins.register("arguments_class", TrainingArguments)
    _trainer_plugins.register("early_stopping_callback", EarlyStoppingCallback)
    _trainer_plugins.register("label_smoothing", LabelSmoothing)
    _trainer_plugins.register("batch_eval_metrics", BatchEvalMetrics)
    _trainer_plugins.register("default_collator", DefaultCollator)
    _trainer_plugins.register("step_sampling", step_sampling)
    _trainer_plugins.register("flop_counter", flop_counter)
    _trainer_plugins.register("window_rates", WindowRates)
    _trainer_plugins.register("loss_targets", causal_lm_targets)
    _trainer_plugins.register("checkpoint_parts", (ADAPTER_PARTS, HEAD_PARTS))
    _trainer_plugins.register("read_sharded_weights", read_model_weights)
    _trainer_plugins.register("model_files", HubModelFiles)
    _trainer_plugins.register("fsdp_blocks", transformer_blocks)
    _trainer_plugins.register("activation_checkpointing", enable_activation_checkpointing)
    _trainer_plugins.register("compile_model", compile_model)
    _trainer_plugins.register("liger_kernel", apply_liger_kernel)
    _trainer_plugins.register("generation", GREEDY)
    _trainer_plugins.register("checkpoint_writer", AsyncCheckpointer)
    _trainer_plugins.register("step_position", position_from_step)


_fill_trainer_slots()

__version__ = "0.1.0"
__all__ = [
    "EarlyStoppingCallback", "EvalPrediction", "InferenceModel", "PredictionOutput", "Trainer", "TrainerCallback",
    "TrainerControl", "TrainerState", "TrainOutput", "TrainingArguments", "__version__", "attach_heads",
    "load_for_inference", "Seq2SeqTrainer", "Seq2SeqTrainingArguments",
]
