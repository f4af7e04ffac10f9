"""The run directory's layout: every file and folder a run writes, named once. Writers (run.py,
utils/run_logger.py, utils/checkpoint.py) and readers (predict.py, export.py, model.py's --weights RUN,
tools/, benchmarks/, the tests) take their paths from here.

    RUN/config.yaml          the resolved config               RUN/run_record.json   what it ran on
    RUN/class_indices.json   {"0": "daisy", ...}               RUN/metrics.jsonl     one line per epoch
    RUN/eval.json            --eval-only's report              RUN/predictions.csv   predict.py's default --out
    RUN/param_groups.json    each trained parameter's lr scale and weight decay (utils/param_groups.py)
    RUN/confusion_matrix.png, worst_mistakes.png (per_label_f1.png multi-label): --eval-only's pictures
    RUN/job.log              a kfold fold's or sweep trial's output (utils/jobs.py)
    RUN/events.out.tfevents.* TensorBoard
    RUN/checkpoints/last.pt, best.pt, epoch_NNN.pt (train.keep_last), sharded-*/ (FSDP)
    RUN/features/train.pt, val.pt  the linear probe's cached features (linear_probe.py; or train.feature_cache)
"""
import json
from pathlib import Path

CONFIG = "config.yaml"
RECORD = "run_record.json"
CLASSES = "class_indices.json"
METRICS = "metrics.jsonl"
EVAL = "eval.json"
PARAM_GROUPS = "param_groups.json"
PREDICTIONS = "predictions.csv"
# --eval-only's pictures (a training run's go to TensorBoard): single-label, and a multi-label run's bars.
CONFUSION_PNG, WORST_PNG, F1_BARS_PNG = "confusion_matrix.png", "worst_mistakes.png", "per_label_f1.png"
RELIABILITY_PNG = "reliability.png"  # --eval-only, single-label: confidence against accuracy, before and after T
JOB_LOG = "job.log"
CHECKPOINTS = "checkpoints"
LAST, BEST = "last.pt", "best.pt"
FEATURES = "features"


def checkpoints(run_dir):
    return Path(run_dir) / CHECKPOINTS


def features(run_dir, cache=None):
    """The linear probe's feature folder: train.feature_cache, else RUN/features."""
    return Path(cache) if cache else Path(run_dir) / FEATURES


def last(run_dir):
    return checkpoints(run_dir) / LAST


def best(run_dir):
    return checkpoints(run_dir) / BEST


def epoch_checkpoint(ckpt_dir, epoch):
    """The copy of the checkpoint at the end of `epoch` (1-based) kept by train.keep_last."""
    return Path(ckpt_dir) / f"epoch_{epoch:03d}.pt"


def epoch_checkpoints(ckpt_dir):
    """The epoch_NNN.pt copies in `ckpt_dir`, oldest first."""
    return sorted(Path(ckpt_dir).glob("epoch_*.pt"))


def run_of(checkpoint):
    """The run directory of a checkpoint file: RUN for RUN/checkpoints/X.pt, else the file's folder."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else checkpoint.parent


def holds_run(run_dir):
    """Whether a run has written here (its metrics or checkpoints): what another run must not write over."""
    return (Path(run_dir) / METRICS).exists() or checkpoints(run_dir).exists()


def read_metrics(run_dir, epochs_only=False):
    """metrics.jsonl as a list of dicts, [] when there is none; epochs_only drops event lines (a "done")."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "epoch" in r] if epochs_only else rows
