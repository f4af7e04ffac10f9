"""k-fold cross-validation: data.folds/data.fold (utils/splits.py) and tools/kfold.py, as a user runs them.

    python -m pytest tests/test_kfold.py -q          # the SLURM array test skips without a cluster

The folds' properties are checked on data.py's real split (in this process: no training needed);
tools/kfold.py runs `python train.py` folds of tiny data, is killed while fold 1 trains and is started
again; the SLURM array path runs slurm/train_ddp.sbatch on the local cluster, then --summarize.
"""
import csv
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

import data
import train
from _resume_utils import run_main
from conftest import FAST_ARGS, REPO, free_port, make_image_folder
from test_slurm import PYTHON, SBATCH, _cluster_up, wait_done
from utils.config import load_config

CLASSES = ("daisy", "roses", "tulips")


@pytest.fixture(scope="module")
def flowers(tmp_path_factory):
    """3 classes x 6 images: 2 folds of 9, 2 training steps of 4 per epoch."""
    return make_image_folder(tmp_path_factory.mktemp("kfold") / "flowers", classes=CLASSES)


def split_of(root, **kw):
    """data.split_dataset of the data section data.path=root with the data keys given."""
    return data.split_dataset(load_config([f"data.path={root}", *(f"data.{k}={v}" for k, v in kw.items())]).data)


def val_sets(root, folds, **kw):
    return [{p for p, _ in split_of(root, folds=folds, fold=i, **kw).val} for i in range(folds)]


def test_folds_are_disjoint_cover_the_set_are_stratified_and_the_same_on_every_call(tmp_path):
    root = make_image_folder(tmp_path / "flowers", per_class=7)  # 7 per class in 3 folds: 3, 2, 2
    folds = [split_of(root, split_seed=5, folds=3, fold=i) for i in range(3)]
    every = {p for p, _ in folds[0].train} | {p for p, _ in folds[0].val}
    vals = [[p for p, _ in f.val] for f in folds]
    assert len(every) == 35 and sorted(p for v in vals for p in v) == sorted(every)  # disjoint and covering
    for f, val in zip(folds, vals):
        assert {p for p, _ in f.train} == every - set(val)
    per_class = np.array([np.bincount([label for _, label in f.val], minlength=5) for f in folds])
    assert (per_class.max(0) - per_class.min(0) <= 1).all() and (per_class.sum(0) == 7).all(), per_class
    assert vals == [[p for p, _ in split_of(root, split_seed=5, folds=3, fold=i).val] for i in range(3)]
    assert val_sets(root, 3, split_seed=6) != [set(v) for v in vals]  # data.split_seed chooses the folds


def test_a_label_files_group_never_spans_two_folds_whatever_the_row_order(flowers, tmp_path):
    rows = [(f"{c}/{c}_{i:03d}.jpg", c, f"{c}-{i // 2}") for c in CLASSES for i in range(6)]  # 9 groups of 2
    files = []
    for n, order in enumerate((rows, random.Random(0).sample(rows, len(rows)))):
        for columns in (3, 2):  # with and without the group column
            files.append(tmp_path / f"labels{n}_{columns}.csv")
            with open(files[-1], "w", newline="") as f:
                csv.writer(f).writerows(r[:columns] for r in [("path", "label", "group"), *order])
    vals = [val_sets(flowers, 3, labels=f) for f in files]
    assert vals[0] == vals[2] and vals[1] == vals[3]  # the folds follow the images, not the file's row order
    assert vals[1] == val_sets(flowers, 3)  # and a label file gives the folds its folders give
    group_of = {str(flowers / p): g for p, _, g in rows}
    folds_of_group = {}
    for i, val in enumerate(vals[0]):
        for p in val:
            folds_of_group.setdefault(group_of[p], set()).add(i)
    assert len(folds_of_group) == 9 and all(len(f) == 1 for f in folds_of_group.values()), folds_of_group
    assert sorted(p for v in vals[0] for p in v) == sorted(group_of)


@pytest.mark.parametrize("args, message", [
    (["data.folds=3", "data.fold=3"], "bad value for 'data.fold': 3; must be in 0..2 (data.folds=3)"),
    (["data.folds=1"], "bad value for 'data.folds': 1; 0 (off) or at least 2 folds"),
    (["data.fold=1"], "bad value for 'data.fold': 1; data.folds=K first (0 = no folds)"),
    (["data.folds=2", "@split"], "has a split column, which fixes one; drop the column, or set data.folds=0"),
    (["data.folds=2", "@trainval"], "holds train/ and val/, which fixes one; point data.path at the class folders"),
])
def test_bad_fold_settings_are_refused_in_one_line(args, message, flowers, tmp_path, monkeypatch, capsys):
    where = ["--data-path", str(flowers)]
    if "@split" in args:
        (tmp_path / "s.csv").write_text("path,label,split\ndaisy/daisy_000.jpg,daisy,train\n"
                                        "roses/roses_000.jpg,roses,val\n")
        where += ["data.labels=" + str(tmp_path / "s.csv")]
    if "@trainval" in args:
        for part in ("train", "val"):
            make_image_folder(tmp_path / "tv" / part, per_class=1, classes=CLASSES[:2])
        where = ["--data-path", str(tmp_path / "tv")]
    args = [a for a in args if not a.startswith("@")]
    code = run_main(train, [*where, "--output-dir", str(tmp_path / "run"), *FAST_ARGS, *args], monkeypatch)
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "run").exists()


def kfold_command(out, flowers):
    return [sys.executable, "tools/kfold.py", "--folds", "2", "--dir", str(out), "--", sys.executable, "train.py",
            "--data-path", str(flowers), *FAST_ARGS, "train.epochs=4", "train.amp=off"]


