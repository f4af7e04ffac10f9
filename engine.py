"""The training and evaluation loop shared by train.py and the train_multi_gpu_*.py scripts: what a
user edits. run.py's `fit` drives it (resume, epochs, the best checkpoint, pictures, --eval-only).

What you are most likely to change sits at the top:
    Criterion        the loss (cross entropy; e.g. a focal loss goes in Criterion.loss)
    sample_metrics   per-image validation metrics (each reaches metrics.jsonl, TensorBoard, eval.json)
    build_step       the Step: optimizer, schedule, loss, amp, EMA, MixUp/CutMix from the config
    train_one_epoch  the step: forward, backward, clipping, optimizer, EMA, one log window at a time
    evaluate         the validation pass: loss, accuracy, confusion matrix, the worst mistakes

Per step nothing is copied back to the host: losses are summed on the device
and read once per `train.log_every` steps, where a NaN/inf is also caught.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from torch.utils.hooks import RemovableHandle

from model import find_head, load_teacher, use_channels_last
from utils import checkpoint as ckpt
from utils.data_wait import TimedBatches
from utils.distributed_utils import broadcast_buffers, gather_objects, no_sync, reduce_min, reduce_sums
from utils.errors import RUNTIME_EXIT, UserError, unused_parameters
from utils import calibration, fsdp, param_groups, profiling
from utils.normalization import model_input, normalization_of
from utils.metrics import best_f1_thresholds, classification_report, multilabel_report, top_k_hits
from utils.mixing import batch_mixer
from utils.optim import WeightEMA, accumulation, build_optimizer, build_scaler, build_scheduler, group_lrs, \
    per_group_lrs, resolve_amp
from utils.run_logger import RunLogger
from utils.stop import StopRequest

_NO_BAD_STEP = 2 ** 62


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


def distillation_loss(logits, teacher_logits, temperature, multilabel=False):
    """train.teacher's term: T^2 x KL(teacher || student) of the outputs softened by T, the batch's mean (fp32).
    Single-label: over the softmax of each image. Multi-label: each label's sigmoid is a two-class
    distribution, KL = BCE(student, teacher's p) - BCE(teacher, p), averaged over the labels and images.
    T^2 keeps the gradients' size independent of T (Hinton et al., 2015)."""
    student, teacher = logits.float() / temperature, teacher_logits.float() / temperature
    if multilabel:
        p = teacher.sigmoid()
        kl = F.binary_cross_entropy_with_logits(student, p, reduction="none") - \
            F.binary_cross_entropy_with_logits(teacher, p, reduction="none")
        return kl.mean() * temperature ** 2
    return F.kl_div(F.log_softmax(student, dim=1), F.log_softmax(teacher, dim=1), reduction="batchmean",
                    log_target=True) * temperature ** 2


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
        metrics["val_top5"] = lambda logits, labels: top_k_hits(logits, labels, 5)
    return metrics


# --------------------------------------------------------------------------- one epoch of training

def seed_for(seed, epoch, rank):
    """One seed per (run seed, epoch, rank): augmentation and data order are reproducible
    per epoch, so a run resumed at an epoch boundary continues exactly."""
    return (seed * 1_000_003 + epoch * 1009 + rank) % (2 ** 63)


def _to_device(images, labels, device, channels_last, norm):
    return model_input(images, device, norm, channels_last), labels.to(device, non_blocking=True)


_batch_hooks = collections.OrderedDict()  # an OrderedDict: RemovableHandle keeps a weak reference


def register_batch_hook(hook):
    """hook(images, labels) runs on every training batch train_one_epoch takes, as the loader gave it
    (before the device and MixUp/CutMix), in every process; returns a handle whose .remove() takes it
    away. For acting at a given batch (a count, a signal) without editing the loop, as torch's
    register_module_forward_hook does for forwards."""
    handle = RemovableHandle(_batch_hooks)
    _batch_hooks[handle.id] = hook
    return handle


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
    # The bare network under the wrappers (DP/DDP, torch.compile): what the optimizer, the EMA, the
    # checkpoints, the cost line and Grad-CAM see. Found from `model` when not given.
    net: Optional[torch.nn.Module] = None
    # train.teacher: an eval-mode model without gradients (never wrapped or sharded), its outputs softened
    # by kd_temperature; the loss is (1 - kd_alpha) x the task's + kd_alpha x distillation_loss.
    teacher: Optional[torch.nn.Module] = None
    kd_alpha: float = 0.5
    kd_temperature: float = 1.0
    teacher_info: dict = field(default_factory=dict)  # its source, file and sha256 (the run record's)
    # train.unfreeze_at: the epochs before it keep these BatchNorm layers (the body's) in eval mode.
    unfreeze_at: int = 0
    body_norms: list = field(default_factory=list)

    def __post_init__(self):
        if self.net is None:
            self.net = ckpt.unwrap(self.model)


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
                logits = step.model(images)
            except RuntimeError as e:
                raise unused_parameters(e, step.net) or e
            loss = step.criterion(logits, targets)
            if step.teacher is not None:  # the same (mixed) batch, under the same autocast
                with torch.no_grad():
                    teacher_logits = step.teacher(images)
                loss = (1 - step.kd_alpha) * loss + step.kd_alpha * distillation_loss(
                    logits, teacher_logits, step.kd_temperature, step.criterion.multilabel)
        # The summed micro-batch gradients then equal one batch of accum_steps x batch_size.
        with record_function("backward"):  # DDP's all-reduce inside: gloo:all_reduce / nccl:all_reduce
            step.scaler.scale(loss / step.accum_steps if step.accum_steps > 1 else loss).backward()
    return loss.detach().double()


@record_function("optimizer step")
def _optimizer_step(step, window, params_to_clip, global_step=None):
    """Clip the gradients of `params_to_clip` (adding the pre-clip norm to the window), step, update the scale,
    schedule and EMA. global_step: the run's optimizer steps with this one (the EMA warm-up's count)."""
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
        step.ema.update(global_step)


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


@dataclass
class EpochEnd:
    """What train_one_epoch returns, whether the epoch ran to its end or a stop request ended it."""
    global_step: int                        # optimizer steps taken, this epoch's included
    stopped: bool = False                   # a stop request ended it after hooks.save_step; no metrics then
    input_bound: bool = False               # most log windows waited over data_wait.DATA_WAIT_HINT of their time
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
    input_bound: whether most windows waited more than utils.data_wait.DATA_WAIT_HINT of their time.
    """
    hooks = hooks or EpochHooks()
    logger = hooks.logger or RunLogger(".", enabled=False)
    step.model.train()
    if epoch < step.unfreeze_at:  # the body's lr is 0: its BatchNorm statistics stay as loaded too
        for module in step.body_norms:
            module.eval()
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
    waits = TimedBatches(itertools.islice(batches, used - skip))
    bar = logger.progress_bar(waits, used - skip, f"{label} train")
    norm = normalization_of(getattr(loader, "dataset", None), step.device)
    for i, (images, labels) in enumerate(profiling.profiled(bar, hooks.profiler, step.accum_steps), start=skip):
        for hook in list(_batch_hooks.values()):
            hook(images, labels)
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
        _optimizer_step(step, window, params_to_clip, global_step + 1)
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
    if resume["rng"] is not None:  # None: another world size's checkpoint, its ranks' states not this run's
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
    lr, lowest = group_lrs(step.optimizer)  # the head's and the lowest group's (the same without lr scales)
    bar, label, epoch_step, epoch_steps, eta = bar_fields
    logger.window(bar, label, epoch_step, epoch_steps, loss, window.images * world / seconds, lr, eta)
    logger.scalar("train/loss_step", loss, global_step)
    wait = totals["waited"] / world
    logger.scalar("train/data_wait_step", min(wait / seconds, 1.0), global_step)  # share of the window
    # The lr the window ended with (a Python float, no sync): warm-up and cosine show as curves.
    logger.scalar("train/lr", lr, global_step)
    if per_group_lrs(step.optimizer):
        logger.scalar("train/lr_lowest", lowest, global_step)
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
             tune_thresholds=False, temperature=None, keep_scores=False, tta="none"):
    """Loss, accuracy, sample_metrics (top-5), confusion matrix, per-class precision/recall/F1 over the
    whole validation set, and with `worst_k` the k misclassified images of highest loss ("val_worst").

    Each rank evaluates a disjoint, unpadded shard (utils.samplers.ShardSampler) and the sums are all-reduced
    once, so every image counts exactly once and the result equals a single-process evaluation
    whatever the world size. Each rank keeps its own k worst on the device (no host sync per
    batch); the lists are gathered once and merged by (loss, dataset index), as one process would.

    Single-label, calibration (utils/calibration.py): ECE before and after one temperature, fitted here by
    NLL (or `temperature` as given), the rejection threshold at it, the reliability diagram's bins, and with
    `keep_scores` every image's scores ("val_scores", for eval.ood).

    tta (eval.tta): "flip" averages each image's logits with its mirror image's (test-time augmentation).

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
    kept = ([], [])  # this shard's logits and labels, for the calibration
    padding = _padding_forwards(model, loader)
    start = time.perf_counter()
    norm = normalization_of(getattr(loader, "dataset", None), device)
    for images, labels in logger.progress_bar(loader, len(loader), "eval"):
        images, labels = _to_device(images, labels, device, channels_last, norm)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = tta_forward(model, images, tta)
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
        kept[0].append(logits.detach().float())
        kept[1].append(labels)
    for _ in range(padding):  # results unused: only the collectives inside the forward count
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            tta_forward(model, images[:1], tta)  # as many forwards as a batch makes
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
    logits = torch.cat(kept[0]) if kept[0] else torch.zeros(0, num_classes, device=device)
    labels = torch.cat(kept[1]) if kept[1] else torch.zeros(0, dtype=torch.long, device=device)
    out.update(calibration.report(logits, labels, temperature, keep_scores))  # collectives: every rank
    out["val_seconds"] = time.perf_counter() - start
    return out


TTA_VIEWS = ("none", "flip")  # eval.tta's choices


def tta_forward(model, images, tta="none"):
    """The model's logits for a batch; tta="flip": the mean of the image's and its mirror image's (a second
    forward, so FSDP's padding makes it too)."""
    logits = model(images)
    if tta == "flip":
        logits = (logits + model(images.flip(-1))) / 2
    return logits


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


# --------------------------------------------------------------------------- the step of a run

def compile_model(model):
    """torch.compile (train.compile): the first steps in train and in eval mode pay the compilation."""
    if not hasattr(torch, "compile"):
        raise UserError("train.compile=true needs torch >= 2.0")
    return torch.compile(model)


def compute_settings(cfg, device, class_weight=None, multilabel=False, pos_weight=None):
    """(criterion, autocast dtype or None, channels_last) of the config on `device`: resolved here
    alone, for training (build_step) and --eval-only (whose loss is the plain per-image one)."""
    return (build_criterion(cfg.optim, class_weight, multilabel, pos_weight), resolve_amp(cfg.train.amp, device),
            use_channels_last(cfg.model.channels_last, device))


def is_multilabel(loader):
    """The data's task, as its dataset says (data.py resolves data.task); never re-derived here."""
    return bool(getattr(getattr(loader, "dataset", None), "multilabel", False))


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
    network = ckpt.unwrap(model)  # Step.net: what the optimizer, the EMA and the checkpoints see
    criterion, amp_dtype, channels_last = compute_settings(cfg, device, class_weight, multilabel, pos_weight)
    scales, head, unfreeze = fine_tuning(cfg, network, len(classes))
    optimizer = build_optimizer(network, cfg.optim, world, fused=amp_dtype == torch.float16,
                                global_batch=cfg.train.global_batch, lr_scales=scales,
                                head=param_groups.head_names(network, head))
    step = Step(model=compile_model(model) if cfg.train.compile else model, optimizer=optimizer,
                scheduler=build_scheduler(optimizer, cfg.optim, cfg.train.epochs, steps, unfreeze),
                scaler=build_scaler(amp_dtype, device), device=device,
                criterion=criterion, amp_dtype=amp_dtype, channels_last=channels_last, accum_steps=accum,
                clip_grad_norm=cfg.optim.clip_grad_norm,
                mix=batch_mixer(cfg.data.mixup_alpha, cfg.data.cutmix_alpha, len(classes), multilabel),
                ema=WeightEMA(network, cfg.train.ema_decay, cfg.train.ema_warmup) if cfg.train.ema_decay else None,
                net=network,
                unfreeze_at=cfg.train.unfreeze_at,
                body_norms=param_groups.body_norms(network, head) if cfg.train.unfreeze_at else [])
    if cfg.train.teacher:
        step.teacher, step.teacher_info = load_teacher(cfg.train.teacher, classes, multilabel, cfg.data.img_size,
                                                       cfg.data.channels, device, cfg.model.channels_last)
        step.kd_alpha, step.kd_temperature = cfg.train.kd_alpha, cfg.train.kd_temperature
    layout = ckpt.data_layout(cfg.train.seed, world, cfg.train.batch_size, steps, len(train_loader.dataset),
                              accum_steps=accum, sampler=cfg.data.sampler)
    return step, layout


def fine_tuning(cfg, network, num_classes):
    """(lr scale per parameter name or None, the head's name or None, (unfreeze_at, unfreeze_warmup)) of
    optim.head_lr_scale, optim.layer_decay and train.unfreeze_at (utils/param_groups.py). None when all
    are off: the optimizer's groups are then today's (and resume a checkpoint written before them)."""
    optim, train = cfg.optim, cfg.train
    unfreeze = (train.unfreeze_at, train.unfreeze_warmup)
    if optim.head_lr_scale == 1 and optim.layer_decay == 1 and not train.unfreeze_at:
        return None, None, unfreeze
    keys = [k for k, on in (("optim.head_lr_scale", optim.head_lr_scale != 1),
                            ("train.unfreeze_at", train.unfreeze_at)) if on]
    head = param_groups.require_head(find_head(network, num_classes), cfg.model.name, keys) if keys else \
        (find_head(network, num_classes) or (None,))[0]
    return param_groups.lr_scales(network, optim, head, cfg.model.name, cfg.model.blocks), head, unfreeze
