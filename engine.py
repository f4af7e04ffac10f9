"""The training and evaluation loop shared by train.py, train_multi_gpu_dp.py and train_multi_gpu_ddp.py.

The entry scripts build the device, the (wrapped) model and the loaders; `fit`
does everything else the same way for all three: optimizer and schedule,
resume, epochs, exact distributed evaluation, checkpoints and logs.

Per step nothing is copied back to the host: losses are summed on the device
and read once per `train.log_every` steps, where a NaN/inf is also caught.
"""
import contextlib
import itertools
import json
import math
import os
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from utils import checkpoint as ckpt
from utils.config import config_to_dict
from utils.distributed_utils import (DistInfo, any_rank, broadcast_buffers, broadcast_object, gather_objects,
                                     reduce_min, reduce_value)
from utils.errors import RUNTIME_EXIT, UserError
from utils.optim import (WeightEMA, batch_mixer, build_optimizer, build_scaler, build_scheduler, class_weights,
                         place_schedule, resolve_amp)
from utils.run_logger import RunLogger
from utils.stop import StopRequest

_NO_BAD_STEP = 2 ** 62


def seed_for(seed, epoch, rank):
    """One seed per (run seed, epoch, rank): augmentation and data order are reproducible
    per epoch, so a run resumed at an epoch boundary continues exactly."""
    return (seed * 1_000_003 + epoch * 1009 + rank) % (2 ** 63)


def _to_device(images, labels, device, channels_last):
    # non_blocking pairs with pin_memory: the copy overlaps with queued GPU work.
    images = images.to(device, non_blocking=True)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, labels.to(device, non_blocking=True)


