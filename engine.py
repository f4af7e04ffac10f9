"""The training and evaluation loop shared by train.py and the train_multi_gpu_*.py scripts.

What you are most likely to change sits at the top:
    Criterion        the loss (cross entropy; e.g. a focal loss goes in Criterion.loss)
    sample_metrics   per-image validation metrics (each reaches metrics.jsonl, TensorBoard, eval.json)
    train_one_epoch  the step: forward, backward, clipping, optimizer, EMA, one log window at a time
    evaluate         the validation pass: loss, accuracy, confusion matrix, the worst mistakes

The entry scripts build the device, the (wrapped) model and the loaders; `fit`
does everything else the same way for all four: optimizer and schedule,
resume, epochs, exact distributed evaluation, checkpoints and logs.

Per step nothing is copied back to the host: losses are summed on the device
and read once per `train.log_every` steps, where a NaN/inf is also caught.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from model import create_model, use_channels_last
from utils import checkpoint as ckpt
from utils.cli import OUT_OF_MEMORY, out_of_memory
from utils.cam import find_target, gallery_explainer
from utils.config import config_to_dict, register_check
from utils.distributed_utils import (DistInfo, any_rank, broadcast_buffers, broadcast_object, gather_objects, no_sync,
                                     nondeterministic_op, reduce_min, reduce_sums)
from utils.errors import RUNTIME_EXIT, UserError
from utils import figures, fsdp, profiling
from utils.normalization import model_input, normalization_of
from utils.metrics import best_f1_thresholds, classification_report, multilabel_report
from utils.mixing import batch_mixer
from utils.optim import (WeightEMA, build_optimizer, build_scaler, build_scheduler, place_schedule,
                         resolve_amp)
from utils.run_logger import RunLogger, check_run_dir, check_writable, resolve_run_dir, scalar_tag
from utils.stop import StopRequest

_NO_BAD_STEP = 2 ** 62
# A run whose loop waits for batches in more than this share of most of an epoch's log windows is
# input-bound: rank 0 says so once (train/data_wait, docs/troubleshooting.md).
DATA_WAIT_HINT = 0.2


# --------------------------------------------------------------------------- the loss and the metrics

@dataclass(eq=False)
class Criterion:
    """The loss, in one place: training calls criterion(logits, targets) for the batch's mean loss
    (targets are class indices, or MixUp/CutMix's soft targets, one row of class probabilities per
    image; multi-label: one row of 0/1 per image, or their mix). Evaluation calls
    criterion.per_image(logits, labels): each image's plain loss (no smoothing, no weights), for
    val_loss and the worst mistakes.

    Single-label: cross entropy. Multi-label (`multilabel`): a sigmoid and binary cross entropy per
    label, averaged over the labels (an image's loss) and the batch; `pos_weight` scales each label's
    positive term (optim.class_weights). optim.label_smoothing=eps pulls a binary target t to
    t * (1 - eps) + eps / 2: a positive becomes 1 - eps/2, a negative eps/2.

    To train with another loss, change `loss`: both calls go through it. Its options are the fields
    below, and a field named as an optim.* key takes that key's value (build_criterion): a focal loss's
    gamma is one field here and one key in configs/default.yaml and utils/config.py."""
    label_smoothing: float = 0.0                 # optim.label_smoothing
    class_weight: Optional[torch.Tensor] = None  # optim.class_weights, one weight per class (class_weights)
    multilabel: bool = False                     # the data's task (its dataset's .multilabel)
    pos_weight: Optional[torch.Tensor] = None    # multi-label optim.class_weights, one per label (pos_weights)

    def __call__(self, logits, targets):
        return self.loss(logits, targets, reduction="mean")

    def per_image(self, logits, labels):
        plain = dataclasses.replace(self, label_smoothing=0.0, class_weight=None, pos_weight=None)
        return plain.loss(logits.float(), labels, reduction="none")

    def loss(self, logits, targets, reduction):
        """The batch's mean loss (reduction="mean") or each image's ("none")."""
        if self.multilabel:
            targets = targets.to(logits.dtype)
            if self.label_smoothing:
                targets = targets * (1 - self.label_smoothing) + self.label_smoothing / 2
            per_label = F.binary_cross_entropy_with_logits(logits, targets, pos_weight=self.pos_weight,
                                                           reduction="none")
            return per_label.mean() if reduction == "mean" else per_label.mean(dim=1)
        return F.cross_entropy(logits, targets, weight=self.class_weight, label_smoothing=self.label_smoothing,
                               reduction=reduction)


def build_criterion(optim_cfg, class_weight=None, multilabel=False, pos_weight=None):
    """The config's loss: each Criterion field named as an optim.* key gets that key's value, and the
    class weights (class_weights) or, multi-label, the labels' positive weights (pos_weights)."""
    options = {f.name: getattr(optim_cfg, f.name) for f in dataclasses.fields(Criterion) if f.name in optim_cfg}
    return Criterion(**options, class_weight=class_weight, multilabel=multilabel, pos_weight=pos_weight)


def class_weights(spec, labels, num_classes, device):
    """optim.class_weights -> a (num_classes,) loss weight tensor on `device`, or None for "none".
    `labels`: the training set's label per sample (its .targets), or None if it has none.

    auto: w_c = N / (C * n_c), inverse frequency over the training labels, so a class of the
    average size weighs 1 and every class contributes equally to the expected loss.
    """
    if spec == "none":
        return None
    if spec == "auto":
        if labels is None:
            raise UserError("optim.class_weights=auto needs the training labels: the dataset has no .targets",
                            every_rank=True)
        counts = torch.bincount(torch.as_tensor(list(labels), dtype=torch.long), minlength=num_classes).double()
        weights = counts.sum() / (num_classes * counts.clamp(min=1))
    else:
        weights = _listed_weights(spec, num_classes, "classes")
    return weights.float().to(device)


def pos_weights(spec, samples, num_classes, device):
    """Multi-label optim.class_weights -> a (num_classes,) pos_weight tensor on `device`, or None.
    `samples`: the training set's SampleList (its multi-label CSR `label_values`), or None.

    auto: pos_weight_c = (N - n_c) / n_c, the negatives per positive of label c among the N training
    images, so each label's positives weigh as much as its negatives. A label with no positive in
    training gets 1 (its positive term never occurs; 1 leaves the loss as it is).
    A list gives each label's pos_weight as written."""
    if spec == "none":
        return None
    if spec == "auto":
        values = getattr(samples, "label_values", None)
        if values is None:
            raise UserError("optim.class_weights=auto needs the training labels: the dataset has no multi-label "
                            "samples (.samples.label_values)", every_rank=True)
        counts = torch.bincount(torch.as_tensor(values, dtype=torch.long), minlength=num_classes).double()
        weights = torch.where(counts > 0, (len(samples) - counts) / counts.clamp(min=1), torch.ones_like(counts))
    else:
        weights = _listed_weights(spec, num_classes, "labels")
    return weights.float().to(device)


def _listed_weights(spec, num_classes, what):
    if len(spec) != num_classes:
        raise UserError(f"optim.class_weights has {len(spec)} weights, the data has {num_classes} {what}",
                        every_rank=True)
    return torch.tensor([float(w) for w in spec], dtype=torch.float64)


def sample_metrics(num_classes):
    """Per-image validation metrics: {name: fn(logits, labels) -> one value per image}, averaged over
    the whole validation set (summed on the device, all-reduced once). Add an entry and it appears in
    metrics.jsonl, in TensorBoard (val_x -> val/x) and in --eval-only's eval.json."""
    metrics = {}
    if num_classes >= 5:
        metrics["val_top5"] = lambda logits, labels: (logits.topk(5, dim=1).indices == labels[:, None]).any(dim=1)
    return metrics


# --------------------------------------------------------------------------- one epoch of training

def seed_for(seed, epoch, rank):
    """One seed per (run seed, epoch, rank): augmentation and data order are reproducible
    per epoch, so a run resumed at an epoch boundary continues exactly."""
    return (seed * 1_000_003 + epoch * 1009 + rank) % (2 ** 63)


def _to_device(images, labels, device, channels_last, norm):
    return model_input(images, device, norm, channels_last), labels.to(device, non_blocking=True)


@dataclass
class Step:
    """What one optimizer step uses, built once by fit (build_step); add a field for a new option."""
    model: torch.nn.Module                  # what the step runs: wrapped (DP/DDP), compiled if train.compile
    optimizer: torch.optim.Optimizer
    scheduler: object                       # stepped after every optimizer step
    scaler: torch.amp.GradScaler            # loss scaling (fp16); disabled otherwise
    device: torch.device
    criterion: Criterion = field(default_factory=Criterion)
    amp_dtype: Optional[torch.dtype] = None  # autocast dtype; None = fp32
    channels_last: bool = False             # NHWC batches (CUDA)
    accum_steps: int = 1                    # batches per optimizer step (DDP all-reduces on the last only)
    clip_grad_norm: float = 0.0             # clip the gradients' total norm to this; 0 = off
    mix: Optional[Callable] = None          # MixUp/CutMix: (images, labels) -> (images, soft targets)
    ema: Optional[WeightEMA] = None         # an average of the weights, updated after every step


@dataclass
class EpochHooks:
    """What an epoch reports to and asks of the run around the steps."""
    logger: Optional[RunLogger] = None      # progress, TensorBoard scalars (rank 0 writes)
    log_every: int = 20                     # optimizer steps per log window (one host read each)
    world_size: int = 1
    epochs: Optional[int] = None            # for the progress label "epoch 3/30"
    stop: Optional[StopRequest] = None      # a signal: all ranks stop at the same window boundary
    save_every: int = 0                     # optimizer steps between mid-epoch saves; 0 = none
    save_step: Optional[Callable] = None    # save_step(epoch_step, global_step, loss_sum, images_seen)
    first_batch: Optional[Callable] = None  # first_batch(images, labels): before MixUp/CutMix, epoch start only
    profiler: Optional[profiling.StepProfiler] = None  # train.profile: records some of this epoch's steps


def _forward_backward(step, images, targets, stepping):
    """The batch's loss (detached), its gradients added to the parameters' (scaled under fp16)."""
    # The non-final micro-batches only add to the local gradients (DDP's no_sync, FSDP's alike).
    with no_sync(step.model) if step.accum_steps > 1 and not stepping else contextlib.nullcontext():
        with record_function("forward"), torch.autocast(step.device.type, dtype=step.amp_dtype,
                                                        enabled=step.amp_dtype is not None):
            try:
                loss = step.criterion(step.model(images), targets)
            except RuntimeError as e:
                raise _unused_parameters_error(e, step.model) or e
        # The summed micro-batch gradients then equal one batch of accum_steps x batch_size.
        with record_function("backward"):  # DDP's all-reduce inside: gloo:all_reduce / nccl:all_reduce
            step.scaler.scale(loss / step.accum_steps if step.accum_steps > 1 else loss).backward()
    return loss.detach().double()


def _unused_parameters_error(e, model):
    """DDP's "Expected to have finished reduction in the prior iteration" (a forward that left some
    parameters out of the loss) as one error line naming the key and the parameters; None for any
    other error. Every rank raises it, at the step after the one that skipped them."""
    text = str(e)
    if "Expected to have finished reduction in the prior iteration" not in text:
        return None
    # torch names their indices among the module's trained parameters (names only under DETAIL).
    found = re.search(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)", text)
    trained = [name for name, p in ckpt.unwrap(model).named_parameters() if p.requires_grad]
    names = [trained[int(i)] for i in found.group(1).split() if int(i) < len(trained)] if found else []
    which = f" ({', '.join(names[:8])}{', ...' if len(names) > 8 else ''})" if names else ""
    return UserError(f"DDP found parameters that took no part in the loss{which}; a model that skips some on "
                     "purpose needs ddp.find_unused_parameters=true (see docs/troubleshooting.md)",
                     exit_code=RUNTIME_EXIT, every_rank=True)


@record_function("optimizer step")
def _optimizer_step(step, window, params_to_clip):
    """Clip the gradients of `params_to_clip` (adding the pre-clip norm to the window), step, update the scale, schedule and EMA."""
    if step.clip_grad_norm:
        step.scaler.unscale_(step.optimizer)  # clip the true gradients, not the loss-scaled ones
        norm = torch.nn.utils.clip_grad_norm_(params_to_clip, step.clip_grad_norm)  # no host sync
        # FSDP: a replicated DTensor (its shards' norms combined, in another order than DDP's sum).
        window.add_norm((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double())
    step.scaler.step(step.optimizer)
    step.scaler.update()
    step.scheduler.step()
    step.optimizer.zero_grad(set_to_none=True)
    if step.ema is not None:
        step.ema.update()


class _Window:
    """The sums of one log window, kept on the device and read once at its end (one all-reduce)."""

    def __init__(self, device, start_time):
        zero = torch.zeros((), device=device, dtype=torch.float64)
        # loss: per batch; grad_norm: pre-clip norms of the steps with finite gradients, finite_norms: how many.
        self.sums = {"loss": zero.clone(), "grad_norm": zero.clone(), "finite_norms": zero.clone()}
        self.first_bad = torch.full((), _NO_BAD_STEP, device=device, dtype=torch.long)
        self.steps, self.batches, self.images, self.start = 0, 0, 0, start_time

    def add_batch(self, loss, images, global_step):
        self.sums["loss"] += loss
        # Remember the first non-finite step without a host sync: finite steps add a huge offset.
        self.first_bad = torch.minimum(self.first_bad, torch.isfinite(loss).long() * _NO_BAD_STEP + global_step)
        self.batches += 1
        self.images += images

    def add_norm(self, norm):
        # fp16: GradScaler skips a step whose gradients overflowed; its inf norm stays out of the mean.
        finite = torch.isfinite(norm)
        self.sums["grad_norm"] += torch.where(finite, norm, 0.0)
        self.sums["finite_norms"] += finite

    def totals(self, stop_requested, waited):
        """Every rank's sums, whether any rank was asked to stop and the seconds the ranks waited for
        batches (host values, riding in the same all-reduce)."""
        flag = self.sums["loss"].new_tensor(float(stop_requested))
        return reduce_sums({**self.sums, "stop": flag, "waited": self.sums["loss"].new_tensor(waited)})


class _TimedBatches:
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


@dataclass
class EpochEnd:
    """What train_one_epoch returns, whether the epoch ran to its end or a stop request ended it."""
    global_step: int                        # optimizer steps taken, this epoch's included
    stopped: bool = False                   # a stop request ended it after hooks.save_step; no metrics then
    input_bound: bool = False               # most log windows waited over DATA_WAIT_HINT of their time
    metrics: dict = field(default_factory=dict)  # train_loss, img_per_s, train_seconds, train_data_wait


def train_one_epoch(step, loader, epoch, global_step=0, hooks=None, resume=None):
    """One pass over `loader`; returns its EpochEnd: the epoch's mean loss (over all ranks), throughput, step.

    Steps are optimizer steps: each takes `step.accum_steps` batches of the loader; a tail of fewer
    batches is not trained. `global_step`, `hooks.log_every` and `hooks.save_every` count optimizer steps.
    resume: a mid-epoch checkpoint's point (checkpoint.resume_point) to continue from.
    At the first window boundary after each `hooks.save_every` steps, and on a stop request, every
    rank calls hooks.save_step; after a stop it returns EpochEnd(global_step, stopped=True).
    Under clipping, train/grad_norm is the window's mean pre-clip norm over the steps with finite
    gradients, and train/skipped_steps counts the others (fp16's GradScaler skipped them).
    train_data_wait: the share of the windows' time the ranks (on average) waited for batches;
    input_bound: whether most windows waited more than DATA_WAIT_HINT of their time.
    """
    hooks = hooks or EpochHooks()
    logger = hooks.logger or RunLogger(".", enabled=False)
    step.model.train()
    used = len(loader) // step.accum_steps * step.accum_steps  # batches that make whole optimizer steps
    batches = iter(loader)
    skip, images_seen, resumed_loss = _skip_trained(batches, resume)
    loss_sum = torch.full((), resumed_loss, device=step.device, dtype=torch.float64)  # over the epoch's images
    next_save = (global_step // hooks.save_every + 1) * hooks.save_every if hooks.save_every else None
    start = time.perf_counter()
    window = _Window(step.device, start)
    label = f"epoch {epoch + 1}" + (f"/{hooks.epochs}" if hooks.epochs else "")
    step.optimizer.zero_grad(set_to_none=True)
    params_to_clip = [p for g in step.optimizer.param_groups for p in g["params"]] if step.clip_grad_norm else []
    # islice: a tail that makes no whole step is not even loaded.
    waits = _TimedBatches(itertools.islice(batches, used - skip))
    bar = logger.progress_bar(waits, used - skip, f"{label} train")
    norm = normalization_of(getattr(loader, "dataset", None), step.device)
    for i, (images, labels) in enumerate(profiling.profiled(bar, hooks.profiler, step.accum_steps), start=skip):
        images, labels = _to_device(images, labels, step.device, step.channels_last, norm)
        if i == 0 and hooks.first_batch is not None:
            hooks.first_batch(images, labels)
        images, targets = step.mix(images, labels) if step.mix is not None else (images, labels)
        stepping = (i + 1) % step.accum_steps == 0
        loss = _forward_backward(step, images, targets, stepping)
        loss_sum += loss * labels.shape[0]
        images_seen += labels.shape[0]
        window.add_batch(loss, labels.shape[0], global_step)
        if not stepping:
            continue
        _optimizer_step(step, window, params_to_clip)
        window.steps += 1
        global_step += 1
        last = i == used - 1
        # One process needs nobody's agreement: it honours a stop request at the very next step.
        alone_stopping = hooks.world_size == 1 and _stop_requested(hooks)
        if window.steps < hooks.log_every and not last and not alone_stopping:
            continue
        # The one host sync (and all-reduce) per window; every rank reaches it at the same step.
        stopping, wait, seconds = _close_window(step, hooks, logger, window, epoch, global_step, waits.pop_wait(),
                                                (bar, label, (i + 1) // step.accum_steps, used // step.accum_steps,
                                                 (time.perf_counter() - start) / (i + 1 - skip) * (used - i - 1)))
        waits.add_window(wait, seconds)
        window = _Window(step.device, time.perf_counter())
        # The epoch's last step is followed by evaluation and the epoch checkpoint anyway.
        if hooks.save_step is not None and not last and (stopping or (next_save and global_step >= next_save)):
            hooks.save_step(i + 1, global_step, loss_sum.item(), images_seen)
            next_save = (global_step // hooks.save_every + 1) * hooks.save_every if hooks.save_every else None
            if stopping:
                return EpochEnd(global_step, stopped=True)
    seconds = time.perf_counter() - start
    epoch_totals = reduce_sums({"loss": loss_sum, "images": loss_sum.new_tensor(float(images_seen))})
    return EpochEnd(global_step, input_bound=waits.input_bound(),
                    metrics={"train_loss": epoch_totals["loss"] / epoch_totals["images"],
                             "img_per_s": epoch_totals["images"] / max(seconds, 1e-9),
                             "train_seconds": seconds, "train_data_wait": waits.wait_share()})


def _skip_trained(batches, resume):
    """A mid-epoch resume: draw and drop the batches already trained, so that the sampler order and
    the augmentation's random draws continue exactly as in the interrupted run (no forward/backward).
    Returns (batches skipped, images seen, their loss sum); nothing to skip without `resume`."""
    if resume is None:
        return 0, 0, 0.0
    for _ in range(resume["epoch_step"]):
        next(batches)
    ckpt.set_rng_state(resume["rng"])
    return resume["epoch_step"], resume["images_seen"], resume["loss_sum"]


def _stop_requested(hooks):
    return hooks.stop is not None and hooks.stop.requested()


def _close_window(step, hooks, logger, window, epoch, global_step, waited, bar_fields):
    """Read the window's sums (one all-reduce), stop on a non-finite loss, log. waited: this rank's
    seconds spent waiting for batches in the window. Returns (whether any rank was asked to stop,
    the ranks' mean wait, the window's seconds). bar_fields: (bar, label, epoch's step, its steps,
    seconds to the epoch's end)."""
    totals = window.totals(_stop_requested(hooks), waited)
    world = hooks.world_size
    loss = totals["loss"] / (window.batches * world)
    if not math.isfinite(loss):
        bad = reduce_min(window.first_bad).item()  # all ranks saw the same NaN sum, all join this
        raise UserError(f"loss is {loss} at epoch {epoch + 1}, step {bad}; stopping. "
                        "The last good checkpoint is kept. Try a lower --lr or train.amp=off.",
                        exit_code=RUNTIME_EXIT, every_rank=True)
    seconds = max(time.perf_counter() - window.start, 1e-9)
    lr = step.optimizer.param_groups[0]["lr"]
    bar, label, epoch_step, epoch_steps, eta = bar_fields
    logger.window(bar, label, epoch_step, epoch_steps, loss, window.images * world / seconds, lr, eta)
    logger.scalar("train/loss_step", loss, global_step)
    wait = totals["waited"] / world
    logger.scalar("train/data_wait_step", min(wait / seconds, 1.0), global_step)  # share of the window
    # The lr the window ended with (a Python float, no sync): warm-up and cosine show as curves.
    logger.scalar("train/lr", lr, global_step)
    if step.clip_grad_norm:  # every rank clips the same reduced gradients: the sums hold world copies
        if totals["finite_norms"]:
            logger.scalar("train/grad_norm", totals["grad_norm"] / totals["finite_norms"], global_step)
        logger.scalar("train/skipped_steps", window.steps - totals["finite_norms"] / world, global_step)
    return totals["stop"] > 0, wait, seconds


# --------------------------------------------------------------------------- evaluation

@dataclass
class EvalSettings:
    """How evaluate runs the model; a Step has the same three fields, and training passes its own."""
    criterion: Criterion = field(default_factory=Criterion)  # per_image: val_loss and the worst mistakes
    amp_dtype: Optional[torch.dtype] = None                  # autocast dtype; None = fp32
    channels_last: bool = False                              # NHWC batches (CUDA)


@torch.no_grad()
def evaluate(model, loader, device, num_classes, settings=None, *, logger=None, worst_k=0, threshold=0.5,
             tune_thresholds=False):
    """Loss, accuracy, sample_metrics (top-5), confusion matrix, per-class precision/recall/F1 over the
    whole validation set, and with `worst_k` the k misclassified images of highest loss ("val_worst").

    Each rank evaluates a disjoint, unpadded shard (utils.samplers.ShardSampler) and the sums are all-reduced
    once, so every image counts exactly once and the result equals a single-process evaluation
    whatever the world size. Each rank keeps its own k worst on the device (no host sync per
    batch); the lists are gathered once and merged by (loss, dataset index), as one process would.

    A multi-label dataset (`.multilabel`) gets multilabel_report's metrics instead, at `threshold`
    (one number, or one per label), or at the thresholds tuned on these scores (`tune_thresholds`).
    """
    broadcast_buffers(model)  # every rank evaluates rank 0's model, the one checkpointed
    model.eval()
    settings = settings or EvalSettings()
    criterion, amp_dtype, channels_last = settings.criterion, settings.amp_dtype, settings.channels_last
    logger = logger or RunLogger(".", enabled=False)
    multilabel = is_multilabel(loader)
    metrics = {} if multilabel else sample_metrics(num_classes)
    scores = _AllScores(loader, device, num_classes) if multilabel else None
    zero = torch.zeros((), device=device, dtype=torch.float64)
    sums = {"loss": zero.clone(), **{name: zero.clone() for name in metrics},
            "confusion": torch.zeros(num_classes * num_classes, device=device, dtype=torch.float64)}
    worst = _WorstImages(loader, device, worst_k)
    padding = _padding_forwards(model, loader)
    start = time.perf_counter()
    norm = normalization_of(getattr(loader, "dataset", None), device)
    for images, labels in logger.progress_bar(loader, len(loader), "eval"):
        images, labels = _to_device(images, labels, device, channels_last, norm)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        if multilabel:  # kept whole: mAP and tuned thresholds need every score, not sums
            scores.add(logits, labels)
            continue
        losses = criterion.per_image(logits, labels).double()
        sums["loss"] += losses.sum()
        for name, metric in metrics.items():
            sums[name] += metric(logits, labels).sum()
        pred = logits.argmax(dim=1)
        # index_add_, not bincount: bincount sizes its output from the data, a host sync on CUDA.
        cells = labels * num_classes + pred
        sums["confusion"].index_add_(0, cells, torch.ones_like(cells, dtype=sums["confusion"].dtype))
        worst.add(logits, pred, labels, losses)
    for _ in range(padding):  # results unused: only the collectives inside the forward count
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            model(images[:1])
    if multilabel:
        out = scores.report(criterion, threshold, tune_thresholds, worst_k, loader.dataset)
        out["val_seconds"] = time.perf_counter() - start
        return out
    totals = reduce_sums(sums)
    confusion = totals.pop("confusion").view(num_classes, num_classes)  # rows: true class, columns: predicted
    count = confusion.sum().item()
    out = {"val_loss": totals.pop("loss") / max(count, 1),
           "val_acc": confusion.diag().sum().item() / max(count, 1),
           **{name: value / max(count, 1) for name, value in totals.items()},
           "val_count": int(count),
           "val_per_class_acc": (confusion.diag() / confusion.sum(dim=1).clamp(min=1)).tolist(),
           **classification_report(confusion)}
    if worst_k:
        out["val_worst"] = worst.merged(loader.dataset)  # every rank joins the gather
    out["val_seconds"] = time.perf_counter() - start
    return out


def _padding_forwards(model, loader):
    """FSDP: a forward gathers each block's shards from every rank, so all ranks must make as many as
    the one with the most validation batches; how many forwards this rank adds to its own (0 for
    other models)."""
    if not fsdp.is_sharded(model):
        return 0
    counts = gather_objects(len(loader))
    if min(counts) == 0:
        raise UserError(f"train_multi_gpu_fsdp.py: {len(loader.dataset)} validation images for {len(counts)} "
                        "processes leave a process without any; use fewer processes", every_rank=True)
    return max(counts) - len(loader)


class _WorstImages:
    """Each rank's k misclassified images of highest loss, kept on the device while evaluating."""

    def __init__(self, loader, device, k):
        # Dataset index of each image this rank sees, in loader order (the val sampler does not shuffle).
        order = list(getattr(loader, "sampler", None) or []) if k else []
        self.k, self.positions, self.seen = k, torch.tensor(order, device=device, dtype=torch.long), 0
        self.rows = torch.empty(0, 5, device=device, dtype=torch.float64)  # loss, index, pred, prob, label

    def add(self, logits, pred, labels, losses):
        if not len(self.positions):
            return
        n = labels.shape[0]
        prob = logits.float().softmax(dim=1).gather(1, pred[:, None]).squeeze(1).double()
        key = torch.where(pred != labels, losses, torch.full_like(losses, -math.inf))
        rows = torch.stack([key, self.positions[self.seen:self.seen + n].double(), pred.double(), prob,
                            labels.double()], dim=1)
        self.rows = torch.cat([self.rows, rows])
        self.rows = self.rows[self.rows[:, 0].topk(min(self.k, len(self.rows))).indices]
        self.seen += n

    def merged(self, dataset):
        """All ranks' lists merged, as one process would rank them (a collective: every rank calls it)."""
        mine = [r for r in self.rows.cpu().tolist() if math.isfinite(r[0])]
        merged = sorted((r for part in gather_objects(mine) for r in part), key=lambda r: (-r[0], r[1]))
        samples = getattr(dataset, "samples", None)
        return [{"index": int(i), "path": str(samples[int(i)][0]) if samples else None,
                 "label": int(label), "pred": int(pred), "prob": prob, "loss": loss}
                for loss, i, pred, prob, label in merged[:self.k]]


def _gallery_cam(model, cfg):
    """The worst mistakes' Grad-CAM (utils/cam.py) on rank 0: the bare module's forward and backward, so
    DDP's hooks and collectives stay out; FSDP's sharded model gets none."""
    bare = ckpt.unwrap(model)
    return gallery_explainer(bare, cfg.model.cam_layer, sharded=fsdp.is_sharded(model) or fsdp.is_sharded(bare))


@register_check
def check_cam_layer(cfg):
    """model.cam_layer names a module of the model: checked on its structure alone (the meta device)."""
    if cfg.model.cam_layer:
        with torch.device("meta"):
            find_target(create_model(cfg.model.name, num_classes=2, img_size=cfg.data.img_size,
                                     channels=cfg.data.channels), cfg.model.cam_layer)


# --------------------------------------------------------------------------- multi-label evaluation

class _AllScores:
    """Multi-label evaluation: every logit and target of this rank's shard, with its dataset index.
    Gathered once at the end and put in dataset order, so each rank holds exactly the scores one
    process would have, and computes the same metrics and thresholds from them."""

    def __init__(self, loader, device, num_classes):
        sampler = getattr(loader, "sampler", None)
        order = list(sampler) if sampler is not None else list(range(len(loader.dataset)))
        self.positions, self.num_classes = torch.tensor(order, dtype=torch.long), num_classes
        self.logits, self.targets = [], []

    def add(self, logits, targets):
        self.logits.append(logits.float())
        self.targets.append(targets > 0.5)

    def gathered(self):
        """(dataset indices, logits, 0/1 targets) of the whole set in dataset order (a collective)."""
        empty = torch.zeros(0, self.num_classes)
        logits = torch.cat(self.logits).cpu() if self.logits else empty
        targets = torch.cat(self.targets).cpu() if self.targets else empty.bool()
        parts = gather_objects((self.positions[:len(logits)], logits, targets))
        index, logits, targets = (torch.cat([part[k] for part in parts]) for k in range(3))
        order = index.argsort()
        return index[order], logits[order], targets[order]

    def report(self, criterion, threshold, tune, worst_k, dataset):
        index, logits, targets = self.gathered()
        losses = dataclasses.replace(criterion, multilabel=True).per_image(logits, targets).double()
        probs = logits.double().sigmoid()
        thresholds = torch.as_tensor(threshold, dtype=torch.float64).expand(self.num_classes).clone()
        if tune:
            thresholds = best_f1_thresholds(probs, targets, thresholds)
        out = {"val_loss": losses.mean().item() if len(losses) else 0.0, **multilabel_report(probs, targets, thresholds)}
        if worst_k:
            out["val_worst"] = _worst_multilabel(index, probs, targets, thresholds, losses, worst_k, dataset)
        out["val_pr"] = (probs, targets)  # for the pictures (precision-recall curves); popped by the callers
        return out


def _worst_multilabel(index, probs, targets, thresholds, losses, k, dataset):
    """The k images whose predicted label set is wrong, of highest loss (ties: lower dataset index)."""
    pred = probs >= thresholds
    wrong = (pred != targets.bool()).any(dim=1)
    key = torch.where(wrong, losses, torch.full_like(losses, -math.inf))
    order = key.sort(descending=True, stable=True).indices[:k]
    samples = getattr(dataset, "samples", None)
    return [{"index": int(index[i]), "path": str(samples[int(index[i])][0]) if samples is not None else None,
             "labels": targets[i].nonzero().flatten().tolist(), "preds": pred[i].nonzero().flatten().tolist(),
             "loss": losses[i].item()} for i in order.tolist() if wrong[i]]


# --------------------------------------------------------------------------- the run: fit

def compile_model(model):
    """torch.compile (train.compile): the first steps in train and in eval mode pay the compilation."""
    if not hasattr(torch, "compile"):
        raise UserError("train.compile=true needs torch >= 2.0")
    return torch.compile(model)


def _raise_stopped(stop, where, global_step, run_dir, dist_info):
    """End the run after a stop request's checkpoint: one line on rank 0, 128+signal everywhere."""
    if dist_info.rank != 0:
        raise SystemExit(stop.exit_code)
    command = ckpt.resume_command(run_dir, dist_info.world_size, dist_info.local_world_size)
    raise UserError(f"stopped by {stop.name} {where}, global step {global_step}; "
                    f"{run_dir / 'checkpoints' / 'last.pt'} is saved. Resume with: {command}",
                    exit_code=stop.exit_code)


@dataclass
class _Run:
    """What every epoch of fit uses."""
    cfg: object
    step: Step
    train_loader: object
    val_loader: object
    classes: list
    dist_info: DistInfo
    run_dir: Path
    logger: RunLogger
    saver: ckpt.Checkpointer
    stop: Optional[StopRequest]             # installed for the epochs
    run_state: ckpt.RunState                # epoch, global step, best score: the loop's and the checkpoint's
    hinted: bool = False                    # the input-bound hint was printed (once per run)
    profiled: bool = False                  # train.profile's epoch is done (the first this process trains)


def fit(cfg, model, train_loader, val_loader, classes, dist_info: DistInfo, script_name):
    """Train for cfg.train.epochs, evaluating, logging and checkpointing after each epoch.

    `model` is what the script built: plain, DataParallel or DDP. Every rank calls fit; only rank 0 writes.
    """
    is_main = dist_info.rank == 0
    # torchrun --max-restarts=N re-runs this same command after a worker dies; a restarted
    # run continues from its run directory's last.pt (see utils/checkpoint.py).
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if restarted and not cfg.output_dir:
        raise UserError("torchrun restarted the workers, but the run has no fixed --output-dir to continue; "
                        "with --max-restarts pass --output-dir DIR --resume auto")
    run_dir = resolve_run_dir(cfg, script_name, dist_info)
    # Rank 0 finds and reads the checkpoint and hands it to every rank: nodes need not share the run directory.
    resume_path, state = ckpt.agree_resume(cfg.resume, run_dir, restarted, dist_info.rank)
    if cfg.eval_only:
        return evaluate_only(cfg, model, val_loader, classes, dist_info, run_dir, resume_path, state)
    step, layout = build_step(cfg, model, train_loader, classes, dist_info)  # refuses what the data refutes
    multilabel = is_multilabel(train_loader)
    names = best_metric_names(multilabel, len(classes), ema=step.ema is not None)
    metric, mode = resolve_best(cfg.train, multilabel, names)  # an unknown name stops here, before any training
    if is_main:
        check_run_dir(run_dir, resuming=resume_path is not None or cfg.resume == "auto" or restarted)
        check_writable(run_dir)
        ckpt.remove_stale_temps(run_dir / "checkpoints")
    run_state, notes = (ckpt.RunState(multilabel=multilabel), []) if resume_path is None else \
        _restore(cfg, state, step, layout, classes, dist_info)
    del state
    notes += [note for note in [run_state.follow(metric, mode)] if note]
    if metric != score_key(multilabel) or cfg.train.early_stop_patience:
        patience = cfg.train.early_stop_patience
        notes.append(f"best.pt follows {metric} ({mode})" + (f"; the run stops after {patience} epochs without "
                                                              "improvement" if patience else ""))
    logger = RunLogger(run_dir, enabled=is_main, start_epoch=run_state.epoch, start_step=run_state.global_step,
                       resuming=resume_path is not None or restarted or cfg.resume == "auto")
    saver = ckpt.Checkpointer(run_dir / "checkpoints", ckpt.unwrap(model), step, config_to_dict(cfg), classes,
                              layout, cfg.train.keep_last, dist_info.rank)
    run = _Run(cfg, step, train_loader, val_loader, classes, dist_info, run_dir, logger, saver, None, run_state)
    _log_start(run, resume_path, notes)
    run.stop = StopRequest().install()
    metrics, early_stop = {}, False
    try:
        for epoch in range(run_state.epoch, cfg.train.epochs):
            # On the count the last epoch left, or the checkpoint: a resumed run stops where it would have.
            early_stop = _early_stop(run)
            if early_stop:
                # A finished run, not an interrupted one: tools that run many (k-fold, sweeps) read this line.
                logger.info(early_stop_line(run_state))
                logger.event("done", reason="early_stop", epochs=run_state.epoch, best_metric=run_state.best_metric,
                             best=run_state.best_score, best_epoch=run_state.best_epoch)
                break
            metrics = _train_epoch(run, epoch)
    except OUT_OF_MEMORY as e:
        raise out_of_memory(e, cfg, dist_info, script_name) from e
    except RuntimeError as e:  # train.deterministic met an op without a deterministic kernel: one line
        raise nondeterministic_op(e) or e
    finally:
        run.stop.uninstall()
        logger.close()
    return {best_key(run_state.best_metric): run_state.best_score, "best_metric": run_state.best_metric,
            "best_epoch": run_state.best_epoch, "early_stop": early_stop, "run_dir": str(run_dir), "last": metrics}


def compute_settings(cfg, device, class_weight=None, multilabel=False, pos_weight=None):
    """(criterion, autocast dtype or None, channels_last) of the config on `device`: resolved here
    alone, for training (build_step) and --eval-only (whose loss is the plain per-image one)."""
    return (build_criterion(cfg.optim, class_weight, multilabel, pos_weight), resolve_amp(cfg.train.amp, device),
            use_channels_last(cfg.model.channels_last, device))


def is_multilabel(loader):
    """The data's task, as its dataset says (data.py resolves data.task); never re-derived here."""
    return bool(getattr(getattr(loader, "dataset", None), "multilabel", False))


def score_key(multilabel):
    """The validation number the best checkpoint follows by default (train.best_metric=auto): val_map
    multi-label, else val_acc."""
    return ckpt.BEST_ACC_METRIC[multilabel]


def best_key(metric):
    """metrics.jsonl's key (and fit's) for the best value of `metric` so far: val_loss -> best_loss."""
    return metric.replace("val_", "best_", 1)


def _is_score(name, value):
    """A validation number best.pt can follow: one float per epoch (not a count, a time or a list)."""
    return name.startswith("val_") and isinstance(value, float) and name != "val_seconds"


def best_metric_names(multilabel, num_classes, ema):
    """The numbers train.best_metric may name: the validation floats of every epoch's metrics.jsonl
    line, known before training from the functions that compute them (run on no images)."""
    if multilabel:
        no_images = torch.zeros(0, num_classes)
        report = {"val_loss": 0.0, **multilabel_report(no_images, no_images, torch.full((num_classes,), 0.5))}
    else:
        report = {"val_loss": 0.0, "val_acc": 0.0, **{name: 0.0 for name in sample_metrics(num_classes)},
                  **classification_report(torch.zeros(num_classes, num_classes))}
    names = [name for name, value in report.items() if _is_score(name, value)]
    return names + [f"{name}_ema" for name in EMA_METRICS[multilabel] if ema and name in names]


def resolve_best(train_cfg, multilabel, names):
    """(metric, mode) of train.best_metric and train.best_mode; auto: val_acc (val_map multi-label), and
    min for a loss, else max. A metric not in `names` is refused in one line that lists them."""
    metric = score_key(multilabel) if train_cfg.best_metric == "auto" else train_cfg.best_metric
    if metric not in names:
        raise UserError(f"train.best_metric={metric} is not a metric of this run; choose one of {', '.join(names)}",
                        every_rank=True)
    mode = train_cfg.best_mode
    if mode == "auto":
        mode = "min" if metric.removesuffix("_ema").endswith("loss") else "max"
    return metric, mode


def build_step(cfg, model, train_loader, classes, dist_info):
    """The Step of this run from the config (optimizer, schedule, loss, amp, EMA, MixUp/CutMix) and
    the data layout a mid-epoch resume must find unchanged. Refuses, before anything is written,
    the settings only the data can refute."""
    device, world = dist_info.device, dist_info.world_size
    accum = accumulation(cfg.train, world)  # train.accum_steps, or what train.global_batch makes of the world
    steps = len(train_loader) // accum  # optimizer steps per epoch
    if steps == 0:
        what = (f"train.global_batch={cfg.train.global_batch} makes {accum} batches per step, more than"
                if cfg.train.global_batch else f"train.accum_steps={accum} is more than")
        raise UserError(f"{what} the {len(train_loader)} batches of an epoch per process; lower it or --batch-size",
                        every_rank=True)
    multilabel = is_multilabel(train_loader)
    class_weight, pos_weight = None, None
    if multilabel:
        pos_weight = pos_weights(cfg.optim.class_weights, getattr(train_loader.dataset, "samples", None),
                                 len(classes), device)
    else:
        class_weight = class_weights(cfg.optim.class_weights, getattr(train_loader.dataset, "targets", None),
                                     len(classes), device)
    network = ckpt.unwrap(model)  # what the optimizer, the EMA and the checkpoints see
    criterion, amp_dtype, channels_last = compute_settings(cfg, device, class_weight, multilabel, pos_weight)
    optimizer = build_optimizer(network, cfg.optim, world, fused=amp_dtype == torch.float16,
                                global_batch=cfg.train.global_batch)
    step = Step(model=compile_model(model) if cfg.train.compile else model, optimizer=optimizer,
                scheduler=build_scheduler(optimizer, cfg.optim, cfg.train.epochs, steps),
                scaler=build_scaler(amp_dtype, device), device=device,
                criterion=criterion, amp_dtype=amp_dtype, channels_last=channels_last, accum_steps=accum,
                clip_grad_norm=cfg.optim.clip_grad_norm,
                mix=batch_mixer(cfg.data.mixup_alpha, cfg.data.cutmix_alpha, len(classes), multilabel),
                ema=WeightEMA(network, cfg.train.ema_decay) if cfg.train.ema_decay else None)
    layout = ckpt.data_layout(cfg.train.seed, world, cfg.train.batch_size, steps, len(train_loader.dataset),
                              accum_steps=accum, sampler=cfg.data.sampler)
    return step, layout


def accumulation(train_cfg, world_size):
    """Batches per optimizer step: train.accum_steps, or with train.global_batch=N, N / (batch_size x
    processes) (DataParallel is one process whose batch is already the global one). One line when N does
    not divide, naming what would."""
    n, batch = train_cfg.global_batch, train_cfg.batch_size
    if not n:
        return train_cfg.accum_steps
    per_step = batch * world_size  # images of one micro-batch over all processes
    if n % per_step == 0:
        return n // per_step
    near = " or ".join(str(g) for g in (n // per_step * per_step, (n // per_step + 1) * per_step) if g)
    if n % world_size:
        fix = f"a global batch divisible by the {world_size} processes, e.g. {near}"
    else:
        mine = n // world_size  # images per process per step
        sizes = sorted(sorted((d for d in range(1, mine + 1) if mine % d == 0), key=lambda d: abs(d - batch))[:3])
        fix = f"--batch-size {', '.join(map(str, sizes))} (dividing its {mine} per process), or a global batch of {near}"
    raise UserError(f"train.global_batch={n} does not divide into --batch-size {batch} x {world_size} process(es) "
                    f"= {per_step} images per micro-batch; use {fix}", every_rank=True)


def _restore(cfg, state, step, layout, classes, dist_info):
    """The checkpoint's weights, optimizer, schedule, scaler and EMA into the step; its RunState, and
    notes on what differs from this run (world size, epochs, a missing EMA)."""
    if bool(state.get("multilabel")) != step.criterion.multilabel:
        task = {True: "multi-label", False: "single-label"}
        raise UserError(f"checkpoint is of a {task[bool(state.get('multilabel'))]} run, the data is "
                        f"{task[step.criterion.multilabel]} (data.task); resume with the same task, or start "
                        "from its weights with --weights", every_rank=True)
    run_state = ckpt.restore(state, step.model, step.optimizer, step.scheduler, step.scaler, classes,
                             model_name=cfg.model.name, ema=step.ema)
    notes = []
    if step.ema is not None and not state.get("ema"):
        notes.append("note: the checkpoint holds no EMA of the weights; train.ema_decay's average starts "
                     "from its weights")
    rng, resume_at, note = ckpt.resume_point(state, dist_info.rank, layout)
    notes += [note] if note else []
    theirs = state.get("data") or {}
    steps, their_steps = layout["steps_per_epoch"], theirs.get("steps_per_epoch")
    their_epochs = (state.get("config") or {}).get("train", {}).get("epochs")
    their_accum, their_world = theirs.get("accum_steps", 1), theirs.get("world_size")
    if cfg.train.global_batch and their_world and (their_world, their_accum) != (dist_info.world_size,
                                                                                step.accum_steps):
        # An elastic restart at another world size: the images per step stay N, the accumulation follows.
        notes.append(f"note: train.global_batch={cfg.train.global_batch} kept: {their_world} -> "
                     f"{dist_info.world_size} process(es), accumulation {their_accum} -> {step.accum_steps} "
                     f"batches of {cfg.train.batch_size} per step")
    if their_steps not in (None, steps):
        # Another world size (an elastic restart), batch size or accum_steps: the schedule continues in this run's steps.
        run_state.global_step = run_state.epoch * steps
        place_schedule(step.scheduler, cfg.optim, dist_info.world_size, their_epochs or cfg.train.epochs, steps,
                       run_state.global_step, global_batch=cfg.train.global_batch)
        notes.append(f"note: the checkpoint has {their_steps} steps per epoch, this run {steps} "
                     f"({dist_info.world_size} process(es)): the lr schedule continues from epoch {run_state.epoch + 1}'s "
                     "start in this run's steps")
    if rng is not None:
        ckpt.set_rng_state(rng)  # Python/NumPy continue; torch's is reseeded per epoch
    if their_epochs not in (None, cfg.train.epochs):
        notes.append(f"note: the checkpoint's lr schedule spans {their_epochs} epochs and is kept; "
                     f"training runs to epoch {cfg.train.epochs}")
    run_state.resume_at = resume_at
    return run_state, notes


def _log_start(run, resume_path, notes):
    """A new run's config, class list and hparams; the start-up lines (rank 0 writes)."""
    cfg, step, logger, run_state, device = run.cfg, run.step, run.logger, run.run_state, run.dist_info.device
    cost = profiling.model_cost(ckpt.unwrap(step.model), cfg.data.img_size, cfg.data.channels)  # meta device: ms
    if resume_path is None:
        logger.write_config(cfg)
        logger.write_json("class_indices.json", {str(i): c for i, c in enumerate(run.classes)})
        # The headline number, the best of train.best_metric (val/best_acc by default; val/best_loss ...), and more.
        logger.hparams({**config_to_dict(cfg), **cost}, [scalar_tag(score_key(step.criterion.multilabel)),
                       scalar_tag(best_key(run_state.best_metric)), "val/macro_f1", "val/loss", "train/loss"])
    resume_at = run_state.resume_at
    where = f"epoch {run_state.epoch + 1}" + (f" after its step {resume_at['epoch_step']}" if resume_at else "")
    logger.info(f"run directory: {run.run_dir}" + (f" (resumed from {resume_path} at {where}, global step "
                                                     f"{run_state.global_step})" if resume_path else ""))
    if cfg.train.amp in ("bf16", "fp16") and step.amp_dtype is None:
        notes.append(f"note: train.amp={cfg.train.amp} applies on CUDA only; this {device.type} run computes in fp32")
    for note in notes:
        logger.info(note)
    logger.info(f"{len(run.train_loader.dataset)} train / {len(run.val_loader.dataset)} val images, "
                f"{len(run.classes)} classes, {run.dist_info.world_size} process(es) on {device}, "
                f"lr {step.optimizer.param_groups[0]['initial_lr']:.4g}, amp {step.amp_dtype or 'off'}"
                + (f", {step.accum_steps} batches per step" if step.accum_steps > 1 else "")
                + (f", global batch {cfg.train.global_batch}" if cfg.train.global_batch else "")
                + (", deterministic" if cfg.train.deterministic else ""))
    logger.info(profiling.cost_line(cost, cfg.data.img_size))
    weight, pos_weight = step.criterion.class_weight, step.criterion.pos_weight
    if weight is not None:
        logger.info("class weights: " + ", ".join(f"{c} {w:.3g}" for c, w in zip(run.classes, weight.tolist())))
    if pos_weight is not None:
        logger.info("pos_weight: " + ", ".join(f"{c} {w:.3g}" for c, w in zip(run.classes, pos_weight.tolist())))


def _train_epoch(run, epoch):
    """One epoch: train, evaluate (and the EMA), choose the best, checkpoint, pictures, metrics."""
    cfg, run_state, stop = run.cfg, run.run_state, run.stop
    epoch_start = time.perf_counter()
    run.train_loader.sampler.set_epoch(epoch)
    torch.manual_seed(seed_for(cfg.train.seed, epoch, run.dist_info.rank))
    run.train_loader.generator.manual_seed(seed_for(cfg.train.seed, epoch, run.dist_info.rank))
    lr = run_state.resume_at["lr"] if run_state.resume_at else run.step.optimizer.param_groups[0]["lr"]

    def save_step(epoch_step, global_step, loss_sum, images_seen):
        run.saver.save(dataclasses.replace(run_state, global_step=global_step), epoch_step=epoch_step,
                       loss_sum=loss_sum, images_seen=images_seen, epoch_lr=lr)

    first_batch = None
    if epoch == 0 and cfg.train.figures:
        def first_batch(images, labels, at_step=run_state.global_step):
            figures.sample_picture(run.logger, images, labels, run.classes, run.train_loader.dataset, at_step)
    # train.profile: some steps of the first epoch this process trains
    profiler = None if run.profiled else profiling.epoch_profiler(
        cfg.train, run.dist_info.rank, run.run_dir, run.step.device, run.logger.info,
        len(run.train_loader) // run.step.accum_steps)
    run.profiled = True
    hooks = EpochHooks(logger=run.logger, log_every=cfg.train.log_every, world_size=run.dist_info.world_size,
                       epochs=cfg.train.epochs, stop=stop, save_every=cfg.train.save_every_steps,
                       save_step=save_step, first_batch=first_batch, profiler=profiler)
    end = train_one_epoch(run.step, run.train_loader, epoch, run_state.global_step, hooks, run_state.resume_at)
    run_state.resume_at, run_state.global_step, train = None, end.global_step, end.metrics
    if end.stopped:
        _raise_stopped(stop, f"in epoch {epoch + 1}", run_state.global_step, run.run_dir, run.dist_info)
    val, worst, pr = _validate(run)
    # best.pt follows train.best_metric (best_mode); with an EMA the better of the two weight sets
    # competes, and best.pt records which ("best_weights"). Only a strict improvement counts.
    which, score = _best_candidate(run_state, val)
    is_best = run_state.better(score, run_state.best_score)
    if is_best:
        run_state.best_score, run_state.best_weights, run_state.best_epoch = score, which, epoch + 1
    run_state.bad_epochs = 0 if is_best else run_state.bad_epochs + 1  # in the checkpoint: a resume counts on
    if run_state.multilabel:  # those of the weights a checkpoint's user loads (checkpoint.best_weights)
        run_state.thresholds = val["val_threshold_ema" if run_state.best_weights == "ema" else "val_threshold"]
    run_state.epoch = epoch + 1
    run.saver.save(run_state, is_best=is_best)
    cam = _gallery_cam(run.step.model, cfg) if cfg.train.figures and worst and run.logger.enabled else None
    key = score_key(run_state.multilabel)
    figure_seconds = figures.epoch_pictures(run.logger, val, worst, run.classes, run.val_loader.dataset,
                                            run_state.global_step, pr, cam) if cfg.train.figures else 0.0
    metrics = {"epoch": epoch + 1, "step": run_state.global_step, **train, **val, "lr": lr,
               best_key(run_state.best_metric): run_state.best_score,
               **({"best_weights": run_state.best_weights} if run.step.ema is not None else {}),
               "figure_seconds": figure_seconds, "epoch_seconds": time.perf_counter() - epoch_start}
    run.logger.epoch(metrics, run.classes)
    run.logger.info(f"epoch {epoch + 1}/{cfg.train.epochs}  train_loss {train['train_loss']:.4f}  "
                    f"val_loss {val['val_loss']:.4f}  {key} {val[key]:.4f}  "
                    + (f"val_macro_f1 {val['val_macro_f1']:.4f}  " if run_state.multilabel else "")
                    + (f"{key}_ema {val[key + '_ema']:.4f}  " if run.step.ema is not None else "")
                    + f"{train['img_per_s']:.0f} img/s  {metrics['epoch_seconds']:.1f}s")
    if end.input_bound and not run.hinted:
        run.hinted = True
        run.logger.info(input_bound_hint(train["train_data_wait"], epoch, run.train_loader))
    # A signal that came during evaluation: the epoch's checkpoint is already written.
    if epoch + 1 < cfg.train.epochs and any_rank(stop.requested(), run.dist_info.device):
        _raise_stopped(stop, f"after epoch {epoch + 1}", run_state.global_step, run.run_dir, run.dist_info)
    return metrics


def _best_candidate(run_state, val):
    """(which weights, score) compete this epoch for best.pt: the value of run_state.best_metric, or with an
    EMA the better of it and its twin (val_acc and val_acc_ema, val_loss and val_loss_ema); a metric named
    *_ema is the EMA's alone."""
    metric = run_state.best_metric
    if metric not in val:  # best_metric_names missed one: refused before any checkpoint is written as best
        names = ", ".join(k for k, v in val.items() if _is_score(k, v))
        raise UserError(f"train.best_metric={metric} is not a metric of this run; choose one of {names}",
                        every_rank=True)
    if metric.endswith("_ema"):
        return "ema", val[metric]
    twin = val.get(f"{metric}_ema")
    if twin is not None and run_state.better(twin, val[metric]):
        return "ema", twin
    return "model", val[metric]


def _early_stop(run):
    """Whether the run ends now, before epoch run_state.epoch + 1: train.early_stop_patience epochs
    without improvement. Rank 0 decides and every rank gets its answer (a broadcast every rank runs), so all stop at
    the same epoch even where their views differed."""
    patience, run_state = run.cfg.train.early_stop_patience, run.run_state
    if not patience:
        return False
    return broadcast_object(run_state.bad_epochs >= patience if run.dist_info.rank == 0 else None)


def early_stop_line(run_state):
    """The one line rank 0 prints when train.early_stop_patience ends the run."""
    at = f" at epoch {run_state.best_epoch}" if run_state.best_epoch else ""
    epochs = f"{run_state.bad_epochs} epoch" + ("s" if run_state.bad_epochs != 1 else "")
    return (f"early stop: {run_state.best_metric} has not improved for {epochs} "
            f"(best {run_state.best_score:.4f}{at}); the run ends after epoch {run_state.epoch}")


def input_bound_hint(share, epoch, loader):
    """The one line rank 0 prints when the loop waited for batches in most of an epoch's windows."""
    workers = getattr(loader, "num_workers", None)
    now = f" (now {workers})" if workers is not None else ""
    return (f"note: input-bound: the loop waited for batches in {share:.0%} of epoch {epoch + 1}'s training "
            f"time (train/data_wait); try more data.num_workers{now}, data.pipeline=gpu, a smaller "
            "data.img_size, or the data on a local disk; see docs/troubleshooting.md (several GPUs slower than one)")


# The validation numbers evaluated for the EMA too (as <name>_ema), single-label and multi-label.
EMA_METRICS = {False: ("val_loss", "val_acc", "val_macro_f1"),
               True: ("val_loss", "val_map", "val_macro_f1", "val_threshold")}


def _validate(run):
    """The epoch's validation metrics (and the EMA's beside them), its worst mistakes (or None) and,
    multi-label, every image's (probabilities, targets) for the precision-recall curves (or None)."""
    step, cfg = run.step, run.cfg
    thresholds = {"threshold": cfg.eval.threshold, "tune_thresholds": cfg.eval.tune_thresholds}
    val = evaluate(step.model, run.val_loader, step.device, len(run.classes), step, logger=run.logger,
                   worst_k=cfg.train.worst_images if cfg.train.figures else 0, **thresholds)
    worst, pr = val.pop("val_worst", None), val.pop("val_pr", None)
    if step.ema is not None:  # the average's own evaluation, beside the raw weights'
        averaged = evaluate(step.ema.module, run.val_loader, step.device, len(run.classes), step, logger=run.logger,
                            **thresholds)
        val.update({f"{k}_ema": averaged[k] for k in EMA_METRICS[run.run_state.multilabel]})
    # Unreadable images met so far by any rank or loader worker (a collective: all ranks).
    val["bad_images"] = sum(ds.sync_bad_images() for ds in (run.train_loader.dataset, run.val_loader.dataset)
                            if hasattr(ds, "sync_bad_images"))
    return val, worst, pr


# --------------------------------------------------------------------------- --eval-only

def evaluate_only(cfg, model, val_loader, classes, dist_info, run_dir, resume_path, state=None):
    """--eval-only: the checkpoint's (or --weights') model on the validation split, or on test/
    when the data root has one; rank 0 writes eval.json (evaluate's own keys) and two pictures.
    Multi-label: at the checkpoint's thresholds (eval.threshold for --weights, or tuned on this split
    with eval.tune_thresholds), eval.json with a per-label table ("labels")."""
    device, multilabel = dist_info.device, is_multilabel(val_loader)
    if resume_path is None and not cfg.model.weights:  # load_config refused neither; --resume auto found nothing
        raise UserError(f"--eval-only --resume {cfg.resume} found no checkpoint in '{run_dir}'; pass "
                        "--resume CHECKPOINT or --weights FILE", every_rank=True)
    source, thresholds = str(resume_path or cfg.model.weights), None
    if resume_path is not None:
        state = state or ckpt.load_checkpoint(resume_path, map_location="cpu")
        ckpt.check_compatible(state, model, classes, model_name=cfg.model.name)
        theirs, thresholds = ckpt.label_task(state)
        if theirs != multilabel:
            task = {True: "multi-label", False: "single-label"}
            raise UserError(f"checkpoint '{resume_path}' is of a {task[theirs]} run, the data is {task[multilabel]} "
                            "(data.task)", every_rank=True)
        weights = ckpt.best_weights(state)  # its EMA where that made the best score (train.ema_decay)
        ckpt.load_weights(model, weights)
        source += " (EMA weights)" if weights is state.get("ema") else ""
        metric = ckpt.RunState.of(state).best_metric
        del state, weights
    else:
        metric = resolve_best(cfg.train, multilabel, best_metric_names(multilabel, len(classes), ema=True))[0]
    # What best.pt was chosen by (the checkpoint's, else train.best_metric), read on the weights evaluated here.
    metric = metric.removesuffix("_ema")
    if dist_info.rank == 0:
        check_writable(run_dir)
    val = evaluate(model, val_loader, device, len(classes), EvalSettings(*compute_settings(cfg, device, multilabel=multilabel)),
                   worst_k=cfg.train.worst_images, threshold=thresholds or cfg.eval.threshold,
                   tune_thresholds=cfg.eval.tune_thresholds)
    val.pop("val_seconds")
    val.pop("val_pr", None)
    if multilabel:
        val["val_worst"] = [{**w, "true": [classes[c] for c in w["labels"]],
                             "predicted": [classes[c] for c in w["preds"]]} for w in val.get("val_worst", [])]
        val["labels"] = [{"label": name, **{k: val[f"val_{k}"][c] for k in PER_LABEL}}
                         for c, name in enumerate(classes)]
    else:
        val["val_worst"] = [{**w, "true": classes[w["label"]], "predicted": classes[w["pred"]]}
                            for w in val.get("val_worst", [])]
    split = getattr(val_loader.dataset, "split", "val")
    result = {"checkpoint": source, "split": split, "classes": list(classes), "best_metric": metric,
              **profiling.model_cost(ckpt.unwrap(model), cfg.data.img_size, cfg.data.channels), **val}
    if dist_info.rank == 0:
        if multilabel:
            figures.save_png(figures.f1_bars_image(val["val_f1"], classes), run_dir / "per_label_f1.png")
        else:
            figures.save_png(figures.confusion_matrix_image(val["val_confusion"], classes),
                             run_dir / "confusion_matrix.png")
        if cfg.train.worst_images:
            cam = _gallery_cam(model, cfg) if val["val_worst"] else None
            figures.save_png(figures.worst_picture(val["val_worst"], classes, val_loader.dataset, cam),
                             run_dir / "worst_mistakes.png")
        tmp = run_dir / "eval.json.tmp"
        tmp.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.replace(run_dir / "eval.json")
        if multilabel:
            scores = (f"mAP {val['val_map']:.4f}  micro-F1 {val['val_micro_f1']:.4f}  "
                      f"exact match {val['val_exact_match']:.4f}")
        else:
            top5 = f"  top-5 {val['val_top5']:.4f}" if "val_top5" in val else ""
            scores = f"accuracy {val['val_acc']:.4f}{top5}"
        print(f"eval-only: {source} on {split}: {val['val_count']} images  {scores}  "
              f"macro-F1 {val['val_macro_f1']:.4f}  -> {run_dir / 'eval.json'}", flush=True)
    return {best_key(metric): val.get(metric), "best_metric": metric, "run_dir": str(run_dir), "last": result}


# The per-label columns of a multi-label eval.json's table ("labels"), each a val_* list of evaluate's.
PER_LABEL = ("precision", "recall", "f1", "ap", "threshold", "positives")
