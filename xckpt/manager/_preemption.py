"""SIGTERM as a preemption notice: a flag the manager reads at the next step boundary.

Schedulers (Slurm, Kubernetes, torchelastic) send SIGTERM some seconds before they
kill a job. `SigtermFlag` installs a handler that only sets a flag (a signal
handler must not save: it runs between two bytecodes of the training loop, maybe in
the middle of an optimizer step), then calls the handler installed before it, if
that one is a Python callable (`SIG_DFL` would end the process before the save, and
`SIG_IGN` does nothing, so neither is called). The manager reads the flag in
`should_save` / `save`, agrees with the other ranks, saves, and exits 143.

Python runs signal handlers in the main thread only, and installs them only from it:
a manager built on another thread installs none and warns, so build the manager on
the main thread to handle preemption.
"""

from __future__ import annotations

import signal
import threading
import warnings
from typing import Any

__all__ = ["SigtermFlag"]


class SigtermFlag:
    """A SIGTERM handler that sets `received` and chains the earlier handler."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> bool:
        """Install the handler (main thread only); whether it was installed."""
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "CheckpointManager(handle_preemption=True) was built outside the main thread, where "
                "Python cannot install a SIGTERM handler: preemption is not handled. Build the manager "
                "on the main thread, or pass handle_preemption=False",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        previous = self._previous
        if callable(previous):
            previous(signum, frame)

    def uninstall(self) -> None:
        """Put the earlier handler back, if this one is still the installed handler.

        When another handler was installed after this one (and chains it), this one
        stays in its chain; it then only sets a flag nobody reads and calls the
        earlier handler.
        """
        if not self._installed:
            return
        self._installed = False
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == self._handle
        ):
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
