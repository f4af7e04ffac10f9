"""The run around the loop: `fit` for train.py and the train_multi_gpu_*.py scripts.

The entry scripts build the device, the (wrapped) model and the loaders; `fit` does everything else
the same way for all four: the step (engine.build_step), resume, the start-up lines, the epochs
(engine.train_one_epoch, engine.evaluate), exact distributed evaluation, the best checkpoint and
early stop, pictures, logs, and --eval-only. What a user edits (the loss, the metrics, the step,
evaluation) is in engine.py.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from engine import EpochHooks, EvalSettings, Step, build_step, compute_settings, evaluate, is_multilabel, \
    sample_metrics, seed_for, train_one_epoch
from data import make_loader, unlabelled_set
import linear_probe
from utils import calibration
from utils import checkpoint as ckpt
from utils import figures, fsdp, param_groups, profiling, run_record
from utils import run_dir as run_files
from utils.cam import gallery_explainer
from utils.config import config_to_dict
from utils.data_wait import input_bound_hint
from utils.distributed_utils import DistInfo, any_rank, broadcast_object
from utils.errors import OUT_OF_MEMORY, UserError, nondeterministic_op, out_of_memory
from utils.metrics import classification_report, multilabel_report
from utils.optim import group_lrs, per_group_lrs, place_schedule
from utils.run_logger import RunLogger, check_run_dir, check_writable, resolve_run_dir, scalar_tag, write_json
from utils.samplers import ShardSampler
from utils.stop import StopRequest


# --------------------------------------------------------------------------- fit

def _done():
    done = threading.Event()
    done.set()
    return done


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
    cam_net: Optional[torch.nn.Module] = None  # the pictures' copy of the weights (_pictures)
    pictures_done: threading.Event = dataclasses.field(default_factory=_done)  # the last epoch's pictures are drawn
    profiled: bool = False                  # train.profile's epoch is done (the first this process trains)
    record: dict = dataclasses.field(default_factory=dict)  # utils/run_record.py's (complete on rank 0)


def fit(cfg, model, train_loader, val_loader, classes, dist_info: DistInfo, script_name):
    """Train for cfg.train.epochs, evaluating, logging and checkpointing after each epoch.

    `model` is what the script built: plain, DataParallel or DDP. Every rank calls fit; only rank 0 writes.
    Out of device memory anywhere in it (the EMA copy, the restore, an epoch, --eval-only) is one line.
    """
    try:
        return _fit(cfg, model, train_loader, val_loader, classes, dist_info, script_name)
    except OUT_OF_MEMORY as e:
        raise out_of_memory(e, cfg, dist_info, script_name) from e


def _fit(cfg, model, train_loader, val_loader, classes, dist_info, script_name):
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
    if cfg.train.linear_probe:  # a path of its own, read top to bottom in linear_probe.py
        return _linear_probe(cfg, model, train_loader, val_loader, classes, dist_info, run_dir,
                             resumed=resume_path is not None or restarted)
    step, layout = build_step(cfg, model, train_loader, classes, dist_info)  # refuses what the data refutes
    multilabel = is_multilabel(train_loader)
    names = best_metric_names(multilabel, len(classes), ema=step.ema is not None)
    metric, mode = resolve_best(cfg.train, multilabel, names)  # an unknown name stops here, before any training
    if is_main:
        check_run_dir(run_dir, resuming=resume_path is not None or cfg.resume == "auto" or restarted)
        check_writable(run_dir)
        ckpt.remove_stale_temps(run_files.checkpoints(run_dir))
    record = run_record.collect(cfg.data, {"train": train_loader.dataset, "val": val_loader.dataset}, classes,
                                dist_info)  # every rank: each names its host and GPU
    if step.teacher_info and record:  # train.teacher: its file and digest, not its weights, go with the run
        record["teacher"] = step.teacher_info
    run_state, notes = (ckpt.RunState(multilabel=multilabel), []) if resume_path is None else \
        _restore(cfg, state, step, layout, classes, dist_info)
    notes += [note for note in [run_record.data_note((state or {}).get("record", {}).get("data"),
                                                     record.get("data"))] if note]
    del state
    notes += [note for note in [run_state.follow(metric, mode)] if note]
    if metric != score_key(multilabel) or cfg.train.early_stop_patience:
        patience = cfg.train.early_stop_patience
        notes.append(f"best.pt follows {metric} ({mode})" + (f"; the run stops after {patience} epochs without "
                                                              "improvement" if patience else ""))
    logger = RunLogger(run_dir, enabled=is_main, start_epoch=run_state.epoch, start_step=run_state.global_step,
                       resuming=resume_path is not None or restarted or cfg.resume == "auto")
    saver = ckpt.Checkpointer(run_files.checkpoints(run_dir), step.net, step, config_to_dict(cfg), classes,
                              layout, cfg.train.keep_last, dist_info.rank, record=record,
                              background=logger.background, on_failure=lambda: run.stop.request())
    run = _Run(cfg, step, train_loader, val_loader, classes, dist_info, run_dir, logger, saver, None, run_state,
               record=record)
    _log_start(run, resume_path, notes)
    if step.teacher is not None:
        _log_teacher(run)
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
        saver.finish()  # the last epoch's checkpoint is on disk (every rank: its write is voted on)
        logger.info(done_lines(run_dir, run_state, dist_info))
    except OUT_OF_MEMORY:
        raise  # fit's one line
    except RuntimeError as e:  # train.deterministic met an op without a deterministic kernel: one line
        raise nondeterministic_op(e) or e
    finally:
        run.stop.uninstall()
        logger.close()
    return {best_key(run_state.best_metric): run_state.best_score, "best_metric": run_state.best_metric,
            "best_epoch": run_state.best_epoch, "early_stop": early_stop, "run_dir": str(run_dir), "last": metrics}


def _linear_probe(cfg, model, train_loader, val_loader, classes, dist_info, run_dir, resumed):
    """train.linear_probe: the run directory, its logs and record around linear_probe.probe, which encodes
    (or reads) the features, trains one head per optim.lr and writes best.pt and last.pt."""
    multilabel = is_multilabel(val_loader)
    metric, mode = resolve_best(cfg.train, multilabel, linear_probe.METRICS[multilabel])  # before any work
    if dist_info.rank == 0:
        check_run_dir(run_dir, resuming=resumed or cfg.resume == "auto")
        check_writable(run_dir)
    record = run_record.collect(cfg.data, {"train": train_loader.dataset, "val": val_loader.dataset}, classes,
                                dist_info)
    run_state = ckpt.RunState(multilabel=multilabel, best_metric=metric, best_mode=mode)
    logger = RunLogger(run_dir, enabled=dist_info.rank == 0, resuming=resumed or cfg.resume == "auto")
    try:
        logger.write_config(cfg)
        logger.write_json(run_files.CLASSES, {str(i): c for i, c in enumerate(classes)})
        logger.write_json(run_files.RECORD, record)
        if not resumed:  # the config beside the headline numbers in TensorBoard's HParams (a sweep's view)
            logger.hparams(config_to_dict(cfg), [scalar_tag(best_key(metric)), "val/loss", "train/loss"])
        logger.info(f"run directory: {run_dir}")
        logger.info(f"{len(train_loader.dataset)} train / {len(val_loader.dataset)} val images, {len(classes)} "
                    f"classes, {dist_info.world_size} process(es) on {dist_info.device}, linear probe of "
                    f"{cfg.model.name}, lr {cfg.optim.lr}")
        linear_probe.probe(cfg, model, train_loader, val_loader, classes, dist_info, run_dir, logger, run_state,
                           resumed, record)
        logger.info(done_lines(run_dir, run_state, dist_info))
    finally:
        logger.close()
    return {best_key(metric): run_state.best_score, "best_metric": metric, "best_epoch": run_state.best_epoch,
            "early_stop": False, "run_dir": str(run_dir), "last": {}}


def _restore(cfg, state, step, layout, classes, dist_info):
    """The checkpoint's weights, optimizer, schedule, scaler and EMA into the step; its RunState, and
    notes on what differs from this run (world size, epochs, a missing EMA)."""
    if bool(state.get("multilabel")) != step.criterion.multilabel:
        task = {True: "multi-label", False: "single-label"}
        raise UserError(f"checkpoint is of a {task[bool(state.get('multilabel'))]} run, the data is "
                        f"{task[step.criterion.multilabel]} (data.task); resume with the same task, or start "
                        "from its weights with --weights", every_rank=True)
    run_state = ckpt.restore(state, step.net, step.optimizer, step.scheduler, step.scaler, classes,
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
        # Another world size (an elastic restart), batch size or accum_steps: the schedule continues in this run's steps,
        # from the epoch's start or, mid-epoch, from as many of them as the images already trained in it make.
        done = resume_at["start"] // (cfg.train.batch_size * dist_info.world_size * step.accum_steps) if resume_at \
            else 0
        run_state.global_step = run_state.epoch * steps + min(done, steps)
        place_schedule(step.scheduler, cfg.optim, dist_info.world_size, their_epochs or cfg.train.epochs, steps,
                       run_state.global_step, global_batch=cfg.train.global_batch,
                       unfreeze=(cfg.train.unfreeze_at, cfg.train.unfreeze_warmup))
        notes.append(f"note: the checkpoint has {their_steps} steps per epoch, this run {steps} "
                     f"({dist_info.world_size} process(es)): the lr schedule continues from epoch {run_state.epoch + 1}'s "
                     + (f"step {min(done, steps)}" if resume_at else "start") + " in this run's steps")
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
    cost = profiling.model_cost(step.net, cfg.data.img_size, cfg.data.channels)  # meta device: ms
    if resume_path is None:
        logger.write_config(cfg)
        logger.write_json(run_files.CLASSES, {str(i): c for i, c in enumerate(run.classes)})
        # The headline number, the best of train.best_metric (val/best_acc by default; val/best_loss ...), and more.
        logger.hparams({**config_to_dict(cfg), **cost}, [scalar_tag(score_key(step.criterion.multilabel)),
                       scalar_tag(best_key(run_state.best_metric)), "val/macro_f1", "val/loss", "train/loss"])
    _write_record(run, resume_path is not None)
    logger.write_json(run_files.PARAM_GROUPS, param_groups.table(step.net, step.optimizer))
    resume_at = run_state.resume_at
    where = f"epoch {run_state.epoch + 1}"
    if resume_at and resume_at["epoch_step"]:
        where += f" after its step {resume_at['epoch_step']}"
    elif resume_at:  # an elastic restart: the epoch goes on from the first image no process has trained
        where += f" at image {resume_at['start'] + 1} of its order"
    logger.info(f"run directory: {run.run_dir}" + (f" (resumed from {resume_path} at {where}, global step "
                                                     f"{run_state.global_step})" if resume_path else ""))
    if cfg.train.amp in ("bf16", "fp16") and step.amp_dtype is None:
        notes.append(f"note: train.amp={cfg.train.amp} applies on CUDA only; this {device.type} run computes in fp32")
    for note in notes:
        logger.info(note)
    logger.info(f"{len(run.train_loader.dataset)} train / {len(run.val_loader.dataset)} val images, "
                f"{len(run.classes)} classes, {run.dist_info.world_size} process(es) on {device}, "
                f"lr {_head_group(step.optimizer)['initial_lr']:.4g}, amp {step.amp_dtype or 'off'}"
                + (f", {step.accum_steps} batches per step" if step.accum_steps > 1 else "")
                + (f", global batch {cfg.train.global_batch}" if cfg.train.global_batch else "")
                + (", deterministic" if cfg.train.deterministic else ""))
    logger.info(profiling.cost_line(cost, cfg.data.img_size))
    weight, pos_weight = step.criterion.class_weight, step.criterion.pos_weight
    if weight is not None:
        logger.info("class weights: " + ", ".join(f"{c} {w:.3g}" for c, w in zip(run.classes, weight.tolist())))
    if pos_weight is not None:
        logger.info("pos_weight: " + ", ".join(f"{c} {w:.3g}" for c, w in zip(run.classes, pos_weight.tolist())))


def _log_teacher(run):
    """train.teacher's own validation score, once at the start (every rank evaluates its shard)."""
    step, key = run.step, score_key(run.run_state.multilabel)
    val = evaluate(step.teacher, run.val_loader, step.device, len(run.classes), step, logger=run.logger)
    info = step.teacher_info
    run.logger.info(f"teacher {info['source']} (sha256 {info['sha256'][:12]}): {key} {val[key]:.4f}; "
                    f"distilled with kd_alpha {step.kd_alpha:g}, kd_temperature {step.kd_temperature:g}")


