"""Resume equals an uninterrupted run (train.py, in this process, real signals).

    python -m pytest tests/test_resume.py -q

4 epochs straight vs the same command stopped by a real SIGTERM after epoch 2
(or a SIGINT in the middle of epoch 2) and continued with the one command the
stop message prints: final weights, optimizer state and schedule bit-for-bit
equal, metrics.jsonl equal except timings. The DDP variants, with torchrun and
kill -9, are in test_ddp_resume.py.
"""
import os
import shlex
import signal

import pytest
import torch

import train
from _resume_utils import assert_same_run, load, metrics, one_thread, run_args, run_main  # noqa: F401
from conftest import make_image_folder
import engine
import run


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("resume") / "flowers")  # 25 train: 6 steps/epoch


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory, one_thread):
    """The reference: 4 epochs without interruption."""
    out = tmp_path_factory.mktemp("straight") / "run"
    mp = pytest.MonkeyPatch()
    try:
        assert run_main(train, run_args(data, out), mp) == 0
    finally:
        mp.undo()
    return out


def signal_on_training_batch(request, n, sig):
    """A real `sig` to this process as the loop takes its n-th training batch (engine.register_batch_hook:
    evaluation's batches are not counted), once; returns the list that counts the batches taken. The
    hook goes with the test."""
    taken = []

    def signal_at_n(images, labels):
        taken.append(1)
        if len(taken) == n:
            os.kill(os.getpid(), sig)

    request.addfinalizer(engine.register_batch_hook(signal_at_n).remove)
    return taken


def _resume_from_message(err, script="train.py"):
    """The 'Resume with: python train.py ...' command of the stop line -> that command's arguments."""
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err
    cmd = shlex.split(lines[0].split("Resume with: ", 1)[1])
    assert cmd[:2] == ["python", script]
    return cmd[2:]


@pytest.mark.slow
def test_sigterm_after_epoch_2_then_resume_equals_straight_run(data, straight, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_evaluate, evals = run.evaluate, []

    def evaluate_then_signal(*a, **k):
        evals.append(1)
        if len(evals) == 2:  # a real SIGTERM to this process while epoch 2 evaluates
            os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*a, **k)

    monkeypatch.setattr(run, "evaluate", evaluate_then_signal)
    code = run_main(train, run_args(data, out), monkeypatch)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after epoch 2" in err
    state = load(out / "checkpoints" / "last.pt")
    assert (state["epoch"], state["epoch_step"]) == (2, 0)
    assert len(metrics(out)) == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # fit put the handlers back

    monkeypatch.setattr(run, "evaluate", real_evaluate)
    args = _resume_from_message(err)
    assert run_main(train, args, monkeypatch) == 0
    assert "resumed from" in capsys.readouterr().out
    assert_same_run(straight, out)


@pytest.mark.slow
def test_sigint_mid_epoch_stops_at_next_step_and_resume_equals_straight_run(data, straight, tmp_path,
                                                                         monkeypatch, capsys, request):
    out = tmp_path / "run"
    steps = signal_on_training_batch(request, 6 + 3, signal.SIGINT)  # Ctrl-C during the 3rd step of epoch 2
    code = run_main(train, run_args(data, out), monkeypatch)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    assert "stopped by SIGINT in epoch 2, global step 9" in err
    state = load(out / "checkpoints" / "last.pt")
    # The step in flight finished, then the run stopped: epoch 2 has 3 of its 6 steps done.
    assert (state["epoch"], state["epoch_step"], state["global_step"]) == (1, 3, 9)
    assert len(steps) == 9  # not one batch more was drawn

    monkeypatch.undo()
    assert run_main(train, _resume_from_message(err), monkeypatch) == 0
    assert "at epoch 2 after its step 3" in capsys.readouterr().out
    assert_same_run(straight, out)


def test_resume_auto_starts_fresh_in_an_empty_directory_and_a_restart_needs_output_dir(data, tmp_path,
                                                                                        monkeypatch, capsys):
    out = tmp_path / "run"
    assert run_main(train, run_args(data, out, "train.batch_size=12", epochs=1, flags=["--resume", "auto"]),
                    monkeypatch) == 0
    assert len(metrics(out)) == 1
    # Under torchrun --max-restarts a restarted worker must find the run again: no fixed directory, one line.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    args = [a for a in run_args(data, out, epochs=1) if a not in ("--output-dir", str(out))]
    assert run_main(train, args, monkeypatch) == 2
    assert "no fixed --output-dir" in capsys.readouterr().err


# Every recipe option that keeps state or draws random numbers, at once: the EMA of the weights,
# the balanced sampler, accumulation (2 batches per step), MixUp/CutMix, auto class weights.
RECIPE = ["train.ema_decay=0.9", "data.sampler=balanced", "train.accum_steps=2", "data.mixup_alpha=0.4",
          "data.cutmix_alpha=1.0", "optim.class_weights=auto"]


@pytest.mark.slow
def test_recipe_options_resume_mid_step_bit_for_bit(data, tmp_path, monkeypatch, capsys, request):
    """A SIGINT between the two batches of a step in epoch 2: the run stops at that step's end and
    the resumed run ends with the same weights, EMA weights, optimizer and metrics as a straight one."""
    straight, out = tmp_path / "straight", tmp_path / "run"
    assert run_main(train, run_args(data, straight, *RECIPE, epochs=2), monkeypatch) == 0
    # The first batch of epoch 2's second step (3 steps of 2 batches).
    signal_on_training_batch(request, 6 + 3, signal.SIGINT)
    code = run_main(train, run_args(data, out, *RECIPE, epochs=2), monkeypatch)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    state = load(out / "checkpoints" / "last.pt")
    assert (state["epoch"], state["epoch_step"], state["global_step"]) == (1, 4, 5)  # on the step's boundary
    monkeypatch.undo()
    assert run_main(train, _resume_from_message(err), monkeypatch) == 0
    assert_same_run(straight, out)
    a, b = load(straight / "checkpoints" / "last.pt"), load(out / "checkpoints" / "last.pt")
    assert a["ema"].keys() == b["ema"].keys()
    for k in a["ema"]:
        assert torch.equal(a["ema"][k], b["ema"][k]), f"EMA tensor {k} differs"
    assert a["best_weights"] == b["best_weights"] and "val_acc_ema" in metrics(out)[-1]


@pytest.mark.slow
def test_persistent_workers_resume_mid_epoch_bit_for_bit(data, tmp_path, monkeypatch, capsys, request):
    """data.num_workers=2, workers that live across epochs: 2 epochs straight (epoch 2 on epoch 1's
    workers) == stopped by SIGINT in epoch 2 and resumed (epoch 2 on fresh workers, 3 steps skipped).
    Later epochs on the same workers: tests/test_loader.py."""
    straight, out = tmp_path / "straight", tmp_path / "run"
    assert run_main(train, run_args(data, straight, "data.num_workers=2", epochs=2), monkeypatch) == 0
    signal_on_training_batch(request, 6 + 3, signal.SIGINT)
    code = run_main(train, run_args(data, out, "data.num_workers=2", epochs=2), monkeypatch)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    assert load(out / "checkpoints" / "last.pt")["epoch_step"] == 3
    monkeypatch.undo()
    assert run_main(train, _resume_from_message(err), monkeypatch) == 0
    assert_same_run(straight, out)
