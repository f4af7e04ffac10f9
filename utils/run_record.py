"""The run record: what a run ran on, written beside config.yaml as run_record.json and kept in its checkpoints.

    python -c "import json; print(json.load(open('runs/demo/run_record.json'))['data'])"

It holds Python's and the key packages' versions; CUDA, cuDNN and NCCL; each node's GPUs and processes;
the world size; the command line as typed; the git commit of the code and whether its tree had
changes (nothing when the code is not a git checkout); and a digest of the data: per split its images
and a SHA-256 of its sorted (path relative to data.path, label names) rows. A resumed run appends
its own start to "earlier" (the file's top level is always the latest start), and says in one line
when its data digest is not the checkpoint's. tools/kfold.py --summarize and tools/sweep.py name the
fields in which their runs differ.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from utils.run_dir import RECORD

FILE = RECORD
# Versions worth comparing across machines; a package that is not installed is left out.
PACKAGES = ("torch", "torchvision", "numpy", "pillow", "omegaconf", "timm", "onnx", "onnxruntime", "tensorboard")
# What two runs of one experiment (k folds, sweep trials) should share; their data and commands differ by design.
SHARED = ("python", "packages", "cuda", "cudnn", "nccl", "device", "nodes", "git")
CODE = Path(__file__).resolve().parent.parent


def collect(data_cfg, splits, classes, dist_info):
    """This start's record. Called by every rank (each reports its host and GPU); rank 0 alone also reads
    git and hashes the data, and only its record is complete. `splits`: {"train": dataset, "val": dataset}."""
    import torch  # here, not at the top: tools/kfold.py and tools/sweep.py read records without torch
    from utils.distributed_utils import gather_objects
    device = dist_info.device
    here = {"host": socket.gethostname(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    ranks = gather_objects(here)
    if dist_info.rank != 0:
        return {}
    nodes = {}
    for r in ranks:
        node = nodes.setdefault(r["host"], {"processes": 0, "gpus": []})
        node["processes"] += 1
        node["gpus"] += [r["gpu"]] if r["gpu"] else []
    return {"python": platform.python_version(), "platform": platform.platform(),
            "packages": package_versions(), "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "nccl": nccl_version() if device.type == "cuda" else None,
            "device": device.type, "world_size": dist_info.world_size, "nodes": nodes,
            "command": command_line(), "git": git_state(CODE),
            "data": data_digest(data_cfg.path, splits, classes)}


def package_versions():
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def nccl_version():
    import torch
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a build without NCCL (Windows, ROCm's RCCL under another name)
        return None


def command_line():
    """The command as typed: the interpreter's own argv (python -m torch.distributed.run ... under torchrun's
    parent; each worker sees `python -u script ...`), and the launcher that started this process."""
    argv = getattr(sys, "orig_argv", [sys.executable, *sys.argv])  # orig_argv: Python 3.10+
    launcher = ("torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else
                "slurm" if "SLURM_JOB_ID" in os.environ else "python")
    return {"argv": shlex.join(argv), "launcher": launcher, "cwd": os.getcwd()}


def git_state(path):
    """{"commit", "dirty", "changed" (the first 20 changed paths)} of the checkout holding `path`, or None
    when it is none (a copied tree, a wheel) or git is not installed."""
    def git(*args):
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode:
            return None
        status = git("status", "--porcelain")
    except (OSError, subprocess.TimeoutExpired):
        return None
    changed = [line[3:] for line in status.stdout.splitlines() if line.strip()]
    return {"commit": head.stdout.strip(), "dirty": bool(changed), "changed": changed[:20]}


def data_digest(root, splits, classes):
    """Per split: its number of images and a SHA-256 of its rows, "path<TAB>labels" sorted, the path relative
    to data.path and the labels by class name (";" between a multi-label row's): the same images with the
    same labels give the same digest on any machine and in any order of discovery."""
    prefix = str(root).rstrip("/\\") + os.sep if root else None
    out = {"classes": len(classes)}
    for name, dataset in splits.items():
        samples = getattr(dataset, "samples", None)
        if samples is None:
            out[name] = {"images": len(dataset), "sha256": None}
            continue
        rows = []
        for path, label in samples:
            path = os.fsdecode(path)
            path = path[len(prefix):] if prefix and path.startswith(prefix) else path
            names = ";".join(classes[i] for i in label) if isinstance(label, tuple) else classes[label]
            rows.append(f"{path}\t{names}\n")
        rows.sort()
        digest = hashlib.sha256()
        for row in rows:
            digest.update(row.encode("utf-8", "surrogateescape"))
        out[name] = {"images": len(rows), "sha256": digest.hexdigest()}
    return out


def read(run_dir):
    """A run directory's record (its latest start), or None when it has none or it does not parse."""
    try:
        return json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return None


def data_note(theirs, ours):
    """One line when the checkpoint's data digest is not this run's (the run goes on: a user may add images
    on purpose); None when they agree or the checkpoint holds none."""
    if not theirs or not ours or theirs == ours:
        return None
    parts = []
    for split in sorted(set(theirs) | set(ours)):
        if split == "classes" or theirs.get(split) == ours.get(split):
            continue
        a, b = theirs.get(split) or {}, ours.get(split) or {}
        parts.append(f"{split} {a.get('images', '?')} -> {b.get('images', '?')} images"
                     if a.get("images") != b.get("images") else f"{split}: other images or labels")
    if theirs.get("classes") != ours.get("classes"):
        parts.append(f"{theirs.get('classes')} -> {ours.get('classes')} classes")
    return ("note: the data is not the checkpoint's (" + ", ".join(parts) + "); training goes on with this "
            "data (run_record.json holds both digests)")


def differences(records, keys=SHARED):
    """{field: {label: value}} for each dotted field (packages.torch, git.commit, ...) under `keys` whose
    value is not the same in every record; `records` is {label: record}. Records missing are left out."""
    flat = {label: dict(_flatten(rec, keys)) for label, rec in records.items() if rec}
    fields = sorted({f for rec in flat.values() for f in rec})
    return {f: {label: rec.get(f) for label, rec in flat.items()} for f in fields
            if len({repr(rec.get(f)) for rec in flat.values()}) > 1}


def difference_line(records, what, keys=SHARED):
    """'note: the <what> differ in their run record: packages.torch (fold_0 2.4.0, fold_1 2.5.1); ...' or None."""
    diff = differences(records, keys)
    if not diff:
        return None
    return (f"note: the {what} differ in their run record ({FILE}): "
            + "; ".join(f"{field} (" + ", ".join(f"{label} {value}" for label, value in values.items()) + ")"
                        for field, values in diff.items()))


def _flatten(record, keys, prefix=""):
    for key, value in record.items():
        if prefix == "" and key not in keys:
            continue
        if key == "changed":
            continue  # the list of paths: "dirty" says it
        if isinstance(value, dict):
            yield from _flatten(value, keys, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
