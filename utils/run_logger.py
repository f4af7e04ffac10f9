"""Run directory, console, metrics.jsonl and TensorBoard: every side effect, rank 0 only.

The run directory is named once for all ranks (resolve_run_dir) and checked before any training:
never an earlier run's without --resume (check_run_dir), and writable (check_writable).
Other ranks get a RunLogger with enabled=False whose methods do nothing, so
call sites need no rank checks (and never wrap a collective in one).

TensorBoard has one x-axis, the global optimizer step: step-level points at their
step, an epoch's points (every number of its metrics.jsonl line) and pictures at
the step where the epoch ends. The epoch's checkpoint, its metrics.jsonl line,
TensorBoard's writes and the pictures happen on a thread of their own (Background), in the order
asked, so the next epoch does not wait for them; run files and the console lines are written on
the caller's thread at once. Pictures (utils/figures.py): the confusion matrix
and the worst mistakes every epoch, augmented training samples once.
The Custom Scalars tab (LAYOUT) puts train and val loss on one chart; the bookkeeping
numbers (epoch, seconds, counts) sort after the curves, in BOOKKEEPING.
"""
import io
import json
import math
import os
import queue
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from tqdm import tqdm

try:
    import google_crc32c
except ImportError:  # TensorBoard's own checksum, in pure Python (checksum_in_c)
    google_crc32c = None

from utils import run_dir as run_files
from utils.config import flatten, save_config
from utils.distributed_utils import broadcast_object
from utils.errors import UserError


