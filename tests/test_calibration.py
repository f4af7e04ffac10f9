"""Calibrated probabilities and "none of these": the temperature, ECE, --reject and --eval-only --ood.

    python -m pytest tests/test_calibration.py -q

utils/calibration.py against plain references (ECE as torchmetrics' MulticlassCalibrationError defines it,
the NLL over a dense grid of temperatures) and scikit-learn (roc_curve for the FPR at 95% TPR); then on the
shared finished run (conftest.trained_run): best.pt carries the temperature of the weights it holds;
--eval-only --ood writes ECE before and after and the OOD scores, each recomputed here from the model's own
logits; predict.py prints softmax(logits / T) and answers "unknown" under the threshold, as predict_onnx.py
does with the exported file.
"""
import csv
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import train
from _resume_utils import run_main, single_thread
from conftest import run_entry
from utils import calibration


def ece_reference(probs, labels, bins=15):
    """torchmetrics' MulticlassCalibrationError (norm="l1"), written out: bins (i/15, (i+1)/15], the first
    also taking 0; per bin |accuracy - mean confidence| weighted by its share of the images."""
    conf, pred = probs.max(dim=1)
    total = 0.0
    for i in range(bins):
        lo, hi = i / bins, (i + 1) / bins
        inside = [(c, p == y) for c, p, y in zip(conf.tolist(), pred.tolist(), labels.tolist())
                  if (lo <= c < hi) or (i == bins - 1 and c >= hi)]
        if inside:
            acc = sum(ok for _, ok in inside) / len(inside)
            mean_conf = sum(c for c, _ in inside) / len(inside)
            total += abs(acc - mean_conf) * len(inside) / len(labels)
    return total


def test_ece_is_torchmetrics_definition():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(400, 6, generator=gen) * 3
    labels = torch.randint(0, 6, (400,), generator=gen)
    for t in (1.0, 0.5, 2.5):
        assert calibration.ece(logits, labels, t) == pytest.approx(ece_reference((logits.double() / t).softmax(1), labels),
                                                                   abs=1e-12)
    sure = torch.tensor([[50.0, 0.0], [0.0, 50.0]])  # confidence 1.0: the last bin, not a 16th
    assert calibration.ece(sure, torch.tensor([0, 0])) == pytest.approx(0.5)


def test_the_temperature_minimises_the_nll_and_changes_no_prediction():
    """Over-confident logits (a calibrated model's times 3): the fitted T is the NLL's minimum that SciPy's
    bounded scalar minimiser finds, to 1e-4, near 3; the argmax stays."""
    from scipy.optimize import minimize_scalar
    gen = torch.Generator().manual_seed(1)
    true_logits = torch.randn(2000, 5, generator=gen)
    labels = torch.multinomial(true_logits.softmax(1), 1, generator=gen).squeeze(1)
    logits = 3 * true_logits
    t = calibration.fit_temperature(logits, labels)
    found = minimize_scalar(lambda g: F.cross_entropy(logits.double() / math.exp(g), labels).item(), method="bounded",
                            bounds=(math.log(0.05), math.log(20)), options={"xatol": 1e-9})
    assert t == pytest.approx(math.exp(found.x), rel=1e-4) and 2.5 < t < 3.5
    assert torch.equal((logits / t).argmax(1), logits.argmax(1))
    assert calibration.ece(logits, labels, t) < calibration.ece(logits, labels) / 3


def test_the_automatic_threshold_keeps_95_percent_and_the_fpr_is_scikit_learns():
    from sklearn.metrics import roc_curve
    gen = torch.Generator().manual_seed(2)
    known, unknown = torch.rand(333, generator=gen) * 0.6 + 0.4, torch.rand(101, generator=gen) * 0.7
    threshold = calibration.reject_threshold(known)
    assert (known >= threshold).double().mean() >= 0.95 > (known >= threshold + 1e-9).double().mean() - 1 / 333
    y = np.r_[np.ones(len(known)), np.zeros(len(unknown))]
    fpr, tpr, _ = roc_curve(y, np.r_[known.numpy(), unknown.numpy()])
    assert calibration.fpr_at_tpr(known, unknown) == pytest.approx(fpr[np.argmax(tpr >= 0.95)])


# --------------------------------------------------------------------------- through the scripts

@pytest.mark.slow
def test_best_pt_carries_the_temperature_of_the_weights_it_holds(trained_run):
    rows = [json.loads(line) for line in (trained_run["run_dir"] / "metrics.jsonl").read_text().splitlines()
            if '"epoch"' in line]
    state = torch.load(trained_run["run_dir"] / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    row = rows[state["best_epoch"] - 1]
    suffix = "_ema" if state["best_weights"] == "ema" else ""
    assert state["temperature"] == row["val_temperature" + suffix] and 0.05 <= state["temperature"] <= 20
    assert state["reject_threshold"] == row["val_reject_threshold" + suffix]
    assert all(0 <= r["val_ece"] <= 1 and 0 <= r["val_ece_calibrated"] <= 1 for r in rows)


def write_noise(folder, n=6):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (32, 40, 3), dtype=np.uint8)).save(folder / f"noise_{i}.jpg")
    return folder


