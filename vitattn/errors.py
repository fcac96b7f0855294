"""The errors the training half raises for input it refuses; imports nothing of the package, so
every module can raise them without an import circle."""

from __future__ import annotations

import signal


class UsageError(ValueError):
    """A bad option or a run folder that cannot be used: exit status 2, nothing written."""


class Signalled(KeyboardInterrupt):
    """A stop signal where no checkpoint can be saved first (a second signal, or one before training)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