def _head_group(optimizer):
    """The head's group (optim.head_lr_scale's), else the first: whose peak lr the start line names."""
    return next((g for g in optimizer.param_groups if g.get("head")), optimizer.param_groups[0])


def _write_record(run, resumed):
    """run_record.json: this start's record on top; a resumed run keeps the earlier starts' under "earlier"."""
    if not run.logger.enabled:
        return
    path = run.run_dir / run_files.RECORD
    record = dict(run.record)
    if resumed and path.exists():
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError):
            before = {}  # a hand-damaged file: this start's record replaces it
        if before:
            record["earlier"] = before.pop("earlier", []) + [before]
    run.logger.write_json(run_files.RECORD, record)


def _train_epoch(run, epoch):
    """One epoch: train, evaluate (and the EMA), choose the best, checkpoint, pictures, metrics."""
    cfg, run_state, stop = run.cfg, run.run_state, run.stop
    epoch_start = time.perf_counter()
    order_start = run_state.resume_at["start"] if run_state.resume_at else 0  # after an elastic restart: > 0
    if order_start:
        run.train_loader.sampler.set_epoch(epoch, order_start)
    else:
        run.train_loader.sampler.set_epoch(epoch)
    torch.manual_seed(seed_for(cfg.train.seed, epoch, run.dist_info.rank))
    run.train_loader.generator.manual_seed(seed_for(cfg.train.seed, epoch, run.dist_info.rank))
    lr, lowest = group_lrs(run.step.optimizer)  # the head's and the lowest group's, at the epoch's start
    if run_state.resume_at:  # mid-epoch: the lrs of the epoch's first step, from each group's schedule
        sched = run.step.scheduler
        start = run_state.global_step - run_state.resume_at["epoch_step"] // run.step.accum_steps
        lrs = [base * shape(start) for base, shape in zip(sched.base_lrs, sched.lr_lambdas)]
        lr, lowest = run_state.resume_at["lr"], min(lrs)
    per_group = per_group_lrs(run.step.optimizer)

    def save_step(epoch_step, global_step, loss_sum, images_seen):
        run.saver.save(dataclasses.replace(run_state, global_step=global_step), epoch_step=epoch_step,
                       loss_sum=loss_sum, images_seen=images_seen, epoch_lr=lr, epoch_start=order_start)

    first_batch = None
    if epoch == 0 and cfg.train.figures:
        def first_batch(images, labels, at_step=run_state.global_step):
            if run.logger.enabled:  # drawn on the logger's thread, from a copy: the step goes on with the batch
                run.logger.later(figures.sample_picture, run.logger, images[:16].clone(), labels[:16].clone(),
                                 run.classes, run.train_loader.dataset, at_step)
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
    ema = "_ema" if run_state.best_weights == "ema" else ""  # the weights a checkpoint's user loads (best_weights)
    if run_state.multilabel:
        run_state.thresholds = val[f"val_threshold{ema}"]
    else:  # their temperature and rejection threshold, fitted on val (utils/calibration.py)
        run_state.temperature, run_state.reject_threshold = val[f"val_temperature{ema}"], val[f"val_reject_threshold{ema}"]
    run_state.epoch = epoch + 1
    run.saver.save(run_state, is_best=is_best, wait=False)  # written beside the next epoch
    key = score_key(run_state.multilabel)
    pictures, figure_seconds = _pictures(run, val, worst, pr) if cfg.train.figures else (None, 0.0)
    metrics = {"epoch": epoch + 1, "step": run_state.global_step, **train, **val, "lr": lr,
               **({"lr_lowest": lowest} if per_group else {}),
               best_key(run_state.best_metric): run_state.best_score,
               **({"best_weights": run_state.best_weights} if run.step.ema is not None else {}),
               "figure_seconds": figure_seconds, "epoch_seconds": time.perf_counter() - epoch_start}
    run.logger.epoch(metrics, run.classes)
    if pictures is not None:  # after the epoch's line: a picture never holds up metrics.jsonl
        run.pictures_done = run.logger.later(*pictures)
    run.logger.info(f"epoch {epoch + 1}/{cfg.train.epochs}  train_loss {train['train_loss']:.4f}  "
                    f"val_loss {val['val_loss']:.4f}  {key} {val[key]:.4f}  "
                    + (f"val_macro_f1 {val['val_macro_f1']:.4f}  " if run_state.multilabel else "")
                    + (f"{key}_ema {val[key + '_ema']:.4f}  " if run.step.ema is not None else "")
                    + (f"lr {lr:.3g} (lowest group {lowest:.3g})  " if per_group else "")
                    + f"{train['img_per_s']:.0f} img/s  {metrics['epoch_seconds']:.1f}s")
    if end.input_bound and not run.hinted:
        run.hinted = True
        run.logger.info(input_bound_hint(train["train_data_wait"], epoch, run.train_loader))
    # A signal that came during evaluation: the epoch's checkpoint is written first (finish: every rank).
    # any_rank gives every rank the same answer, so all of them take this branch or none.
    stopping = epoch + 1 < cfg.train.epochs and any_rank(stop.requested(), run.dist_info.device)
    if stopping:
        run.saver.finish()
        _raise_stopped(stop, f"after epoch {epoch + 1}", run_state.global_step, run.run_dir, run.dist_info)
    return metrics