def train_one_epoch(model, loader, optimizer, scheduler, scaler, device, epoch, *, amp_dtype=None,
                    channels_last=False, log_every=20, global_step=0, world_size=1, logger=None,
                    resume=None, stop=None, save_every=0, save_step=None, epochs=None, first_batch=None,
                    label_smoothing=0.0, clip_grad_norm=0.0, accum_steps=1, class_weight=None, mix=None,
                    ema=None):
    """One pass over `loader`; returns the epoch's mean loss (over all ranks), throughput and step.

    Steps are optimizer steps: each takes `accum_steps` batches of the loader (under DDP the
    gradients are all-reduced on the last of them only); a tail of fewer batches is not trained.
    `global_step`, `log_every` and `save_every` count optimizer steps.
    resume: a mid-epoch checkpoint's point (checkpoint.resume_point) to continue from.
    stop: a StopRequest; when any rank has one, all stop at the same window boundary.
    save_step(epoch_batch, global_step, loss_sum, images_seen): called by every rank at the
    first window boundary after each `save_every` steps, and on a stop; then "stopped" is set.
    first_batch(images, labels): called with the epoch's first batch, before any MixUp/CutMix
    (the augmented-samples picture); not called when the epoch is resumed past its first step.
    label_smoothing, class_weight: of the training loss. mix(images, labels) -> (images, soft
    targets): utils.optim.batch_mixer. clip_grad_norm (> 0): the gradients' total norm is
    clipped to it (after unscaling under fp16); its pre-clip value is summed on the device and
    logged per window as train/grad_norm, the mean of the steps with finite gradients, beside
    train/skipped_steps, the steps fp16's GradScaler skipped. ema: a utils.optim.WeightEMA.
    """
    model.train()
    logger = logger or RunLogger(".", enabled=False)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    window_sum = torch.zeros((), device=device, dtype=torch.float64)
    first_bad = torch.full((), _NO_BAD_STEP, device=device, dtype=torch.long)
    norm_sum = torch.zeros((), device=device, dtype=torch.float64)  # pre-clip norms of the finite steps
    norm_count = torch.zeros((), device=device, dtype=torch.float64)  # and how many they were
    clipped = [p for g in optimizer.param_groups for p in g["params"]] if clip_grad_norm else []
    # DDP's no_sync: the non-final micro-batches only add to the local gradients.
    no_sync = getattr(model, "no_sync", None) if accum_steps > 1 else None
    used = len(loader) // accum_steps * accum_steps  # batches that make whole optimizer steps
    images_seen, window_steps, window_batches, window_images = 0, 0, 0, 0
    batches, skip = iter(loader), 0
    if resume is not None:
        # Draw and drop the batches already trained: the sampler order and the augmentation's
        # random draws then continue exactly as in the interrupted run (no forward/backward).
        skip = resume["epoch_step"]
        for _ in range(skip):
            next(batches)
        loss_sum += resume["loss_sum"]
        images_seen = resume["images_seen"]
        ckpt.set_rng_state(resume["rng"])
    next_save = (global_step // save_every + 1) * save_every if save_every else None
    start = window_start = time.perf_counter()
    label = f"epoch {epoch + 1}" + (f"/{epochs}" if epochs else "")
    optimizer.zero_grad(set_to_none=True)
    # islice: a tail that makes no whole step is not even loaded.
    bar = logger.progress(itertools.islice(batches, used - skip), used - skip, f"{label} train")
    for i, (images, labels) in enumerate(bar, start=skip):
        images, labels = _to_device(images, labels, device, channels_last)
        if i == 0 and first_batch is not None:
            first_batch(images, labels)
        targets = labels
        if mix is not None:
            images, targets = mix(images, labels)
        stepping = (i + 1) % accum_steps == 0
        with no_sync() if no_sync is not None and not stepping else contextlib.nullcontext():
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(images), targets, weight=class_weight, label_smoothing=label_smoothing)
            # The summed micro-batch gradients then equal one batch of accum_steps x batch_size.
            scaler.scale(loss / accum_steps if accum_steps > 1 else loss).backward()

        detached = loss.detach().double()
        loss_sum += detached * labels.shape[0]
        window_sum += detached
        # Remember the first non-finite step without a host sync: finite steps add a huge offset.
        first_bad = torch.minimum(first_bad, torch.isfinite(detached).long() * _NO_BAD_STEP + global_step)
        images_seen += labels.shape[0]
        window_batches += 1
        window_images += labels.shape[0]
        if not stepping:
            continue
        if clip_grad_norm:
            scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
            norm = torch.nn.utils.clip_grad_norm_(clipped, clip_grad_norm).double()  # no sync
            # fp16: GradScaler skips a step whose gradients overflowed; its inf norm stays out of the mean.
            finite = torch.isfinite(norm)
            norm_sum += torch.where(finite, norm, 0.0)
            norm_count += finite
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update()
        window_steps += 1
        global_step += 1

        last = i == used - 1
        # One process needs nobody's agreement: it honours a stop request at the very next step.
        if window_steps == log_every or last or (world_size == 1 and stop is not None and stop.requested()):
            # The one host sync (and all-reduce) per window; every rank reaches it at the same step.
            # A stop request rides in the same all-reduce: no extra collective on the hot path.
            flag = window_sum.new_tensor(float(stop is not None and stop.requested()))
            summed = reduce_value(torch.stack([window_sum, flag, norm_sum, norm_count]), average=False).tolist()
            window_loss, stopping = summed[0] / (window_batches * world_size), summed[1] > 0
            if not math.isfinite(window_loss):
                bad = reduce_min(first_bad).item()  # all ranks saw the same NaN sum, all join this
                raise UserError(f"loss is {window_loss} at epoch {epoch + 1}, step {bad}; stopping. "
                                "The last good checkpoint is kept. Try a lower --lr or train.amp=off.",
                                exit_code=RUNTIME_EXIT, every_rank=True)
            now = time.perf_counter()
            speed = window_images * world_size / max(now - window_start, 1e-9)
            eta = (now - start) / (i + 1 - skip) * (used - i - 1)  # to the end of this epoch
            # Optimizer steps of this epoch, as global_step and TensorBoard count them.
            logger.window(bar, label, (i + 1) // accum_steps, used // accum_steps, window_loss, speed,
                          optimizer.param_groups[0]["lr"], eta)
            logger.scalar("train/loss_step", window_loss, global_step)
            # The lr the window ended with (a Python float, no sync): warm-up and cosine show as curves.
            logger.scalar("train/lr", optimizer.param_groups[0]["lr"], global_step)
            if clip_grad_norm:  # the mean pre-clip norm of the window (every rank clips the same reduced grads)
                if summed[3]:
                    logger.scalar("train/grad_norm", summed[2] / summed[3], global_step)
                # Steps with inf/NaN gradients, which GradScaler skipped (fp16; otherwise 0).
                logger.scalar("train/skipped_steps", window_steps - summed[3] / world_size, global_step)
                norm_sum.zero_()
                norm_count.zero_()
            window_sum.zero_()
            window_steps, window_batches, window_images, window_start = 0, 0, 0, now
            # The epoch's last step is followed by evaluation and the epoch checkpoint anyway.
            if save_step is not None and not last and (stopping or (next_save and global_step >= next_save)):
                save_step(i + 1, global_step, loss_sum.item(), images_seen)
                next_save = (global_step // save_every + 1) * save_every if save_every else None
                if stopping:
                    return {"stopped": True, "global_step": global_step}
    seconds = time.perf_counter() - start
    total_loss, total_images = reduce_value(torch.stack([loss_sum, torch.tensor(
        float(images_seen), device=device, dtype=torch.float64)]), average=False).tolist()  # one host read
    return {
        "train_loss": total_loss / total_images,
        "img_per_s": total_images / max(seconds, 1e-9),
        "train_seconds": seconds,
        "global_step": global_step,
    }


@torch.no_grad()
def evaluate(model, loader, device, num_classes, *, amp_dtype=None, channels_last=False, logger=None,
             worst_k=0):
    """Loss, accuracy (top-1, top-5), confusion matrix, per-class precision/recall/F1 over the whole
    validation set, and with `worst_k` the k misclassified images of highest loss ("val_worst").

    Each rank evaluates a disjoint, unpadded shard (data.ShardSampler) and the
    sums are all-reduced once, so every image counts exactly once and the
    result equals a single-process evaluation whatever the world size. Each rank
    keeps its own k worst on the device (no host sync per batch); the lists are
    gathered once and merged by (loss, dataset index), as one process would rank them.
    """
    broadcast_buffers(model)  # every rank evaluates rank 0's model, the one checkpointed
    model.eval()
    logger = logger or RunLogger(".", enabled=False)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.float64)
    top5 = torch.zeros((), device=device, dtype=torch.float64)
    # Dataset index of each image this rank sees, in loader order (the val sampler does not shuffle).
    order = list(getattr(loader, "sampler", None) or []) if worst_k else []
    positions = torch.tensor(order, device=device, dtype=torch.long)
    worst = torch.empty(0, 5, device=device, dtype=torch.float64)  # loss, index, pred, prob, label
    seen = 0
    start = time.perf_counter()
    for images, labels in logger.progress(loader, len(loader), "eval"):
        images, labels = _to_device(images, labels, device, channels_last)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        losses = F.cross_entropy(logits.float(), labels, reduction="none").double()
        loss_sum += losses.sum()
        pred = logits.argmax(dim=1)
        # index_add_, not bincount: bincount sizes its output from the data, a host sync on CUDA.
        cells = labels * num_classes + pred
        confusion.index_add_(0, cells, torch.ones_like(cells, dtype=confusion.dtype))
        if num_classes >= 5:
            top5 += (logits.topk(5, dim=1).indices == labels[:, None]).any(dim=1).sum()
        if len(order):
            n = labels.shape[0]
            prob = logits.float().softmax(dim=1).gather(1, pred[:, None]).squeeze(1).double()
            key = torch.where(pred != labels, losses, torch.full_like(losses, -math.inf))
            rows = torch.stack([key, positions[seen:seen + n].double(), pred.double(), prob, labels.double()], dim=1)
            worst = torch.cat([worst, rows])
            worst = worst[worst[:, 0].topk(min(worst_k, len(worst))).indices]
            seen += n
    totals = reduce_value(torch.cat([loss_sum.view(1), top5.view(1), confusion]), average=False).cpu()
    confusion = totals[2:].view(num_classes, num_classes)  # rows: true class, columns: predicted
    count = confusion.sum().item()
    per_class_total = confusion.sum(dim=1)
    out = {
        "val_loss": totals[0].item() / max(count, 1),
        "val_acc": confusion.diag().sum().item() / max(count, 1),
        **({"val_top5": totals[1].item() / max(count, 1)} if num_classes >= 5 else {}),
        "val_count": int(count),
        "val_per_class_acc": (confusion.diag() / per_class_total.clamp(min=1)).tolist(),
        **classification_report(confusion),
    }
    if worst_k:  # every rank joins the gather, also one without a sampler order
        mine = [r for r in worst.cpu().tolist() if math.isfinite(r[0])]
        merged = sorted((r for part in gather_objects(mine) for r in part), key=lambda r: (-r[0], r[1]))
        samples = getattr(loader.dataset, "samples", None)
        out["val_worst"] = [{"index": int(i), "path": str(samples[int(i)][0]) if samples else None,
                             "label": int(label), "pred": int(p), "prob": p_, "loss": loss}
                            for loss, i, p, p_, label in merged[:worst_k]]
    out["val_seconds"] = time.perf_counter() - start
    return out


