"""The training and evaluation loop shared by train.py, train_multi_gpu_dp.py and train_multi_gpu_ddp.py.

The entry scripts build the device, the (wrapped) model and the loaders; `fit`
does everything else the same way for all three: optimizer and schedule,
resume, epochs, exact distributed evaluation, checkpoints and logs.

Per step nothing is copied back to the host: losses are summed on the device
and read once per `train.log_every` steps, where a NaN/inf is also caught.
"""
import math
import os
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from utils import checkpoint as ckpt
from utils.config import config_to_dict
from utils.distributed_utils import (DistInfo, any_rank, broadcast_buffers, broadcast_object, reduce_min,
                                     reduce_value)
from utils.errors import RUNTIME_EXIT, UserError
from utils.optim import build_optimizer, build_scaler, build_scheduler, place_schedule, resolve_amp
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
                    resume=None, stop=None, save_every=0, save_step=None, epochs=None):
    """One pass over `loader`; returns the epoch's mean loss (over all ranks), throughput and step.

    resume: a mid-epoch checkpoint's point (checkpoint.resume_point) to continue from.
    stop: a StopRequest; when any rank has one, all stop at the same window boundary.
    save_step(epoch_step, global_step, loss_sum, images_seen): called by every rank at the
    first window boundary after each `save_every` steps, and on a stop; then "stopped" is set.
    """
    model.train()
    logger = logger or RunLogger(".", enabled=False)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    window_sum = torch.zeros((), device=device, dtype=torch.float64)
    first_bad = torch.full((), _NO_BAD_STEP, device=device, dtype=torch.long)
    images_seen, window_steps = 0, 0
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
    bar = logger.progress(batches, len(loader) - skip, f"{label} train")
    for i, (images, labels) in enumerate(bar, start=skip):
        images, labels = _to_device(images, labels, device, channels_last)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        detached = loss.detach().double()
        loss_sum += detached * labels.shape[0]
        window_sum += detached
        # Remember the first non-finite step without a host sync: finite steps add a huge offset.
        first_bad = torch.minimum(first_bad, torch.isfinite(detached).long() * _NO_BAD_STEP + global_step)
        images_seen += labels.shape[0]
        window_steps += 1
        global_step += 1

        last = i == len(loader) - 1
        # One process needs nobody's agreement: it honours a stop request at the very next step.
        if window_steps == log_every or last or (world_size == 1 and stop is not None and stop.requested()):
            # The one host sync (and all-reduce) per window; every rank reaches it at the same step.
            # A stop request rides in the same all-reduce: no extra collective on the hot path.
            flag = window_sum.new_tensor(float(stop is not None and stop.requested()))
            summed = reduce_value(torch.stack([window_sum, flag]), average=False).tolist()
            window_loss, stopping = summed[0] / (window_steps * world_size), summed[1] > 0
            if not math.isfinite(window_loss):
                bad = reduce_min(first_bad).item()  # all ranks saw the same NaN sum, all join this
                raise UserError(f"loss is {window_loss} at epoch {epoch + 1}, step {bad}; stopping. "
                                "The last good checkpoint is kept. Try a lower --lr or train.amp=off.",
                                exit_code=RUNTIME_EXIT, every_rank=True)
            now = time.perf_counter()
            speed = window_steps * labels.shape[0] * world_size / max(now - window_start, 1e-9)
            eta = (now - start) / (i + 1 - skip) * (len(loader) - i - 1)  # to the end of this epoch
            logger.window(bar, label, i + 1, len(loader), window_loss, speed, optimizer.param_groups[0]["lr"], eta)
            logger.scalar("train/loss_step", window_loss, global_step)
            window_sum.zero_()
            window_steps, window_start = 0, now
            # The epoch's last step is followed by evaluation and the epoch checkpoint anyway.
            if save_step is not None and not last and (stopping or (next_save and global_step >= next_save)):
                save_step(i + 1, global_step, loss_sum.item(), images_seen)
                next_save = (global_step // save_every + 1) * save_every if save_every else None
                if stopping:
                    return {"stopped": True, "global_step": global_step}
    seconds = time.perf_counter() - start
    total = reduce_value(torch.stack([loss_sum, torch.tensor(float(images_seen), device=device,
                                                                dtype=torch.float64)]), average=False)
    return {
        "train_loss": (total[0] / total[1]).item(),
        "img_per_s": total[1].item() / max(seconds, 1e-9),
        "train_seconds": seconds,
        "global_step": global_step,
    }


@torch.no_grad()
def evaluate(model, loader, device, num_classes, *, amp_dtype=None, channels_last=False, logger=None):
    """Loss, accuracy and per-class accuracy over the whole validation set.

    Each rank evaluates a disjoint, unpadded shard (data.ShardSampler) and the
    sums are all-reduced once, so every image counts exactly once and the
    result equals a single-process evaluation whatever the world size.
    """
    broadcast_buffers(model)  # every rank evaluates rank 0's model, the one checkpointed
    model.eval()
    logger = logger or RunLogger(".", enabled=False)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.float64)
    start = time.perf_counter()
    for images, labels in logger.progress(loader, len(loader), "eval"):
        images, labels = _to_device(images, labels, device, channels_last)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").double()
        pred = logits.argmax(dim=1)
        # index_add_, not bincount: bincount sizes its output from the data, a host sync on CUDA.
        cells = labels * num_classes + pred
        confusion.index_add_(0, cells, torch.ones_like(cells, dtype=confusion.dtype))
    totals = reduce_value(torch.cat([loss_sum.view(1), confusion]), average=False).cpu()
    confusion = totals[1:].view(num_classes, num_classes)  # rows: true class, columns: predicted
    count = confusion.sum().item()
    per_class_total = confusion.sum(dim=1)
    return {
        "val_loss": totals[0].item() / max(count, 1),
        "val_acc": confusion.diag().sum().item() / max(count, 1),
        "val_count": int(count),
        "val_per_class_acc": (confusion.diag() / per_class_total.clamp(min=1)).tolist(),
        "val_seconds": time.perf_counter() - start,
    }


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
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.epochs, len(train_loader))
    scaler = build_scaler(amp_dtype, device)
    layout = ckpt.data_layout(cfg.train.seed, world, cfg.train.batch_size, len(train_loader),
                              len(train_loader.dataset))
    start_epoch, global_step, best_acc, mid, notes = 0, 0, -1.0, None, []
    if resume_path is not None:
        state, resume_state = resume_state, None
        start_epoch, global_step, best_acc = ckpt.restore(state, model, optimizer, scheduler, scaler, classes,
                                                          model_name=cfg.model.name)
        rng, mid, note = ckpt.resume_point(state, rank, layout)
        notes += [note] if note else []
        their_steps = (state.get("data") or {}).get("steps_per_epoch")
        if their_steps not in (None, len(train_loader)):
            # Another world size (an elastic restart) or batch size: the schedule continues in this run's steps.
            global_step = start_epoch * len(train_loader)
            place_schedule(scheduler, cfg.optim, world, (state.get("config") or {}).get("train", {}).get(
                "epochs") or cfg.train.epochs, len(train_loader), global_step)
            notes.append(f"note: the checkpoint has {their_steps} steps per epoch, this run {len(train_loader)} "
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
    where = f"epoch {start_epoch + 1}" + (f" after its step {mid['epoch_step']}" if mid else "")
    logger.info(f"run directory: {run_dir}" + (f" (resumed from {resume_path} at {where}, global step "
                                                 f"{global_step})" if resume_path else ""))
    if cfg.train.amp in ("bf16", "fp16") and amp_dtype is None:
        notes.append(f"note: train.amp={cfg.train.amp} applies on CUDA only; this {device.type} run computes in fp32")
    for note in notes:
        logger.info(note)
    logger.info(f"{len(train_loader.dataset)} train / {len(val_loader.dataset)} val images, "
                f"{len(classes)} classes, {world} process(es) on {device}, "
                f"lr {optimizer.param_groups[0]['initial_lr']:.4g}, amp {amp_dtype or 'off'}")
    saver = ckpt.Checkpointer(run_dir / "checkpoints", model, optimizer, scheduler, scaler, config_to_dict(cfg),
                              classes, layout, cfg.train.keep_last, rank, device)
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
                           images_seen=images_seen, epoch_lr=lr)

            train = train_one_epoch(step_model, train_loader, optimizer, scheduler, scaler, device, epoch,
                                    amp_dtype=amp_dtype, channels_last=channels_last,
                                    log_every=cfg.train.log_every, global_step=global_step,
                                    world_size=world, logger=logger, resume=mid, stop=stop,
                                    save_every=cfg.train.save_every_steps, save_step=save_step,
                                    epochs=cfg.train.epochs)
            mid = None
            global_step = train.pop("global_step")
            if train.pop("stopped", False):
                _stopped(stop, f"in epoch {epoch + 1}", global_step, run_dir, dist_info)
            val = evaluate(step_model, val_loader, device, len(classes), amp_dtype=amp_dtype,
                           channels_last=channels_last, logger=logger)
            # Unreadable images met so far by any rank or loader worker (a collective: all ranks).
            val["bad_images"] = sum(ds.sync_bad_images() for ds in (train_loader.dataset, val_loader.dataset)
                                    if hasattr(ds, "sync_bad_images"))
            is_best = val["val_acc"] > best_acc
            best_acc = max(best_acc, val["val_acc"])
            saver.save(epoch + 1, global_step, best_acc, is_best=is_best)
            metrics = {"epoch": epoch + 1, "step": global_step, **train, **val, "lr": lr,
                       "best_acc": best_acc, "epoch_seconds": time.perf_counter() - epoch_start}
            logger.epoch(metrics)
            logger.info(f"epoch {epoch + 1}/{cfg.train.epochs}  train_loss {train['train_loss']:.4f}  "
                        f"val_loss {val['val_loss']:.4f}  val_acc {val['val_acc']:.4f}  "
                        f"{train['img_per_s']:.0f} img/s  {metrics['epoch_seconds']:.1f}s")
            # A signal that came during evaluation: the epoch's checkpoint is already written.
            if epoch + 1 < cfg.train.epochs and any_rank(stop.requested(), device):
                _stopped(stop, f"after epoch {epoch + 1}", global_step, run_dir, dist_info)
    finally:
        stop.uninstall()
        logger.close()
    return {"best_acc": best_acc, "run_dir": str(run_dir), "last": metrics}
