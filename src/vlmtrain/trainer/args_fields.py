"""The arguments the trainer core reads, as dataclass fields with their defaults and docstrings (their checks at
construction: args.py). The higher layers declare theirs (vlmtrain/evaluation/arguments.py,
vlmtrain/logging/arguments.py, vlmtrain/compat/arguments_fields.py), which vlmtrain.TrainingArguments adds.
The modules that make a dataclass of them import the field types too: parsers resolve its __init__'s annotations
in its module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class FsdpValue(str):
    """The type of TrainingArguments.fsdp as parsers see it: a string of transformers' options ('full_shard
    auto_wrap'), a list of them, or a bool. A str subclass, so that transformers' HfArgumentParser reads
    `--fsdp "full_shard auto_wrap"` as a string; vlmtrain's YAML/CLI parser registers it for the other forms."""


class WorkersValue(str):
    """The type of TrainingArguments.dataloader_num_workers as parsers see it: a number or 'auto'. A str subclass,
    so that HfArgumentParser reads `--dataloader_num_workers 4` or `auto` (TrainingArguments makes digits an int);
    vlmtrain's YAML/CLI parser registers it to take YAML numbers too."""


@dataclass
class CoreArguments:
    """The arguments the trainer core reads; names and defaults follow transformers' TrainingArguments where it
    has them. The fields of TrainingArgumentsCore, and the first ones of vlmtrain.TrainingArguments."""

    output_dir: str | None = "trainer_output"
    """Where checkpoints, metrics.jsonl and the resolved config are written (None: trainer_output, as in
    transformers; `~` is expanded). The vlmtrain CLI and YAML configs default to runs/default."""
    num_train_epochs: float = 3.0
    """Epochs to train when max_steps is not set (fractions allowed)."""
    max_steps: int = -1
    """If > 0: total optimizer steps, overriding num_train_epochs. Required for datasets without a length."""
    per_device_train_batch_size: int = 8
    """Samples per micro-batch per process in training."""
    per_device_eval_batch_size: int = 8
    """Samples per batch per process in evaluation and prediction."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated into one optimizer step."""
    learning_rate: float = 5e-5
    """Peak learning rate of parameters that match no entry of module_learning_rates."""
    module_learning_rates: dict[str, float] | str | None = None
    """Per-module peak learning rates, e.g. {"projector": 5e-3, "vision": 5e-5}. A key matches a
    parameter whose name starts with it (or with it after a dotted prefix); the longest key wins.
    A learning rate of 0 freezes those parameters (requires_grad=False, not in the optimizer)."""
    weight_decay: float = 0.0
    """Decoupled weight decay; never applied to biases and normalization weights."""
    adam_beta1: float = 0.9
    """AdamW beta1. optim='sgd' is plain SGD without momentum, as transformers' Trainer builds it (which sets its
    momentum only through optim_args); for SGD with momentum pass your own optimizer (Trainer(optimizers=...))."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    optim: str = "adamw_torch_fused"
    """Optimizer: adamw_torch_fused (transformers 5's default; fused AdamW runs on CPU too), adamw_torch or sgd."""
    lr_scheduler_type: str = "linear"
    """constant, constant_with_warmup, linear, cosine, cosine_with_min_lr or polynomial."""
    lr_scheduler_kwargs: dict[str, float] | str | None = None
    """Extra schedule arguments: min_lr_rate (cosine_with_min_lr), power and lr_end (polynomial), num_cycles."""
    warmup_steps: float = 0
    """Linear warmup length: an int number of steps, or a float in (0, 1) as a ratio of total steps."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of total steps (used when warmup_steps is 0)."""
    label_smoothing_factor: float = 0.0
    """Label smoothing epsilon, as transformers: when > 0 and the batch has `labels`, the model is called without
    them and the loss is (1 - eps) * NLL + eps * the mean negative log-probability over the vocabulary, from its
    `logits` (shifted by one for causal models: transformers' causal-LM classes, and the own VLM and every Hub VLM
    family, which transformers leaves unshifted). 0: the model's own loss. Refused for a model with score heads
    (the smoothed loss would replace their losses)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    logging_strategy: str = "steps"
    """When to log training metrics: no, steps or epoch."""
    logging_steps: float = 500
    """Log every N optimizer steps (logging_strategy='steps'); a float in (0, 1) is a ratio of the total steps
    (rounded up), as in transformers. A value above 1 must be a whole number."""
    logging_first_step: bool = False
    """Also log after the first optimizer step."""
    include_num_input_tokens_seen: str | bool = "no"
    """Count the input tokens trained on (over all ranks) in state.num_input_tokens_seen and log it as
    num_input_tokens_seen: all (every token of the model's main input, padding included), non_padding (the
    attention mask's ones, else the tokens that are not the pad token), or no. True means all, False no."""
    peak_tflops: float | None = None
    """The accelerator's peak dense TFLOP/s per device in the training dtype (e.g. 989 for an H100 SXM in bf16):
    training logs then carry mfu = tflops_per_second / peak_tflops. None: tflops_per_second only."""
    eval_strategy: str = "no"
    """When to evaluate: no, steps or epoch."""
    eval_steps: float | None = None
    """Evaluate every N steps (eval_strategy='steps'; a float in (0, 1): a ratio of the total steps); defaults to
    logging_steps."""
    max_eval_batches: int | None = None
    """Evaluate on at most this many batches per eval set (None: all)."""
    eval_on_start: bool = False
    """Evaluate once before the first training step (logged at step 0), as a sanity check of the eval setup."""
    batch_eval_metrics: bool = False
    """compute_metrics(eval_prediction, compute_result) is called once per evaluation batch (on tensors; every
    rank's rows of that batch), compute_result=True on the last, whose return is the metrics, as transformers.
    vlmtrain cuts the batches from the collected eval set, so it does not lower evaluation memory."""
    label_names: list[str] | None = None
    """Keys of the batch that hold labels (e.g. [score_labels, type_labels]): evaluation hands these arrays to
    compute_metrics as label_ids (a tuple when there are several). None: the batch's 'labels'."""
    ddp_timeout: int = 1800
    """Seconds a collective may wait for the other ranks before failing (torch.distributed's timeout): how
    long a run hangs when a rank or node is lost without its process dying."""
    preemption_grace_s: int = 120
    """`vlmtrain train --nproc N`: seconds torchrun gives the ranks to save a checkpoint and exit after it is
    itself sent SIGTERM/SIGUSR1 (its shutdown timeout, default 30), before it kills them. Set it to the lead
    time your scheduler gives (e.g. SLURM's --signal=B:USR1@120)."""
    ddp_find_unused_parameters: bool | None = None
    """DDP's find_unused_parameters: True when some parameters get no gradient in a step (e.g. a head that
    only some batches use). None: False, DDP's own default (transformers' None means True unless activation
    checkpointing is on)."""
    ddp_bucket_cap_mb: int | None = None
    """DDP's bucket_cap_mb (gradient all-reduce bucket size); None: DDP's default (25)."""
    ddp_broadcast_buffers: bool | None = None
    """DDP's broadcast_buffers (copy buffers from rank 0 at every forward); None: DDP's default (True)."""
    ddp_static_graph: bool | None = None
    """DDP's static_graph (the set of used parameters never changes between steps); None: DDP's default."""
    fsdp: FsdpValue | None = None
    """Under torchrun: shard parameters, gradients and optimizer state over the ranks with FSDP2 (fully_shard
    per transformer block) instead of replicating the model with DDP, for models that do not fit one device.
    With bf16: bfloat16 compute from float32 master weights, float32 gradient reduction. With LoRA a checkpoint
    holds what trains (adapter, heads, optimizer state) as without FSDP; a full fine-tune's holds DCP shards (dcp/),
    which `vlmtrain export` writes as one model.safetensors. A single process trains unsharded.
    transformers' values 'full_shard' and 'auto_wrap' (a string or list) mean true; other options are refused."""
    activation_checkpointing: bool | None = None
    """Recompute each transformer block's activations in backward instead of keeping them (less memory, ~20%
    slower), through the model's activation_checkpointing_enable() (transformers models). None: false."""
    activation_checkpointing_kwargs: dict[str, Any] | str | None = None
    """activation_checkpointing_enable()'s every_n_layers, offload; vlmtrain's mode: full (default: recompute each
    layer whole), selective (keep matmul and attention outputs; with selective_every_n_layers k every k-th layer,
    the others full), attention (keep attention outputs only), auto (the memory plan picks, docs/memory.md); other
    keys (e.g. use_reentrant) go to torch.utils.checkpoint; docs/speed.md. None: {use_reentrant: false}."""
    max_consecutive_nonfinite_steps: int = 10
    """A step whose loss or gradients are NaN/Inf is skipped on every rank (no update; counted as
    nonfinite_steps in the log); this many in a row stop training with an error. 0 = never stop."""
    max_bad_sample_fraction: float = 0.5
    """Stop training with an error (naming example sample keys) when more than this fraction of a logging
    window's samples were skipped as bad; samples a data filter rejected do not count. 1 = never."""
    save_strategy: str = "steps"
    """When to checkpoint: no, steps, epoch or best (whenever metric_for_best_model improves)."""
    save_steps: float = 500
    """Checkpoint every N steps (save_strategy='steps'; a float in (0, 1): a ratio of the total steps)."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints; the best one is never deleted."""
    async_checkpoint: bool = False
    """Write checkpoints in a background thread from a CPU copy of the state, while training goes on (still
    atomic; the next save and the end of training wait for it; a failed write raises on every rank at the next
    step end). on_save then fires when the write starts. FSDP checkpoints stay synchronous."""
    metric_for_best_model: str | None = None
    """Metric (e.g. 'loss', 'eval_accuracy') that picks the best checkpoint; 'eval_' is prefixed when missing."""
    greater_is_better: bool | None = None
    """Whether a larger metric_for_best_model is better; by default False for names ending in 'loss'."""
    load_best_model_at_end: bool = False
    """Reload the best checkpoint's weights when training ends."""
    seed: int = 42
    """Seed for model init (when built by vlmtrain), shuffling and dropout."""
    data_seed: int | None = None
    """Seed for the data order only; defaults to seed."""
    bf16: bool = False
    """Run forward passes under bfloat16 autocast."""
    tf32: bool | None = None
    """On CUDA: allow (true) or forbid (false) TF32 matmuls and convolutions; None leaves torch's setting. Ignored
    with a warning on a machine without a GPU."""
    train_sampling_strategy: str = "random"
    """Order of the training samples: random (a seeded shuffle per epoch; data_seed) or sequential (the dataset's
    order). transformers' group_by_length and batch_rebalance are refused (use data.packing)."""
    use_cpu: bool = False
    """Train on the CPU even when a GPU is visible (torch.distributed then uses gloo); also turns off
    dataloader_pin_memory, as in transformers."""
    torch_empty_cache_steps: int | None = None
    """Call torch.cuda.empty_cache() every N steps (in each micro-batch of those steps, between forward and backward,
    as transformers), to lower peak memory at some speed cost. None: never. No effect on the CPU."""
    dataloader_num_workers: WorkersValue = 0  # type: ignore[assignment]
    """Worker processes of the data loaders, or auto: on a CUDA machine min(4, CPU cores per process - 2), so
    that processing (Hub processor calls, image decoding and resizing, collation, skipped samples counted)
    runs beside the training step instead of inside it; 0 without a GPU, where workers would take the cores
    the torch threads compute on. A number is used as given. Default: auto in a YAML run config
    (`vlmtrain train`), 0 in Python (transformers' default)."""
    dataloader_pin_memory: bool = True
    """Pin host memory for faster copies to the accelerator (ignored on CPU)."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete training batch of each epoch."""
    dataloader_persistent_workers: bool = False
    """Keep the loaders' worker processes alive between epochs and evaluations (with dataloader_num_workers > 0:
    one eval loader per eval set is kept); a stream still reshuffles its shards every epoch."""
    dataloader_prefetch_factor: int | None = None
    """Batches each training worker loads ahead (needs dataloader_num_workers > 0; left out where 'auto' gives
    none); None: torch's default (2)."""
    dataloader_multiprocessing_context: str | None = None
    """Start method of the training loader's workers: fork, spawn or forkserver; None: the platform's default."""
    resume_from_checkpoint: str | None = None
    """Checkpoint dir to resume from, or 'true'/'latest' for the newest complete one in output_dir."""
    torch_compile: bool = False
    """Compile the model with torch.compile before training: a Hub VLM (model.kind hub_vlm) layer by layer (each
    decoder layer and vision block compiled on its own), any other model whole."""
    torch_compile_backend: str | None = None
    """torch.compile's backend (e.g. inductor, aot_eager); setting it turns torch_compile on."""
    torch_compile_mode: str | None = None
    """torch.compile's mode (e.g. default, reduce-overhead, max-autotune); setting it turns torch_compile on."""
    fuse_elementwise: str | None = None
    """compile: the model's RMSNorms, gated MLPs (SwiGLU / GeGLU) and rotary embeddings compiled one by one with
    torch.compile (inductor), each fused into a few kernels, the rest of the model eager; for a transformers model
    (causal LM or Hub VLM) where Liger Kernel is not installed or does not cover the family. Dynamic shapes: new
    lengths do not recompile. null: off. Not with torch_compile (which compiles whole layers) or
    use_liger_kernel."""
    use_liger_kernel: bool = False
    """Liger Kernel's Triton kernels (RMSNorm, rotary embeddings, SwiGLU / GeGLU, LayerNorm) in a Hub VLM of a
    family Liger covers (qwen3_vl, qwen2_5_vl, gemma3, smolvlm), patched into the model instance before
    training; vlmtrain's own chunked LM loss stays (Liger's loss kernels are never applied). CUDA only; needs
    the liger extra (pip install -e '.[liger]'). Anything else (no GPU, another model) is an error."""
    liger_kernel_config: dict[str, bool] | None = None
    """Liger's options for the family's patch, as transformers passes them (e.g. {rope: false, swiglu: true});
    unset ones take Liger's defaults (Qwen3-VL: SwiGLU too). fused_linear_cross_entropy and cross_entropy
    cannot be turned on. Needs use_liger_kernel."""
    predict_with_generate: bool = False
    """Evaluation/prediction generate from the batch's `prompt_*` inputs and return the generated ids."""
    generation_max_new_tokens: int = 32
    """Maximum new tokens per generated answer (predict_with_generate)."""
