"""`vlmtrain train|eval|predict|demo`: parse and validate the config first, then do the work in vlmtrain.run."""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from vlmtrain.cli_help import (  # noqa: F401 - COMMANDS, DOCS
    CHECKPOINT_HELP,
    COMMANDS,
    DOCS,
    HELP_ALL,
    NPROC_HELP,
    description,
    option_value,
    pop_nproc,
    predict_help,
    shorten,
    usage,
    wants_help,
)
from vlmtrain.cli_inference import (
    help_formatter,
    parse_predict_data,
    predict_data_parser,
    without_data_section,
)
from vlmtrain.errors import USER_ERRORS, ConfigError


def _parse(command: str, argv: list[str], checkpoint: str | None = None,
           extra: Callable[[Any], None] | None = None, nproc: bool = False) -> tuple[Any, Any]:
    """checkpoint: None (no --checkpoint option), 'optional' or 'required'; extra adds options to the parser;
    nproc: --help lists --nproc (taken out of argv before)."""
    if argv and not argv[0].startswith("-"):  # `vlmtrain train my.yaml`: the config is an option
        raise ConfigError(f"vlmtrain {command} takes no positional argument {argv[0]!r}: pass the config file as "
                          f"--config {argv[0]}.")
    from vlmtrain.config import build_parser, parse_with

    parser = build_parser(prog=f"vlmtrain {command}", description=description(command))
    if checkpoint:
        parser.add_argument("--checkpoint", type=str | None, default=None, help=CHECKPOINT_HELP)
    if extra is not None:
        extra(parser)
    if wants_help(argv):  # the common keys; --help-all: every key
        argv = shorten(parser, command, argv, [("--nproc N", NPROC_HELP)] if nproc else [])
    argv = ["--print_config" if a == "--print-config" else a for a in argv]  # both spellings
    cfg, ns = parse_with(parser, argv)
    if not ns.get("config"):
        raise ConfigError(f"vlmtrain {command} needs --config FILE.yaml (see configs/ for examples).")
    if checkpoint == "required" and not ns.get("checkpoint"):
        raise ConfigError(f"vlmtrain {command} needs --checkpoint DIR. {CHECKPOINT_HELP}")
    return cfg, ns


def _is_rank_zero() -> bool:
    """Whether this process prints results: always, except on ranks other than 0 under torchrun."""
    return os.environ.get("RANK", "0") == "0"


def _print_metrics(metrics: dict[str, Any]) -> None:
    if _is_rank_zero():
        print(json.dumps(metrics, indent=2, default=str))


def _launch(nproc: int, args: list[str], *options: str) -> int:
    """``vlmtrain ARGS`` in ``nproc`` processes under torchrun. SIGTERM/SIGUSR1 to this process reach every rank
    (they save and exit 0); sent to torchrun directly, they still reach the ranks, with
    train.preemption_grace_s to save before torchrun kills them."""
    from vlmtrain import launch

    if "WORLD_SIZE" in os.environ:
        raise ConfigError("--nproc cannot be used inside torchrun: torchrun already sets the process count.")
    note = launch.cpu_note(nproc)
    if note:
        print(note, file=sys.stderr, flush=True)
    return launch.run_forwarding_signals(launch.torchrun_command(nproc, args, *options))


