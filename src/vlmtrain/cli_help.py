"""What `vlmtrain --help` and `vlmtrain COMMAND --help` print: one line per command, each command's page in the
docs, and for the config commands (train, eval, predict) the common keys only; `--help-all` lists every key.
Also the options vlmtrain.cli reads before its parsers do (--nproc, a value in argv)."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from vlmtrain.errors import ConfigError

COMMANDS = {
    "train": "Train a model: vlmtrain train --config FILE.yaml [--nproc N] [--train.learning_rate 3e-4 ...]",
    "eval": "Evaluate on the eval set: vlmtrain eval --config FILE.yaml [--checkpoint DIR] [--result-file F.json]; "
            "vlmtrain eval --checkpoint RUN_DIR --all evaluates every checkpoint metrics.jsonl has no evaluation for",
    "predict": "Score new data with a checkpoint's heads (without heads: answer it): vlmtrain predict --checkpoint DIR "
               "--data FILE.jsonl|SHARDS.tar [--output predictions.jsonl] [--batch-size N] [--num-workers N] "
               "[--max-new-tokens N] [--nproc N]; or the eval set's "
               "answers/scores: vlmtrain predict --config FILE.yaml --checkpoint DIR",
    "generate": "Answer a prompt from a checkpoint: vlmtrain generate --checkpoint DIR [--image a.png ...] "
                "[--video clip.mp4 ...] --prompt TEXT",
    # The time is the README's measured one (configs/shapes-tiny.yaml).
    "demo": "Train a tiny VLM on shapes-VQA on CPU (333-342 s on an idle 2-core machine): "
            "vlmtrain demo [--config C] [--output-dir DIR] [--seed N] [--resume]",
    "export": "Write a checkpoint's model without its training state: an FSDP full fine-tune's shards as one "
              "model.safetensors (+ heads, config, processor), a LoRA or full checkpoint's model files as they are, "
              "or with --merge the adapter merged into the base: vlmtrain export --checkpoint DIR [--output-dir OUT] "
              "[--merge]",
    "data": "Data tools: vlmtrain data to-wds SRC OUT [--shard-size N] | vlmtrain data inspect SRC [--limit N]",
    "report": "Write RUN_DIR/report.html (curves, eval metrics, held-out samples) and curves.png: "
              "vlmtrain report RUN_DIR [--max-cards N]",
    "sync": "Replay RUN_DIR/metrics.jsonl into a tracker: vlmtrain sync RUN_DIR --to wandb|mlflow|trackio|tensorboard "
            "[--project P] [--run-name N]",
    "plan": "Estimate one training step's peak memory per part (weights, gradients, optimizer, activations, "
            "temporaries) without a GPU: vlmtrain plan --config FILE.yaml [--device h100-80gb | --device-memory "
            "80GiB] [--nproc N]",
}
# Each command's page in the documentation (docs/ of the repository; `mkdocs serve` renders it as a site).
DOCS = {
    "train": "docs/trainer.md#from-the-command-line (every key: docs/configuration.md)",
    "eval": "docs/evaluation.md#evaluation",
    "predict": "docs/hub-vlms.md#inference",
    "generate": "docs/own-vlm.md#generation-and-evaluation",
    "demo": "docs/own-vlm.md#the-demo",
    "export": "docs/hub-vlms.md#export",
    "data": "docs/data.md",
    "report": "docs/evaluation.md#the-run-report",
    "sync": "docs/evaluation.md#trackers",
    "plan": "docs/memory.md",
}
CHECKPOINT_HELP = ("Checkpoint directory (checkpoint-N/), a run directory (its newest checkpoint is used), "
                   "or 'latest' for the newest checkpoint in train.output_dir.")
NPROC_HELP = ("Run N processes on this node (torchrun --standalone --nproc_per_node N): one per GPU; without GPUs, "
              "N CPU processes (gloo).")
# The config keys `vlmtrain train|eval|predict --help` shows; --help-all (and docs/configuration.md) has them all.
COMMON_KEYS = (
    "model.kind", "model.pretrained", "model.torch_dtype", "model.heads", "model.lora",
    "data.source", "data.train_file", "data.eval_file", "data.sources", "data.max_length", "data.packing",
    "data.num_digits",
    "train.output_dir", "train.num_train_epochs", "train.max_steps", "train.per_device_train_batch_size",
    "train.per_device_eval_batch_size", "train.gradient_accumulation_steps", "train.learning_rate",
    "train.lr_scheduler_type", "train.warmup_ratio", "train.logging_steps", "train.eval_strategy",
    "train.eval_steps", "train.save_strategy", "train.save_steps", "train.save_total_limit", "train.bf16",
    "train.activation_checkpointing", "train.fsdp", "train.dataloader_num_workers",
    "train.resume_from_checkpoint", "train.seed", "train.report_to", "train.objective",
)
HELP_ALL = "--help-all"


def usage() -> str:
    """`vlmtrain --help`: every command, one line each, with its page in the docs."""
    lines = ["usage: vlmtrain {train,eval,predict,generate,demo,export,data,report,sync,plan} [options]  "
             "(vlmtrain COMMAND --help: its options; --help-all: every config key)", ""]
    for name, text in COMMANDS.items():
        lines += [f"  {name:<8} {text}", f"  {'':<8} docs: {DOCS[name]}"]
    lines += ["", "Documentation: docs/index.md in the repository, one page per topic "
              "(pip install -e '.[docs]' && mkdocs serve: the same pages as a site)."]
    return "\n".join(lines)


def description(command: str) -> str:
    """A command's --help text: what it does, and its page in the documentation."""
    return f"{COMMANDS[command]}\nDocumentation: {DOCS[command]}"


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help", HELP_ALL) for a in argv)


