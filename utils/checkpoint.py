"""Checkpoints: what a run needs to continue exactly, written atomically by rank 0.

    <run>/checkpoints/last.pt        after every epoch, every train.save_every_steps steps, and on SIGTERM/SIGINT
    <run>/checkpoints/best.pt        on a new best of train.best_metric (validation accuracy by default)
    <run>/checkpoints/epoch_NNN.pt   the last train.keep_last epochs, if > 0

    python train.py --output-dir runs/a --resume auto      # continue runs/a (or start it)
    python train.py --output-dir runs/b --resume runs/a/checkpoints/epoch_002.pt

A checkpoint holds the unwrapped weights, optimizer, schedule, GradScaler,
epoch, global step, best score, resolved config, class names, the data
layout (seed, world size, batch size: the per-epoch order is a function of
these), and per rank the random states (Python, NumPy, torch CPU and CUDA)
plus, for a checkpoint written mid-epoch, the steps already done in that epoch
and their loss sums, so a resumed run ends bit-for-bit where an uninterrupted
one would. With train.ema_decay it also holds the EMA of the weights ("ema"),
and "best_weights" says which of the two scored best. "best_score" is the best value of
"best_metric" (train.best_metric, "best_mode" max or min) at epoch "best_epoch", and "bad_epochs"
the epochs since without improvement, so train.early_stop_patience stops a resumed run where an
uninterrupted one stops. A multi-label run's checkpoints say so
("multilabel") and hold each label's threshold ("thresholds"), which predict.py and export.py use.

A save goes to a temporary file in the same directory, is fsynced and renamed
over the old one, so a process killed mid-write leaves the previous checkpoint
intact. An epoch's checkpoint is written on rank 0's logger thread from a copy of its tensors,
beside the next epoch (Checkpointer); every other save waits for it and is written at once, and
metrics.jsonl gets the epoch's line only once its checkpoint is on disk. Loads use weights_only=True: a file that carries pickled code is refused.
"""
import os
import random
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from utils import run_dir as run_files
from utils.distributed_utils import any_rank, broadcast_object, gather_objects
from utils.errors import RUNTIME_EXIT, UserError
from utils.fsdp import full_state_dict, is_sharded, load_full_state_dict, load_sharded, remove_sharded, save_sharded
from utils.optim import load_optimizer_state


def unwrap(model):
    """The bare nn.Module under DataParallel / DDP / torch.compile."""
    while True:
        if hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def strip_wrapper_prefixes(state_dict):
    """Keys saved from DataParallel/DDP ('module.') or torch.compile ('_orig_mod.') -> plain keys."""
    out = {}
    for key, value in state_dict.items():
        for prefix in ("module.", "_orig_mod."):
            while key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out