def classification_report(confusion):
    """Per-class precision, recall and F1, macro-F1 and the matrix itself from a confusion
    matrix (rows true, columns predicted); 0 where a class was never predicted or never present."""
    confusion = confusion.double()
    tp = confusion.diag()
    predicted, actual = confusion.sum(dim=0), confusion.sum(dim=1)
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(actual > 0, tp / actual.clamp(min=1), torch.zeros_like(tp))
    both = precision + recall
    f1 = torch.where(both > 0, 2 * precision * recall / both.clamp(min=1e-12), torch.zeros_like(tp))
    return {"val_precision": precision.tolist(), "val_recall": recall.tolist(), "val_f1": f1.tolist(),
            "val_macro_f1": f1.mean().item(), "val_confusion": confusion.long().tolist()}


def compile_model(model):
    """torch.compile (train.compile): the first steps in train and in eval mode pay the compilation."""
    if not hasattr(torch, "compile"):
        raise UserError("train.compile=true needs torch >= 2.0")
    return torch.compile(model)


def resolve_run_dir(cfg, script_name, dist_info):
    """Rank 0 names the run directory and every rank agrees on it (one broadcast)."""
    if cfg.output_dir:
        run_dir = cfg.output_dir
    elif cfg.resume == "auto":
        raise UserError("--resume auto needs --output-dir: the run directory to continue")
    else:
        run_dir = str(Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{script_name}")
    return Path(broadcast_object(run_dir if dist_info.rank == 0 else None))


def _check_run_dir(run_dir, resuming):
    """Never write over an earlier run without --resume; fail before any training."""
    if resuming:
        return
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise UserError(f"run directory '{run_dir}' already holds a run; continue it with "
                        "--resume auto, or choose another --output-dir")


def _check_writable(run_dir):
    """A run directory that cannot be written fails now, not at the end of the first epoch."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output directory '{run_dir}' is not writable ({e.strerror or e}); "
                        "choose another --output-dir") from None


def _stopped(stop, where, global_step, run_dir, dist_info):
    """End the run after a stop request's checkpoint: one line on rank 0, 128+signal everywhere."""
    if dist_info.rank != 0:
        raise SystemExit(stop.exit_code)
    command = ckpt.resume_command(run_dir, dist_info.world_size, dist_info.local_world_size)
    raise UserError(f"stopped by {stop.name} {where}, global step {global_step}; "
                    f"{run_dir / 'checkpoints' / 'last.pt'} is saved. Resume with: {command}",
                    exit_code=stop.exit_code)


def fit(cfg, model, train_loader, val_loader, classes, dist_info: DistInfo, script_name):
    """Train for cfg.train.epochs, evaluating, logging and checkpointing after each epoch.

    `model` is what the script built: bare, DataParallel or DDP. Every rank
    calls fit; only rank 0 writes.
    """
    device, rank, world = dist_info.device, dist_info.rank, dist_info.world_size
    main = rank == 0
    # torchrun --max-restarts=N re-runs this same command after a worker dies; a restarted
    # run continues from its run directory's last.pt (see utils/checkpoint.py).
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if restarted and not cfg.output_dir:
        raise UserError("torchrun restarted the workers, but the run has no fixed --output-dir to continue; "
                        "with --max-restarts pass --output-dir DIR --resume auto")
    run_dir = resolve_run_dir(cfg, script_name, dist_info)
    # Rank 0 finds and reads the checkpoint and hands it to every rank: nodes need not share the run directory.
    resume_path, resume_state = ckpt.agree_resume(cfg.resume, run_dir, restarted, rank)
    if cfg.eval_only:
        return evaluate_only(cfg, model, val_loader, classes, dist_info, run_dir, resume_path, resume_state)
    # Settings that only the data can refute: refused here, before anything is written.
    accum = cfg.train.accum_steps
    steps = len(train_loader) // accum  # optimizer steps per epoch
    if steps == 0:
        raise UserError(f"train.accum_steps={accum} is more than the {len(train_loader)} batches of an epoch "
                        "per process; lower it or --batch-size", every_rank=True)
    class_weight = class_weights(cfg.optim.class_weights, getattr(train_loader.dataset, "targets", None),
                                 len(classes), device)
    if main:
        _check_run_dir(run_dir, resuming=resume_path is not None or cfg.resume == "auto" or restarted)
        _check_writable(run_dir)
        ckpt.remove_stale_temps(run_dir / "checkpoints")

    bare = ckpt.unwrap(model)
    amp_dtype = resolve_amp(cfg.train.amp, device)
    channels_last = cfg.model.channels_last and device.type == "cuda"
    # Steps run through `step_model`; checkpoints keep saving `model`'s plain (uncompiled) weights.
    step_model = compile_model(model) if cfg.train.compile else model
    optimizer = build_optimizer(bare, cfg.optim, world, fused=amp_dtype == torch.float16)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.epochs, steps)
    scaler = build_scaler(amp_dtype, device)
    ema = WeightEMA(bare, cfg.train.ema_decay) if cfg.train.ema_decay else None
    mix = batch_mixer(cfg.data.mixup_alpha, cfg.data.cutmix_alpha, len(classes))
    layout = ckpt.data_layout(cfg.train.seed, world, cfg.train.batch_size, steps, len(train_loader.dataset),
                              accum_steps=accum, sampler=cfg.data.sampler)
    start_epoch, global_step, best_acc, best_weights, mid, notes = 0, 0, -1.0, "model", None, []
    if resume_path is not None:
        state, resume_state = resume_state, None
        start_epoch, global_step, best_acc = ckpt.restore(state, model, optimizer, scheduler, scaler, classes,
                                                          model_name=cfg.model.name, ema=ema)
        best_weights = state.get("best_weights", "model")
        if ema is not None and not state.get("ema"):
            notes.append("note: the checkpoint holds no EMA of the weights; train.ema_decay's average starts "
                         "from its weights")
        rng, mid, note = ckpt.resume_point(state, rank, layout)
        notes += [note] if note else []
        their_steps = (state.get("data") or {}).get("steps_per_epoch")
        if their_steps not in (None, steps):
            # Another world size (an elastic restart), batch size or accum_steps: the schedule continues in this run's steps.
            global_step = start_epoch * steps
            place_schedule(scheduler, cfg.optim, world, (state.get("config") or {}).get("train", {}).get(
                "epochs") or cfg.train.epochs, steps, global_step)
            notes.append(f"note: the checkpoint has {their_steps} steps per epoch, this run {steps} "
                         f"({world} process(es)): the lr schedule continues from epoch {start_epoch + 1}'s start "
                         "in this run's steps")
        if rng is not None:
            ckpt.set_rng_state(rng)  # Python/NumPy continue; torch's is reseeded per epoch below
        their_epochs = (state.get("config") or {}).get("train", {}).get("epochs")
        if their_epochs not in (None, cfg.train.epochs):
            notes.append(f"note: the checkpoint's lr schedule spans {their_epochs} epochs and is kept; "
                         f"training runs to epoch {cfg.train.epochs}")
        del state

    logger = RunLogger(run_dir, enabled=main, start_epoch=start_epoch, start_step=global_step,
                       resuming=resume_path is not None or restarted or cfg.resume == "auto")
    if resume_path is None:
        logger.write_config(cfg)
        logger.write_json("class_indices.json", {str(i): c for i, c in enumerate(classes)})
        logger.hparams(config_to_dict(cfg), ["val/acc", "val/best_acc", "val/macro_f1", "val/loss", "train/loss"])
    where = f"epoch {start_epoch + 1}" + (f" after its step {mid['epoch_step']}" if mid else "")
    logger.info(f"run directory: {run_dir}" + (f" (resumed from {resume_path} at {where}, global step "
                                                 f"{global_step})" if resume_path else ""))
    if cfg.train.amp in ("bf16", "fp16") and amp_dtype is None:
        notes.append(f"note: train.amp={cfg.train.amp} applies on CUDA only; this {device.type} run computes in fp32")
    for note in notes:
        logger.info(note)
    logger.info(f"{len(train_loader.dataset)} train / {len(val_loader.dataset)} val images, "
                f"{len(classes)} classes, {world} process(es) on {device}, "
                f"lr {optimizer.param_groups[0]['initial_lr']:.4g}, amp {amp_dtype or 'off'}"
                + (f", {accum} batches per step" if accum > 1 else ""))
    if class_weight is not None:
        logger.info("class weights: " + ", ".join(f"{c} {w:.3g}" for c, w in zip(classes, class_weight.tolist())))
    saver = ckpt.Checkpointer(run_dir / "checkpoints", model, optimizer, scheduler, scaler, config_to_dict(cfg),
                              classes, layout, cfg.train.keep_last, rank, device, ema=ema)
    stop = StopRequest().install()
    metrics = {}
    try:
        for epoch in range(start_epoch, cfg.train.epochs):
            epoch_start = time.perf_counter()
            train_loader.sampler.set_epoch(epoch)
            torch.manual_seed(seed_for(cfg.train.seed, epoch, rank))
            train_loader.generator.manual_seed(seed_for(cfg.train.seed, epoch, rank))
            lr = mid["lr"] if mid else optimizer.param_groups[0]["lr"]

            def save_step(epoch_step, step, loss_sum, images_seen, epoch=epoch, lr=lr):
                saver.save(epoch, step, best_acc, epoch_step=epoch_step, loss_sum=loss_sum,
                           images_seen=images_seen, epoch_lr=lr, best_weights=best_weights)

            train = train_one_epoch(step_model, train_loader, optimizer, scheduler, scaler, device, epoch,
                                    amp_dtype=amp_dtype, channels_last=channels_last,
                                    log_every=cfg.train.log_every, global_step=global_step,
                                    world_size=world, logger=logger, resume=mid, stop=stop,
                                    save_every=cfg.train.save_every_steps, save_step=save_step,
                                    epochs=cfg.train.epochs, label_smoothing=cfg.optim.label_smoothing,
                                    clip_grad_norm=cfg.optim.clip_grad_norm, accum_steps=accum,
                                    class_weight=class_weight, mix=mix, ema=ema,
                                    first_batch=(lambda im, lb, s=global_step: sample_picture(
                                        logger, im, lb, classes, train_loader.dataset, s))
                                    if epoch == 0 and cfg.train.figures else None)
            mid = None
            global_step = train.pop("global_step")
            if train.pop("stopped", False):
                _stopped(stop, f"in epoch {epoch + 1}", global_step, run_dir, dist_info)
            val = evaluate(step_model, val_loader, device, len(classes), amp_dtype=amp_dtype,
                           channels_last=channels_last, logger=logger,
                           worst_k=cfg.train.worst_images if cfg.train.figures else 0)
            worst = val.pop("val_worst", None)
            if ema is not None:  # the average's own evaluation, beside the raw weights'
                averaged = evaluate(ema.module, val_loader, device, len(classes), amp_dtype=amp_dtype,
                                    channels_last=channels_last, logger=logger)
                val.update({f"{k}_ema": averaged[k] for k in ("val_loss", "val_acc", "val_macro_f1")})
            # Unreadable images met so far by any rank or loader worker (a collective: all ranks).
            val["bad_images"] = sum(ds.sync_bad_images() for ds in (train_loader.dataset, val_loader.dataset)
                                    if hasattr(ds, "sync_bad_images"))
            # With an EMA, the better of the two weight sets competes; best.pt records which ("best_weights").
            which = "ema" if ema is not None and val["val_acc_ema"] > val["val_acc"] else "model"
            score = val["val_acc_ema"] if which == "ema" else val["val_acc"]
            is_best = score > best_acc
            if is_best:
                best_acc, best_weights = score, which
            saver.save(epoch + 1, global_step, best_acc, is_best=is_best, best_weights=best_weights)
            figure_seconds = epoch_pictures(logger, val, worst, classes, val_loader.dataset, global_step) \
                if cfg.train.figures else 0.0
            metrics = {"epoch": epoch + 1, "step": global_step, **train, **val, "lr": lr,
                       "best_acc": best_acc, **({"best_weights": best_weights} if ema is not None else {}),
                       "figure_seconds": figure_seconds,
                       "epoch_seconds": time.perf_counter() - epoch_start}
            logger.epoch(metrics, classes)
            logger.info(f"epoch {epoch + 1}/{cfg.train.epochs}  train_loss {train['train_loss']:.4f}  "
                        f"val_loss {val['val_loss']:.4f}  val_acc {val['val_acc']:.4f}  "
                        + (f"val_acc_ema {val['val_acc_ema']:.4f}  " if ema is not None else "")
                        + f"{train['img_per_s']:.0f} img/s  {metrics['epoch_seconds']:.1f}s")
            # A signal that came during evaluation: the epoch's checkpoint is already written.
            if epoch + 1 < cfg.train.epochs and any_rank(stop.requested(), device):
                _stopped(stop, f"after epoch {epoch + 1}", global_step, run_dir, dist_info)
    finally:
        stop.uninstall()
        logger.close()
    return {"best_acc": best_acc, "run_dir": str(run_dir), "last": metrics}