def shorten(parser: Any, command: str, argv: list[str], extra: list[tuple[str, str]] = ()) -> list[str]:
    """Make ``parser``'s --help show only the command's own options and COMMON_KEYS, unless argv asks for
    --help-all (returned as --help, with every key shown). ``extra``: (option, help) lines to list after the
    usage (options a command takes before the parser sees them, e.g. --nproc)."""
    full = HELP_ALL in argv
    argv = ["--help" if a == HELP_ALL else a for a in argv]
    hidden = 0
    if not full:
        for action in parser._actions:
            dest = action.dest
            if "." in dest and dest not in COMMON_KEYS or dest in ("model", "data", "train"):
                hidden += "." in dest and action.help is not argparse.SUPPRESS  # (keys, not section files)
                action.help = argparse.SUPPRESS
    lines = [line for option, text in extra  # argparse's layout: the option, then its help indented
             for line in textwrap.wrap(text, 78, initial_indent=f"  {option:<22}", subsequent_indent=" " * 24)]
    more = ([f"Common keys only: {hidden} more (every TrainingArguments name, each data source's and model kind's "
             f"options) with `vlmtrain {command} {HELP_ALL}`, and in docs/configuration.md."] if hidden else [])
    parser.epilog = "\n".join([*(["Launcher options:", *lines, ""] if lines else []), *more]) or None
    return argv


def predict_help(parser: Any) -> str:
    """`vlmtrain predict --help`: its two forms, scoring new data (the options of ``parser``) and predicting
    a config's eval set."""
    parser.epilog = ("Or predict a config's eval set (answers and head scores): vlmtrain predict --config "
                     "FILE.yaml --checkpoint DIR [--train.KEY V ...]; its keys: vlmtrain train --help "
                     f"(every one: {HELP_ALL}, docs/configuration.md).")
    return parser.format_help()


def pop_nproc(argv: list[str]) -> tuple[int, list[str]]:
    """``--nproc N`` (or ``--nproc=N``) taken out of argv."""
    rest, nproc, i = [], 1, 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--nproc", "--nproc_per_node") and i + 1 < len(argv):
            nproc, i = argv[i + 1], i + 2
            continue
        if arg.startswith(("--nproc=", "--nproc_per_node=")):
            nproc = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if not str(nproc).isdigit() or int(nproc) < 1:
        raise ConfigError(f"--nproc must be a positive number of processes, got {nproc!r}.")
    return int(nproc), rest


def option_value(argv: list[str], name: str) -> str | None:
    """The value of option ``name`` in argv (``NAME V`` or ``NAME=V``), None if absent."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None
