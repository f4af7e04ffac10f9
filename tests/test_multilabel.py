"""Multi-label training: the loss, multi-hot mixing, the metrics and thresholds, exact under DDP, resumable.

    python -m pytest tests/test_multilabel.py -q

The metrics are checked on fixed logits against a plain numpy implementation written here (and
scikit-learn's where it is installed). The loop's behaviour is checked through the entry scripts:
train.py on a tiny label file (predict.py, --eval-only's eval.json, export.py after it), torchrun
with 2 and 3 processes evaluating the same checkpoint, and a run stopped mid-epoch and resumed.
"""
import math

import numpy as np
import pytest
import torch

from engine import Criterion, average_precision, best_f1_thresholds, multilabel_report, pos_weights
from utils.errors import UserError
from utils.mixing import MultiHotMix, batch_mixer


# --------------------------------------------------------------------------- a numpy reference

def reference_ap(scores, truth):
    """Average precision of one label, by its definition: over the positives, the mean precision among
    the images scored at least as high as that positive (ties count together)."""
    positives = np.flatnonzero(truth)
    return float(np.mean([truth[scores >= scores[k]].mean() for k in positives])) if len(positives) else None


def reference_metrics(probs, truth, thresholds):
    pred = probs >= np.asarray(thresholds)[None, :]
    out = {"precision": [], "recall": [], "f1": []}
    tp_all = fp_all = fn_all = 0
    for c in range(probs.shape[1]):
        tp = int(np.sum(pred[:, c] & truth[:, c]))
        fp = int(np.sum(pred[:, c] & ~truth[:, c]))
        fn = int(np.sum(~pred[:, c] & truth[:, c]))
        tp_all, fp_all, fn_all = tp_all + tp, fp_all + fp, fn_all + fn
        out["precision"].append(tp / (tp + fp) if tp + fp else 0.0)
        out["recall"].append(tp / (tp + fn) if tp + fn else 0.0)
        out["f1"].append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    ap = [reference_ap(probs[:, c], truth[:, c]) for c in range(probs.shape[1])]
    out.update(ap=ap, map=float(np.mean([a for a in ap if a is not None])), macro_f1=float(np.mean(out["f1"])),
               micro_f1=2 * tp_all / (2 * tp_all + fp_all + fn_all),
               exact_match=float(np.mean(np.all(pred == truth, axis=1))))
    return out


def assert_report_matches(report, ref, tol=1e-12):
    for k in ("map", "macro_f1", "micro_f1", "exact_match"):
        assert report[f"val_{k}"] == pytest.approx(ref[k], abs=tol), k
    for k in ("precision", "recall", "f1"):
        assert report[f"val_{k}"] == pytest.approx(ref[k], abs=tol), k
    assert [a is None for a in report["val_ap"]] == [a is None for a in ref["ap"]]
    assert [a for a in report["val_ap"] if a is not None] == pytest.approx([a for a in ref["ap"] if a is not None],
                                                                            abs=tol)


def fixed_scores():
    """60 images x 5 labels: logits rounded to create ties; label 4 has no positive."""
    g = torch.Generator().manual_seed(3)
    truth = torch.rand(60, 5, generator=g) < 0.35
    truth[:, 4] = False
    logits = (torch.randn(60, 5, generator=g) + 1.6 * truth).mul(2).round().div(2)
    return logits.double().sigmoid(), truth


# --------------------------------------------------------------------------- metrics on fixed logits

THRESHOLDS = torch.tensor([0.5, 0.4, 0.6, 0.5, 0.5], dtype=torch.float64)


def test_metrics_equal_a_numpy_reference():
    probs, truth = fixed_scores()
    report = multilabel_report(probs, truth, THRESHOLDS)
    assert_report_matches(report, reference_metrics(probs.numpy(), truth.numpy(), THRESHOLDS.numpy()))
    assert report["val_ap"][4] is None and report["val_positives"][4] == 0  # left out of mAP
    assert report["val_positives"] == truth.sum(0).tolist() and report["val_count"] == 60


def test_metrics_equal_scikit_learns():
    sklearn = pytest.importorskip("sklearn.metrics", reason="scikit-learn is not installed (not in requirements.txt); "
                                  "test_metrics_equal_a_numpy_reference checks the same numbers")
    probs, truth = fixed_scores()
    report = multilabel_report(probs, truth, THRESHOLDS)
    y, p, pred = truth.numpy().astype(int), probs.numpy(), (probs >= THRESHOLDS).numpy().astype(int)
    assert report["val_ap"][:4] == pytest.approx(sklearn.average_precision_score(y[:, :4], p[:, :4], average=None))
    assert report["val_map"] == pytest.approx(sklearn.average_precision_score(y[:, :4], p[:, :4], average="macro"))
    assert report["val_f1"] == pytest.approx(sklearn.f1_score(y, pred, average=None, zero_division=0))
    assert report["val_macro_f1"] == pytest.approx(sklearn.f1_score(y, pred, average="macro", zero_division=0))
    assert report["val_micro_f1"] == pytest.approx(sklearn.f1_score(y, pred, average="micro", zero_division=0))
    assert report["val_exact_match"] == pytest.approx(sklearn.accuracy_score(y, pred))