def snapshot(folder):
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.rglob("*")) if p.is_file()}


def last_epoch(run_dir):
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.fixture(scope="module")
def killed_and_restarted(flowers, tmp_path_factory):
    """tools/kfold.py, SIGTERM while fold 1 trains (after its epoch 1), then the same command again.
    Four epochs leave fold 1 three more after its first last.pt: a kill that lands while it still trains,
    even on a loaded machine (with two, the last epoch could finish before the signal arrived)."""
    out = tmp_path_factory.mktemp("kfold_run") / "cv"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(kfold_command(out, flowers), cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    while not (out / "fold_1" / "checkpoints" / "last.pt").exists():
        assert first.poll() is None and time.time() < deadline, first.stdout.read()
        time.sleep(0.01)
    first.send_signal(signal.SIGTERM)
    first_out = first.communicate(timeout=120)[0]
    before = json.loads((out / "kfold.json").read_text())
    fold0, fold0_log = snapshot(out / "fold_0"), (out / "fold_0" / "job.log").read_text()
    again = subprocess.run(kfold_command(out, flowers), cwd=REPO, env=env, text=True, capture_output=True,
                           timeout=240)
    return dict(out=out, first=(first.returncode, first_out, before), again=again, fold0=(fold0, fold0_log))


def test_a_killed_kfold_run_started_again_skips_the_finished_fold_and_resumes_the_interrupted_one(
        killed_and_restarted):
    out, again = killed_and_restarted["out"], killed_and_restarted["again"]
    rc, first_out, before = killed_and_restarted["first"]
    assert rc == 1 and [f["status"] for f in before["per_fold"]] == ["done", "failed"], first_out[-3000:]
    assert "SIGTERM" in before["per_fold"][1]["error"] and "last.pt is saved" in before["per_fold"][1]["error"]
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    fold0, fold0_log = killed_and_restarted["fold0"]
    assert (out / "fold_0" / "job.log").read_text() == fold0_log and snapshot(out / "fold_0") == fold0
    assert "kfold: fold 0 finished before, skipped" in again.stdout
    log1 = (out / "fold_1" / "job.log").read_text()
    assert log1.count("resumed from") == 1 and "fold_1/checkpoints/last.pt" in log1.split("resumed from")[1]
    epochs = [json.loads(x)["epoch"] for x in (out / "fold_1" / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2, 3, 4]
    for i in range(2):
        config = yaml.safe_load((out / f"fold_{i}" / "config.yaml").read_text())["data"]
        assert (config["folds"], config["fold"]) == (2, i)


def test_kfold_json_and_md_hold_each_folds_final_metrics_and_their_mean_and_std(killed_and_restarted):
    out = killed_and_restarted["out"]
    summary = json.loads((out / "kfold.json").read_text())
    assert summary["folds"] == 2 and summary["command"][:2] == [sys.executable, "train.py"]
    finals = [last_epoch(out / f"fold_{i}") for i in range(2)]
    assert [f["status"] for f in summary["per_fold"]] == ["done", "done"]
    for key in ("val_acc", "val_loss", "train_loss", "best_acc", "val_macro_f1"):
        values = [f[key] for f in finals]
        assert [f[key] for f in summary["per_fold"]] == values
        assert summary["mean"][key] == pytest.approx(statistics.fmean(values), abs=1e-12)
        assert summary["std"][key] == pytest.approx(statistics.stdev(values), abs=1e-12)
    assert not any(k.endswith(("_seconds", "_count")) for k in summary["mean"])
    table = (out / "kfold.md").read_text()
    acc = f"{summary['mean']['val_acc']:.4f} ± {summary['std']['val_acc']:.4f}"
    assert "| 0 | done |" in table and "| 1 | done |" in table and acc in table, table


@pytest.mark.slurm
@pytest.mark.slow
def test_a_slurm_array_trains_one_fold_per_task_and_summarize_reads_them(flowers, tmp_path):
    reason = _cluster_up()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "cv"
    env = {**os.environ, "OUTPUT_DIR": str(out), "NPROC_PER_NODE": "1", "RDZV_PORT": str(free_port()),
           "PYTHON": PYTHON}
    r = subprocess.run(["sbatch", "--parsable", "--array=0-1", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1",
                        "--time=10", f"--output={tmp_path}/task_%a.out", str(SBATCH), "--data-path", str(flowers),
                        *FAST_ARGS, "train.amp=off", "ddp.backend=gloo", "data.folds=2",
                        "data.fold=$SLURM_ARRAY_TASK_ID"],  # as `data.fold=\$SLURM_ARRAY_TASK_ID` types it
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=30)
    assert r.returncode == 0, r.stderr
    array = r.stdout.strip().split(";")[0]
    for i in range(2):
        info = wait_done(f"{array}_{i}")
        assert info["JobState"] == "COMPLETED", (tmp_path / f"task_{i}.out").read_text()[-3000:]
    summarized = subprocess.run([sys.executable, "tools/kfold.py", "--summarize", str(out)], cwd=REPO, text=True,
                                capture_output=True, timeout=60)
    assert summarized.returncode == 0, summarized.stderr
    summary = json.loads((out / "kfold.json").read_text())
    assert [f["status"] for f in summary["per_fold"]] == ["done", "done"]
    for i, val in enumerate(val_sets(flowers, 2)):
        config = yaml.safe_load((out / f"fold_{i}" / "config.yaml").read_text())["data"]
        assert (config["folds"], config["fold"]) == (2, i)
        assert last_epoch(out / f"fold_{i}")["val_count"] == len(val)
        assert summary["per_fold"][i]["val_acc"] == last_epoch(out / f"fold_{i}")["val_acc"]
