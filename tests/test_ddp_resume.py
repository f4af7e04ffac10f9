"""DDP under the real launcher: SIGTERM, kill -9 with torchrun restarts, NaN on one rank.

    python -m pytest tests/test_ddp_resume.py -q

Every run is torchrun with 2 gloo processes on the CPU. The SIGTERM and the kill -9 are two stops
of one run (the command the SIGTERM's line prints is the one that is then killed), compared with one
uninterrupted 4-epoch run of the same command: it must end with bit-for-bit the same weights and
the same metrics.jsonl (timings aside).
"""
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from _resume_utils import assert_same_run, load, metrics, run_args
from conftest import REPO, free_port, make_image_folder, run_entry, workers_of

pytestmark = pytest.mark.slow
DDP = "train_multi_gpu_ddp.py"
# log_every=1: ranks compare notes every step, so a stop lands on the very next step.
EXTRA = ("train.log_every=1",)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("ddp") / "flowers")  # 2 ranks x 3 steps per epoch


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_straight") / "run"
    r = run_entry(DDP, *run_args(data, out, *EXTRA), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


class Launch:
    """torchrun in the background, its output collected line by line."""

    def __init__(self, script, args, *launcher_args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *launcher_args,
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(REPO / script), *map(str, args)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=REPO)
        self.lines = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait(self, timeout=300):
        try:
            rc = self.proc.wait(timeout)
        finally:
            self.proc.kill()
            self._reader.join(10)
        return rc, "".join(self.lines)

    def workers(self):
        """{rank: pid} of the worker processes torchrun started."""
        return workers_of(self.proc.pid)


def _wait_for(predicate, proc, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert proc.poll() is None, "the run ended before the moment the test waits for"
        time.sleep(0.02)
    raise AssertionError("timed out")


def _epochs_done(run_dir):
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


STEPS_PER_EPOCH = 3  # the data fixture's 24 training images, 2 ranks x batch 4


@pytest.fixture(scope="module")
def stopped_then_killed(data, tmp_path_factory):
    """One run, stopped twice: SIGTERM to torchrun after epoch 1; then the command its stop line prints,
    launched with --max-restarts=2 (and a save after every step), loses rank 0 to kill -9 right after
    a mid-epoch save, and torchrun's restart finishes it. The SIGTERM test asserts on the first half,
    the kill -9 test on the second; both end on the straight run's weights and metrics."""
    out = tmp_path_factory.mktemp("ddp_stopped") / "run"
    last = out / "checkpoints" / "last.pt"
    run = Launch(DDP, run_args(data, out, *EXTRA))
    _wait_for(lambda: _epochs_done(out) >= 1, run.proc)
    run.proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both workers
    stopped = {"out": out, "log": run.wait(120)}
    stopped["state"] = state = load(last)
    stops = [x for x in stopped["log"][1].splitlines() if x.startswith("error: stopped by SIGTERM")]
    assert stops, stopped["log"][1][-3000:]
    cmd = shlex.split(stops[0].split("Resume with: ", 1)[1])
    # The printed command, as is, under torchrun with restarts; saving every step changes no number.
    run = Launch(DDP, [*cmd[3:], "train.save_every_steps=1"], "--max-restarts=2")
    # Kill rank 0, the one that writes, right after a save of this run's (past the SIGTERM's) inside an epoch.
    _wait_for(lambda: last.exists() and (g := load(last)["global_step"]) > state["global_step"]
              and g % STEPS_PER_EPOCH, run.proc)
    killed_at = load(last)["global_step"]
    workers = run.workers()
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[0], signal.SIGKILL)
    return {**stopped, "stops": stops, "cmd": cmd, "killed_at": killed_at, "resumed": run.wait(300)}


def _resumed_lines(log):
    return [x for x in log.splitlines() if "resumed from" in x]


def test_sigterm_stops_all_ranks_with_a_checkpoint_and_the_printed_command_resumes_exactly(stopped_then_killed,
                                                                                           straight):
    run = stopped_then_killed
    rc, log = run["log"]
    assert rc != 0
    assert len(run["stops"]) == 1, log[-3000:]  # one line, from rank 0
    state = run["state"]
    assert state["epoch"] >= 1 and len(state["ranks"]) == 2  # both ranks' random states
    cmd = run["cmd"]
    assert cmd[:2] == ["torchrun", "--nproc_per_node=2"] and Path(cmd[2]).name == DDP, cmd

    rc, log = run["resumed"]
    assert rc == 0, log[-4000:]
    resumed = _resumed_lines(log)  # the printed command's first, then the kill -9 test's restart
    assert resumed and resumed[0].endswith(f"global step {state['global_step']})"), resumed
    # ...and the printed command itself resumed: no error before it, as a refusal then a restart would print.
    before = log[:log.index(resumed[0])].splitlines()
    assert not [x for x in before if x.startswith("error:")], before[-20:]
    assert_same_run(straight, run["out"])


def test_kill_9_of_a_worker_mid_epoch_torchrun_restarts_and_the_run_finishes_exactly(stopped_then_killed,
                                                                                     straight):
    run = stopped_then_killed
    rc, log = run["resumed"]
    assert rc == 0, log[-4000:]
    resumed = _resumed_lines(log)
    assert len(resumed) == 2, log[-4000:]  # the printed command's resume, then one restart that continued
    # It continued from the mid-epoch save the kill followed (or a later one): nothing before the
    # unfinished epoch was redone.
    at = int(resumed[1].rsplit("global step ", 1)[1].rstrip(")"))
    assert at >= run["killed_at"] and f"at epoch {at // STEPS_PER_EPOCH + 1}" in resumed[1], resumed
    assert [m["epoch"] for m in metrics(run["out"])] == [1, 2, 3, 4]
    assert_same_run(straight, run["out"])


def test_nan_on_one_rank_stops_every_rank_and_keeps_the_last_good_checkpoint(data, tmp_path):
    out = tmp_path / "run"
    # Rank 1's 5th step (epoch 2, global step 4) and later give a NaN loss; saves after every step.
    r = run_entry("tests/_faults.py", "nan:1:4", DDP,
                  *run_args(data, out, *EXTRA, "train.save_every_steps=1", epochs=2), nproc=2, timeout=180)
    assert r.returncode != 0
    assert "loss is nan at epoch 2, step 4" in r.stderr, r.stderr[-3000:]
    state = load(out / "checkpoints" / "last.pt")
    assert state["global_step"] == 4
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())