def test_tuned_thresholds_give_each_label_its_best_f1():
    probs, truth = fixed_scores()
    default = torch.full((5,), 0.5, dtype=torch.float64)
    tuned = best_f1_thresholds(probs, truth, default)
    f1 = multilabel_report(probs, truth, tuned)["val_f1"]
    for c in range(4):  # every cut the scores allow, tried one by one
        s, y = probs[:, c].numpy(), truth[:, c].numpy()
        best = max(2 * np.sum((s >= t) & y) / (np.sum(s >= t) + np.sum(y)) for t in np.unique(s))
        assert f1[c] == pytest.approx(best, abs=1e-12)
    assert all(a >= b for a, b in zip(f1, multilabel_report(probs, truth, default)["val_f1"]))
    assert tuned[4] == 0.5  # no positive: the default stays
    assert average_precision(probs, truth)[4].isnan()


# --------------------------------------------------------------------------- the loss and the mixing

def test_loss_is_sigmoid_bce_with_pos_weight_and_binary_label_smoothing():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(6, 3, generator=g), (torch.rand(6, 3, generator=g) < 0.5).float()
    w = torch.tensor([1.0, 3.0, 0.5])
    crit = Criterion(label_smoothing=0.2, multilabel=True, pos_weight=w)
    t = targets * 0.8 + 0.1  # eps = 0.2: positives 0.9, negatives 0.1
    want = -(w * t * logits.sigmoid().log() + (1 - t) * (1 - logits.sigmoid()).log()).mean()
    assert crit(logits, targets).item() == pytest.approx(want.item(), rel=1e-6)
    plain = -(targets * logits.sigmoid().log() + (1 - targets) * (1 - logits.sigmoid()).log()).mean(dim=1)
    assert torch.allclose(crit.per_image(logits, targets), plain, atol=1e-6)  # validation: no smoothing, no weights


class _Samples(list):
    """A training set's multi-label samples as the data contract keeps them (CSR label_values)."""

    @property
    def label_values(self):
        return np.array([c for _, labels in self for c in labels], dtype=np.int64)


def test_pos_weight_auto_is_negatives_per_positive_and_1_without_a_positive():
    samples = _Samples([("a", (0,)), ("b", (0, 1)), ("c", (1,)), ("d", (0,))])  # label 2: no positive
    got = pos_weights("auto", samples, 3, torch.device("cpu"))
    assert got.tolist() == pytest.approx([1 / 3, 1.0, 1.0])
    assert pos_weights([2, 1, 4], samples, 3, torch.device("cpu")).tolist() == [2, 1, 4]
    assert pos_weights("none", samples, 3, torch.device("cpu")) is None
    with pytest.raises(UserError, match="2 weights, the data has 3 labels"):
        pos_weights([1, 2], samples, 3, torch.device("cpu"))


@pytest.mark.parametrize("mixup, cutmix", [(0.4, 0.0), (0.0, 1.0), (0.4, 1.0)])
def test_mixing_mixes_the_multi_hot_targets_with_the_images_weight(mixup, cutmix):
    torch.manual_seed(1)
    images = torch.arange(4.0).view(4, 1, 1, 1).expand(4, 3, 8, 8).contiguous()  # image i: all pixels i
    targets = torch.tensor([[1, 0, 0], [0, 1, 1], [1, 1, 0], [0, 0, 1]], dtype=torch.float32)
    mix = batch_mixer(mixup, cutmix, 3, multilabel=True)
    assert isinstance(mix, MultiHotMix)
    for _ in range(5):
        mixed, soft = mix(images, targets)
        # Image i's weight on itself: the mean share of its own pixels (values i vs i - 1 rolled in).
        own = torch.stack([(mixed[i] - images[i - 1]) / (images[i] - images[i - 1]) for i in range(4)])
        lam = own.mean(dim=(1, 2, 3))
        assert torch.allclose(lam, lam[0].expand(4), atol=1e-6)
        assert torch.allclose(soft, lam[0] * targets + (1 - lam[0]) * targets.roll(1, 0), atol=1e-6)
