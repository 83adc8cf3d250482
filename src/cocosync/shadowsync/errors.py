"""The errors a ShadowSync job raises for people: a bad setting, a bad checkpoint. A leaf module (imports nothing of
cocosync) so that every layer can raise them without importing another."""

from __future__ import annotations

import os

__all__ = ["ConfigError", "CheckpointError", "debug_mode"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""


class CheckpointError(ConfigError):
    """A checkpoint is missing, damaged, of another format, or holds something other than data."""


def debug_mode() -> bool:
    """`cocosync --debug ...`: errors show their traceback."""
    return os.environ.get("COCOSYNC_DEBUG") == "1"
