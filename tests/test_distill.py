"""Knowledge distillation (train.teacher, train.kd_alpha, train.kd_temperature; engine.distillation_loss,
model.load_teacher) through train.py.

    python -m pytest tests/test_distill.py -q

A teacher run is trained once; a student distils from its run directory: the teacher's val accuracy is
printed at the start, its path and digest go into the run record and the checkpoints while its weights
do not, and a student stopped mid-epoch resumes bit for bit. The loss of a step is (1 - alpha) x the
task's + alpha x T^2 x KL(teacher || student), checked against the same sum in float64 by hand.
"""
import hashlib
import json
import math
import signal

import pytest
import torch
import torch.nn.functional as F

import engine
import train
from _resume_utils import assert_same_run, load, metrics, one_thread, run_args, run_main  # noqa: F401
from conftest import FAST_ARGS, make_image_folder, run_entry
from model import create_model
from test_resume import _resume_from_message, signal_on_training_batch
from utils import run_dir as run_files

STUDENT = ("model.name=mobilenet_v3_small", "train.kd_alpha=0.7", "train.kd_temperature=2")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("distill") / "flowers")  # 25 train: 6 steps of 4


@pytest.fixture(scope="module")
def teacher(data, tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("teacher") / "run"
    mp = pytest.MonkeyPatch()
    try:
        assert run_main(train, run_args(data, out, epochs=2), mp) == 0
    finally:
        mp.undo()
    return out


def by_hand(logits, teacher_logits, targets, alpha, temperature, multilabel):
    """The loss of a step in float64, written out: KL summed over the classes (or each label's two outcomes)."""
    s, t = logits.double() / temperature, teacher_logits.double() / temperature
    if multilabel:
        p, q = t.sigmoid(), s.sigmoid()
        kl = (p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()).mean()
        task = F.binary_cross_entropy_with_logits(logits.double(), targets.double())
    else:
        p, log_p, log_q = t.softmax(1), t.log_softmax(1), s.log_softmax(1)
        kl = (p * (log_p - log_q)).sum(1).mean()
        task = F.cross_entropy(logits.double(), targets)
    return (1 - alpha) * task + alpha * temperature ** 2 * kl


@pytest.mark.parametrize("multilabel", [False, True])
def test_a_steps_loss_is_the_task_and_the_softened_kl_weighted_by_alpha(multilabel):
    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    step = engine.Step(student, opt, None, torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu"),
                       criterion=engine.Criterion(multilabel=multilabel), teacher=teacher, kd_alpha=0.7,
                       kd_temperature=3.0)
    images = torch.randn(5, 6)
    targets = torch.randint(0, 2, (5, 4)).float() if multilabel else torch.randint(0, 4, (5,))
    loss = engine._forward_backward(step, images, targets, stepping=True)
    expected = by_hand(student(images).detach(), teacher(images), targets, 0.7, 3.0, multilabel)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.slow
def test_a_student_distils_from_a_run_and_resumes_bit_for_bit(data, teacher, tmp_path, monkeypatch, capsys,
                                                             request, one_thread):
    straight, out = tmp_path / "straight", tmp_path / "run"
    args = (*STUDENT, f"train.teacher={teacher}")
    assert run_main(train, run_args(data, straight, *args, epochs=2), monkeypatch) == 0
    printed = capsys.readouterr().out
    best = run_files.best(teacher)
    digest = hashlib.sha256(best.read_bytes()).hexdigest()
    their_acc = max(row["val_acc"] for row in metrics(teacher))
    assert f"teacher {teacher} (sha256 {digest[:12]}): val_acc {their_acc:.4f}" in printed
    record = json.loads((straight / run_files.RECORD).read_text())["teacher"]
    assert record == {"source": str(teacher), "path": str(best.resolve()), "sha256": digest}
    state = load(straight / "checkpoints" / "last.pt")
    assert state["record"]["teacher"] == record
    assert state["model"].keys() == create_model("mobilenet_v3_small", 5).state_dict().keys()  # no teacher inside
    assert hashlib.sha256(best.read_bytes()).hexdigest() == digest
    signal_on_training_batch(request, 6 + 3, signal.SIGINT)  # epoch 2's third step
    code = run_main(train, run_args(data, out, *args, epochs=2), monkeypatch)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    monkeypatch.undo()
    assert run_main(train, _resume_from_message(err), monkeypatch) == 0
    assert_same_run(straight, out)
    assert math.isfinite(metrics(out)[-1]["train_loss"])


def test_a_teacher_of_other_classes_is_one_error_line(data, teacher, tmp_path):
    other = make_image_folder(tmp_path / "other", classes=("cats", "dogs"))
    proc = run_entry("train.py", *FAST_ARGS, "--data-path", other, "--output-dir", tmp_path / "run",
                     f"train.teacher={teacher}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "a teacher must be trained on the same class list" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
