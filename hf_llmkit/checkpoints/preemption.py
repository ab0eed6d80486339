"""The preemption signals of `FaultToleranceCallback`: handlers that turn SIGTERM / SIGUSR1 into a save-and-exit
request at the next step boundary, installed for a training run and put back after it, and the one line a preempted
run ends with."""

from __future__ import annotations

import logging
import signal
import threading

from hf_llmkit.checkpoints.endings import StopRequest
from hf_llmkit.checkpoints.names import checkpoint_folder

__all__ = ["PreemptionSignals", "preemption_message"]

logger = logging.getLogger(__name__)


class PreemptionSignals:
    """Records the signals of `names` while installed; `received` is the last one seen (None: none yet).

    `install` replaces the current handlers (on the main thread only); `restore` puts them back, in reverse order,
    except where another component has installed its own over ours meanwhile: that one stays, and ours, if it is
    still called after training, passes the signal on to the handler it had replaced.

    Args:
        names: Signal names (e.g. `("SIGTERM", "SIGUSR1")`); an unknown one is a ValueError.
    """

    def __init__(self, names: tuple[str, ...] | list[str]):
        unknown = [name for name in names if not isinstance(getattr(signal, str(name), None), signal.Signals)]
        if unknown:
            raise ValueError(f"unknown signal names {unknown}; use names such as 'SIGTERM' or 'SIGUSR1'")
        self.names = tuple(names)
        self.signals = tuple(getattr(signal, name) for name in names)
        self.received: int | None = None
        self._old_handlers: dict[int, object] = {}  # installed now: signal -> the handler ours replaced
        self._replaced: dict[int, object] = {}  # every handler ours replaced, kept to pass a late signal on

    def _on_signal(self, signum, frame) -> None:
        if signum not in self._old_handlers:  # training is over: this handler was left installed by someone else
            _pass_on(signum, frame, self._replaced.get(signum))
            return
        if self.received is None:
            logger.warning("received %s: saving at the next step boundary, then stopping", signal.Signals(signum).name)
        self.received = signum

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("FaultToleranceCallback: not on the main thread, signal handlers not installed")
            return
        for signum in self.signals:
            if signum not in self._old_handlers:
                previous = signal.signal(signum, self._on_signal)
                if previous == self._on_signal:  # still ours from an earlier run (left by someone else's restore)
                    previous = self._replaced.get(signum, signal.SIG_DFL)
                self._old_handlers[signum] = self._replaced[signum] = previous

    def restore(self) -> None:
        for signum, handler in reversed(list(self._old_handlers.items())):  # the last replaced goes back first
            if signal.getsignal(signum) == self._on_signal:  # else someone installed theirs over ours: it stays
                signal.signal(signum, handler)
        self._old_handlers.clear()


def _pass_on(signum: int, frame, handler) -> None:
    """Deliver a signal to the handler ours had replaced: call it, or let the default action happen."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL or handler is None:
        signal.signal(signum, signal.SIG_DFL)  # e.g. SIGTERM's default: the process ends
        signal.raise_signal(signum)


def preemption_message(request: StopRequest, output_dir: str) -> str:
    """The one line a preempted run ends with: what happened, where the checkpoint is, how to continue."""
    checkpoint = checkpoint_folder(output_dir, request.step)
    return (
        f"received {request.reason}: stopped at step {request.step} after saving the complete checkpoint "
        f"{checkpoint}; run the same command again to continue from it"
    )
