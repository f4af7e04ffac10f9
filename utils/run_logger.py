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
    def __init__(self, run_dir, enabled, start_epoch=0, start_step=0, resuming=False):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
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
        # In a log file (no TTY) a redraw per step would flood it; redraw every 30 s instead.
        return tqdm(iterable, total=total, desc=desc, disable=not self.enabled, dynamic_ncols=True,
                    leave=False, mininterval=0.1 if sys.stderr.isatty() else 30)

    def close(self):
        if self.writer is not None:
            self.writer.close()
