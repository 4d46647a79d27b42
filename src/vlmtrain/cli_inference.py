"""The options of `vlmtrain predict --checkpoint DIR --data ...` (scoring or answering new data with a checkpoint
alone), apart from the config form's: its parser, its checks, and the config form's hidden --data section."""

from __future__ import annotations

import argparse
from typing import Any

from vlmtrain.cli_help import CHECKPOINT_HELP, NPROC_HELP, description
from vlmtrain.errors import ConfigError


def help_formatter() -> type:
    """config.help_formatter, imported when a parser is built: `vlmtrain --help` stays free of the config's imports."""
    from vlmtrain.config import help_formatter as formatter

    return formatter()


def without_data_section(parser: Any) -> None:
    """predict's --data is the data to score: the config form's --data (the data section as a file) is hidden."""
    next(a for a in parser._actions if a.dest == "data").help = argparse.SUPPRESS


def predict_data_parser() -> Any:
    """The options of ``vlmtrain predict --checkpoint DIR --data ...`` (no config: the checkpoint says it all)."""
    import jsonargparse

    parser = jsonargparse.ArgumentParser(prog="vlmtrain predict", description=description("predict"),
                                         formatter_class=help_formatter(), exit_on_error=False, allow_abbrev=False)
    parser.add_argument("--checkpoint", type=str, required=True, help=CHECKPOINT_HELP.replace(
        ", or 'latest' for the newest checkpoint in train.output_dir", ", or an exported folder"))
    parser.add_argument("--data", type=str, required=True,
                        help="Samples in the training format: a .jsonl file (image paths relative to it) or "
                             "WebDataset shards (x.tar, a glob or x-{000..009}.tar); labels optional.")
    parser.add_argument("--output", type=str, default="predictions.jsonl",
                        help="Where to write one JSON row per input sample, keyed by its id: the heads' outputs, "
                             "or for a checkpoint without heads the generated answer.")
    parser.add_argument("--max-new-tokens", "--max_new_tokens", type=int | None, default=None,
                        help="Without heads: most tokens to generate (default: the run's "
                             "train.generation_max_new_tokens, else 32).")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=8, help="Samples per forward pass.")
    parser.add_argument("--num-workers", "--num_workers", type=int, default=0,
                        help="Data-loader worker processes reading and processing samples.")
    parser.add_argument("--nproc", type=int, default=1, help=NPROC_HELP + " Each scores its share of the data.")
    parser.add_argument("--device", type=str | None, default=None, help="Default: cuda if available, else cpu.")
    parser.add_argument("--dtype", type=str | None, default=None,
                        help="Weights dtype; default bfloat16 on CUDA, float32 on CPU.")
    return parser


def parse_predict_data(argv: list[str]) -> Any:
    """``vlmtrain predict --checkpoint DIR --data ...``'s options, checked (a ConfigError names a bad one)."""
    import jsonargparse

    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        raise ConfigError("vlmtrain predict --data scores with the checkpoint alone (limits come from the run's "
                          "config.yaml): drop --config, or drop --data to predict the config's eval set.")
    try:
        ns = predict_data_parser().parse_args(argv)
    except jsonargparse.ArgumentError as e:
        raise ConfigError(f"{e}. See vlmtrain predict --help.") from None
    if ns.batch_size < 1 or ns.num_workers < 0:
        raise ConfigError(f"--batch-size must be >= 1 and --num-workers >= 0, got {ns.batch_size}, {ns.num_workers}.")
    return ns
