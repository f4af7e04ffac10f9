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

from data import sync_bad_images
from utils import checkpoint as ckpt
from utils.config import config_to_dict
from utils.distributed_utils import DistInfo, any_rank, broadcast_object, reduce_min, reduce_value
from utils.errors import RUNTIME_EXIT, UserError
from utils.optim import build_optimizer, build_scaler, build_scheduler, resolve_amp
from utils.run_logger import RunLogger

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
                    channels_last=False, log_every=20, global_step=0, world_size=1, logger=None):
    """One pass over `loader`; returns the epoch's mean loss (over all ranks), throughput and step."""
    model.train()
    logger = logger or RunLogger(".", enabled=False)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    window_sum = torch.zeros((), device=device, dtype=torch.float64)
    first_bad = torch.full((), _NO_BAD_STEP, device=device, dtype=torch.long)
    images_seen, window_steps = 0, 0
    start = window_start = time.perf_counter()
    bar = logger.progress(loader, len(loader), f"epoch {epoch + 1} train")
    for i, (images, labels) in enumerate(bar):
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

        if window_steps == log_every or i == len(loader) - 1:
            # The one host sync (and all-reduce) per window; every rank reaches it at the same step.
            window_loss = reduce_value(window_sum, average=False).item() / (window_steps * world_size)
            if not math.isfinite(window_loss):
                bad = reduce_min(first_bad).item()  # all ranks saw the same NaN sum, all join this
                raise UserError(f"loss is {window_loss} at epoch {epoch + 1}, step {bad}; stopping. "
                                "The last good checkpoint is kept. Try a lower --lr or train.amp=off.",
                                exit_code=RUNTIME_EXIT)
            now = time.perf_counter()
            speed = window_steps * labels.shape[0] * world_size / max(now - window_start, 1e-9)
            bar.set_postfix(loss=f"{window_loss:.4f}", img_s=f"{speed:.0f}",
                            lr=f"{optimizer.param_groups[0]['lr']:.2e}")
            logger.scalar("train/loss_step", window_loss, global_step)
            window_sum.zero_()
            window_steps, window_start = 0, now
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
        confusion += torch.bincount(labels * num_classes + pred, minlength=num_classes ** 2).double()
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


def fit(cfg, model, train_loader, val_loader, classes, dist_info: DistInfo, script_name):
    """Train for cfg.train.epochs, evaluating, logging and checkpointing after each epoch.

    `model` is what the script built: bare, DataParallel or DDP. Every rank
    calls fit; only rank 0 writes.
    """
    device, rank, world = dist_info.device, dist_info.rank, dist_info.world_size
    main = rank == 0
    run_dir = resolve_run_dir(cfg, script_name, dist_info)
    resume_path = ckpt.find_resume_path(cfg.resume, run_dir)
    if main:
        _check_run_dir(run_dir, resuming=resume_path is not None)
        _check_writable(run_dir)

    bare = ckpt.unwrap(model)
    amp_dtype = resolve_amp(cfg.train.amp, device)
    channels_last = cfg.model.channels_last and device.type == "cuda"
    optimizer = build_optimizer(bare, cfg.optim, world)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.epochs, len(train_loader))
    scaler = build_scaler(amp_dtype, device)
    start_epoch, global_step, best_acc = 0, 0, -1.0
    if resume_path is not None:
        state = ckpt.load_checkpoint(resume_path, map_location=device)
        start_epoch, global_step, best_acc = ckpt.restore(state, model, optimizer, scheduler, scaler, classes)
        del state

    logger = RunLogger(run_dir, enabled=main, start_epoch=start_epoch, start_step=global_step)
    if resume_path is None:
        logger.write_config(cfg)
        logger.write_json("class_indices.json", {str(i): c for i, c in enumerate(classes)})
    logger.info(f"run directory: {run_dir}" + (f" (resumed from {resume_path}, epoch {start_epoch})"
                                                 if resume_path else ""))
    logger.info(f"{len(train_loader.dataset)} train / {len(val_loader.dataset)} val images, "
                f"{len(classes)} classes, {world} process(es) on {device}, "
                f"lr {optimizer.param_groups[0]['initial_lr']:.4g}, amp {amp_dtype or 'off'}")
    config_dict = config_to_dict(cfg)
    metrics = {}
    try:
        for epoch in range(start_epoch, cfg.train.epochs):
            epoch_start = time.perf_counter()
            train_loader.sampler.set_epoch(epoch)
            torch.manual_seed(seed_for(cfg.train.seed, epoch, rank))
            train_loader.generator.manual_seed(seed_for(cfg.train.seed, epoch, rank))
            lr = optimizer.param_groups[0]["lr"]
            train = train_one_epoch(model, train_loader, optimizer, scheduler, scaler, device, epoch,
                                    amp_dtype=amp_dtype, channels_last=channels_last,
                                    log_every=cfg.train.log_every, global_step=global_step,
                                    world_size=world, logger=logger)
            global_step = train.pop("global_step")
            val = evaluate(model, val_loader, device, len(classes), amp_dtype=amp_dtype,
                           channels_last=channels_last, logger=logger)
            # Unreadable images met so far by any rank or loader worker (a collective: all ranks).
            val["bad_images"] = sync_bad_images(train_loader.dataset, val_loader.dataset)
            is_best = val["val_acc"] > best_acc
            best_acc = max(best_acc, val["val_acc"])
            save_error = None
            if main:
                state = ckpt.make_state(model, optimizer, scheduler, scaler, epoch + 1, global_step,
                                        best_acc, config_dict, classes)
                try:
                    ckpt.save_checkpoint(state, run_dir / "checkpoints", is_best, cfg.train.keep_last)
                except UserError as e:
                    save_error = e
            # Every rank joins this vote, so a failed save on rank 0 stops all ranks instead of
            # leaving them to wait in the next epoch's collectives.
            if any_rank(save_error is not None, device):
                raise save_error or UserError("rank 0 could not write its checkpoint; stopping",
                                              exit_code=RUNTIME_EXIT)
            metrics = {"epoch": epoch + 1, "step": global_step, **train, **val, "lr": lr,
                       "best_acc": best_acc, "epoch_seconds": time.perf_counter() - epoch_start}
            logger.epoch(metrics)
            logger.info(f"epoch {epoch + 1}/{cfg.train.epochs}  train_loss {train['train_loss']:.4f}  "
                        f"val_loss {val['val_loss']:.4f}  val_acc {val['val_acc']:.4f}  "
                        f"{train['img_per_s']:.0f} img/s  {metrics['epoch_seconds']:.1f}s")
    finally:
        logger.close()
    return {"best_acc": best_acc, "run_dir": str(run_dir), "last": metrics}
