"""Multi-label training: the loss, multi-hot mixing, the metrics and thresholds, exact under DDP, resumable.

    python -m pytest tests/test_multilabel.py -q

The metrics are checked on fixed logits against a plain numpy implementation written here and
against scikit-learn's. The loop's behaviour is checked through the entry scripts:
train.py on a tiny label file (predict.py, --eval-only's eval.json, export.py after it), torchrun
with 2 and 3 processes evaluating the same checkpoint, and a run stopped mid-epoch and resumed.
"""
import math

import numpy as np
import pytest
import sklearn.metrics as skm
import torch

from engine import Criterion, pos_weights
from utils.errors import UserError
from utils.metrics import average_precision, best_f1_thresholds, multilabel_report
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


def assert_report_matches_sklearn(report, probs, truth, thresholds, tol=1e-12):
    """The report against scikit-learn's metrics on the same scores (labels without a positive have no AP)."""
    y, p = truth.numpy().astype(int), probs.numpy()
    pred = (p >= np.asarray(thresholds)[None, :]).astype(int)
    has = y.any(0)
    ap = skm.average_precision_score(y[:, has], p[:, has], average=None)
    assert [a for a in report["val_ap"] if a is not None] == pytest.approx(ap, abs=tol)
    assert report["val_map"] == pytest.approx(ap.mean(), abs=tol)
    for name, score in (("precision", skm.precision_score), ("recall", skm.recall_score), ("f1", skm.f1_score)):
        assert report[f"val_{name}"] == pytest.approx(score(y, pred, average=None, zero_division=0), abs=tol), name
    assert report["val_macro_f1"] == pytest.approx(skm.f1_score(y, pred, average="macro", zero_division=0), abs=tol)
    assert report["val_micro_f1"] == pytest.approx(skm.f1_score(y, pred, average="micro", zero_division=0), abs=tol)
    assert report["val_exact_match"] == pytest.approx(skm.accuracy_score(y, pred), abs=tol)


def test_metrics_equal_scikit_learns():
    probs, truth = fixed_scores()
    assert_report_matches_sklearn(multilabel_report(probs, truth, THRESHOLDS), probs, truth, THRESHOLDS)


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


def test_the_gathered_scores_are_in_dataset_order_whatever_the_ranks_shards(monkeypatch):
    """Each rank's shard arrives with its dataset indices; the whole set comes back ordered by them, as one
    process holds it (here a second rank's shard is faked into the gather)."""
    import engine

    class Loader:
        sampler, dataset = [3, 0, 5], range(6)

    scores = engine._AllScores(Loader(), torch.device("cpu"), 2)
    logits = torch.arange(6.0).view(6, 1).expand(6, 2)  # row of dataset index i: all i
    scores.add(logits[[3, 0, 5]], torch.ones(3, 2))
    other = (torch.tensor([4, 1, 2]), logits[[4, 1, 2]], torch.zeros(3, 2, dtype=torch.bool))
    monkeypatch.setattr(engine, "gather_objects", lambda mine: [other, mine])
    index, got, targets = scores.gathered()
    assert index.tolist() == list(range(6)) and torch.equal(got, logits)
    assert targets[:, 0].tolist() == [True, False, False, True, False, True]


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


# --------------------------------------------------------------------------- the entry scripts on a label file

import csv  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402

import export  # noqa: E402
import predict  # noqa: E402
import train  # noqa: E402
from _resume_utils import assert_same_weights, load, one_thread, run_args, run_main  # noqa: E402,F401
from conftest import FAST_ARGS, SESSION_FOLDERS, run_entry  # noqa: E402,F401
from demo import meadow  # noqa: E402
from model import load_trained  # noqa: E402
from test_resume import _resume_from_message, signal_on_training_batch  # noqa: E402

# Every option of the multi-label loss, mixing and thresholds at once; 2 epochs of 6 steps (26 train rows, batch 4).
RECIPE = ["optim.class_weights=auto", "optim.label_smoothing=0.1", "data.mixup_alpha=0.4", "data.cutmix_alpha=1.0",
          "eval.tune_thresholds=true", "train.figures=true", "train.worst_images=4", "data.min_crop_scale=0.6"]
EPOCHS = 2


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def meadows(tmp_path_factory):
    """33 small meadows of demo/meadow.py and their label file: 26 train / 7 val rows (7: not divisible by 2 or 3)."""
    root = meadow.generate(tmp_path_factory.mktemp("meadow") / "set", images=33, min_size=40, max_size=56)
    return root, root / "labels.csv"


def run_of(meadows, out, *extra, epochs=EPOCHS, flags=()):
    root, labels = meadows
    return run_args(root, out, f"data.labels={labels}", *RECIPE, *extra, epochs=epochs, flags=flags)


@pytest.fixture(scope="module")
def trained(meadows, tmp_path_factory, one_thread):
    """train.py (its main, in this process) on the label file: the run every after-training test reads."""
    out = tmp_path_factory.mktemp("ml_run") / "run"
    mp = pytest.MonkeyPatch()
    try:
        assert run_main(train, run_of(meadows, out), mp) == 0
    finally:
        mp.undo()
    return out


