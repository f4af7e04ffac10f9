"""SIGTERM / SIGINT / SIGUSR1 -> a stop request honoured at a step boundary, never in the middle of a step.

    kill -TERM <pid>    # or Ctrl-C, or a scheduler's preemption signal: checkpoint, then exit 143 (130 for Ctrl-C)
    kill -USR1 <pid>    # the same: SLURM's --signal=USR1@120 warning before the time limit (exit 138)

fit() holds a StopRequest while it trains. The training loop reads it every
step on one process; under DDP it is read once per train.log_every steps and
carried in the all-reduce that already happens there, so every rank stops at
the same step without an extra synchronisation per step. The run then writes
last.pt and exits non-zero with the command that resumes it. The third signal
quits at once, without a checkpoint (torchrun forwards the signal it got, so
one Ctrl-C can arrive twice).
"""
import signal
import threading

FORCE_AFTER = 3
# SIGUSR1 is what SLURM's --signal=USR1@SECONDS sends before the time limit (no SIGUSR1 on Windows).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, name))


class StopRequest:
    def __init__(self):
        self.signum = None
        self.asked = False
        self.count = 0
        self._previous = {}

    def requested(self):
        return self.signum is not None or self.asked

    def request(self):
        """A stop the run asks of itself (an epoch's checkpoint that could not be written, on rank 0's
        logger thread): the loop stops at its next step, where that save's error is raised on every rank."""
        self.asked = True

    @property
    def exit_code(self):
        return 128 + (self.signum or signal.SIGTERM)  # the shell's convention for "killed by signal N"

    @property
    def name(self):
        return signal.Signals(self.signum).name if self.signum else "a stop request on another rank"

    def _handle(self, signum, frame):
        self.count += 1
        if self.count >= FORCE_AFTER:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def install(self):
        # Python delivers signals to the main thread only; elsewhere leave the handlers alone.
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
