"""Every error the training half raises, in one place; imports nothing of the package, so every
module can raise them without an import circle. The scripts map them to exit statuses
(``cli.exit_status``): UsageError, DataError and CheckpointError to 2 (nothing written), a
NonFiniteLoss to 1, Interrupted and Signalled to 128 + the signal."""

from __future__ import annotations

import signal
from typing import Any


class UsageError(ValueError):
    """A bad option or a run folder that cannot be used: exit status 2, nothing written."""


class Signalled(KeyboardInterrupt):
    """A stop signal where no checkpoint can be saved first (a second signal, or one before training)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached a training loop at a step boundary (raised after it saved a checkpoint)."""


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or inf; the last good checkpoint is kept."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names it, and the file is left as it is."""


class DataError(RuntimeError):
    """Data that is missing or unreadable; the message says how to supply it."""


def preview(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: what a message echoes back of an input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