def test_a_label_file_run_trains_multi_label_and_keeps_its_thresholds(trained):
    rows = rows_of(trained / "metrics.jsonl")
    assert len(rows) == EPOCHS
    last = rows[-1]
    for key in ("val_map", "val_micro_f1", "val_macro_f1", "val_exact_match", "best_map"):
        assert 0 <= last[key] <= 1, key
    assert "val_acc" not in last and "val_confusion" not in last
    assert len(last["val_f1"]) == len(last["val_ap"]) == len(last["val_threshold"]) == 5
    assert last["best_map"] == max(r["val_map"] for r in rows)
    best = next(r for r in rows if r["val_map"] == last["best_map"])
    state = load(trained / "checkpoints" / "best.pt")
    assert state["multilabel"] is True and state["best_acc"] == last["best_map"]
    assert state["thresholds"] == best["val_threshold"]  # tuned on that epoch's validation scores
    assert load(trained / "checkpoints" / "last.pt")["thresholds"] == last["val_threshold"]
    assert any(t != 0.5 for t in last["val_threshold"])


def test_tensorboard_has_a_pr_curve_per_label_the_f1_bars_and_the_worst_mistakes(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(trained), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    classes = list(json.loads((trained / "class_indices.json").read_text()).values())
    assert {f"val_pr/{c}" for c in classes} <= set(tags["tensors"])
    assert len(acc.Tensors(f"val_pr/{classes[0]}")) == EPOCHS
    assert {"val/per_label_f1", "val/worst_mistakes", "train/augmented_samples"} <= set(tags["images"])
    assert "val/confusion_matrix" not in tags["images"]


def test_the_custom_scalars_accuracy_chart_draws_val_map(trained):
    """A multi-label run has no val/acc: its Custom Scalars accuracy chart is the mAP's."""
    import re
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    acc = EventAccumulator(str(trained), size_guidance={"tensors": 0})
    acc.Reload()
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {chart.title: [t for t in acc.Tags()["scalars"] if any(re.search(r, t) for r in chart.multiline.tag)]
              for category in layout.category for chart in category.chart}
    drawn = [tags for title, tags in charts.items() if "accuracy" in title]
    assert drawn == [["val/map"]], charts


def test_predict_prints_the_labels_at_their_thresholds_and_writes_every_probability(trained, meadows, val_scores,
                                                                                     capsys):
    root, _ = meadows
    images = sorted((root / "images").glob("*.jpg"))[-7:]
    out = trained / "preds.csv"
    rows = predict.main([str(trained), *map(str, images), "--out", str(out), "--device", "cpu"])
    printed = capsys.readouterr().out.splitlines()
    model, classes, *_ = load_trained(trained)
    thresholds = load(trained / "checkpoints" / "best.pt")["thresholds"]
    table = list(csv.DictReader(out.open(encoding="utf-8")))
    assert len(table) == len(rows) == 7 and list(table[0]) == ["path", "labels", *classes]
    # The last 7 meadows are the val rows: their sigmoid probabilities, to the file's 6 decimals.
    assert np.array([[float(r[c]) for c in classes] for r in table]) == pytest.approx(val_scores[0].numpy(), abs=2e-6)
    for line, row in zip(printed, table):
        probs = {c: float(row[c]) for c in classes}
        on = [c for c in sorted(classes, key=lambda c: -probs[c]) if probs[c] >= thresholds[classes.index(c)]]
        assert row["labels"] == ";".join(on)
        assert line.split()[1:] == ([x for c in on for x in (c, f"{probs[c]:.3f}")] or ["(no", "label)"])
    predict.main([str(trained), *map(str, images[:2]), "--out", str(trained / "preds.json"), "--device", "cpu"])
    first = json.loads((trained / "preds.json").read_text())[0]
    assert set(first["probs"]) == set(classes) and all(p["prob"] >= thresholds[classes.index(p["class"])]
                                                       for p in first["labels"])


def test_eval_only_writes_the_per_label_table_at_the_checkpoints_thresholds(trained, meadows, tmp_path, monkeypatch):
    out = tmp_path / "eval"
    best = trained / "checkpoints" / "best.pt"
    root, labels = meadows
    args = run_args(root, out, f"data.labels={labels}", flags=["--eval-only", "--resume", best])
    assert run_main(train, args, monkeypatch) == 0
    got = json.loads((out / "eval.json").read_text())
    logged = next(r for r in rows_of(trained / "metrics.jsonl") if r["val_map"] == load(best)["best_acc"])
    for key in ("val_map", "val_micro_f1", "val_macro_f1", "val_exact_match", "val_f1", "val_threshold"):
        assert got[key] == logged[key], key  # the same weights, images and thresholds: exactly
    table = got["labels"]
    assert [r["label"] for r in table] == got["classes"] and set(table[0]) == {"label", "precision", "recall", "f1",
                                                                               "ap", "threshold", "positives"}
    assert [r["f1"] for r in table] == got["val_f1"] and [r["threshold"] for r in table] == load(best)["thresholds"]
    assert sum(r["positives"] for r in table) >= got["val_count"] == 7
    assert (out / "per_label_f1.png").is_file() and not (out / "confusion_matrix.png").exists()


def test_export_says_sigmoid_and_its_outputs_match_the_eager_model(trained, tmp_path):
    out = tmp_path / "m.torchscript.pt"
    assert export.main([str(trained), "--format", "torchscript", "--out", str(out)]) <= 1e-4
    side = json.loads(out.with_name(out.name + ".json").read_text())
    assert side["activation"] == "sigmoid" and side["multilabel"] is True
    assert side["thresholds"] == load(trained / "checkpoints" / "best.pt")["thresholds"]
    model, *_ = load_trained(trained)
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        assert (torch.jit.load(str(out))(x) - model(x)).abs().max().item() <= 1e-4


def test_a_run_stopped_mid_epoch_resumes_bit_for_bit(trained, meadows, tmp_path, monkeypatch, capsys,
                                                     request):
    """SIGINT at epoch 2's 4th step (of 6; its checkpoint holds epoch 1's thresholds); the printed command resumes; weights, optimizer, thresholds
    and metrics.jsonl (timings aside) end as the uninterrupted run's."""
    out = tmp_path / "run"
    signal_on_training_batch(request, 6 + 4, signal.SIGINT)
    code = run_main(train, run_of(meadows, out), monkeypatch)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    assert load(out / "checkpoints" / "last.pt")["epoch_step"] == 4
    monkeypatch.undo()
    assert run_main(train, _resume_from_message(err), monkeypatch) == 0
    assert_same_weights(trained / "checkpoints" / "last.pt", out / "checkpoints" / "last.pt")
    assert load(trained / "checkpoints" / "last.pt")["thresholds"] == load(out / "checkpoints" / "last.pt")["thresholds"]
    timing = {"time", "epoch_seconds", "img_per_s", "train_seconds", "val_seconds", "train_data_wait", "figure_seconds"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in rows_of(out / "metrics.jsonl")] == \
        [{k: v for k, v in r.items() if k not in timing} for r in rows_of(trained / "metrics.jsonl")]


@pytest.fixture(scope="module")
def one_process_eval(trained, meadows, tmp_path_factory, one_thread):
    """--eval-only of best.pt in one process, each image its own batch (so every logit is computed alone,
    as under any world size), thresholds tuned on these scores."""
    out = tmp_path_factory.mktemp("ml_eval") / "one"
    root, labels = meadows
    args = run_args(root, out, f"data.labels={labels}", "--batch-size", "1", "eval.tune_thresholds=true",
                    "train.worst_images=4", flags=["--eval-only", "--resume", trained / "checkpoints" / "best.pt"])
    mp = pytest.MonkeyPatch()
    try:
        assert run_main(train, args, mp) == 0
    finally:
        mp.undo()
    return json.loads((out / "eval.json").read_text()), args


@pytest.fixture(scope="module")
def val_scores(trained, meadows):
    """best.pt's sigmoid probabilities of the 7 val meadows, each image alone (as the evaluations run), and their
    0/1 targets, in label-file order."""
    import data
    from utils.config import load_config
    from utils.normalization import model_input, normalization_of
    root, labels = meadows
    _, val_set, _ = data.build_datasets(load_config(run_args(root, trained, f"data.labels={labels}")).data)
    model, *_ = load_trained(trained)
    norm = normalization_of(val_set, torch.device("cpu"))
    with torch.no_grad():
        probs = torch.cat([model(model_input(val_set[i][0][None], torch.device("cpu"), norm))
                           for i in range(len(val_set))]).double().sigmoid()
    return probs, torch.stack([val_set[i][1] for i in range(len(val_set))]).bool()


def test_the_one_process_metrics_equal_the_reference_and_scikit_learns_on_the_same_scores(one_process_eval, val_scores):
    got, _ = one_process_eval
    probs, truth = val_scores
    ref = reference_metrics(probs.numpy(), truth.numpy(), np.array(got["val_threshold"]))
    assert_report_matches(got, ref, tol=1e-6)
    assert_report_matches_sklearn(got, probs, truth, got["val_threshold"], tol=1e-6)
    for c in range(5):  # the tuned thresholds: each label's best F1 over every cut of its scores
        s, y = probs[:, c].numpy(), truth[:, c].numpy()
        if y.any():
            assert got["val_f1"][c] == pytest.approx(max(2 * np.sum((s >= t) & y) / (np.sum(s >= t) + np.sum(y))
                                                         for t in np.unique(s)), abs=1e-9)


@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_multi_label_metrics_equal_one_process(one_process_eval, tmp_path, nproc):
    """train_multi_gpu_ddp.py --eval-only under torchrun (gloo): every rank's scores gathered in dataset
    order, so the metrics, tuned thresholds and worst mistakes are exactly the one-process ones."""
    single, args = one_process_eval
    out = tmp_path / "ddp"
    args = [out if a == args[args.index("--output-dir") + 1] else a for a in args]
    proc = run_entry("train_multi_gpu_ddp.py", *args, nproc=nproc)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    got = json.loads((out / "eval.json").read_text())
    assert set(got) == set(single)
    for key in set(single) - {"checkpoint"}:
        assert got[key] == single[key], key