def _train(argv: list[str]) -> int:
    nproc, argv = pop_nproc(argv)
    if nproc > 1 and not wants_help(argv):  # one node, N processes: the same command under torchrun
        cfg, _ = _parse("train", argv)  # a bad config fails here, once, not in N processes
        return _launch(nproc, ["train", *argv], f"--shutdown-timeout={cfg.train.preemption_grace_s}",
                       "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    cfg, _ = _parse("train", argv, nproc=True)
    from vlmtrain import run

    _print_metrics(run.train(cfg))
    return 0


def _eval_options(parser: Any) -> None:
    parser.add_argument("--result-file", "--result_file", type=str | None, default=None,
                        help="Also write the metrics to this JSON file, atomically (what async evaluation reads).")
    parser.add_argument("--all", action="store_true",
                        help="With --checkpoint RUN_DIR: evaluate every checkpoint of the run that metrics.jsonl "
                             "has no evaluation for, and append their rows (--config defaults to RUN_DIR/config.yaml).")


def _eval(argv: list[str]) -> int:
    if "--all" in argv and "--config" not in argv:  # the run's own config
        checkpoint = option_value(argv, "--checkpoint")
        if checkpoint is None:
            raise ConfigError("vlmtrain eval --all needs --checkpoint RUN_DIR (a run directory).")
        argv = [*argv, "--config", os.path.join(checkpoint, "config.yaml")]
        if not os.path.isfile(argv[-1]):
            raise ConfigError(f"{checkpoint!r} holds no config.yaml (is it a vlmtrain run directory?): pass --config.")
    cfg, ns = _parse("eval", argv, checkpoint="optional", extra=_eval_options)
    from vlmtrain import run

    if ns.all:
        if not ns.checkpoint or not os.path.isdir(ns.checkpoint):
            raise ConfigError(f"vlmtrain eval --all needs --checkpoint RUN_DIR (a run directory), got {ns.checkpoint!r}.")
        rows = run.evaluate_all(ns.checkpoint, cfg)
        if _is_rank_zero():
            print(f"logged {len(rows)} evaluation(s) to {os.path.join(ns.checkpoint, 'metrics.jsonl')}: steps "
                  f"{sorted(rows)}" if rows else "every checkpoint already has an evaluation in metrics.jsonl")
        return 0
    _print_metrics(run.evaluate(cfg, checkpoint=ns.checkpoint, result_file=ns.result_file))
    return 0


def _predict(argv: list[str]) -> int:
    nproc, argv = pop_nproc(argv)
    if wants_help(argv):  # both forms; --help-all adds every key of the config form
        print(predict_help(predict_data_parser()))
        if HELP_ALL in argv:
            print("\nvlmtrain predict --config FILE.yaml --checkpoint DIR, every option:\n")
            _parse("predict", [HELP_ALL], checkpoint="required", extra=without_data_section)
        return 0
    data = any(a == "--data" or a.startswith("--data=") for a in argv)
    if data:
        ns = parse_predict_data(argv)  # a bad option fails here, once, not in N processes
    else:
        _parse("predict", argv, checkpoint="required")
    if nproc > 1:
        return _launch(nproc, ["predict", *argv])
    from vlmtrain import prediction

    if data:
        out = prediction.predict_data(ns.checkpoint, ns.data, output=ns.output, batch_size=ns.batch_size,
                                      num_workers=ns.num_workers, device=ns.device, dtype=ns.dtype,
                                      max_new_tokens=ns.max_new_tokens)
        if _is_rank_zero():
            print(f"wrote {out}")
        return 0
    cfg, ns = _parse("predict", argv, checkpoint="required")
    texts = prediction.predict(cfg, checkpoint=ns.checkpoint)
    if _is_rank_zero():
        print("\n".join(texts))
    return 0


def _demo(argv: list[str]) -> int:
    import jsonargparse

    parser = jsonargparse.ArgumentParser(prog="vlmtrain demo", description=description("demo"), formatter_class=help_formatter(), exit_on_error=False,
                                         allow_abbrev=False)
    parser.add_argument("--output-dir", "--output_dir", type=str | None, default=None,
                        help="Where to write checkpoints, metrics.jsonl and config.yaml (default: the config's).")
    parser.add_argument("--config", type=str | None, default=None,
                        help="Another demo config, e.g. configs/addition-tiny.yaml (default: configs/shapes-tiny.yaml).")
    parser.add_argument("--seed", type=int | None, default=None,
                        help="Sets both train.seed (initialization) and data.seed (the questions); default: the "
                             "config's.")
    parser.add_argument("--resume", action="store_true",
                        help="Continue a stopped demo (e.g. by SIGTERM) from the newest checkpoint in its output "
                             "directory, with the same --config, --output-dir and --seed.")
    try:
        ns = parser.parse_args(argv)
    except jsonargparse.ArgumentError as e:
        raise ConfigError(f"{e}. See vlmtrain demo --help.") from None
    from vlmtrain import run

    run.demo(output_dir=ns.output_dir, config=ns.config, seed=ns.seed, resume=ns.resume)
    return 0


def _generate(argv: list[str]) -> int:
    import jsonargparse

    parser = jsonargparse.ArgumentParser(prog="vlmtrain generate", description=description("generate"), formatter_class=help_formatter(),
                                         exit_on_error=False, allow_abbrev=False)
    parser.add_argument("--checkpoint", type=str, required=True, help=CHECKPOINT_HELP)
    parser.add_argument("--prompt", type=str, required=True, help="The question or text to continue.")
    parser.add_argument("--image", type=str, default=[], action="append",
                        help="An image file; repeat for several images (VLM checkpoints).")
    parser.add_argument("--video", type=str, default=[], action="append",
                        help="A video file (.mp4, .webm, ...), sampled as the run's data.video_* settings say; "
                             "repeat for several (Qwen3-VL / Qwen2.5-VL checkpoints).")
    parser.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=32,
                        help="Most tokens to generate.")
    try:
        ns = parser.parse_args(argv)
    except jsonargparse.ArgumentError as e:
        raise ConfigError(f"{e}. See vlmtrain generate --help.") from None
    from vlmtrain import run

    print(run.generate(ns.checkpoint, ns.prompt, images=list(ns.image), max_new_tokens=ns.max_new_tokens,
                       videos=list(ns.video)))
    return 0


