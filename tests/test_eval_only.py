"""--eval-only on train.py, DP and DDP (FSDP: test_fsdp.py): eval.json from a checkpoint, exact at 1-3 processes.

    python -m pytest tests/test_eval_only.py -q

On the shared finished run (conftest.trained_run): its best.pt evaluated again gives
the logged best_acc exactly; torchrun with 2 and 3 gloo processes writes the same
eval.json (confusion matrix, per-class figures, the worst mistakes gathered over the
ranks, on a mislabelled copy of the images so that there are mistakes); both the EMA and the
plain weights are evaluated when the checkpoint names them; a data root with train/ val/ test/ is evaluated on test/.
"""
import json
import math
import os
import shlex
import subprocess
import sys

import pytest
import torch

import data
import train
from _resume_utils import run_main, single_thread
from conftest import FAST_ARGS, REPO, make_image_folder, run_entry
from plain_transforms.sitecustomize import plain_transforms

pytestmark = pytest.mark.slow

# evaluate()'s own keys (a metric added there lands here too), and what --eval-only adds.
KEYS = {"val_acc", "val_top5", "val_loss", "val_macro_f1", "val_precision", "val_recall", "val_f1", "val_confusion",
        "val_per_class_acc", "val_count", "val_worst", "classes", "split", "checkpoint"}


def evaluate_with(script, trained_run, out, nproc=None, *extra, checkpoint=None):
    """eval.json of --eval-only on `checkpoint` (best.pt): under torchrun with `nproc` processes, or
    train.py's main() in this process (about the numbers only), with one thread as a subprocess has."""
    args = [str(a) for a in (*trained_run["base"], "--eval-only", "--resume",
                             checkpoint or trained_run["run_dir"] / "checkpoints" / "best.pt", "--output-dir", out, *extra)]
    if nproc:
        proc = run_entry(script, *args, nproc=nproc)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    else:
        assert script == "train.py"
        with single_thread(), pytest.MonkeyPatch.context() as monkeypatch:  # the logits round as in the trained run
            assert run_main(train, args, monkeypatch) == 0
    return json.loads((out / "eval.json").read_text())


@pytest.fixture(scope="module")
def single(trained_run, tmp_path_factory):
    return evaluate_with("train.py", trained_run, tmp_path_factory.mktemp("eval") / "one")


WORST = 8  # train.worst_images for the mislabelled folder: fewer than its mistakes, so the list is cut


@pytest.fixture(scope="module")
def mislabelled(trained_run, tmp_path_factory):
    """The trained run's images, half of each val/ class folder taken from the next class: the model
    (which learnt the colours) gets about half of the 30 val images wrong, so there are worst mistakes
    to list, and right answers that must not be among them."""
    root = tmp_path_factory.mktemp("mislabelled")
    classes = sorted(p.name for p in trained_run["data"].iterdir())
    for i, name in enumerate(classes):
        source = sorted((trained_run["data"] / name).iterdir())[:3] + \
            sorted((trained_run["data"] / classes[(i + 1) % len(classes)]).iterdir())[3:]
        for part, files in (("train", source[:1]), ("val", source)):
            (root / part / name).mkdir(parents=True)
            for src in files:
                (root / part / name / src.name).write_bytes(src.read_bytes())
    return root


@pytest.fixture(scope="module")
def mislabelled_single(trained_run, mislabelled, tmp_path_factory):
    return evaluate_with("train.py", trained_run, tmp_path_factory.mktemp("eval") / "mislabelled", None,
                         "--data-path", mislabelled, f"train.worst_images={WORST}")


def test_the_worst_mistakes_are_misclassified_and_of_the_highest_loss(mislabelled_single):
    """eval.json's val_worst: k of the images the model got wrong, highest loss first, each with the
    probability of the class it predicted (which the true class's cannot exceed)."""
    worst, confusion = mislabelled_single["val_worst"], mislabelled_single["val_confusion"]
    mistakes = sum(map(sum, confusion)) - sum(confusion[c][c] for c in range(len(confusion)))
    assert mislabelled_single["val_count"] == 30 and WORST < mistakes < 30 and len(worst) == WORST
    classes = mislabelled_single["classes"]
    for w in worst:
        assert w["pred"] != w["label"] and (w["true"], w["predicted"]) == (classes[w["label"]], classes[w["pred"]])
        assert confusion[w["label"]][w["pred"]] > 0
        # loss = -log p(true) and p(true) <= 1 - p(predicted) for a mistake.
        assert w["loss"] >= -math.log(1 - w["prob"]) - 1e-9 and 0 < w["prob"] < 1
    losses = [w["loss"] for w in worst]
    assert losses == sorted(losses, reverse=True) and len({w["index"] for w in worst}) == WORST


