"""train.best_metric / train.best_mode choose best.pt; train.early_stop_patience ends a run early,
resumes to the same stop, and stops every DDP rank at the same epoch.

    python -m pytest -q tests/test_early_stop.py

One 6-epoch train.py run (best.pt by val_loss, every epoch kept) records the curves and is the
uninterrupted reference: the early-stop run is the same training with val_macro_f1 and a patience,
so where it must stop, and its weights there, follow from that run. It is stopped by a real SIGTERM
and resumed. In this process, but for one torchrun launch whose rank 1 sees other numbers than
rank 0 (this file is that launch's worker: see the end).
"""
import contextlib
import io
import os
import signal
import sys

import pytest

from conftest import make_image_folder, run_entry
from _resume_utils import assert_same_weights, load, metrics, one_thread, run_args  # noqa: F401
import run
import train

pytestmark = pytest.mark.usefixtures("one_thread")

EPOCHS, PATIENCE = 6, 2
# optim.lr=0.02, seed 3 on these 25 images: val_loss is lowest (epoch 6) at another epoch than val_acc is
# first highest (5), and val_macro_f1 stalls after epoch 1 (found by trying seeds: 5 val images make the
# curves coarse; test_best_pt_follows_val_loss_down says so if a package update makes them agree again).
RECIPE = ("optim.lr=0.02", "train.seed=3")


def call_main(args, monkeypatch):
    """train.py's main() in this process: (exit code, fit's return value or None)."""
    monkeypatch.setattr(sys, "argv", ["train.py", *map(str, args)])
    try:
        return 0, train.main([str(a) for a in args])
    except SystemExit as e:
        return e.code, None


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("early") / "flowers")  # 25 train / 5 val


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory, one_thread):
    """EPOCHS epochs, best.pt by val_loss (min: auto), every epoch's checkpoint kept."""
    out = tmp_path_factory.mktemp("by_loss") / "run"
    with pytest.MonkeyPatch.context() as mp:
        code, result = call_main(run_args(data, out, *RECIPE, "train.best_metric=val_loss", "train.keep_last=9",
                                          epochs=EPOCHS), mp)
    assert code == 0
    return out, result


def first_best(values, mode):
    """The 1-based epoch of the first strict best, as best.pt takes it."""
    pick = min if mode == "min" else max
    return values.index(pick(values)) + 1


def expected_stop(values, patience, epochs):
    """(stop epoch or None, best epoch then) of a max-mode metric's curve under the patience rule."""
    best, best_epoch, bad = None, 0, 0
    for epoch, v in enumerate(values, start=1):
        if best is None or v > best:
            best, best_epoch, bad = v, epoch, 0
        else:
            bad += 1
        if bad >= patience and epoch < epochs:
            return epoch, best_epoch
    return None, best_epoch


def early_args(data, out, *extra, flags=()):
    return run_args(data, out, *RECIPE, "train.best_metric=val_macro_f1",
                    f"train.early_stop_patience={PATIENCE}", *extra, epochs=EPOCHS, flags=flags)


@pytest.fixture(scope="module")
def early(data, straight, tmp_path_factory, one_thread):
    """The same training, best.pt by val_macro_f1 (max) with a patience, stopped by a real SIGTERM while
    the epoch before its stop evaluates (its patience count already > 0), then continued with
    --resume auto: -> (run directory, fit's return value, the resumed run's log, the stop epoch)."""
    curve = [r["val_macro_f1"] for r in metrics(straight[0])]
    stop, _ = expected_stop(curve, PATIENCE, EPOCHS)
    assert stop is not None, f"the recipe's val_macro_f1 {curve} never stalls for {PATIENCE} epochs"
    out = tmp_path_factory.mktemp("early_run") / "run"
    real_evaluate, evals = run.evaluate, []

    def evaluate_then_signal(*a, **k):
        evals.append(1)
        if len(evals) == stop - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*a, **k)

    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as log:
        mp.setattr(run, "evaluate", evaluate_then_signal)
        assert call_main(early_args(data, out), mp)[0] == 128 + signal.SIGTERM
        assert load(out / "checkpoints" / "last.pt")["bad_epochs"] > 0  # else the resume could not tell
        mp.undo()
        log.seek(0)
        log.truncate()
        code, result = call_main(early_args(data, out, flags=("--resume", "auto")), mp)
    assert code == 0
    return out, result, log.getvalue(), stop


def test_best_pt_follows_val_loss_down(straight):
    out, result = straight
    rows = metrics(out)
    losses = [r["val_loss"] for r in rows]
    best_epoch = first_best(losses, "min")
    assert len(rows) == EPOCHS and not any("event" in r for r in rows)  # ran to its end: no marker
    # The recipe must make the metrics disagree, else a best chosen by val_acc (or by max) would pass too.
    assert best_epoch not in (first_best([r["val_acc"] for r in rows], "max"), first_best(losses, "max")), losses
    best = load(out / "checkpoints" / "best.pt")
    assert (best["epoch"], best["best_epoch"], best["best_score"]) == (best_epoch, best_epoch, min(losses))
    assert (best["best_metric"], best["best_mode"]) == ("val_loss", "min") and "best_acc" not in best
    assert [r["best_loss"] for r in rows] == [min(losses[:i + 1]) for i in range(EPOCHS)]
    assert (result["best_loss"], result["best_epoch"], result["early_stop"]) == (min(losses), best_epoch, False)
    # TensorBoard's HParams tab shows the best of the metric followed, beside the headline val/acc.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    acc = EventAccumulator(str(out)).Reload()
    content = acc.SummaryMetadata("_hparams_/experiment").plugin_data.content
    shown = [m.name.tag for m in plugin_data_pb2.HParamsPluginData.FromString(content).experiment.metric_infos]
    assert shown[:2] == ["val/acc", "val/best_loss"], shown