def _export(argv: list[str]) -> int:
    import jsonargparse

    parser = jsonargparse.ArgumentParser(prog="vlmtrain export", description=description("export"), formatter_class=help_formatter(),
                                         exit_on_error=False, allow_abbrev=False)
    parser.add_argument("--checkpoint", type=str, required=True, help=CHECKPOINT_HELP)
    parser.add_argument("--output-dir", "--output_dir", type=str | None, default=None,
                        help="Where to write the model, config and processor (default: the checkpoint itself for "
                             "FSDP shards, else <checkpoint>-export).")
    parser.add_argument("--merge", action="store_true",
                        help="For a LoRA checkpoint: merge the adapter into the base model's weights and write the "
                             "full model (default output: <checkpoint>-merged).")
    try:
        ns = parser.parse_args(argv)
    except jsonargparse.ArgumentError as e:
        raise ConfigError(f"{e}. See vlmtrain export --help.") from None
    from vlmtrain import run
    from vlmtrain.errors import CheckpointError
    from vlmtrain.models.files.export import export_checkpoint

    ckpt = run.resolve_checkpoint(ns.checkpoint, ns.checkpoint)
    if ns.output_dir:
        run.check_writable(ns.output_dir, "--output-dir")
    try:
        if ns.merge:
            from vlmtrain.models.hub.lora import export_merged

            out = ns.output_dir or os.path.normpath(ckpt) + "-merged"
            print(f"wrote {export_merged(ckpt, out)}")
        else:
            print(f"wrote {export_checkpoint(ckpt, ns.output_dir)}")
    except (FileNotFoundError, CheckpointError) as e:
        raise ConfigError(str(e) + (" (--merge is for LoRA checkpoints.)" if ns.merge else "")) from None
    return 0


def _data(argv: list[str]) -> int:
    import jsonargparse

    parser = jsonargparse.ArgumentParser(prog="vlmtrain data", description=description("data"), formatter_class=help_formatter(), exit_on_error=False)
    sub = parser.add_subcommands(required=True, dest="tool")
    src_help = "shapes[:N], a .jsonl file/glob, .tar shards (path, glob or {000..009}) or a load_from_disk dir"
    to_wds = jsonargparse.ArgumentParser(description="Write a source as WebDataset tar shards (KEY.json + KEY.N.png + KEY.video.N.mp4).")
    to_wds.add_argument("src", type=str, help=src_help)
    to_wds.add_argument("out", type=str, help="Output directory for shard-NNNNNN.tar files.")
    to_wds.add_argument("--shard-size", "--shard_size", type=int, default=1000, help="Samples per shard.")
    inspect = jsonargparse.ArgumentParser(description="Counts, image/length histograms and bad-sample reasons.")
    inspect.add_argument("src", type=str, help=src_help)
    inspect.add_argument("--limit", type=int | None, default=None, help="Look at the first N samples only.")
    inspect.add_argument("--model", type=str | None, default=None,
                         help="Hub id or checkpoint dir (Qwen3-VL / Qwen2.5-VL; with --config it replaces model.pretrained): "
                              "each video's frames, size and video tokens as its processing plans them (default: "
                              "frames and timestamps only).")
    inspect.add_argument("--config", type=str | None, default=None,
                         help="A run's config: check samples as its training does (its model kind, heads, limits); its "
                              "data.video_* keys (and model.pretrained, unless --model) apply.")
    sub.add_subcommand("to-wds", to_wds)
    sub.add_subcommand("inspect", inspect)
    try:
        ns = parser.parse_args(argv)
    except jsonargparse.ArgumentError as e:
        raise ConfigError(f"{e}. See vlmtrain data --help.") from None
    from vlmtrain.data import tools
    from vlmtrain.data.sources import StreamingDataset

    try:
        if ns.tool == "to-wds":
            args = ns["to-wds"]
            stream = StreamingDataset([tools.open_source(args.src)], shuffle=False)
            paths = tools.write_webdataset(tools.progress(stream, "to-wds"), args.out, shard_size=args.shard_size)
            print(f"wrote {len(paths)} shard(s) to {args.out}")
        else:
            from vlmtrain.run import inspect_checks

            check, video = inspect_checks(ns.inspect.config, ns.inspect.model)
            print(tools.format_report(tools.inspect_source(ns.inspect.src, limit=ns.inspect.limit, check=check,
                                                           video=video)))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return 0