def normalization(dataset):
    """(mean, std) of the dataset transform's Normalize step, or (None, None): to undo it in pictures."""
    for t in getattr(getattr(dataset, "transform", None), "transforms", []):
        if hasattr(t, "mean") and hasattr(t, "std"):
            return tuple(t.mean), tuple(t.std)
    return None, None


def sample_picture(logger, images, labels, classes, dataset, step):
    """The first training batch as the model sees it (normalization undone), rank 0 only."""
    if not logger.enabled:
        return
    from utils import figures
    n = min(16, len(images))
    shown = figures.denormalize(images[:n], *normalization(dataset))
    names = [classes[i] for i in labels[:n].tolist()]
    logger.image("train/augmented_samples",
                 figures.image_grid(shown, names, title="augmented training samples", cols=8), step)


def worst_picture(worst, classes, dataset):
    """The worst mistakes as an image grid: each with true class, predicted class and probability."""
    from utils import figures
    mean, std = normalization(dataset)
    shown = figures.denormalize(torch.stack([dataset[w["index"]][0] for w in worst]), mean, std) if worst else []
    titles = [f"{classes[w['label']]} -> {classes[w['pred']]}\n{w['prob']:.0%}" for w in worst]
    return figures.image_grid(shown, titles, colours=["firebrick"] * len(worst),
                              title="worst mistakes (true -> predicted, probability)", cols=min(8, max(len(worst), 1)))