def resolve_run_dir(cfg, script_name, dist_info):
    """Rank 0 names the run directory and every rank agrees on it (one broadcast)."""
    if cfg.output_dir:
        run_dir = cfg.output_dir
    elif cfg.resume == "auto":
        raise UserError("--resume auto needs --output-dir: the run directory to continue")
    else:
        run_dir = str(Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{script_name}")
    return Path(broadcast_object(run_dir if dist_info.rank == 0 else None))


def check_run_dir(run_dir, resuming):
    """Never write over an earlier run without --resume; fail before any training."""
    if resuming:
        return
    if run_files.holds_run(run_dir):
        raise UserError(f"run directory '{run_dir}' already holds a run; continue it with "
                        "--resume auto, or choose another --output-dir")


def check_writable(run_dir):
    """A run directory that cannot be written fails now, not at the end of the first epoch."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output directory '{run_dir}' is not writable ({e.strerror or e}); "
                        "choose another --output-dir") from None


def write_json(path, obj):
    """A run's JSON file (class_indices.json, eval.json), whole or not at all: written beside and renamed.
    Class names as written (e.g. 玫瑰), not \\uXXXX escapes; UTF-8 whatever the locale."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


class Background:
    """One thread that runs the jobs it is given, one at a time, in the order given: the epoch's checkpoint
    write (utils/checkpoint.py), its metrics.jsonl line, TensorBoard's writes and the epoch's pictures,
    beside the next epoch. later() returns a threading.Event, set when the job is done or dropped. After
    a job fails, the jobs given after it and before its error is taken (by the checkpoint's vote,
    take_error, or at close) are dropped: a metrics line never outruns its checkpoint. A job given on the
    thread itself runs at once."""

    def __init__(self):
        self._jobs, self.error = queue.Queue(), None
        # A job failed in generation g: the rest of g is dropped, even once its error is taken (take_error
        # starts a new one), so that what followed a failed checkpoint never lands whatever the timing.
        self._generation, self._failed = 0, None
        self._thread = threading.Thread(target=self._work, name="run-logger", daemon=True)
        self._thread.start()

    def _work(self):
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            fn, args, done, generation = job
            try:
                if generation != self._failed:
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - taken on the caller's thread
                self.error, self._failed = e, generation
            finally:
                done.set()
                self._jobs.task_done()

    def later(self, fn, *args):
        done = threading.Event()
        if threading.current_thread() is self._thread:
            fn(*args)
            done.set()
        else:
            self._jobs.put((fn, args, done, self._generation))
        return done

    def wait(self):
        """Returns when every job given so far is done (or dropped)."""
        self._jobs.join()

    def take_error(self):
        error, self.error = self.error, None
        if error is not None:
            self._generation += 1
        return error

    def close(self):
        self._jobs.put(None)
        self._thread.join()


class RunLogger:
    def __init__(self, run_dir, enabled, start_epoch=0, start_step=0, resuming=False, tty=None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        # A terminal gets tqdm bars; a file (SLURM's output, nohup, a pipe) gets one plain line per log window.
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.writer = self.background = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / run_files.METRICS
        self._truncate_metrics(start_epoch)
        # purge_step hides points a killed or abandoned run logged past the checkpoint's step
        # (all of them for one killed before its first checkpoint), so a resumed curve does not
        # double back on itself; the checkpoint's own step keeps its points (its epoch's end).
        self.background = Background()
        self.later(self._open_writer, (start_step + 1 if start_step else 0) if resuming else None)

    def _open_writer(self, purge_step):
        from torch.utils.tensorboard import SummaryWriter
        checksum_in_c()
        self.writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=purge_step)
        self.writer.add_custom_scalars(LAYOUT)

    def later(self, fn, *args):
        """Run fn(*args) on the logger's own thread, after what was asked before (rank 0; else nothing).
        Returns a threading.Event set once it is done."""
        if self.background is not None:  # enabled, and not closed yet
            return self.background.later(fn, *args)
        done = threading.Event()
        done.set()
        return done

    def wait(self):
        """Until everything asked of the logger's thread so far is done; its error, if one failed, is raised."""
        if self.background is not None:
            self.background.wait()
            error = self.background.take_error()
            if error is not None:
                raise error

    def _truncate_metrics(self, start_epoch):
        """On resume keep only epochs the checkpoint includes (1-based epoch <= start_epoch); an event line
        (a "done" marker) goes too: the resumed run writes its own."""
        if not self.metrics_path.exists():
            return
        kept = [line for line in self.metrics_path.read_text().splitlines()
                if line.strip() and json.loads(line).get("epoch", math.inf) <= start_epoch]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.metrics_path)

    def info(self, msg):
        if self.enabled:
            tqdm.write(msg)

    def write_json(self, name, obj):
        if self.enabled:
            write_json(self.run_dir / name, obj)

    def write_config(self, cfg):
        if self.enabled:
            save_config(cfg, self.run_dir / run_files.CONFIG)

    def scalar(self, tag, value, global_step):
        self.later(lambda: self.writer.add_scalar(tag, value, global_step))

    def epoch(self, metrics, classes=()):
        """One line of metrics.jsonl; each of its numbers (per-class lists by class name) becomes a
        TensorBoard scalar at the epoch's last global step ("step")."""
        if not self.enabled:
            return
        # Stamped now; written on the logger's thread after the epoch's checkpoint, so that metrics.jsonl
        # never holds an epoch whose last.pt is not on disk.
        self.later(self._epoch, {"time": round(time.time(), 3), **metrics}, tuple(classes))

    def _epoch(self, metrics, classes):
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        global_step = metrics["step"]
        for key, value in metrics.items():
            if key in ("time", "step"):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(scalar_tag(key), value, global_step)
            elif isinstance(value, list) and len(value) == len(classes) and all(
                    v is None or isinstance(v, (int, float)) for v in value):  # per class; the confusion matrix is a figure
                for name, v in zip(classes, value):
                    if v is not None:  # e.g. the AP of a label without a positive
                        self.writer.add_scalar(f"{scalar_tag(key)}/{name}", v, global_step)
        self.writer.flush()

    def event(self, name, **fields):
        """A metrics.jsonl line that is no epoch's (no "epoch" key): {"event": "done", "reason": "early_stop", ...}."""
        self.later(self._append, {"time": round(time.time(), 3), "event": name, **fields})

    def _append(self, line):
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def image(self, tag, image, global_step):
        """An RGB uint8 (H, W, 3) picture from utils/figures.py, as a PNG in the event file. Encoded here:
        add_image converts to float, resamples at scale 1 and compresses at zlib's level 6, which cost
        more than drawing the picture did."""
        self.later(self._image, tag, image, global_step)

    def _image(self, tag, image, global_step):
        from PIL import Image
        from tensorboard.compat.proto.summary_pb2 import Summary
        png = io.BytesIO()
        Image.fromarray(image).save(png, format="PNG", compress_level=1)
        height, width, channels = image.shape
        value = Summary.Value(tag=tag, image=Summary.Image(height=height, width=width, colorspace=channels,
                                                           encoded_image_string=png.getvalue()))
        self.writer._get_file_writer().add_summary(Summary(value=[value]), global_step)

    def pr_curve(self, tag, labels, probabilities, global_step):
        """A precision-recall curve (TensorBoard's PR curves tab) of one label's 0/1 targets and probabilities."""
        self.later(lambda: self.writer.add_pr_curve(tag, labels.int().numpy(), probabilities.float().numpy(),
                                                    global_step))

    def hparams(self, config, metric_tags):
        """The flattened config in TensorBoard's HParams tab, beside the last value of `metric_tags`."""
        if not self.enabled:
            return
        flat = {k: v if isinstance(v, (int, float, str, bool)) else "null" if v is None else str(v)
                for k, v in flatten(config).items()}
        self.later(self._hparams, flat, metric_tags)

    def _hparams(self, flat, metric_tags):
        from torch.utils.tensorboard.summary import hparams
        # Into this run's own event file (add_hparams would open a sub-run beside it).
        writer = self.writer._get_file_writer()
        for summary in hparams(flat, {tag: math.nan for tag in metric_tags}):
            writer.add_summary(summary)

    def progress_bar(self, iterable, total, desc):
        """A tqdm bar on a terminal; elsewhere the iterable itself (no bar, so no carriage returns in a file)."""
        if not (self.enabled and self.tty):
            return _NoBar(iterable)
        return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, leave=False, mininterval=0.1)

    def window(self, bar, label, epoch_step, total, loss, img_s, lr, eta_s):
        """A log window's numbers: the bar's postfix on a terminal, else one plain line (rank 0 only)."""
        if not self.enabled:
            return
        if self.tty:
            bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{img_s:.0f}", lr=f"{lr:.2e}")
        else:
            print(f"{label}  step {epoch_step}/{total}  loss {loss:.4f}  {img_s:.0f} img/s  lr {lr:.2e}  "
                  f"ETA {_clock(eta_s)}", flush=True)

    def flush(self):
        self.later(lambda: self.writer.flush())
        self.wait()

    def close(self):
        """Waits for the TensorBoard writes and pictures still to do, then closes the event file. An error of
        theirs is raised here, unless the run is already ending with one of its own."""
        if self.background is None:
            return
        self.background.later(lambda: self.writer is not None and self.writer.close())
        try:
            self.background.close()
            error = self.background.take_error()
        finally:
            self.background = None
        if error is not None and sys.exc_info()[0] is None:
            raise error


