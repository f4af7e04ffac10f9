"""When DDP hangs or refuses: a rank that stops answering, a model with an unused branch, and the
old launcher's --local-rank.

    python -m pytest tests/test_ddp_errors.py -q

The unused branch is a MODELS entry registered by tests/_unused_branch.py before the real
train_multi_gpu_ddp.py runs under torchrun with 2 gloo processes (refused); the run that trains with
the key, and the --local-rank run, call main() in this process, as a process group of one.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import model
import train_multi_gpu_ddp
from _resume_utils import one_thread, run_main  # noqa: F401
from conftest import FAST_ARGS, REPO, cmdline_of, free_port, workers_of
from utils.config import load_config

pytestmark = pytest.mark.slow


def torchrun_cmd(*args):
    """torchrun with 2 gloo processes on localhost; args: torchrun's options, then the script and its own."""
    return [str(c) for c in [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--master_addr=127.0.0.1", f"--master_port={free_port()}", *args]]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(*args, timeout=300):
    return subprocess.run(torchrun_cmd(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=ENV)


def ddp_unused_branch(data, out, *extra):
    """train_multi_gpu_ddp.py on the unused_branch model, through tests/_unused_branch.py."""
    return torchrun(REPO / "tests" / "_unused_branch.py", "train_multi_gpu_ddp.py", *FAST_ARGS,
                    "model.name=unused_branch", "--data-path", data, "--output-dir", out, *extra)


def test_a_stopped_rank_ends_the_job_in_its_timeout_and_the_restart_finishes(image_root, tmp_path):
    """Rank 1 stops (SIGSTOP) in epoch 2 of 3. Within ddp.timeout_minutes (30 s here) rank 0 gives up with
    one line naming the timeout; torchrun --max-restarts=1 kills the stopped worker and restarts, the run
    resumes from last.pt and finishes: every epoch once in metrics.jsonl, no worker left behind.
    The restart runs with the default timeout (tests/_faults.py drops the short one): on a loaded
    machine a slow start-up must not pass for a stopped rank.

    A stopped process takes torchrun's SIGTERM only once it runs again, and torch 2.14's agent waits
    30 s for it whatever --shutdown_timeout says before its SIGKILL: the test sends that SIGKILL as
    soon as the SIGTERM is pending, the one thing torchrun would do next."""
    out, stdout, stderr = tmp_path / "run", tmp_path / "stdout", tmp_path / "stderr"
    cmd = torchrun_cmd("--max-restarts=1", REPO / "tests" / "_faults.py", "stop:1:4", "train_multi_gpu_ddp.py",
                       *FAST_ARGS, "train.epochs=3", "ddp.timeout_minutes=0.5", "--data-path", image_root,
                       "--output-dir", out, "--resume", "auto")
    with open(stdout, "w") as o, open(stderr, "w") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, text=True, cwd=REPO, env=ENV)
    try:
        stopped, deadline = None, time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            stopped = stopped or workers_of(proc.pid).get(1)  # the first attempt's rank 1
            if stopped and sigterm_pending_while_stopped(stopped):
                os.killpg(stopped, signal.SIGKILL)  # its process group, as torchrun's own SIGKILL
                break
            time.sleep(0.1 if stopped else 0.5)
        rc = proc.wait(timeout=max(1, deadline - time.time()))
    finally:
        if proc.poll() is None:  # past the deadline: end the job, a stopped worker included
            for pid in workers_of(proc.pid).values():
                with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                    os.killpg(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
    log = stdout.read_text() + stderr.read_text()
    assert rc == 0, log[-4000:]
    assert f"Sending process {stopped} closing signal SIGTERM" in log  # torchrun ended the stopped rank
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: a collective waited 0.5 min (ddp.timeout_minutes)")
    assert "resumed from" in log and "Traceback" not in stdout.read_text()
    assert [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert not processes_naming(out), "processes of the job still running"


def sigterm_pending_while_stopped(pid):
    """Whether process `pid` is stopped with a SIGTERM waiting for it to run again (/proc/PID/status)."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except OSError:  # ended: nothing to wait for
        return False
    return status["State"].strip().startswith("T") and bool(int(status["ShdPnd"], 16) >> (signal.SIGTERM - 1) & 1)


def processes_naming(text):
    """pids whose command line holds `text` (read from /proc, as pgrep -f would)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(text) in "\0".join(cmdline_of(cmdline.parent.name)):
                found.append(cmdline.parent.name)
        except OSError:  # the process ended meanwhile
            pass
    return found


def test_an_unused_branch_stops_in_one_line_naming_the_key_and_trains_with_it(image_root, tmp_path, monkeypatch,
                                                                            capsys, one_thread):
    """Refused under torchrun with 2 processes (one line, from rank 0). The run with the key is one
    process in this one, DDP-wrapped all the same: a group of one refuses the branch just as 2 ranks
    do (without the key, DDP's reducer stops at the second step whatever the world size), so the key
    reaching DDP is what this run proves; the rank count is the refused half's point."""
    from _unused_branch import UnusedBranch
    r = ddp_unused_branch(image_root, tmp_path / "refused")
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1, (r.stdout + r.stderr)[-3000:]
    assert "ddp.find_unused_parameters=true" in errors[0] and "(aux.weight, aux.bias)" in errors[0], errors
    assert "Expected to have finished reduction" not in r.stdout + r.stderr  # torch's page-long message
    monkeypatch.setitem(model.MODELS, "unused_branch", UnusedBranch)  # as tests/_unused_branch.py does
    code = run_main(train_multi_gpu_ddp, [*FAST_ARGS, "model.name=unused_branch", "--data-path", str(image_root),
                                          "--output-dir", str(tmp_path / "trained"), "ddp.find_unused_parameters=true"],
                    monkeypatch)
    assert code == 0, capsys.readouterr().err[-3000:]
    assert (tmp_path / "trained" / "checkpoints" / "last.pt").is_file()


def test_the_old_launchers_local_rank_trains_with_a_note(image_root, tmp_path, monkeypatch, capsys, one_thread):
    """--local-rank=0 end to end, in this process; the --local_rank spelling is parsed below."""
    monkeypatch.setenv("LOCAL_RANK", "unset")  # recorded, so that the LOCAL_RANK the flag sets goes at teardown
    monkeypatch.delenv("LOCAL_RANK")
    code = run_main(train_multi_gpu_ddp, ["--local-rank=0", *FAST_ARGS, "--data-path", str(image_root),
                                          "--output-dir", str(tmp_path / "run")], monkeypatch)
    out, err = capsys.readouterr()
    assert code == 0, (out + err)[-3000:]
    assert out.count("note: --local-rank is torch.distributed.launch's; torchrun is the launcher to use") == 1
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


def test_local_rank_from_the_environment_wins_over_the_flag(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    load_config(["--local-rank=0"])
    assert os.environ["LOCAL_RANK"] == "1"
    monkeypatch.delenv("LOCAL_RANK")
    load_config(["--local_rank", "3"])
    assert os.environ["LOCAL_RANK"] == "3"  # alone, the flag names this process's device, as it did