def _report(argv: list[str]) -> int:
    import jsonargparse

    parser = jsonargparse.ArgumentParser(prog="vlmtrain report", description=description("report"), formatter_class=help_formatter(),
                                         exit_on_error=False, allow_abbrev=False)
    parser.add_argument("run_dir", type=str, help="A run's train.output_dir (holding metrics.jsonl).")
    parser.add_argument("--max-cards", "--max_cards", type=int, default=48,
                        help="Held-out sample cards per evaluated step (half of them wrong answers).")
    try:
        ns = parser.parse_args(argv)
    except jsonargparse.ArgumentError as e:
        raise ConfigError(f"{e}. See vlmtrain report --help.") from None
    from vlmtrain.logging.report import write_report

    print(f"wrote {write_report(ns.run_dir, max_cards=ns.max_cards)}")
    return 0


def _sync(argv: list[str]) -> int:
    import jsonargparse

    from vlmtrain.logging.trackers import TRACKERS

    parser = jsonargparse.ArgumentParser(prog="vlmtrain sync", description=description("sync"), formatter_class=help_formatter(), exit_on_error=False,
                                         allow_abbrev=False)
    parser.add_argument("run_dir", type=str, help="A run's train.output_dir (holding metrics.jsonl).")
    parser.add_argument("--to", type=str, required=True, help=f"The tracker: {', '.join(TRACKERS)}.")
    parser.add_argument("--project", type=str, default=None, help="Project/experiment (default: the run's "
                        "train.project in RUN_DIR/config.yaml, else huggingface).")
    parser.add_argument("--run-name", "--run_name", type=str, default=None,
                        help="Run name (default: the run's train.run_name, else RUN_DIR's name).")
    try:
        ns = parser.parse_args(argv)
    except jsonargparse.ArgumentError as e:
        raise ConfigError(f"{e}. See vlmtrain sync --help.") from None
    from vlmtrain.logging.sync import sync_run

    run_id, rows = sync_run(ns.run_dir, ns.to, project=ns.project, run_name=ns.run_name)
    print(f"synced {rows} rows of {os.path.join(ns.run_dir, 'metrics.jsonl')} to {ns.to} run {run_id}")
    return 0


def _plan_options(parser: Any) -> None:
    parser.add_argument("--device", type=str | None, default=None,
                        help="The GPU to plan for: h100-80gb, h100-94gb, h200, a100-40gb, a100-80gb, l40s, a10g, l4, "
                             "rtx4090 (default: data.device_memory, else this machine's CUDA device, else none).")
    parser.add_argument("--device-memory", "--device_memory", type=str | None, default=None,
                        help="The device's memory instead of a name, e.g. 80GiB or 40GB.")
    parser.add_argument("--nproc", type=int, default=1,
                        help="Devices of the run: with train.fsdp the weights, gradients and optimizer state are "
                             "split over them.")


def _plan(argv: list[str]) -> int:
    cfg, ns = _parse("plan", argv, extra=_plan_options)
    if ns.device and ns.device_memory:
        raise ConfigError("vlmtrain plan: pass --device or --device-memory, not both.")
    from vlmtrain import memory

    print(memory.plan_report(cfg, ns.device or ns.device_memory, ns.nproc))
    return 0


_HANDLERS = {"train": _train, "eval": _eval, "predict": _predict, "generate": _generate, "demo": _demo,
             "export": _export, "data": _data, "report": _report, "sync": _sync, "plan": _plan}


def _shutdown_distributed() -> None:
    """Under torchrun: wait for every rank, then tear the process groups down and free them (a process that
    exits with gloo threads still running can abort, failing the whole job)."""
    if "WORLD_SIZE" in os.environ:
        from vlmtrain.trainer.distributed import shutdown

        shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the vlmtrain command line; returns the exit code (2 for configuration errors, 1 for other errors the
    user can act on: vlmtrain.errors.USER_ERRORS)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command not in _HANDLERS:
            near = difflib.get_close_matches(command, list(_HANDLERS), n=1)
            raise ConfigError(f"unknown command {command!r}." + (f" Did you mean {near[0]!r}?" if near else "")
                              + f" Commands: {', '.join(_HANDLERS)}.")
        code = _HANDLERS[command](rest)
        _shutdown_distributed()
        return code
    except USER_ERRORS as e:  # one line, no traceback: the user fixes a setting or the data (any other: traceback)
        from vlmtrain.torchrun_errors import report_error  # (stdlib only: no torch for a typo)

        if not report_error(str(e)):  # a rank under `--nproc N`: the launcher prints it, once
            print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except SystemExit as e:  # --help and --print_config exit from inside the parser
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