@pytest.fixture(scope="module")
def judged(trained_run, tmp_path_factory):
    """--eval-only --ood on a root with train/ and val/ (val: all 30 images) and a folder of noise, and the
    model's own logits for those images, computed here: -> (eval.json, val paths, val labels, val logits,
    noise logits, the checkpoint's temperature and threshold)."""
    from data import build_transforms
    from model import load_trained
    from utils import normalization
    from utils.decoding import load_image
    root = tmp_path_factory.mktemp("calibration")
    classes = sorted(p.name for p in trained_run["data"].iterdir())
    for name in classes:
        for part, files in (("train", sorted((trained_run["data"] / name).iterdir())[:1]),
                            ("val", sorted((trained_run["data"] / name).iterdir()))):
            (root / "split" / part / name).mkdir(parents=True, exist_ok=True)
            for src in files:
                (root / "split" / part / name / src.name).write_bytes(src.read_bytes())
    noise = write_noise(root / "noise")
    best = trained_run["run_dir"] / "checkpoints" / "best.pt"
    args = [str(a) for a in (*trained_run["base"], "--data-path", root / "split", "--eval-only", "--resume", best,
                             "--output-dir", root / "out", "--ood", noise, "eval.tta=flip")]
    with single_thread(), pytest.MonkeyPatch.context() as monkeypatch:
        assert run_main(train, args, monkeypatch) == 0
    result = {**json.loads((root / "out" / "eval.json").read_text()), "picture": root / "out" / "reliability.png"}
    model, _, _, _ = load_trained(trained_run["run_dir"])
    transform = build_transforms(32, 36)[1]
    norm = normalization.normalization_of(transform, "cpu")
    paths = sorted((root / "split" / "val").glob("*/*.jpg"))
    with torch.no_grad():
        def logits_of(files, flip=False):
            x = torch.stack([load_image(p, transform) for p in files])
            x = x.flip(-1) if flip else x
            return model(normalization.model_input(x, torch.device("cpu"), norm)).double()
        val_logits, noise_logits = logits_of(paths), logits_of(sorted(noise.iterdir()))
        result["mirror_logits"] = logits_of(paths, flip=True)  # for eval.tta=flip
    state = torch.load(best, map_location="cpu", weights_only=True)
    labels = torch.tensor([classes.index(p.parent.name) for p in paths])
    return result, paths, labels, val_logits, noise_logits, state["temperature"], state["reject_threshold"]


@pytest.mark.slow
def test_eval_only_reports_ece_before_and_after_the_checkpoints_temperature(judged):
    """... and the reliability diagram's bins beside them, drawn into reliability.png."""
    result, _, labels, logits, _, t, _ = judged
    assert result["val_count"] == 30 and result["val_temperature"] == t and result["temperature_from"] == "checkpoint"
    assert result["val_ece"] == pytest.approx(ece_reference(logits.softmax(1), labels), abs=1e-6)
    assert result["val_ece_calibrated"] == pytest.approx(ece_reference((logits / t).softmax(1), labels), abs=1e-6)
    table = result["val_reliability"]
    for key, ece in (("before", result["val_ece"]), ("after", result["val_ece_calibrated"])):
        count, conf, right = table[key]
        assert len(count) == 15 and sum(count) == 30 and sum(right) == round(result["val_acc"] * 30)
        assert calibration.ece_of(table[key]) == ece
    with Image.open(result["picture"]) as img:
        assert img.size[0] > 500 and img.getextrema() != ((255, 255),) * 3


@pytest.mark.slow
def test_eval_only_scores_images_of_no_class_against_val(judged):
    """eval.json's "ood": AUROC (scikit-learn's roc_auc_score) and FPR at 95% TPR of the calibrated top
    probability and of the energy, noise against the 30 val images, and the share under the threshold."""
    from sklearn.metrics import roc_auc_score
    result, _, _, known, unknown, t, reject = judged
    ood = result["ood"]
    assert (ood["images"], ood["known_images"]) == (6, 30)
    y = np.r_[np.ones(30), np.zeros(6)]
    for name, score in (("max_prob", lambda z: (z / t).softmax(1).max(1).values),
                        ("energy", lambda z: t * torch.logsumexp(z / t, 1))):
        a, b = score(known), score(unknown)
        assert ood[name]["auroc"] == pytest.approx(roc_auc_score(y, np.r_[a.numpy(), b.numpy()]), abs=1e-9), name
        cut = a.sort().values[1]  # the second lowest of 30 keeps 29, over 95%
        assert ood[name]["fpr_at_95_tpr"] == pytest.approx((b >= cut - 1e-9).double().mean().item()), name
    conf = (unknown / t).softmax(1).max(1).values
    assert ood["max_prob"]["reject_threshold"] == reject
    assert ood["max_prob"]["rejected"] == pytest.approx((conf < reject).double().mean().item())


