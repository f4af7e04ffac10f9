"""utils/run_record.py: the run record (run_record.json and the checkpoint's "record"), each field checked
against this very process; a resume onto changed data says so in one line; kfold and sweep name what
their runs differ in.

    python -m pytest tests/test_run_record.py -q
"""
import copy
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from types import SimpleNamespace

import omegaconf
import pytest
import torch
import torchvision

import data
from conftest import FAST_ARGS, REPO, make_image_folder, run_entry
from tools import sweep
from utils import run_record
from utils.config import load_config

pytestmark = pytest.mark.slow


def digest(root, dataset, classes):
    """The test's own digest of a split: sorted 'relative path<TAB>class name' rows, SHA-256."""
    rows = sorted(f"{os.path.relpath(path, root)}\t{classes[label]}\n" for path, label in dataset.samples)
    return {"images": len(rows), "sha256": hashlib.sha256("".join(rows).encode()).hexdigest()}


def git(*args):
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Two gloo processes of train_multi_gpu_ddp.py, one epoch."""
    root = tmp_path_factory.mktemp("record")
    folder = make_image_folder(root / "flowers")
    run_dir = root / "run"
    proc = run_entry("train_multi_gpu_ddp.py", *FAST_ARGS, "--data-path", folder, "--output-dir", run_dir, nproc=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {"folder": folder, "run_dir": run_dir, "record": json.loads((run_dir / run_record.FILE).read_text())}


def test_each_field_is_what_the_run_ran_on(ddp_run):
    record = ddp_run["record"]
    assert record["python"] == platform.python_version()
    versions = record["packages"]
    assert versions["torch"] == torch.__version__.split("+")[0]
    assert versions["torchvision"] == torchvision.__version__.split("+")[0]
    assert versions["omegaconf"] == omegaconf.__version__
    assert (record["cuda"], record["device"], record["nccl"]) == (torch.version.cuda, "cpu", None)
    assert record["world_size"] == 2
    assert record["nodes"] == {socket.gethostname(): {"processes": 2, "gpus": []}}  # CPU: no GPU names
    assert record["command"]["launcher"] == "torchrun"
    assert "train_multi_gpu_ddp.py" in record["command"]["argv"] and "--output-dir" in record["command"]["argv"]
    changed = git("status", "--porcelain")
    assert record["git"]["commit"] == git("rev-parse", "HEAD").strip()
    assert record["git"]["dirty"] is bool(changed.strip())
    cfg = load_config([*FAST_ARGS[2:], f"data.path={ddp_run['folder']}"])
    train_set, val_set, classes = data.build_datasets(cfg.data)
    assert record["data"] == {"classes": 5, "train": digest(ddp_run["folder"], train_set, classes),
                              "val": digest(ddp_run["folder"], val_set, classes)}
    assert record["data"]["train"]["images"] + record["data"]["val"]["images"] == 30
    # The same record travels in the checkpoint.
    state = torch.load(ddp_run["run_dir"] / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert state["record"] == record


def test_a_resume_onto_changed_data_says_so_in_one_line_and_goes_on(tmp_path):
    folder = make_image_folder(tmp_path / "flowers")
    run_dir = tmp_path / "run"
    args = [*FAST_ARGS, "--data-path", folder, "--output-dir", run_dir]
    assert run_entry("train.py", *args).returncode == 0
    first = json.loads((run_dir / run_record.FILE).read_text())
    same = run_entry("train.py", *args, "--resume", "auto", "train.epochs=2")
    assert same.returncode == 0 and "not the checkpoint's" not in same.stdout + same.stderr
    for i in range(3):  # three more daisies: train and val both change
        (folder / "daisy" / f"more_{i}.jpg").write_bytes((folder / "dandelion" / f"dandelion_{i:03d}.jpg").read_bytes())
    changed = run_entry("train.py", *args, "--resume", "auto", "train.epochs=3")
    assert changed.returncode == 0, changed.stderr[-3000:]
    lines = [line for line in (changed.stdout + changed.stderr).splitlines() if "not the checkpoint's" in line]
    assert len(lines) == 1, lines
    record = json.loads((run_dir / run_record.FILE).read_text())
    assert sum(record["data"][s]["images"] for s in ("train", "val")) == 33
    was, now = first["data"]["train"]["images"], record["data"]["train"]["images"]
    said = f"train {was} -> {now} images" if was != now else "train: other images or labels"
    assert lines[0].startswith(f"note: the data is not the checkpoint's ({said}") and "goes on" in lines[0], lines
    assert [r["data"] for r in record["earlier"]] == [first["data"]] * 2  # each earlier start, oldest first
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["epoch"] == 3


def test_no_git_record_outside_a_checkout(tmp_path):
    assert run_record.git_state(tmp_path) is None
    assert run_record.git_state(REPO)["commit"] == git("rev-parse", "HEAD").strip()


def fold(out_dir, i, record):
    run_dir = out_dir / f"fold_{i}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("data:\n  folds: 2\ntrain:\n  epochs: 1\n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "val_acc": 0.5 + i / 10}) + "\n")
    (run_dir / run_record.FILE).write_text(json.dumps(record))


def test_kfold_summary_names_the_fields_the_folds_differ_in(ddp_run, tmp_path):
    """Two folds of one run's record, one with another torch and another commit: kfold --summarize says so
    (stdout and kfold.md); folds that differ only in their data and command say nothing."""
    other = copy.deepcopy(ddp_run["record"])
    other["data"]["train"]["sha256"], other["command"]["argv"] = "0" * 64, "python train.py data.fold=1"
    fold(tmp_path / "same", 0, ddp_run["record"])
    fold(tmp_path / "same", 1, other)
    other = copy.deepcopy(other)
    other["packages"]["torch"], other["git"]["commit"] = "2.4.0", "f" * 40
    fold(tmp_path / "differ", 0, ddp_run["record"])
    fold(tmp_path / "differ", 1, other)
    out = {}
    for case in ("same", "differ"):
        proc = subprocess.run([sys.executable, "tools/kfold.py", "--summarize", tmp_path / case], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out[case] = proc.stdout
    assert "run record" not in out["same"]
    torch_version = ddp_run["record"]["packages"]["torch"]
    commit = ddp_run["record"]["git"]["commit"]
    line = (f"kfold: note: the folds differ in their run record (run_record.json): git.commit (fold 0 {commit}, "
            f"fold 1 {'f' * 40}); packages.torch (fold 0 {torch_version}, fold 1 2.4.0)")
    assert line in out["differ"].splitlines(), out["differ"]
    assert line[len("kfold: "):] in (tmp_path / "differ" / "kfold.md").read_text()


def test_sweep_names_trials_that_saw_other_data(ddp_run, tmp_path):
    """A sweep's trials should share versions, GPUs, commit and data: one that saw other images is named."""
    trials = []
    for n, images in enumerate((25, 25, 26)):
        record = copy.deepcopy(ddp_run["record"])
        record["data"]["train"]["images"] = images
        (tmp_path / f"trial_{n}").mkdir()
        (tmp_path / f"trial_{n}" / run_record.FILE).write_text(json.dumps(record))
        trials.append(SimpleNamespace(number=n, user_attrs={"run_dir": str(tmp_path / f"trial_{n}")}))
    assert sweep.record_note(trials) == ("note: the trials differ in their run record (run_record.json): "
                                         "data.train.images (trial 0 25, trial 1 25, trial 2 26)")
    assert sweep.record_note(trials[:2]) is None
