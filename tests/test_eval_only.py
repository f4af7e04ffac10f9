"""--eval-only on the three entry scripts: eval.json from a checkpoint, exact at 1, 2 and 3 processes.

    python -m pytest tests/test_eval_only.py -q

On the shared finished run (conftest.trained_run): its best.pt evaluated again gives
the logged best val_acc exactly; torchrun with 2 and 3 gloo processes writes the same
eval.json (confusion matrix, per-class figures, the worst mistakes gathered over the
ranks); a data root with train/ val/ test/ is evaluated on test/.
"""
import json

import pytest

import train
from conftest import make_image_folder, run_entry

pytestmark = pytest.mark.slow

KEYS = {"accuracy", "top5", "macro_f1", "per_class", "confusion", "count", "classes", "split", "worst"}


def evaluate_with(script, trained_run, out, nproc=None, *extra):
    best = trained_run["run_dir"] / "checkpoints" / "best.pt"
    proc = run_entry(script, *trained_run["base"], "--eval-only", "--resume", best, "--output-dir", out, *extra,
                     nproc=nproc)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads((out / "eval.json").read_text())


@pytest.fixture(scope="module")
def single(trained_run, tmp_path_factory):
    return evaluate_with("train.py", trained_run, tmp_path_factory.mktemp("eval") / "one")


def test_eval_only_reproduces_the_logged_best_val_acc(single, trained_run):
    rows = [json.loads(line) for line in (trained_run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert KEYS <= set(single) and single["split"] == "val" and single["count"] == 5
    assert single["accuracy"] == max(r["val_acc"] for r in rows)  # exactly
    best = next(r for r in rows if r["val_acc"] == single["accuracy"])
    assert single["confusion"]["rows_true_columns_predicted"] == best["val_confusion"]
    assert [single["per_class"][c]["f1"] for c in single["classes"]] == best["val_f1"]
    assert single["macro_f1"] == best["val_macro_f1"]


@pytest.mark.parametrize("nproc", [2, 3])
def test_eval_only_is_exact_under_ddp(single, trained_run, tmp_path, nproc):
    """The worst mistakes are gathered over ranks and merged: the same images, in the same order."""
    got = evaluate_with("train_multi_gpu_ddp.py", trained_run, tmp_path / "ddp", nproc)
    for key in KEYS - {"worst"}:
        assert got[key] == single[key], key
    assert [(w["index"], w["pred"]) for w in got["worst"]] == [(w["index"], w["pred"]) for w in single["worst"]]
    assert [w["prob"] for w in got["worst"]] == pytest.approx([w["prob"] for w in single["worst"]], abs=1e-5)
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
    assert result["split"] == "test" and result["count"] == 15
    with pytest.raises(SystemExit) as e:  # nothing to evaluate
        train.main([*base, "--eval-only", "--output-dir", str(tmp_path / "none")])
    assert e.value.code == 2 and "--eval-only needs a model" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    with pytest.raises(SystemExit) as e:  # --resume auto in a folder with no checkpoint
        train.main([*base, "--eval-only", "--resume", "auto", "--output-dir", str(tmp_path / "empty")])
    assert e.value.code == 2
    assert f"--eval-only --resume auto found no checkpoint in '{tmp_path / 'empty'}'" in capsys.readouterr().err


def test_eval_only_never_touches_the_training_images(trained_run, tmp_path, capsys):
    """No training set is built: nothing of it is verified or decoded (data.pipeline=gpu decodes its
    cache up front), and a batch larger than the training split, which training refuses, is fine."""
    best = trained_run["run_dir"] / "checkpoints" / "best.pt"
    base = [str(a) for a in trained_run["base"]]
    train.main([*base, "--eval-only", "--resume", str(best), "--output-dir", str(tmp_path / "out"),
                "data.pipeline=gpu", "data.verify=true", "train.batch_size=64"])
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "eval.json").read_text())["count"] == 5
    assert "verify: 5 images checked" in out
    assert "gpu pipeline: 5 val images decoded" in out and "train images decoded" not in out