def rng_state():
    state = {
        "python": random.getstate(),
        "numpy": [x.tolist() if isinstance(x, np.ndarray) else x for x in np.random.get_state()],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    np_state = list(state["numpy"])
    np_state[1] = np.array(np_state[1], dtype=np.uint32)
    np.random.set_state(tuple(np_state))
    # .cpu(): the checkpoint was loaded with map_location=<this rank's GPU>, RNG states must be CPU bytes.
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def remove_stale_temps(ckpt_dir):
    """Temp files left by a process killed mid-save; the renamed checkpoints are untouched."""
    for tmp in Path(ckpt_dir).glob(".*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def atomic_save(obj, path):
    """torch.save to a temp file beside `path`, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_link(src, dst):
    """Make `dst` hold what `src` holds now: a hard link (no second copy on disk; the next
    atomic_save of `src` renames a new file over it and leaves `dst` as it was), or a copy
    where the filesystem has no hard links."""
    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        os.unlink(tmp)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# What a checkpoint's best_acc holds (the only best before train.best_metric), per task (multi-label or not).
BEST_ACC_METRIC = {False: "val_acc", True: "val_map"}


@dataclass
class RunState:
    """Where a run stands, in one place: what every epoch moves on, every checkpoint saves (make_state)
    and a resume restores (restore)."""
    epoch: int = 0                      # epochs finished: the next one to train
    global_step: int = 0                # optimizer steps taken
    best_score: Optional[float] = None  # the best value of best_metric so far; None before the first evaluation
    best_weights: str = "model"         # which weights scored best_score: "model", or "ema" (train.ema_decay)
    multilabel: bool = False            # the data's task: sigmoid outputs, one threshold per label
    thresholds: Optional[list] = None   # multi-label: each label's threshold, of the last evaluation
    temperature: Optional[float] = None  # single-label: the softmax temperature fitted on val (utils/calibration.py)
    reject_threshold: Optional[float] = None  # single-label: the calibrated top probability keeping 95% of val
    best_metric: str = ""               # what best.pt follows (train.best_metric): val_acc, val_loss, ...
    best_mode: str = "max"              # "max" or "min": which way best_metric improves (train.best_mode)
    best_epoch: int = 0                 # the epoch (1-based) that scored best_score; 0 = none or not recorded
    bad_epochs: int = 0                 # epochs since then without a strict improvement (train.early_stop_patience)
    resume_at: Optional[dict] = None    # not saved: a mid-epoch checkpoint's point in its epoch (resume_point)

    def saved(self):
        # best_acc, the old name, only where it still means what it meant: val_acc (val_map multi-label), max.
        old = self.best_metric == BEST_ACC_METRIC[self.multilabel] and self.best_mode == "max"
        return {"epoch": self.epoch, "global_step": self.global_step, "best_score": self.best_score,
                "best_metric": self.best_metric, "best_mode": self.best_mode, "best_epoch": self.best_epoch,
                "bad_epochs": self.bad_epochs, "best_weights": self.best_weights, "multilabel": self.multilabel,
                **({"best_acc": self.best_score} if old else {}),
                **({"thresholds": self.thresholds} if self.multilabel else {}),
                **({"temperature": self.temperature, "reject_threshold": self.reject_threshold}
                   if not self.multilabel and self.temperature is not None else {})}

    @classmethod
    def of(cls, state):
        """A checkpoint's run state. Older layouts: best_weights "model" before the EMA existed, single-label
        before multi-label, and before train.best_metric a best_acc of val_acc (val_map multi-label), max."""
        multilabel = bool(state.get("multilabel", False))
        score = state["best_score"] if "best_score" in state else state["best_acc"]
        return cls(state["epoch"], state["global_step"], score, state.get("best_weights", "model"), multilabel,
                   state.get("thresholds"), best_metric=state.get("best_metric", BEST_ACC_METRIC[multilabel]),
                   best_mode=state.get("best_mode", "max"), best_epoch=state.get("best_epoch", 0),
                   bad_epochs=state.get("bad_epochs", 0), temperature=state.get("temperature"),
                   reject_threshold=state.get("reject_threshold"))

    def better(self, score, than):
        """Whether `score` strictly improves on `than` (None: nothing yet) in best_mode."""
        return than is None or (score > than if self.best_mode == "max" else score < than)

    def follow(self, metric, mode):
        """Make best.pt follow `metric` in `mode`. A checkpoint that followed another restarts its best and
        its early-stop count from here; returns the note that says so (None when nothing changes)."""
        if (self.best_metric, self.best_mode) == (metric, mode):
            return None
        note = (f"note: the checkpoint's best.pt followed {self.best_metric} ({self.best_mode}), this run follows "
                f"{metric} ({mode}): the best and the early-stop count restart") if self.best_metric else None
        self.best_metric, self.best_mode, self.best_score, self.best_epoch, self.bad_epochs = metric, mode, None, 0, 0
        return note


def calibration_of(state):
    """(temperature, rejection threshold) of a single-label checkpoint: those fitted on val by the run,
    (None, None) for a checkpoint written before (or a multi-label one)."""
    if state.get("multilabel", False):
        return None, None
    return state.get("temperature"), state.get("reject_threshold")


def label_task(state):
    """(multilabel, thresholds or None) of a checkpoint: how its outputs are read (predict, export, eval).
    A multi-label checkpoint written before its first evaluation has its config's eval.threshold for each label."""
    if not state.get("multilabel", False):
        return False, None
    thresholds = state.get("thresholds")
    if thresholds is None:
        threshold = float(((state.get("config") or {}).get("eval") or {}).get("threshold", 0.5))
        thresholds = [threshold] * len(state.get("classes") or [])
    return True, list(thresholds)


def make_state(model, optimizer, scheduler, scaler, run_state, config, classes, ranks=None, epoch_step=0,
               epoch_lr=None, data=None, ema=None, sharded=None, record=None, epoch_start=0):
    """The checkpoint dict of `run_state` (a RunState). `ranks[r]` is rank r's {"rng", "loss_sum", "images_seen"}
    (distributed_utils.gather_objects); `epoch_step` > 0 marks a checkpoint written mid-epoch, its loader batches
    counted from position `epoch_start` of the epoch's order (utils.samplers.ShuffleSampler). With an EMA
    (utils.optim.WeightEMA) its weights are kept under "ema". `model` may be a state dict already (FSDP's
    full weights); `sharded` names the directory holding an FSDP run's model and optimizer shards."""
    extra = {"ema": strip_wrapper_prefixes(ema.module.state_dict())} if ema is not None else {}
    extra.update({"sharded": sharded} if sharded else {})
    return {**extra,
        "model": strip_wrapper_prefixes(model if isinstance(model, dict) else unwrap(model).state_dict()),
        "optimizer": {} if sharded else optimizer.state_dict(),  # FSDP's is in the shards
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        **run_state.saved(),            # epoch: epochs completed, a resumed run starts at this index
        "epoch_step": epoch_step,       # loader batches of epoch `epoch` already trained (0: at an epoch boundary)
        "epoch_start": epoch_start,     # ... from this position of the epoch's order (an elastic restart's)
        "epoch_lr": epoch_lr,           # lr at the start of that epoch, for its metrics line
        "config": config,
        "classes": list(classes),
        "data": data or {},             # seed, world_size, batch_size, steps_per_epoch: the data order
        "ranks": ranks if ranks is not None else [{"rng": rng_state()}],
        "record": record or {},         # utils/run_record.py: versions, GPUs, command, git commit, data digest
    }


def save_checkpoint(state, ckpt_dir, is_best, keep_last=0):
    """Write last.pt (and best.pt, epoch_NNN.pt); a failed write stops the run, old files intact."""
    ckpt_dir = Path(ckpt_dir)
    try:
        last = ckpt_dir / run_files.LAST
        atomic_save(state, last)
        if is_best:
            atomic_link(last, ckpt_dir / run_files.BEST)
        if keep_last > 0:
            atomic_link(last, run_files.epoch_checkpoint(ckpt_dir, state["epoch"]))
            for old in run_files.epoch_checkpoints(ckpt_dir)[:-keep_last]:
                old.unlink()
    except OSError as e:
        raise UserError(f"could not write checkpoint in '{ckpt_dir}': {e.strerror or e}; the previous "
                        "checkpoint is intact (free space or fix permissions, then resume)",
                        exit_code=RUNTIME_EXIT)


def find_resume_path(resume, run_dir, restarted=False):
    """--resume PATH or 'auto' (run_dir/checkpoints/last.pt, None when there is none yet).

    `restarted`: torchrun restarted the workers (TORCHELASTIC_RESTART_COUNT > 0);
    the newest save of this run directory wins over whatever --resume said.
    """
    last = run_files.last(run_dir)
    if restarted and last.is_file():
        return last
    if resume is None:
        return None
    if resume == "auto":
        return last if last.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise UserError(f"--resume '{path}' does not exist (use --resume auto to start fresh when absent)")
    return path


def agree_resume(resume, run_dir, restarted, rank):
    """(path, state) of the checkpoint to continue from, the same on every rank; (None, None) for none.

    Rank 0 alone looks for it and reads it, then broadcasts it: the nodes need not share
    a filesystem, and a node whose run directory is empty resumes rank 0's state. An
    error (a missing --resume file, a corrupt checkpoint) is rank 0's, raised on every
    rank. Called by every rank (one broadcast).
    """
    found = None
    if rank == 0:
        try:
            path = find_resume_path(resume, run_dir, restarted)
            found = ("ok", path, load_checkpoint(path, map_location="cpu") if path else None)
        except UserError as e:
            found = ("error", str(e), e.exit_code)
    kind, a, b = broadcast_object(found)
    if kind == "error":
        raise UserError(a, exit_code=b, every_rank=True)
    return a, b


def load_checkpoint(path, map_location):
    """weights_only=True: tensors and plain containers only; a pickled callable is refused, never run."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - corrupt file, foreign pickle, ...: all the file's fault
        raise UserError(f"cannot load checkpoint '{path}': {str(e).strip().splitlines()[0]}")
    if not isinstance(state, dict) or not {"model", "optimizer", "epoch"} <= set(state):
        raise UserError(f"'{path}' is not a training checkpoint of this template "
                        "(for a plain weights file use --weights)")
    if state.get("sharded"):  # an FSDP run's shards: a directory beside the file
        state["sharded"] = str(Path(path).parent / state["sharded"])
    return state


def check_compatible(state, model, classes, model_name=None):
    """Refuse a checkpoint of another class list or architecture, saying what differs. Every rank
    checks the same state (agree_resume hands rank 0's to all), so rank 0 alone prints the refusal."""
    theirs_classes = list(state.get("classes", classes))
    if theirs_classes != list(classes):
        raise UserError(f"checkpoint has {len(theirs_classes)} classes {theirs_classes}, the data has "
                        f"{len(classes)} {list(classes)}; resume needs the same class folders", every_rank=True)
    theirs_name = (state.get("config") or {}).get("model", {}).get("name")
    if model_name and theirs_name and theirs_name != model_name:
        raise UserError(f"checkpoint is a {theirs_name}, this run builds a {model_name} (model.name); "
                        f"resume with model.name={theirs_name}, or start from its weights with --weights",
                        every_rank=True)
    own = unwrap(model).state_dict()
    theirs = state["model"]
    diff = sorted(set(own) ^ set(theirs))
    shapes = [k for k in own if k in theirs and own[k].shape != theirs[k].shape]
    if diff or shapes:
        what = f"{len(diff)} tensor names differ, e.g. {diff[:2]}" if diff else \
            f"tensor shapes differ, e.g. {shapes[0]} {tuple(theirs[shapes[0]].shape)} vs {tuple(own[shapes[0]].shape)}"
        raise UserError(f"checkpoint is for another model: {what}", every_rank=True)


def best_weights(state):
    """The weights that made a checkpoint's best score: its EMA where that scored best
    (train.ema_decay, "best_weights": "ema"), else its model's."""
    ema = state.get("ema")
    return ema if isinstance(ema, dict) and ema and state.get("best_weights") == "ema" else state["model"]


def restore(state, model, optimizer, scheduler, scaler, classes, model_name=None, ema=None):
    """Load a full checkpoint into the run's objects; refuse one of another model or class list.
    `ema` (a WeightEMA) gets the checkpoint's average, or, if it holds none, restarts from its weights.

    The scheduler's state includes its schedule (WarmupCosine's total steps), so
    a resumed run keeps the schedule it started with.
    """
    check_compatible(state, model, classes, model_name)
    _restore_weights_and_optimizer(state, unwrap(model), optimizer)
    scheduler.load_state_dict(state["scheduler"])
    # A bf16, fp32 or CPU run saves an empty scaler state ({}), which GradScaler refuses to load:
    # an fp16 run resumed from it starts its loss scale afresh.
    if state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    if ema is not None and state.get("ema"):
        ema.module.load_state_dict(state["ema"])
    elif ema is not None:
        ema.reset()
    return RunState.of(state)


def load_weights(model, weights):
    """A full state dict (a checkpoint's "model") into the run's model, plain or sharded (every rank)."""
    if is_sharded(unwrap(model)):
        load_full_state_dict(unwrap(model), weights)
    else:
        unwrap(model).load_state_dict(weights)


def _restore_weights_and_optimizer(state, model, optimizer):
    """Today's checkpoints hold both whole; an FSDP run's hold them in shards (state["sharded"])."""
    sharded = state.get("sharded")
    if is_sharded(model) != bool(sharded):
        how = ("its optimizer state is sharded (train_multi_gpu_fsdp.py): resume with that script" if sharded else
               "it holds no sharded state (it is not from train_multi_gpu_fsdp.py): resume with the script that "
               "wrote it")
        raise UserError(f"cannot resume this checkpoint here: {how}, or start from its weights with --weights FILE",
                        every_rank=True)
    if not sharded:
        model.load_state_dict(state["model"])
        load_optimizer_state(optimizer, state["optimizer"])  # keeps this run's fused/foreach flags
        return
    if not Path(sharded).is_dir():
        raise UserError(f"the sharded state '{sharded}' of this checkpoint is gone (only last.pt's is kept); "
                        "resume from last.pt, or start from its weights with --weights FILE", every_rank=True)
    load_sharded(model, optimizer, sharded)


def resume_command(run_dir, world_size=1, local_world_size=1, argv=None, resume="auto", flags=()):
    """The command line that continues this run: the same one, with --output-dir RUN --resume auto
    (or --resume `resume`, after `flags`: --eval-only on best.pt)."""
    argv = list(sys.argv if argv is None else argv)
    kept, drop_next = [], False
    for arg in argv[1:]:
        if drop_next:
            drop_next = False
        elif arg in ("--resume", "--output-dir"):
            drop_next = True
        elif not arg.startswith(("--resume=", "--output-dir=", "resume=", "output_dir=")):
            kept.append(arg)
    if world_size > 1 and world_size == local_world_size:
        launcher = f"torchrun --nproc_per_node={local_world_size}"
    elif world_size > 1:
        launcher = "torchrun <the same torchrun options, on every node>"
    else:
        launcher = "python"
    # The two flags go first: key=value overrides must stay one run of words for the parser.
    return " ".join([launcher, shlex.quote(argv[0]), "--output-dir", shlex.quote(str(run_dir)), *flags,
                     "--resume", shlex.quote(str(resume)), *map(shlex.quote, kept)])


# What a checkpoint written before a layout key existed had: its value then.
_LAYOUT_BEFORE = {"accum_steps": 1, "sampler": "shuffle"}


def data_layout(seed, world_size, batch_size, steps_per_epoch, train_images, accum_steps=1, sampler="shuffle"):
    """What fixes the per-epoch batch order: a mid-epoch resume needs all of it unchanged.
    steps_per_epoch counts optimizer steps (accum_steps batches each)."""
    return {"seed": seed, "world_size": world_size, "batch_size": batch_size,
            "steps_per_epoch": steps_per_epoch, "train_images": train_images,
            "accum_steps": accum_steps, "sampler": sampler}


def resume_point(state, rank, layout):
    """This rank's saved random state, and for a mid-epoch checkpoint where to continue in the epoch.

    Returns (rng or None, resume_at or None, note or None); resume_at = {"epoch_step", "start", "loss_sum",
    "images_seen", "rng", "lr"}: skip `epoch_step` loader batches of the epoch's order from its position
    `start`. A mid-epoch checkpoint of another world size or batch size (an elastic restart) continues at the
    epoch's first image no rank has trained: the ranks trained the first epoch_step x batch x world positions
    of the shuffled order (utils.samplers.ShuffleSampler), which the new ranks then skip; its ranks' loss and
    image sums go to rank 0's, so train_loss is still the epoch's mean. Where the order itself has changed
    (another seed, other data, the balanced sampler, whose order depends on the world size) the epoch
    restarts from its first batch, and `note` says so.
    """
    ranks = state.get("ranks") or []
    same_world = len(ranks) == layout["world_size"]
    rng = ranks[rank]["rng"] if same_world else None
    if not state.get("epoch_step"):
        return rng, None, None
    theirs = state.get("data") or {}
    changed = [f"{k} {theirs.get(k, _LAYOUT_BEFORE.get(k))} -> {v}" for k, v in layout.items()
               if theirs.get(k, _LAYOUT_BEFORE.get(k)) != v]
    start = state.get("epoch_start", 0)
    if not changed and same_world:
        mine = ranks[rank]
        return rng, {"epoch_step": state["epoch_step"], "start": start, "loss_sum": mine["loss_sum"],
                     "images_seen": mine["images_seen"], "rng": mine["rng"], "lr": state["epoch_lr"]}, None
    where = f"the checkpoint was written at step {state['epoch_step']} of epoch {state['epoch'] + 1}"
    same_order = all(theirs.get(k, _LAYOUT_BEFORE.get(k)) == layout[k] for k in ("seed", "train_images", "sampler"))
    if same_order and layout["sampler"] == "shuffle" and theirs.get("batch_size") and ranks:
        start += state["epoch_step"] * theirs["batch_size"] * len(ranks)
        first = rank == 0  # the epoch's sums so far, counted once
        return rng, {"epoch_step": 0, "start": start, "rng": None, "lr": state["epoch_lr"],
                     "loss_sum": sum(r["loss_sum"] for r in ranks) if first else 0.0,
                     "images_seen": sum(r["images_seen"] for r in ranks) if first else 0}, (
            f"note: {where} ({', '.join(changed)}): epoch {state['epoch'] + 1} goes on from image "
            f"{min(start, layout['train_images']) + 1} of its {layout['train_images']} in its order, the ones "
            "no process has trained yet")
    return rng, None, (f"note: {where} and the batch order has changed since ({', '.join(changed) or 'world size'}): "
                       f"epoch {state['epoch'] + 1} restarts from its first batch (the weights keep the steps "
                       "already trained)")


class Checkpointer:
    """Saves the run's objects; `save` and `finish` are called by every rank (they gather every rank's state
    and vote on rank 0's write). `step`: what holds the optimizer, scheduler, scaler, EMA and device
    (engine.Step). `background`: rank 0's RunLogger.background, where an epoch's checkpoint (save(...,
    wait=False)) is written beside the next epoch from a copy of its tensors; `on_failure()` is called
    there when that write fails (fit asks the loop to stop, so the next save's vote comes at the next step)."""

    def __init__(self, ckpt_dir, model, step, config, classes, layout, keep_last, rank, record=None,
                 background=None, on_failure=None):
        self.ckpt_dir, self.model, self.step, self.record = Path(ckpt_dir), model, step, record
        self.config, self.classes, self.layout, self.keep_last, self.rank = config, classes, layout, keep_last, rank
        self.background, self.on_failure, self._pending = background, on_failure, None

    def save(self, run_state, is_best=False, epoch_step=0, loss_sum=0.0, images_seen=0, epoch_lr=None, wait=True,
             epoch_start=0):
        ranks = gather_objects({"rng": rng_state(), "loss_sum": loss_sum, "images_seen": images_seen})
        model, sharded = self.model, None
        if is_sharded(self.model):  # every rank writes its shards, then gathers the full weights to rank 0
            sharded = f"sharded-e{run_state.epoch:03d}-s{run_state.global_step:08d}-{os.getpid()}"
            sharded = broadcast_object(sharded)
            save_sharded(self.model, self.step.optimizer, self.ckpt_dir, sharded, self.rank)
            model = full_state_dict(self.model)
        # The write still under way (the last epoch's) first: checkpoints land in order, and its error is voted on here.
        error = self._written() if self.rank == 0 else None
        if self.rank == 0 and error is None:
            step = self.step
            state = make_state(model, step.optimizer, step.scheduler, step.scaler, run_state, self.config,
                               self.classes, ranks=ranks, epoch_step=epoch_step, epoch_lr=epoch_lr,
                               data=self.layout, ema=step.ema, sharded=sharded, record=self.record,
                               epoch_start=epoch_start)
            # epoch_NNN.pt copies are of epoch ends only; a mid-epoch save just replaces last.pt.
            keep = self.keep_last if epoch_step == 0 else 0
            if wait or sharded or self.background is None:
                try:
                    save_checkpoint(state, self.ckpt_dir, is_best, keep)
                    if sharded:
                        remove_sharded(self.ckpt_dir, keep=sharded)
                except UserError as e:
                    error = e
            else:  # the training goes on with the tensors: the write takes a copy of them
                self._pending = self.background.later(self._write, snapshot(state), is_best, keep)
        self._vote(error)

    def finish(self):
        """Every rank: the checkpoint still being written is on disk, or its error stops every rank."""
        self._vote(self._written() if self.rank == 0 else None)

    def _write(self, state, is_best, keep):
        try:
            save_checkpoint(state, self.ckpt_dir, is_best, keep)
        except BaseException:
            if self.on_failure is not None:
                self.on_failure()
            raise

    def _written(self):
        """Rank 0: wait for the write under way; its error (the background's, which dropped what followed it)."""
        if self._pending is None:
            return None
        self._pending.wait()
        self._pending = None
        return self.background.take_error()

    def _vote(self, error):
        # Every rank joins this vote, so a failed save on rank 0 stops all ranks instead of
        # leaving them to wait in the next collective.
        if any_rank(error is not None, self.step.device):
            # One line for all: rank 0 prints its own, the others wait for it (cli.print_error).
            error = error or UserError("rank 0 could not write its checkpoint; stopping", exit_code=RUNTIME_EXIT)
            error.every_rank = True
            raise error


def snapshot(obj):
    """A checkpoint's tensors copied to the CPU (containers copied, other values shared): what a write
    beside the training saves while the weights move on. A state dict's _metadata (module versions) goes along."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        copied = type(obj)((k, snapshot(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            copied._metadata = obj._metadata
        return copied
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(snapshot(v) for v in obj)
    return obj
