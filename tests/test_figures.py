"""utils/figures.py and what a run puts in TensorBoard, read back with TensorBoard's own EventAccumulator.

    python -m pytest tests/test_figures.py -q

Uses the shared 3-epoch train.py run (conftest.trained_run): every epoch has its
confusion matrix and worst mistakes, the first its augmented samples; every scalar
sits on the global-step axis; the HParams tab has the config; and a run resumed
from an older epoch_NNN.pt leaves no point of the abandoned branch past its step.
"""
import json
import shutil
import sys

import numpy as np
import pytest
import torch

from conftest import FAST_ARGS, make_image_folder, run_entry
from utils import figures
from utils.run_dir import read_metrics

pytestmark = pytest.mark.slow


def accumulate(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_figures_draw_rgb_pictures():
    cm = figures.confusion_matrix_image([[3, 1], [0, 4]], ["cat", "玫瑰"])
    assert cm.dtype == np.uint8 and cm.ndim == 3 and cm.shape[2] == 3 and cm.std() > 0
    images = figures.denormalize(torch.zeros(3, 3, 8, 8), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert torch.allclose(images, torch.full_like(images, 0.5))  # normalization undone
    grid = figures.image_grid(images, ["a", "b", "c"], title="t")
    assert grid.shape[2] == 3


def test_the_per_epoch_pictures_need_no_matplotlib(monkeypatch):
    """A matplotlib figure's text layout cost ~0.1 s per picture every epoch (BENCHMARKS.md, against
    timm's train.py): the confusion matrix and the image grids are drawn in PIL, without it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # any import of it (or of a submodule) fails
    try:
        cm = figures.confusion_matrix_image([[5, 1, 0], [2, 7, 1], [0, 0, 9]], ["a", "b", "c"])
        grid = figures.image_grid(torch.rand(4, 3, 8, 8), ["a -> b\n90%"] * 4, colours=["firebrick"] * 4, title="t")
        empty = figures.image_grid([], [], title="t")
    finally:
        figures._font.cache_clear()  # the fallback font found meanwhile is not kept for later pictures
    assert all(p.dtype == np.uint8 and p.shape[2] == 3 and p.std() > 0 for p in (cm, grid, empty))


def test_every_epoch_has_its_pictures_and_the_first_its_samples(trained_run):
    acc = accumulate(trained_run["run_dir"])
    ends = [row["step"] for row in read_metrics(trained_run["run_dir"])]
    assert len(ends) == 3
    assert [e.step for e in acc.Images("val/confusion_matrix")] == ends
    assert [e.step for e in acc.Images("val/worst_mistakes")] == ends
    assert [e.step for e in acc.Images("train/augmented_samples")] == [0]


def test_every_number_of_metrics_jsonl_is_a_scalar_on_the_global_step_axis(trained_run):
    run_dir = trained_run["run_dir"]
    acc = accumulate(run_dir)
    rows = read_metrics(run_dir)
    tags = set(acc.Tags()["scalars"])
    ends = [row["step"] for row in rows]
    for key, tag in (("val_acc", "val/acc"), ("train_loss", "train/loss"), ("val_macro_f1", "val/macro_f1"),
                     ("val_top5", "val/top5"), ("lr", "train/epoch_lr"), ("best_acc", "val/best_acc"),
                     ("val_acc_ema", "val/acc_ema")):  # the EMA of the weights (train.ema_decay), evaluated beside them
        assert [p.step for p in acc.Scalars(tag)] == ends, tag
        assert [p.value for p in acc.Scalars(tag)] == pytest.approx([r[key] for r in rows], rel=1e-5), tag
    assert {f"val/f1/{c}" for c in ("daisy", "tulips")} <= tags and "val/precision/roses" in tags
    numeric = {k for k, v in rows[0].items() if isinstance(v, (int, float)) and k not in ("time", "step")}
    assert len(numeric) >= 12 and all(acc.Scalars(t) for t in tags)
    # The lr once per log window (train.log_every=2 steps): the schedule's shape, on the same axis.
    assert [p.step for p in acc.Scalars("train/lr")] == list(range(2, ends[-1] + 1, 2))
    assert max(p.step for t in tags for p in acc.Scalars(t)) == ends[-1]
    # metrics.jsonl holds the confusion matrix and per-class precision, recall and F1.
    assert np.array(rows[-1]["val_confusion"]).sum() == rows[-1]["val_count"] == 5
    assert len(rows[-1]["val_f1"]) == len(rows[-1]["val_precision"]) == len(rows[-1]["val_recall"]) == 5


def test_tensorboard_records_are_checksummed_in_c_as_tensorboard_checks_them(trained_run, tmp_path):
    """TensorBoard without TensorFlow checksums each record in pure Python, holding the GIL on its writer
    thread while the training loop waits (benchmarks/pictures.py); the RunLogger's writer computes the same
    CRC-32C with google-crc32c instead. Every record of the run's event file carries the checksum that
    TensorBoard's own pure-Python function computes, and a RunLogger's writer uses the C one."""
    import os
    import struct

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as in_python
    from tensorboard.summary.writer import record_writer

    pytest.importorskip("google_crc32c", reason="google-crc32c is not installed (pip install -r requirements.txt)")
    from utils.run_logger import RunLogger, masked_crc32c
    for data in (b"", b"\x00", os.urandom(7), os.urandom(100_003)):
        assert masked_crc32c(data) == in_python(data)
    events, = trained_run["run_dir"].glob("events.out.tfevents.*")
    raw, records, at = events.read_bytes(), 0, 0
    while at < len(raw):  # TFRecord: length, its CRC, the data, its CRC
        header = raw[at:at + 8]
        length, = struct.unpack("<Q", header)
        header_crc, = struct.unpack("<I", raw[at + 8:at + 12])
        data = raw[at + 12:at + 12 + length]
        data_crc, = struct.unpack("<I", raw[at + 12 + length:at + 16 + length])
        assert (header_crc, data_crc) == (in_python(header), in_python(data)), f"record {records}"
        at, records = at + 16 + length, records + 1
    assert records > 50  # scalars, pictures and the hparams, every one checked
    logger = RunLogger(tmp_path / "logger", enabled=True)
    logger.wait()  # the writer is opened on the logger's thread
    try:
        assert record_writer.masked_crc32c is masked_crc32c
    finally:
        logger.close()


def test_hparams_tab_holds_the_config(trained_run):
    from tensorboard.plugins.hparams import plugin_data_pb2
    acc = accumulate(trained_run["run_dir"])
    content = acc.SummaryMetadata("_hparams_/session_start_info").plugin_data.content
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert info.hparams["model.name"].string_value == "resnet18"
    assert info.hparams["train.epochs"].number_value == 3


def test_resume_from_an_older_epoch_leaves_no_point_of_the_abandoned_branch(trained_run, tmp_path):
    """Resumed from epoch_001.pt and run to epoch 2 (the checkpoint said 3): the first run's
    points of epochs 2 and 3 are gone, epoch 1's stay, and no step appears twice."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run["run_dir"], run_dir)
    first = read_metrics(run_dir)
    proc = run_entry("train.py", *trained_run["base"], "--output-dir", run_dir, "train.epochs=2",
                     "--resume", run_dir / "checkpoints" / "epoch_001.pt")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    acc = accumulate(run_dir)
    resumed_at, end = first[0]["step"], first[1]["step"]
    for tag in acc.Tags()["scalars"]:
        steps = [p.step for p in acc.Scalars(tag)]
        assert steps == sorted(set(steps)), f"{tag}: a step twice or out of order: {steps}"
        assert max(steps) <= end, f"{tag}: a point of the abandoned epoch 3: {steps}"
    assert [e.step for e in acc.Images("val/confusion_matrix")] == [resumed_at, end]
    assert [e.step for e in acc.Scalars("val/acc")] == [resumed_at, end]


def test_pictures_drawn_beside_the_next_epoch_are_of_their_own_epochs_weights(tmp_path):
    """The epoch's pictures are drawn on the logger's thread while the next epoch trains (run._pictures):
    its worst mistakes' Grad-CAM maps must come from the epoch's own weights, not from the model training
    on, and the training must not feel them. Epoch 1's picture in TensorBoard equals the one --eval-only
    draws from epoch_001.pt (the same function, synchronously), pixel for pixel; the run's checkpoints
    equal those of the same run without pictures, bit for bit; and epoch_001.pt, written beside epoch 2,
    scores epoch 1's val_loss exactly."""
    from io import BytesIO

    from PIL import Image
    data = make_image_folder(tmp_path / "flowers", per_class=10)
    base = [*FAST_ARGS, "--data-path", data, "train.epochs=2", "train.keep_last=2", "train.worst_images=4",
            "optim.lr=0.05"]
    drawn, plain = tmp_path / "drawn", tmp_path / "plain"
    for out, figures_on in ((drawn, "true"), (plain, "false")):
        proc = run_entry("train.py", *base, f"train.figures={figures_on}", "--output-dir", out)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for name in ("epoch_001.pt", "epoch_002.pt"):
        mine, theirs = (torch.load(d / "checkpoints" / name, weights_only=True) for d in (drawn, plain))
        assert all(torch.equal(mine["model"][k], theirs["model"][k]) for k in theirs["model"])
    again = run_entry("train.py", *base, "--output-dir", tmp_path / "again", "--eval-only", "--resume",
                      drawn / "checkpoints" / "epoch_001.pt")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    # The checkpoint written beside epoch 2 (utils/checkpoint.py) holds epoch 1's weights: they score its line.
    scored = json.loads((tmp_path / "again" / "eval.json").read_text())
    assert scored["val_loss"] == pytest.approx(read_metrics(drawn)[0]["val_loss"], rel=1e-12, abs=0)
    first = accumulate(drawn).Images("val/worst_mistakes")[0]
    assert first.step == read_metrics(drawn)[0]["step"]
    in_tensorboard = np.asarray(Image.open(BytesIO(first.encoded_image_string)).convert("RGB"))
    redrawn = np.asarray(Image.open(tmp_path / "again" / "worst_mistakes.png").convert("RGB"))
    assert in_tensorboard.shape == redrawn.shape and in_tensorboard.std() > 0
    assert np.array_equal(in_tensorboard, redrawn)