# The validation numbers evaluated for the EMA too (as <name>_ema), single-label and multi-label.
EMA_METRICS = {False: ("val_loss", "val_acc", "val_macro_f1", "val_temperature", "val_reject_threshold"),
               True: ("val_loss", "val_map", "val_macro_f1", "val_threshold")}


def _validate(run):
    """The epoch's validation metrics (and the EMA's beside them), its worst mistakes (or None) and,
    multi-label, every image's (probabilities, targets) for the precision-recall curves (or None)."""
    step, cfg = run.step, run.cfg
    thresholds = {"threshold": cfg.eval.threshold, "tune_thresholds": cfg.eval.tune_thresholds}
    val = evaluate(step.model, run.val_loader, step.device, len(run.classes), step, logger=run.logger,
                   worst_k=cfg.train.worst_images if cfg.train.figures else 0, **thresholds)
    worst, pr = val.pop("val_worst", None), val.pop("val_pr", None)
    val.pop("val_reliability", None)  # eval-only's picture; metrics.jsonl keeps the two ECEs
    if step.ema is not None:  # the average's own evaluation, beside the raw weights'
        averaged = evaluate(step.ema.module, run.val_loader, step.device, len(run.classes), step, logger=run.logger,
                            **thresholds)
        val.update({f"{k}_ema": averaged[k] for k in EMA_METRICS[run.run_state.multilabel]})
    # Unreadable images met so far by any rank or loader worker (a collective: all ranks).
    val["bad_images"] = sum(ds.sync_bad_images() for ds in (run.train_loader.dataset, run.val_loader.dataset)
                            if hasattr(ds, "sync_bad_images"))
    return val, worst, pr


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