def test_a_sigterm_to_one_rank_during_evaluation_stops_every_rank_after_the_epoch(data, tmp_path):
    """Rank 1 alone is signalled, while it evaluates epoch 1: its training windows are over, so the
    vote after evaluation is what tells rank 0. Both stop with epoch 1's checkpoint, in one line."""
    out = tmp_path / "run"
    r = run_entry("tests/_faults.py", "term:1:1", DDP, *run_args(data, out, *EXTRA, epochs=3), nproc=2,
                  timeout=240)
    log = r.stdout + r.stderr
    errors = [x for x in log.splitlines() if x.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1, log[-3000:]  # one line, from rank 0, which was not signalled
    assert errors[0].startswith("error: stopped by a stop request on another rank after epoch 1, global step 3")
    assert [m["epoch"] for m in metrics(out)] == [1] and load(out / "checkpoints" / "last.pt")["epoch"] == 1


def test_a_failed_save_on_rank_0_stops_every_rank_in_one_line(data, tmp_path):
    """Rank 0 cannot write epoch 2's checkpoint (disk full); rank 1, which writes nothing, hears of it in
    the vote after the save and stops too, instead of training on into a collective rank 0 never joins."""
    out, raised = tmp_path / "run", tmp_path / "raised.tsv"
    r = run_entry("tests/_faults.py", "nospace:0:2", DDP, *run_args(data, out, *EXTRA, epochs=3), nproc=2,
                  timeout=240, env={"FAULT_ERRORS": str(raised)})
    log = r.stdout + r.stderr
    errors = [x for x in log.splitlines() if x.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "could not write checkpoint" in errors[0], log[-3000:]
    assert "No space left on device" in errors[0]
    # Rank 1 stopped at the save itself, on the vote's word (torchrun would have ended it anyway once
    # rank 0 exited, so the printed lines alone cannot tell; the error it raised, unprinted, can).
    by_rank = dict(line.split("\t", 1) for line in raised.read_text().splitlines())
    assert by_rank.get("1") == "rank 0 could not write its checkpoint; stopping", by_rank
    assert load(out / "checkpoints" / "last.pt")["epoch"] == 1 and [m["epoch"] for m in metrics(out)] == [1]
