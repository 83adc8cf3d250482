"""The `cocosync` command (and `python -m cocosync_start`): where the command starts ranks, the warm fork server
starts first, then cocosync's command line runs (cocosync.cli)."""

from __future__ import annotations

import os
import sys

from cocosync_start import EARLY_ENV, start, starts_ranks, warm


def run() -> None:
    if starts_ranks(sys.argv[1:]) and warm():
        os.environ[EARLY_ENV] = str(os.getpid())
        try:
            start()
        finally:
            del os.environ[EARLY_ENV]  # (the server has its copy; the ranks take the launcher's environment)
    from cocosync.cli import run as command  # (after the server's start: this imports torch)

    command()


if __name__ == "__main__":
    run()