def done_lines(run_dir, run_state, dist_info, argv=None):
    """The run's last lines: where best.pt is, its score and epoch, and the commands that use it next."""
    best = run_files.best(run_dir)
    if not run_state.best_epoch:  # train.epochs reached before this process validated anything
        return f"done: no epoch validated, no best.pt in {best.parent}"
    weights = " (EMA weights)" if run_state.best_weights == "ema" else ""
    run = shlex.quote(str(run_dir))
    evaluate = ckpt.resume_command(run_dir, dist_info.world_size, dist_info.local_world_size, argv,
                                   resume=best, flags=("--eval-only",))
    return "\n".join([
        f"done: best.pt is epoch {run_state.best_epoch}'s{weights}, {run_state.best_metric} "
        f"{run_state.best_score:.4f}: {best}",
        f"  predict:  python predict.py {run} IMAGES",
        f"  evaluate: {evaluate}",
        f"  export:   python export.py {run} --format onnx"])


# --------------------------------------------------------------------------- an epoch's ends

def _raise_stopped(stop, where, global_step, run_dir, dist_info):
    """End the run after a stop request's checkpoint: one line on rank 0, 128+signal everywhere."""
    if dist_info.rank != 0:
        raise SystemExit(stop.exit_code)
    command = ckpt.resume_command(run_dir, dist_info.world_size, dist_info.local_world_size)
    raise UserError(f"stopped by {stop.name} {where}, global step {global_step}; "
                    f"{run_files.last(run_dir)} is saved. Resume with: {command}",
                    exit_code=stop.exit_code)