# TensorBoard's Scalars tab sorts its sections by the tag's first part: bookkeeping goes in one
# section that sorts after train/ and val/, so the curves come first on screen.
BOOKKEEPING = "~run"
# metrics.jsonl key -> TensorBoard tag: "val_acc" -> "val/acc"; the rest by name.
_TAGS = {"lr": "train/epoch_lr", "img_per_s": "train/img_per_s",
         **{key: f"{BOOKKEEPING}/{key}" for key in ("epoch", "epoch_seconds", "figure_seconds", "train_seconds",
                                                    "val_seconds", "val_count", "bad_images")}}
# The Custom Scalars tab: {section: {chart: ["Multiline", [tag regexes]]}}; a chart's lines are the tags
# its regexes match (val/acc_ema with train.ema_decay, val/map for multi-label runs).
LAYOUT = {
    "curves": {
        "loss: train and val": ["Multiline", [r"^train/loss$", r"^val/loss$", r"^val/loss_ema$"]],
        "val accuracy, its EMA and top-5 (multi-label: mAP)": ["Multiline", [r"^val/(acc|map)(_ema)?$",
                                                                             r"^val/top5$"]],
        "learning rate": ["Multiline", [r"^train/lr$"]],
    },
    "speed": {
        "img/s": ["Multiline", [r"^train/img_per_s$"]],
        "data wait: share of the training time": ["Multiline", [r"^train/data_wait(_step)?$"]],
    },
}


def masked_crc32c(data):
    """TensorBoard's record checksum (CRC-32C, masked as TFRecord's), computed in C by google-crc32c."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | ((crc << 17) & 0xFFFFFFFF)) + 0xA282EAD8) & 0xFFFFFFFF


def checksum_in_c():
    """Whether TensorBoard's records are checksummed by masked_crc32c (it is installed into TensorBoard's
    writer here when google-crc32c's C code is there). Without TensorFlow, TensorBoard computes the checksum
    of every record in pure Python: 27 ms for a 100 KB picture, all of it holding Python's lock (the GIL) on
    the writer's thread, while the training loop's thread waits for that lock between its ops
    (benchmarks/pictures.py). The event files are the same byte for byte."""
    from tensorboard.summary.writer import record_writer
    if google_crc32c is not None and google_crc32c.implementation == "c":
        record_writer.masked_crc32c = masked_crc32c
    return record_writer.masked_crc32c is masked_crc32c


def scalar_tag(key):
    if key in _TAGS:
        return _TAGS[key]
    if key.startswith("best_"):  # train.best_metric's best so far: best_acc -> val/best_acc, best_loss -> val/best_loss
        return "val/" + key
    for prefix in ("train_", "val_"):
        if key.startswith(prefix):
            return prefix[:-1] + "/" + key[len(prefix):]
    return f"{BOOKKEEPING}/{key}"


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
