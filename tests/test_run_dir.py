"""utils/run_dir.py names every file and folder a run writes: a finished run's directory holds nothing
else, and what it names is there.

    python -m pytest tests/test_run_dir.py -q
"""
import re

from utils import run_dir as run_files


def test_a_finished_run_holds_only_what_run_dir_names(trained_run):
    """The shared run (3 epochs, train.keep_last=3, pictures on): config, record, classes, metrics, lr groups,
    TensorBoard's event file, and checkpoints/ with last.pt, best.pt and one epoch_NNN.pt per epoch."""
    run = trained_run["run_dir"]
    top = {p.name for p in run.iterdir()}
    named = {run_files.CONFIG, run_files.RECORD, run_files.CLASSES, run_files.METRICS, run_files.PARAM_GROUPS,
             run_files.CHECKPOINTS}
    events = {name for name in top if name.startswith("events.out.tfevents.")}
    others = top - named - events - {run_files.EVAL, run_files.PREDICTIONS}  # later tests may add these two
    assert named <= top and len(events) == 1 and not others, sorted(top)
    ckpts = {p.name for p in run_files.checkpoints(run).iterdir()}
    epochs = {run_files.epoch_checkpoint(run, e).name for e in (1, 2, 3)}
    assert ckpts == {run_files.LAST, run_files.BEST} | epochs, sorted(ckpts)
    assert all(re.fullmatch(r"epoch_\d{3}\.pt", name) for name in epochs)
    assert run_files.run_of(run_files.best(run)) == run == run_files.run_of(run / "elsewhere.pt")
    assert run_files.holds_run(run) and not run_files.holds_run(run / "nothing here")
    rows = run_files.read_metrics(run, epochs_only=True)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
