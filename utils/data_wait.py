"""The data-wait diagnostics: how long the training loop waited for its batches, and the one line
rank 0 prints when an epoch was input-bound (train/data_wait, docs/troubleshooting.md)."""
import time

from torch.profiler import record_function

# A run whose loop waits for batches in more than this share of most of an epoch's log windows is
# input-bound: rank 0 says so once (train/data_wait, docs/troubleshooting.md).
DATA_WAIT_HINT = 0.2


class TimedBatches:
    """The loader's batches, timed on the host: the seconds the loop spent waiting for the next one
    (no device sync; on CUDA the steps run ahead of the host until a window's end reads them), and
    the epoch's record of them, window by window."""

    def __init__(self, batches):
        self.batches, self.seconds = batches, 0.0
        self.shares, self.waited, self.windows_seconds = [], 0.0, 0.0

    def __iter__(self):
        batches, end = iter(self.batches), object()
        while True:
            asked = time.perf_counter()
            with record_function("data wait"):
                batch = next(batches, end)
            if batch is end:
                return
            self.seconds += time.perf_counter() - asked
            yield batch

    def pop_wait(self):
        """The seconds waited since the last pop_wait: the window's, then counted afresh."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def add_window(self, wait, seconds):
        """A closed window: the ranks' mean wait in it, and its length."""
        self.shares.append(wait / seconds)
        self.waited, self.windows_seconds = self.waited + wait, self.windows_seconds + seconds

    def wait_share(self):
        """The share of the closed windows' time spent waiting for batches."""
        return self.waited / max(self.windows_seconds, 1e-9)

    def input_bound(self):
        """Whether the loop waited for batches in over DATA_WAIT_HINT of most of the epoch's log windows:
        a slow start (the workers' first batches) alone does not count."""
        return sum(share > DATA_WAIT_HINT for share in self.shares) * 2 > len(self.shares)


def input_bound_hint(share, epoch, loader):
    """The one line rank 0 prints when the loop waited for batches in most of an epoch's windows."""
    workers = getattr(loader, "num_workers", None)
    now = f" (now {workers})" if workers is not None else ""
    return (f"note: input-bound: the loop waited for batches in {share:.0%} of epoch {epoch + 1}'s training "
            f"time (train/data_wait); try more data.num_workers{now}, data.pipeline=gpu, a smaller "
            "data.img_size, or the data on a local disk; see docs/troubleshooting.md (several GPUs slower than one)")

