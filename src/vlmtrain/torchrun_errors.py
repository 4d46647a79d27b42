"""torchrun for `vlmtrain train|predict --nproc N`, where an error the user can act on prints as one line.

A rank that stops on such an error (a ConfigError, CheckpointError or DataError: see vlmtrain.cli) writes its
message to a file in ``$VLMTRAIN_ERRORS_DIR`` instead of printing it; when torchrun then reports the failed
ranks, this prints each distinct message once (``error: ...``) and exits with the rank's exit code, without
torchrun's traceback and failure table. Any other failure (a rank's own traceback) is reported by torchrun as
always. Run as a file (see vlmtrain.launch.torchrun_command): it imports only the standard library and torch,
so the launcher does not import vlmtrain a second time before the ranks start.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

ERRORS_ENV = "VLMTRAIN_ERRORS_DIR"
# torchrun logs here the ranks it stops ("Sending process N closing signal SIGTERM") and "failed (exitcode: 2)
# local_rank: 0 (pid: ...) of binary: ..." before raising ChildFailedError: left out once a rank reported an error
# (they only repeat it as noise).
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def report_error(message: str) -> bool:
    """In a rank that the launcher started: hand ``message`` (an error the user can act on) to the launcher,
    which prints each distinct one once; False elsewhere (the caller prints it)."""
    directory = os.environ.get(ERRORS_ENV)
    if not directory or "WORLD_SIZE" not in os.environ or not os.path.isdir(directory):
        return False
    path = os.path.join(directory, f"rank-{int(os.environ.get('RANK', '0'))}.txt")
    with open(path + ".tmp", "w") as f:
        f.write(message)
    os.replace(path + ".tmp", path)
    return True


def reported(directory: str) -> list[str]:
    """The distinct messages the ranks wrote to ``directory``, in rank order."""
    names = sorted((n for n in os.listdir(directory) if n.endswith(".txt")) if os.path.isdir(directory) else [],
                   key=lambda n: int(n.split("-")[1].split(".")[0]))
    messages: list[str] = []
    for name in names:
        with open(os.path.join(directory, name)) as f:
            text = f.read().strip()
        if text and text not in messages:
            messages.append(text)
    return messages


class _QuietWhenReported(logging.Filter):
    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def filter(self, record: logging.LogRecord) -> bool:
        return not reported(self.directory)


def main(argv: list[str]) -> int:
    """torchrun ``argv`` (its own options, then the command); returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    directory = tempfile.mkdtemp(prefix="vlmtrain-errors-")
    os.environ[ERRORS_ENV] = directory  # the ranks inherit it
    quiet = _QuietWhenReported(directory)
    agent = logging.getLogger(_AGENT_LOGGER)
    agent.addFilter(quiet)
    try:
        torchrun(argv)
        return 0
    except ChildFailedError as e:
        messages = reported(directory)
        if not messages:
            raise
        for message in messages:
            print(f"error: {message}", file=sys.stderr)
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else 1
    finally:
        agent.removeFilter(quiet)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
