"""Helpers shared by the checkpoint / resume tests: tiny runs, and 'same run' comparisons."""
import contextlib
import sys

import pytest
import torch

from conftest import FAST_ARGS
from utils.run_dir import read_metrics

# Metrics that measure time; everything else in a metrics.jsonl line must match exactly.
TIMING = {"time", "epoch_seconds", "img_per_s", "train_seconds", "val_seconds", "train_data_wait"}


def run_args(data, out, *overrides, epochs=4, flags=()):
    """A tiny run: resnet18 at 32 px, batch 4, seed fixed; `overrides` (key=value) win over these.

    Flags go first: the command line takes its key=value overrides as one run of words."""
    return ["--data-path", str(data), "--output-dir", str(out), *map(str, flags), *FAST_ARGS,
            f"train.epochs={epochs}", "train.amp=off", *map(str, overrides)]


def run_main(script_module, args, monkeypatch):
    """Call an entry script's main() in this process, with sys.argv as a user would have typed it.

    Returns the exit code (0 when main returns normally)."""
    monkeypatch.setattr(sys, "argv", [f"{script_module.__name__}.py", *args])
    try:
        script_module.main(args)
    except SystemExit as e:
        return e.code
    return 0


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(a, b, run_state=True):
    """Every model tensor, optimizer buffer, the schedule and (`run_state`) the run state of two checkpoints:
    bit-for-bit equal."""
    a, b = load(a), load(b)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"model tensor {k} differs"
    for pid, st in a["optimizer"]["state"].items():
        for name, t in st.items():
            assert torch.equal(t, b["optimizer"]["state"][pid][name]), f"optimizer {pid}.{name} differs"
    assert a["scheduler"] == b["scheduler"]
    if not run_state:
        return
    # The run state (utils.checkpoint.RunState; best_acc only where the best is val_acc's or val_map's).
    run_state = ("epoch", "global_step", "best_acc", "best_score", "best_metric", "best_mode", "best_epoch",
                 "bad_epochs")
    assert {k: a.get(k) for k in run_state} == {k: b.get(k) for k in run_state}


def metrics(run_dir):
    return [{k: v for k, v in m.items() if k not in TIMING} for m in read_metrics(run_dir)]


def assert_same_run(straight, resumed):
    assert_same_weights(straight / "checkpoints" / "last.pt", resumed / "checkpoints" / "last.pt")
    assert metrics(straight) == metrics(resumed)


@contextlib.contextmanager
def single_thread():
    """One intra-op thread inside, as run_entry's OMP_NUM_THREADS=1 gives a subprocess: on a shared 2-core
    box spinning OpenMP threads double the CPU time, and the CPU kernels round as in those runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """A module's in-process runs on one intra-op thread (single_thread)."""
    with single_thread():
        yield
