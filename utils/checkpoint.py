"""Checkpoints: what a run needs to continue exactly, written atomically by rank 0.

    <run>/checkpoints/last.pt        after every epoch
    <run>/checkpoints/best.pt        on a new best validation accuracy
    <run>/checkpoints/epoch_NNN.pt   the last train.keep_last epochs, if > 0

A save goes to a temporary file in the same directory and is renamed over the
old one, so a process killed mid-write leaves the previous checkpoint intact.
Loads use weights_only=True: a file that carries pickled code is refused.
"""
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from model import strip_wrapper_prefixes
from utils.errors import RUNTIME_EXIT, UserError


def unwrap(model):
    """The bare nn.Module under DataParallel / DDP / torch.compile."""
    while True:
        if hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


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
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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


def atomic_copy(src, dst):
    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def make_state(model, optimizer, scheduler, scaler, epoch, global_step, best_acc, config, classes):
    return {
        "model": strip_wrapper_prefixes(unwrap(model).state_dict()),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,                 # epochs completed; a resumed run starts at this index
        "global_step": global_step,
        "best_acc": best_acc,
        "config": config,
        "classes": list(classes),
        "rng": rng_state(),
    }


def save_checkpoint(state, ckpt_dir, is_best, keep_last=0):
    """Write last.pt (and best.pt, epoch_NNN.pt); a failed write stops the run, old files intact."""
    ckpt_dir = Path(ckpt_dir)
    try:
        last = ckpt_dir / "last.pt"
        atomic_save(state, last)
        if is_best:
            atomic_copy(last, ckpt_dir / "best.pt")
        if keep_last > 0:
            atomic_copy(last, ckpt_dir / f"epoch_{state['epoch']:03d}.pt")
            for old in sorted(ckpt_dir.glob("epoch_*.pt"))[:-keep_last]:
                old.unlink()
    except OSError as e:
        raise UserError(f"could not write checkpoint in '{ckpt_dir}': {e.strerror or e}; "
                        "the previous checkpoint is intact", exit_code=RUNTIME_EXIT)


def find_resume_path(resume, run_dir):
    """--resume PATH or 'auto' (run_dir/checkpoints/last.pt, None when there is none yet)."""
    if resume is None:
        return None
    if resume == "auto":
        last = Path(run_dir) / "checkpoints" / "last.pt"
        return last if last.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise UserError(f"--resume '{path}' does not exist (use --resume auto to start fresh when absent)")
    return path


def load_checkpoint(path, map_location):
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - corrupt file, foreign pickle, ...: all the file's fault
        raise UserError(f"cannot load checkpoint '{path}': {str(e).splitlines()[0]}")


def restore(state, model, optimizer, scheduler, scaler, classes):
    """Load a full checkpoint into the run's objects; refuse one of another model or class list."""
    if list(state.get("classes", classes)) != list(classes):
        raise UserError(f"checkpoint classes {state.get('classes')} differ from the data's {list(classes)}")
    own = unwrap(model).state_dict()
    theirs = state["model"]
    diff = sorted(set(own) ^ set(theirs))
    shapes = [k for k in own if k in theirs and own[k].shape != theirs[k].shape]
    if diff or shapes:
        what = f"{len(diff)} tensor names differ, e.g. {diff[:2]}" if diff else \
            f"tensor shapes differ, e.g. {shapes[0]} {tuple(theirs[shapes[0]].shape)} vs {tuple(own[shapes[0]].shape)}"
        raise UserError(f"checkpoint is for another model: {what}")
    unwrap(model).load_state_dict(theirs)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    if "rng" in state:
        set_rng_state(state["rng"])
    return state["epoch"], state["global_step"], state["best_acc"]