def epoch_pictures(logger, val, worst, classes, dataset, step):
    """Rank 0 draws the epoch's confusion matrix and worst mistakes; returns the seconds it took."""
    if not logger.enabled:
        return 0.0
    from utils import figures
    start = time.perf_counter()
    logger.image("val/confusion_matrix", figures.confusion_matrix_image(val["val_confusion"], classes), step)
    if worst is not None:  # train.worst_images > 0; also when there was no mistake
        logger.image("val/worst_mistakes", worst_picture(worst, classes, dataset), step)
    return round(time.perf_counter() - start, 4)


def evaluate_only(cfg, model, val_loader, classes, dist_info, run_dir, resume_path, state=None):
    """--eval-only: the checkpoint's (or --weights') model on the validation split, or on test/
    when the data root has one; rank 0 writes eval.json and the two pictures into `run_dir`."""
    device, main = dist_info.device, dist_info.rank == 0
    if resume_path is None and not cfg.model.weights:  # load_config refused neither; --resume auto found nothing
        raise UserError(f"--eval-only --resume {cfg.resume} found no checkpoint in '{run_dir}'; pass "
                        "--resume CHECKPOINT or --weights FILE", every_rank=True)
    source = str(resume_path or cfg.model.weights)
    if resume_path is not None:
        state = state or ckpt.load_checkpoint(resume_path, map_location="cpu")
        ckpt.check_compatible(state, model, classes, model_name=cfg.model.name)
        # The weights that made the checkpoint's best accuracy: its EMA where that did (train.ema_decay).
        weights = "ema" if state.get("best_weights") == "ema" and state.get("ema") else "model"
        ckpt.unwrap(model).load_state_dict(state[weights])
        source += " (EMA weights)" if weights == "ema" else ""
        del state
    if main:
        _check_writable(run_dir)
    amp_dtype = resolve_amp(cfg.train.amp, device)
    val = evaluate(model, val_loader, device, len(classes), amp_dtype=amp_dtype,
                   channels_last=cfg.model.channels_last and device.type == "cuda",
                   worst_k=cfg.train.worst_images)
    worst = val.pop("val_worst", [])
    split = getattr(val_loader.dataset, "split", "val")
    result = {"checkpoint": source, "split": split, "classes": list(classes), "count": val["val_count"],
              "accuracy": val["val_acc"], **({"top5": val["val_top5"]} if "val_top5" in val else {}),
              "loss": val["val_loss"], "macro_f1": val["val_macro_f1"],
              "per_class": {c: {"precision": p, "recall": r, "f1": f, "support": int(sum(row))}
                            for c, p, r, f, row in zip(classes, val["val_precision"], val["val_recall"],
                                                       val["val_f1"], val["val_confusion"])},
              "confusion": {"classes": list(classes), "rows_true_columns_predicted": val["val_confusion"]},
              "worst": [{**w, "true": classes[w["label"]], "predicted": classes[w["pred"]]} for w in worst]}
    if main:
        from utils import figures
        figures.save_png(figures.confusion_matrix_image(val["val_confusion"], classes),
                         run_dir / "confusion_matrix.png")
        if cfg.train.worst_images:
            figures.save_png(worst_picture(worst, classes, val_loader.dataset), run_dir / "worst_mistakes.png")
        tmp = run_dir / "eval.json.tmp"
        tmp.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.replace(run_dir / "eval.json")
        top5 = f"  top-5 {result['top5']:.4f}" if "top5" in result else ""
        print(f"eval-only: {source} on {split}: {result['count']} images  accuracy {result['accuracy']:.4f}"
              f"{top5}  macro-F1 {result['macro_f1']:.4f}  -> {run_dir / 'eval.json'}", flush=True)
    return {"best_acc": val["val_acc"], "run_dir": str(run_dir), "last": result}