@pytest.mark.parametrize("weights", ["model", "ema"])
def test_eval_only_evaluates_the_weights_the_checkpoint_names(weights, trained_run, tmp_path):
    """Both branches, forced: last.pt (epoch 3) with best_weights set to "model" or "ema" scores what
    epoch 3 logged for those weights (val_acc or val_acc_ema, and their loss and macro-F1)."""
    state = torch.load(trained_run["run_dir"] / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    forced = tmp_path / f"{weights}.pt"
    torch.save({**state, "best_weights": weights}, forced)
    row = json.loads((trained_run["run_dir"] / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["epoch"] == state["epoch"] == 3
    assert row["val_loss"] != pytest.approx(row["val_loss_ema"], rel=1e-4)  # the two can be told apart
    got = evaluate_with("train.py", trained_run, tmp_path / "out", checkpoint=forced)
    suffix = "_ema" if weights == "ema" else ""
    assert got["checkpoint"] == str(forced) + (" (EMA weights)" if suffix else "")
    assert got["val_acc"] == row["val_acc" + suffix] and got["val_macro_f1"] == row["val_macro_f1" + suffix]
    assert got["val_loss"] == pytest.approx(row["val_loss" + suffix], rel=1e-6)


def test_eval_only_reproduces_the_logged_best_acc(single, trained_run):
    """best.pt holds the better of the weights and their EMA (train.ema_decay): evaluated again, it
    scores the run's best_acc exactly, with that epoch's logged figures for those weights."""
    rows = [json.loads(line) for line in (trained_run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert KEYS <= set(single) and single["split"] == "val" and single["val_count"] == 5
    best_acc = rows[-1]["best_acc"]
    assert single["val_acc"] == best_acc  # exactly
    best = next(r for r in rows if best_acc in (r["val_acc"], r["val_acc_ema"]) and r["best_acc"] == best_acc)
    suffix = "_ema" if best["best_weights"] == "ema" else ""
    assert single["checkpoint"].endswith("(EMA weights)") is (suffix == "_ema")
    assert single["val_macro_f1"] == best["val_macro_f1" + suffix]
    assert single["val_loss"] == pytest.approx(best["val_loss" + suffix], rel=1e-6)
    if not suffix:  # the raw weights' whole report is logged too
        assert single["val_confusion"] == best["val_confusion"] and single["val_f1"] == best["val_f1"]


def test_eval_only_is_exact_under_ddp(mislabelled_single, mislabelled, trained_run, tmp_path, nproc=3):
    """The worst mistakes are gathered over ranks and merged: the same images, in the same order."""
    single = mislabelled_single
    got = evaluate_with("train_multi_gpu_ddp.py", trained_run, tmp_path / "ddp", nproc, "--data-path", mislabelled,
                        f"train.worst_images={WORST}")
    for key in KEYS - {"val_worst", "val_loss"}:  # counts: exact; the loss sums in another order
        assert got[key] == single[key], key
    # And each rank's batches have other sizes: CPU convolutions may round float32 logits differently (5e-8 seen).
    assert got["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)
    # Calibration: sums all-reduced, confidences gathered: a single process's numbers.
    for key in ("val_temperature", "val_ece", "val_ece_calibrated", "val_reject_threshold"):
        assert got[key] == pytest.approx(single[key], rel=1e-6), key
    worst, single_worst = got["val_worst"], single["val_worst"]
    assert len(worst) == WORST
    assert [(w["index"], w["pred"], w["true"]) for w in worst] == [(w["index"], w["pred"], w["true"]) for w in single_worst]
    assert [w["prob"] for w in worst] == pytest.approx([w["prob"] for w in single_worst], abs=1e-5)
    assert (tmp_path / "ddp" / "confusion_matrix.png").is_file()


def test_a_test_folder_is_what_eval_only_evaluates(trained_run, tmp_path, capsys):
    root = tmp_path / "split"
    for part, n in (("train", 4), ("val", 1), ("test", 3)):
        make_image_folder(root / part, per_class=n)
    best = trained_run["run_dir"] / "checkpoints" / "best.pt"
    base = [str(a) for a in trained_run["base"]]
    train.main([*base, "--data-path", str(root), "--eval-only", "--resume", str(best),
                "--output-dir", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert result["split"] == "test" and result["val_count"] == 15
    with pytest.raises(SystemExit) as e:  # nothing to evaluate
        train.main([*base, "--eval-only", "--output-dir", str(tmp_path / "none")])
    assert e.value.code == 2 and "--eval-only needs a model" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    with pytest.raises(SystemExit) as e:  # --resume auto in a folder with no checkpoint
        train.main([*base, "--eval-only", "--resume", "auto", "--output-dir", str(tmp_path / "empty")])
    assert e.value.code == 2
    assert f"--eval-only --resume auto found no checkpoint in '{tmp_path / 'empty'}'" in capsys.readouterr().err


def test_eval_only_never_touches_the_training_images(trained_run, tmp_path, capsys, monkeypatch):
    """No training set is built: nothing of it is verified or decoded (data.pipeline=gpu decodes its
    cache up front), and a batch larger than the training split, which training refuses, is fine.
    The plain transforms: the gpu pipeline refuses an augmentation it cannot reproduce, by design."""
    monkeypatch.setattr(data, "build_transforms", plain_transforms)
    best = trained_run["run_dir"] / "checkpoints" / "best.pt"
    base = [str(a) for a in trained_run["base"]]
    train.main([*base, "--eval-only", "--resume", str(best), "--output-dir", str(tmp_path / "out"),
                "data.pipeline=gpu", "data.verify=true", "train.batch_size=64"])
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "eval.json").read_text())["val_count"] == 5
    assert "verify: 5 images checked" in out
    assert "gpu pipeline: 5 val images decoded" in out and "train images decoded" not in out


def test_a_checkpoint_of_another_model_is_refused_in_one_line_under_ddp(trained_run, tmp_path):
    """Every rank reads the same checkpoint and refuses it alike: rank 0 alone prints the line."""
    best = trained_run["run_dir"] / "checkpoints" / "best.pt"
    proc = run_entry("train_multi_gpu_ddp.py", *trained_run["base"], "model.name=resnet34", "--eval-only",
                     "--resume", best, "--output-dir", tmp_path / "other", nproc=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == [
        "error: checkpoint is a resnet18, this run builds a resnet34 (model.name); resume with "
        "model.name=resnet18, or start from its weights with --weights"], (proc.stdout + proc.stderr)[-3000:]


def test_the_runs_last_lines_name_best_pt_and_commands_that_run(tmp_path):
    """The run's last lines: best.pt's epoch and score as metrics.jsonl has them, its path, and the commands
    that use it next; the printed evaluate command, run as it is, gives the logged best score in eval.json
    and leaves every file the run wrote as it was."""
    run_dir = tmp_path / "run dir"  # a space: the commands must quote the path
    proc = run_entry("train.py", *FAST_ARGS, "--data-path", make_image_folder(tmp_path / "flowers"),
                     "--output-dir", run_dir, "train.epochs=3", "optim.lr=0.01")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = (proc.stdout + proc.stderr).rstrip().splitlines()[-4:]
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [e for e in epochs if "val_acc" in e]
    best = max(epochs, key=lambda e: e["val_acc"])  # the first of the highest: only a strict gain counts
    assert lines[0].endswith(f"done: best.pt is epoch {best['epoch']}'s, val_acc {best['val_acc']:.4f}: "
                             f"{run_dir / 'checkpoints' / 'best.pt'}"), lines
    assert lines[1].endswith(f"predict:  python predict.py {shlex.quote(str(run_dir))} IMAGES"), lines
    assert lines[3].endswith(f"export:   python export.py {shlex.quote(str(run_dir))} --format onnx"), lines
    command = shlex.split(lines[2].split("evaluate: ", 1)[1])
    assert command[:2] == ["python", str(REPO / "train.py")] and "--eval-only" in command, command
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    again = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run_dir / "eval.json").read_text())["val_acc"] == pytest.approx(best["val_acc"], abs=1e-6)
    changed = [p.name for p, b in before.items() if p.read_bytes() != b and not p.name.endswith(".log")]
    assert not changed, changed