def test_a_resumed_run_stops_at_the_patience_as_the_uninterrupted_one(straight, early, data, monkeypatch, capsys):
    """The straight run is the same training: up to the stop its lines and epoch files are the
    uninterrupted early-stopped run's."""
    out, result, log, stop = early
    straight_rows = metrics(straight[0])
    curve = [r["val_macro_f1"] for r in straight_rows]
    best_epoch = expected_stop(curve, PATIENCE, EPOCHS)[1]
    lines = metrics(out)
    *rows, done = lines
    assert [r["epoch"] for r in rows] == list(range(1, stop + 1))
    # The marker a tool tells a finished early-stopped run by: the last line, no epoch's.
    assert done == {"event": "done", "reason": "early_stop", "epochs": stop, "best_metric": "val_macro_f1",
                    "best": max(curve[:stop]), "best_epoch": best_epoch}
    assert [r["best_macro_f1"] for r in rows] == [max(curve[:i + 1]) for i in range(stop)]
    trained = [{k: v for k, v in r.items() if not k.startswith("best_")} for r in rows]
    assert trained == [{k: v for k, v in r.items() if not k.startswith("best_")} for r in straight_rows[:stop]]
    assert_same_weights(out / "checkpoints" / "last.pt", straight[0] / "checkpoints" / f"epoch_{stop:03d}.pt",
                        run_state=False)
    assert load(out / "checkpoints" / "last.pt")["bad_epochs"] == PATIENCE
    best = load(out / "checkpoints" / "best.pt")
    assert (best["epoch"], best["best_metric"], best["best_mode"]) == (best_epoch, "val_macro_f1", "max")
    assert_same_weights(out / "checkpoints" / "best.pt", straight[0] / "checkpoints" / f"epoch_{best_epoch:03d}.pt",
                        run_state=False)
    assert (result["best_macro_f1"], result["best_epoch"], result["early_stop"]) == (max(curve[:stop]), best_epoch,
                                                                                     True)
    assert [x for x in log.splitlines() if x.startswith("early stop:")] == [
        f"early stop: val_macro_f1 has not improved for {PATIENCE} epochs (best {max(curve[:stop]):.4f} at epoch "
        f"{best_epoch}); the run ends after epoch {stop}"]
    # Started again once more, the finished run trains nothing and stops at once.
    assert call_main(early_args(data, out, flags=("--resume", "auto")), monkeypatch)[0] == 0
    assert metrics(out) == lines and "early stop:" in capsys.readouterr().out


def test_an_unknown_best_metric_is_refused_in_one_line_before_training(data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    code, _ = call_main(run_args(data, out, "train.best_metric=val_accuracy"), monkeypatch)
    out_text, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "run directory:" not in out_text  # refused before the run started, not after an epoch
    assert lines[0] == ("error: train.best_metric=val_accuracy is not a metric of this run; choose one of "
                        "val_loss, val_acc, val_top5, val_macro_f1")
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_ddp_ranks_stop_at_rank_0s_epoch_though_rank_1_sees_improvement(tmp_path):
    """torchrun, 2 gloo processes. This file's worker feeds each rank its own val_loss: rank 0 a
    rising one (best at epoch 1: patience 1 ends the run after epoch 2 of 3), rank 1 a falling one.
    A decision each rank took alone would send rank 1 into epoch 3 alone: a hang or an error."""
    out, seen = tmp_path / "run", tmp_path / "seen"
    seen.mkdir()
    small = make_image_folder(tmp_path / "small", per_class=3)  # the numbers are the worker's: least training
    proc = run_entry("tests/test_early_stop.py", "train_multi_gpu_ddp.py",
                     *run_args(small, out, "train.best_metric=val_loss", "train.early_stop_patience=1",
                               "ddp.timeout_minutes=0.5", epochs=3),
                     nproc=2, env={"EARLY_STOP_SEEN": str(seen)}, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    *rows, done = metrics(out)
    assert [(r["epoch"], r["val_loss"]) for r in rows] == [(1, 1.0), (2, 2.0)] and done["reason"] == "early_stop"
    assert "early stop: val_loss has not improved for 1 epoch (best 1.0000 at epoch 1)" in proc.stdout
    # Each rank evaluated exactly the two epochs (the worker notes each of its evaluations).
    assert sorted(p.name for p in seen.iterdir()) == ["0", "1"]
    assert all(p.read_text().split() == ["1", "2"] for p in seen.iterdir())


if __name__ == "__main__":
    # The DDP test's worker: python -m torch.distributed.run ... tests/test_early_stop.py SCRIPT ARGS...
    # Each rank's val_loss is replaced by its own curve, then SCRIPT runs unchanged.
    import runpy
    rank, real_validate, evals = int(os.environ["RANK"]), run._validate, []

    def validate_with_own_view(run):
        val, worst, pr = real_validate(run)
        evals.append(str(len(evals) + 1))
        val["val_loss"] = float(len(evals)) if rank == 0 else 1.0 / len(evals)  # rising on 0, falling on 1
        with open(os.path.join(os.environ["EARLY_STOP_SEEN"], str(rank)), "w") as f:
            f.write(" ".join(evals))
        return val, worst, pr

    run._validate = validate_with_own_view
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