def _pictures(run, val, worst, pr):
    """The epoch's pictures (utils/figures.py), to be drawn on the logger's thread beside the next epoch,
    rank 0 only: (the job for RunLogger.later or None, the seconds this epoch spent on them). Their
    Grad-CAM maps come from a copy of this epoch's weights (one more copy of the model on rank 0's
    device), as the training goes on with the model meanwhile. The seconds: the wait for the last
    epoch's pictures (so at most one epoch's are pending) and the copy."""
    if not run.logger.enabled:
        return None, 0.0
    start = time.perf_counter()
    run.pictures_done.wait()
    cam = None
    if worst and not fsdp.is_sharded(run.step.net):
        if run.cam_net is None:
            run.cam_net = copy.deepcopy(run.step.net)
        run.cam_net.load_state_dict(run.step.net.state_dict())
        cam = _gallery_cam(run.cam_net, run.cfg)
    job = (_on_device, run.step.device, figures.epoch_pictures, run.logger, val, worst, run.classes,
           run.val_loader.dataset, run.run_state.global_step, pr, cam)
    return job, round(time.perf_counter() - start, 4)


def _on_device(device, fn, *args):
    """fn(*args) with the run's CUDA device current: a new thread's is cuda:0, whatever train.device says."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return fn(*args)


def _gallery_cam(net, cfg):
    """The worst mistakes' Grad-CAM (utils/cam.py) on rank 0: the bare network's forward and backward
    (Step.net), so DDP's hooks and collectives stay out; FSDP's sharded model gets none."""
    return gallery_explainer(net, cfg.model.cam_layer, sharded=fsdp.is_sharded(net))


# --------------------------------------------------------------------------- the best checkpoint's metric

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


# --------------------------------------------------------------------------- --eval-only

def evaluate_only(cfg, model, val_loader, classes, dist_info, run_dir, resume_path, state=None):
    """--eval-only: the checkpoint's (or --weights') model on the validation split, or on test/
    when the data root has one; rank 0 writes eval.json (evaluate's own keys) and two pictures.
    Multi-label: at the checkpoint's thresholds (eval.threshold for --weights, or tuned on this split
    with eval.tune_thresholds), eval.json with a per-label table ("labels"). Single-label: ECE before and
    after the checkpoint's temperature (fitted on val by the run; on this split for a checkpoint without
    one), and with eval.ood (--ood DIR) those images' out-of-distribution scores against this split ("ood")."""
    device, multilabel, net = dist_info.device, is_multilabel(val_loader), ckpt.unwrap(model)
    if resume_path is None and not cfg.model.weights:  # load_config refused neither; --resume auto found nothing
        raise UserError(f"--eval-only --resume {cfg.resume} found no checkpoint in '{run_dir}'; pass "
                        "--resume CHECKPOINT or --weights FILE", every_rank=True)
    source, thresholds, temperature, reject = str(resume_path or cfg.model.weights), None, None, None
    if resume_path is not None:
        state = state or ckpt.load_checkpoint(resume_path, map_location="cpu")
        ckpt.check_compatible(state, model, classes, model_name=cfg.model.name)
        theirs, thresholds = ckpt.label_task(state)
        temperature, reject = ckpt.calibration_of(state)
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
    settings = EvalSettings(*compute_settings(cfg, device, multilabel=multilabel))
    val = evaluate(model, val_loader, device, len(classes), settings,
                   worst_k=cfg.train.worst_images, threshold=thresholds or cfg.eval.threshold,
                   tune_thresholds=cfg.eval.tune_thresholds, temperature=temperature, keep_scores=bool(cfg.eval.ood))
    val.pop("val_seconds")
    val.pop("val_pr", None)
    known = val.pop("val_scores", None)
    ood = tta = None
    if cfg.eval.tta != "none":  # the same images again, each with its views averaged (every rank)
        again = evaluate(model, val_loader, device, len(classes), settings, threshold=thresholds or cfg.eval.threshold,
                         tune_thresholds=cfg.eval.tune_thresholds, temperature=val.get("val_temperature"),
                         tta=cfg.eval.tta)
        tta = {"views": cfg.eval.tta, **{k: again[k] for k in ("val_acc", "val_loss", "val_macro_f1", "val_map",
                                                                "val_ece", "val_ece_calibrated") if k in again}}
    if not multilabel:
        val["temperature_from"] = "checkpoint" if temperature is not None else "fitted here"
        if cfg.eval.ood:  # every rank: the scores are gathered
            reject = reject if reject is not None else val["val_reject_threshold"]
            ood = _ood_scores(cfg, model, val_loader, len(classes), settings, dist_info, val["val_temperature"],
                              known, reject)
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
              **profiling.model_cost(net, cfg.data.img_size, cfg.data.channels), **val,
              **({"ood": ood} if ood is not None else {}), **({"tta": tta} if tta is not None else {})}
    if dist_info.rank == 0:
        if multilabel:
            figures.save_png(figures.f1_bars_image(val["val_f1"], classes), run_dir / run_files.F1_BARS_PNG)
        else:
            figures.save_png(figures.confusion_matrix_image(val["val_confusion"], classes),
                             run_dir / run_files.CONFUSION_PNG)
            figures.save_png(figures.reliability_image(val["val_reliability"], val["val_temperature"]),
                             run_dir / run_files.RELIABILITY_PNG)
        if cfg.train.worst_images:
            cam = _gallery_cam(net, cfg) if val["val_worst"] else None
            figures.save_png(figures.worst_picture(val["val_worst"], classes, val_loader.dataset, cam),
                             run_dir / run_files.WORST_PNG)
        write_json(run_dir / run_files.EVAL, result)
        if multilabel:
            scores = (f"mAP {val['val_map']:.4f}  micro-F1 {val['val_micro_f1']:.4f}  "
                      f"exact match {val['val_exact_match']:.4f}")
        else:
            top5 = f"  top-5 {val['val_top5']:.4f}" if "val_top5" in val else ""
            scores = f"accuracy {val['val_acc']:.4f}{top5}"
        print(f"eval-only: {source} on {split}: {val['val_count']} images  {scores}  "
              f"macro-F1 {val['val_macro_f1']:.4f}  -> {run_dir / 'eval.json'}", flush=True)
        if not multilabel:
            print(f"calibration: ECE {val['val_ece']:.4f} -> {val['val_ece_calibrated']:.4f} at temperature "
                  f"{val['val_temperature']:.3f} ({val['temperature_from']})", flush=True)
        if tta is not None:
            key = "val_map" if multilabel else "val_acc"
            print(f"tta ({tta['views']}): {key} {val[key]:.4f} -> {tta[key]:.4f}", flush=True)
        if ood is not None:
            mp, en = ood["max_prob"], ood["energy"]
            print(f"ood: {ood['images']} images of no class vs {ood['known_images']} of {split}: max-prob AUROC "
                  f"{mp['auroc']:.4f}, FPR at 95% TPR {mp['fpr_at_95_tpr']:.4f}, {mp['rejected']:.1%} rejected "
                  f"under {mp['reject_threshold']:.3f}; energy AUROC {en['auroc']:.4f}, FPR at 95% TPR "
                  f"{en['fpr_at_95_tpr']:.4f}", flush=True)
    return {best_key(metric): val.get(metric), "best_metric": metric, "run_dir": str(run_dir), "last": result}


def _ood_scores(cfg, model, val_loader, num_classes, settings, dist_info, temperature, known, reject):
    """eval.json's "ood": the images of eval.ood, read and sharded as validation is, scored at `temperature`
    against the known images' scores (utils/calibration.py's ood_report). Called by every rank."""
    unknown_set = unlabelled_set(cfg.eval.ood, val_loader.dataset)
    loader = make_loader(unknown_set, cfg.train.batch_size, ShardSampler(unknown_set, dist_info.world_size, dist_info.rank),
                         cfg.data, dist_info.device, train=False, channels_last=cfg.model.channels_last)
    unknown = evaluate(model, loader, dist_info.device, num_classes, settings, temperature=temperature, keep_scores=True)
    return calibration.ood_report(known, unknown["val_scores"], reject)


# The per-label columns of a multi-label eval.json's table ("labels"), each a val_* list of evaluate's.
PER_LABEL = ("precision", "recall", "f1", "ap", "threshold", "positives")