@pytest.mark.slow
def test_test_time_augmentation_averages_each_image_with_its_mirror(judged, trained_run, tmp_path):
    """eval.tta=flip: eval.json's "tta" holds the accuracy and loss of the logits averaged with the mirror
    image's, beside those without; predict.py --tta flip prints the same average's probabilities."""
    result, paths, labels, logits, _, t, _ = judged
    mean = (logits + result["mirror_logits"]) / 2
    tta = result["tta"]
    assert tta["views"] == "flip" and tta["val_acc"] == (mean.argmax(1) == labels).double().mean().item()
    assert tta["val_loss"] == pytest.approx(F.cross_entropy(mean, labels).item(), rel=1e-5)
    assert result["val_loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
    assert tta["val_loss"] != pytest.approx(result["val_loss"], rel=1e-3)  # the views do change the numbers
    out = tmp_path / "tta.csv"
    proc = run_entry("predict.py", trained_run["run_dir"], *paths[:10], "--device", "cpu", "--out", out, "--tta", "flip")
    assert proc.returncode == 0, proc.stderr[-2000:]
    probs = (mean[:10] / t).softmax(1).max(1).values
    assert [float(r["prob1"]) for r in csv.DictReader(out.open())] == pytest.approx(probs.tolist(), abs=2e-6)


@pytest.mark.slow
def test_predict_prints_calibrated_probabilities_and_unknown_as_predict_onnx_does(judged, trained_run, tmp_path):
    """predict.py's probabilities are softmax(logits / T); with --reject P an image whose top one is under P
    is "unknown"; predict_onnx.py on the exported file answers the same, with the sidecar's T and threshold."""
    import export
    _, paths, _, logits, _, t, reject = judged
    probs = (logits / t).softmax(1).max(1).values
    ordered = sorted(probs.tolist())
    p = (ordered[3] + ordered[4]) / 2  # four of them unknown, the others well above
    out = tmp_path / "p.csv"
    proc = run_entry("predict.py", trained_run["run_dir"], *paths, "--device", "cpu", "--out", out, "--reject", p)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["class1"] == "unknown" for r in rows] == (probs < p).tolist() and 0 < (probs < p).sum() < 30
    assert [float(r["prob1"]) for r in rows] == pytest.approx(probs.tolist(), abs=2e-6)
    onnx = tmp_path / "m.onnx"
    with single_thread():
        export.main([str(trained_run["run_dir"]), "--format", "onnx", "--out", str(onnx), "--speed-repeats", "0",
                     "--check-limit", "0"])
    side = json.loads((tmp_path / "m.onnx.json").read_text())
    assert (side["temperature"], side["reject_threshold"]) == (t, reject)
    for flag in (str(p), "auto"):
        ours, theirs = tmp_path / f"onnx_{flag}.csv", tmp_path / f"torch_{flag}.csv"
        proc = run_entry("predict_onnx.py", onnx, *paths, "--out", ours, "--reject", flag)
        assert proc.returncode == 0, proc.stderr[-2000:]
        if flag == "auto":
            proc = run_entry("predict.py", trained_run["run_dir"], *paths, "--device", "cpu", "--out", theirs,
                             "--reject", flag)
            assert proc.returncode == 0, proc.stderr[-2000:]
        else:
            theirs = out
        a, b = list(csv.DictReader(ours.open())), list(csv.DictReader(theirs.open()))
        # An image whose probability is the threshold itself (auto: a val image's) may fall either side.
        clear = (probs - (reject if flag == "auto" else p)).abs() > 1e-6
        assert [r["class1"] for r, c in zip(a, clear) if c] == [r["class1"] for r, c in zip(b, clear) if c]
        assert [float(r["prob1"]) for r in a] == pytest.approx([float(r["prob1"]) for r in b], abs=1e-5)
    assert [r["class1"] == "unknown" for r, c in zip(a, clear) if c] == (probs < reject)[clear].tolist()
    assert 0 < sum(r["class1"] == "unknown" for r in a) < 30


@pytest.mark.slow
def test_a_bad_reject_is_one_error_line(trained_run):
    for script, model in (("predict.py", trained_run["run_dir"]), ("predict_onnx.py", trained_run["run_dir"] / "x.onnx")):
        proc = run_entry(script, model, trained_run["data"], "--reject", "1.5")
        assert proc.returncode == 2 and proc.stderr == ("error: --reject '1.5': give auto or a probability above 0 "
                                                        "and at most 1\n"), (script, proc.stderr)


@pytest.mark.slow
def test_ood_needs_eval_only_and_a_folder(trained_run, tmp_path):
    from utils.config import load_config
    from utils.errors import UserError
    with pytest.raises(UserError, match="scores images of no class with --eval-only"):
        load_config(["--ood", str(tmp_path)])
    proc = run_entry("train.py", *trained_run["base"], "--eval-only", "--resume",
                     trained_run["run_dir"] / "checkpoints" / "best.pt", "--ood", tmp_path / "none",
                     "--output-dir", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "is not a folder" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
