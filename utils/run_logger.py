"""Run directory, console, metrics.jsonl and TensorBoard: every side effect, rank 0 only.

Other ranks get a RunLogger with enabled=False whose methods do nothing, so
call sites need no rank checks (and never wrap a collective in one).
"""
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from utils.config import save_config


class RunLogger:
    def __init__(self, run_dir, enabled, start_epoch=0, start_step=0, resuming=False, tty=None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        # A terminal gets tqdm bars; a file (SLURM's output, nohup, a pipe) gets one plain line per log window.
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.writer = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._truncate_metrics(start_epoch)
        from torch.utils.tensorboard import SummaryWriter
        # purge_step hides points a killed run logged past its last checkpoint (even one killed
        # before its first checkpoint: step 0), so a resumed curve does not double back on itself.
        self.writer = SummaryWriter(log_dir=str(self.run_dir),
                                    purge_step=start_step if resuming else (start_step or None))

    def _truncate_metrics(self, start_epoch):
        """On resume keep only epochs the checkpoint includes (1-based epoch <= start_epoch)."""
        if not self.metrics_path.exists():
            return
        kept = [line for line in self.metrics_path.read_text().splitlines()
                if line.strip() and json.loads(line)["epoch"] <= start_epoch]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.metrics_path)

    def info(self, msg):
        if self.enabled:
            tqdm.write(msg)

    def write_json(self, name, obj):
        if self.enabled:
            # Class names as written (e.g. 玫瑰), not \uXXXX escapes; UTF-8 whatever the locale.
            (self.run_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n",
                                             encoding="utf-8")

    def write_config(self, cfg):
        if self.enabled:
            save_config(cfg, self.run_dir / "config.yaml")

    def scalar(self, tag, value, step):
        if self.enabled:
            self.writer.add_scalar(tag, value, step)

    def epoch(self, metrics):
        """One line of metrics.jsonl and the epoch's TensorBoard points."""
        if not self.enabled:
            return
        metrics = {"time": round(time.time(), 3), **metrics}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        step = metrics["epoch"]
        for key, tag in (("train_loss", "train/loss"), ("val_loss", "val/loss"), ("val_acc", "val/acc"),
                         ("lr", "train/lr"), ("img_per_s", "train/img_per_s")):
            if key in metrics:
                self.writer.add_scalar(tag, metrics[key], step)
        self.writer.flush()

    def progress(self, iterable, total, desc):
        """A tqdm bar on a terminal; elsewhere the iterable itself (no bar, so no carriage returns in a file)."""
        if not (self.enabled and self.tty):
            return _NoBar(iterable)
        return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, leave=False, mininterval=0.1)

    def window(self, bar, label, step, total, loss, img_s, lr, eta_s):
        """A log window's numbers: the bar's postfix on a terminal, else one plain line (rank 0 only)."""
        if not self.enabled:
            return
        if self.tty:
            bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{img_s:.0f}", lr=f"{lr:.2e}")
        else:
            print(f"{label}  step {step}/{total}  loss {loss:.4f}  {img_s:.0f} img/s  lr {lr:.2e}  "
                  f"ETA {_clock(eta_s)}", flush=True)

    def close(self):
        if self.writer is not None:
            self.writer.close()


class _NoBar:
    """Where no bar is drawn (not rank 0, or no terminal): iterates, and ignores bar calls."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def set_postfix(self, **_):
        pass


def _clock(seconds):
    seconds = int(round(max(seconds, 0)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
