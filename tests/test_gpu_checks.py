"""tools/gpu_checks.sh's own plumbing, on CPU: the setup from a wheel folder, the archive, the time limit.

    python -m pytest tests/test_gpu_checks.py -q

Each test runs the real script with STEPS/TESTS choosing one cheap step, so the paths a GPU machine
takes (setup from WHEELS into a Python without omegaconf, a step stopped by its limit) run here too.
"""
import base64
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import omegaconf
import pytest

from conftest import REPO

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tools" / "gpu_checks.sh"


def start_script(tmp_path, env):
    """The script in a process group of its own, so that a failing test can kill all of it."""
    full = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), **env}
    return subprocess.Popen(["bash", str(SCRIPT)], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def kill_script(script):
    if script.poll() is None:
        os.killpg(script.pid, signal.SIGKILL)
    script.communicate()


def run_script(tmp_path, env, timeout=240):
    script = start_script(tmp_path, env)
    try:
        out, err = script.communicate(timeout=timeout)
    finally:
        kill_script(script)
    return subprocess.CompletedProcess(script.args, script.returncode, out, err)


def archive_names(out):
    with tarfile.open(out / "gpu_checks.tgz") as t:
        return set(t.getnames())


def summary_rows(out):
    """{step: [result, seconds, limit, finished, not finished]} from OUT/summary.md."""
    rows = {}
    for line in (out / "summary.md").read_text().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


# ------------------------------------------------------------------ setup: omegaconf from a wheel folder

def omegaconf_wheel(folder):
    """The installed omegaconf repacked as the wheel PyPI serves (omegaconf-<ver>-py3-none-any.whl):
    its package folder and its .dist-info (METADATA, WHEEL, a RECORD of what the zip holds)."""
    site = Path(omegaconf.__file__).parent.parent
    dist_info = next(site.glob(f"omegaconf-{omegaconf.__version__}.dist-info"))
    files = [p for p in sorted((site / "omegaconf").rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    # What the installer added (INSTALLER, REQUESTED, direct_url.json) is no part of a wheel; RECORD is rewritten.
    files += [p for p in sorted(dist_info.rglob("*")) if p.is_file() and
              p.name not in ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")]
    wheel = folder / f"omegaconf-{omegaconf.__version__}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for p in files:
            arc, data = p.relative_to(site).as_posix(), p.read_bytes()
            z.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(data)}")
        record.append(f"{dist_info.name}/RECORD,,")
        z.writestr(f"{dist_info.name}/RECORD", "\n".join(record) + "\n")
    return wheel


HIDE = """\
# This interpreter's own copies of these modules are hidden; a copy elsewhere on sys.path (PYTHONPATH)
# still imports.
import importlib.machinery, os, sys
HIDDEN = {hidden!r}
NAMES = {names!r}

class HideInstalledModules:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in NAMES:
            return None
        rest = [p for p in sys.path if os.path.realpath(p or ".") != HIDDEN]
        spec = importlib.machinery.PathFinder.find_spec(name, rest)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return spec

sys.meta_path.insert(0, HideInstalledModules)
"""


def python_without(tmp_path, *names):
    """A PYTHON for the script: this venv's interpreter, with torch, pytest... but none of `names` importable.
    The hiding sitecustomize rides on PYTHONPATH, so the processes it starts (sys.executable) lack them too."""
    hide = tmp_path / "hide"
    hide.mkdir()
    hidden = os.path.realpath(Path(omegaconf.__file__).parent.parent)  # this venv's site-packages
    (hide / "sitecustomize.py").write_text(HIDE.format(hidden=hidden, names=set(names)))
    wrapper = tmp_path / f"python-without-{'-'.join(names)}"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{hide}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def python_without_omegaconf(tmp_path):
    return python_without(tmp_path, "omegaconf")


def test_setup_installs_omegaconf_from_its_wheel_alone_and_the_run_goes_on(tmp_path):
    """A Python where `import omegaconf` fails, a folder with only the omegaconf wheel (as the documented
    `pip download --no-deps` makes it: no PyYAML): setup succeeds, a step that imports omegaconf passes,
    and everything lands in OUT/gpu_checks.tgz with summary.md beside it."""
    py = python_without_omegaconf(tmp_path)
    gone = subprocess.run([str(py), "-c", "import omegaconf"], capture_output=True, text=True)
    assert gone.returncode != 0 and "No module named 'omegaconf'" in gone.stderr
    wheels = tmp_path / "wheels"
    omegaconf_wheel(wheels)
    assert [p.name for p in wheels.iterdir()] == [f"omegaconf-{omegaconf.__version__}-py3-none-any.whl"]

    installed = tmp_path / "work" / "site" / "omegaconf" / "__init__.py"
    # A test file that imports omegaconf when collected, as test_optim.py does (utils.config), without
    # test_optim.py's torch import: the copy setup installed, or a collection error.
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE.format(installed=str(installed), gpu_mark=GPU_MARK))
    r = run_script(tmp_path, {"PYTHON": str(py), "WHEELS": str(wheels), "QUICK": "1", "TESTS": str(probe),
                              "STEPS": "test_probe"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    out = tmp_path / "out"
    assert f"omegaconf from {installed}" in r.stdout
    rows = summary_rows(out)
    assert rows["setup"][0] == "ok" and rows["test_probe"][0] == "ok", rows
    # Its GPU test was collected (omegaconf imported) and skipped.
    assert "skipped" in rows["test_probe"][3], rows
    assert sorted(p.name for p in out.iterdir()) == ["gpu_checks.tgz", "summary.md"]
    names = archive_names(out)
    for name in ("summary.md", "gpu_checks.log", "logs/setup.log", "logs/test_probe.log", "junit-probe.xml"):
        assert f"gpu_checks/{name}" in names, sorted(names)


PROBE = """\
import omegaconf
import pytest

assert omegaconf.__file__ == {installed!r}, omegaconf.__file__


{gpu_mark}
@pytest.mark.skip(reason="a GPU test, on the CPU")
def test_on_the_gpu():
    pass
"""


def test_a_missing_module_without_wheels_is_one_error_line(tmp_path):
    py = python_without_omegaconf(tmp_path)
    r = run_script(tmp_path, {"PYTHON": str(py), "WHEELS": "", "STEPS": "test_optim"}, timeout=60)
    assert r.returncode == 1
    assert [line for line in r.stdout.splitlines() if line.startswith("error:")] == [
        "error: python modules missing: omegaconf; pip install -r requirements.txt, or WHEELS=<folder of wheels>"]


def test_setup_names_every_missing_module_before_any_step_in_the_planned_order(tmp_path):
    """Modules that only later steps import (matplotlib for the pictures and charts, pytest for the tests)
    are named at setup, all at once; and the plan runs the FSDP memory tool, the FSDP training, the fp16
    resume and deterministic's bitwise check after the tests and before the timed steps, the compile last."""
    py = python_without(tmp_path, "matplotlib", "pytest")
    r = run_script(tmp_path, {"PYTHON": str(py), "WHEELS": ""}, timeout=60)
    assert r.returncode == 1, r.stdout[-3000:]
    assert [line for line in r.stdout.splitlines() if line.startswith("error:")] == [
        "error: python modules missing: matplotlib pytest; pip install -r requirements.txt, "
        "or WHEELS=<folder of wheels>"]
    assert not (tmp_path / "work" / "results" / "gpu_checks" / "logs" / "data.log").exists(), "a step ran"
    plan = next(line for line in r.stdout.splitlines() if line.startswith("steps: ")).split()[1:]
    tests = [s for s in plan if s.startswith("test_")]
    assert tests and plan == ["setup", "data", *tests, "ddp_check", "fsdp_memory", "train_fsdp", "resume_fp16",
                              "deterministic", "benchmark", "scaling", "deterministic_cost",
                              "benchmark_compile"], plan


def test_the_rehearsal_runs_the_fsdp_training_the_fp16_resume_and_the_deterministic_check(tmp_path):
    """QUICK=1 on the CPU: train_multi_gpu_fsdp.py for 2 epochs over 2 gloo processes with train.profile,
    train.py's CPU checkpoint resumed (on the CPU here, on CUDA with fp16 on a GPU), and two deterministic
    runs compared bit for bit: each step checks what its run wrote and the summary says what was trained.
    pytest is missing and the test steps are not chosen: no error."""
    py = python_without(tmp_path, "pytest")
    r = run_script(tmp_path, {"PYTHON": str(py), "QUICK": "1", "STEPS": "data train_fsdp resume_fp16 deterministic"},
                   timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = summary_rows(tmp_path / "out")
    assert list(rows) == ["data", "train_fsdp", "resume_fp16", "deterministic"], rows
    assert rows["train_fsdp"][0] == "ok" and rows["train_fsdp"][3].startswith("2 epochs, "), rows
    assert "2 process(es) on cpu, amp off; val_acc " in rows["train_fsdp"][3], rows
    # train.profile=3 after the profiler's wait and warm-up step: 3 recorded steps, rank 0 alone.
    assert rows["train_fsdp"][3].endswith("; profile: 3 steps in rank0's trace"), rows
    assert [f.name for f in (tmp_path / "work" / "train_fsdp" / "profile").iterdir()] == ["rank0.pt.trace.json"]
    assert rows["deterministic"][0] == "ok", rows
    assert re.fullmatch(r"2 deterministic train\.py runs \(1 epoch, 2 workers\) bitwise equal on cpu: \d+ weights "
                        r"and buffers, \d+ optimizer states, the schedule", rows["deterministic"][3]), rows
    assert rows["resume_fp16"][0] == "ok", rows
    assert re.fullmatch(r"1 epoch on cpu, resumed with 1 process\(es\) on cpu, amp off: 7 steps, "
                        r"(\d+) of \1 parameters changed", rows["resume_fp16"][3]), rows
    metrics = (tmp_path / "work" / "train_fsdp" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in metrics] == [1, 2]


def test_benchmark_compile_with_too_little_time_left_is_named_not_run(tmp_path):
    """The compile step starts only with COMPILE_NEED seconds of TOTAL left; with less, summary.md says so."""
    r = run_script(tmp_path, {"PYTHON": sys.executable, "STEPS": "benchmark_compile", "TOTAL": "30",
                              "COMPILE_NEED": "400"}, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert not (tmp_path / "work" / "results" / "gpu_checks" / "logs" / "benchmark_compile.log").exists()
    row = summary_rows(tmp_path / "out")["benchmark_compile"]
    assert row[0] == "not run" and re.fullmatch(r"not run: \d+ s left of TOTAL=30, it needs 400", row[4]), row


# ------------------------------------------------------------------ the test lanes

LANE_TEST = '''\
import time
from pathlib import Path

import pytest


{gpu_mark}
def test_meets_the_other_lane():
    Path({mine!r}).touch()
    deadline = time.monotonic() + 40
    while not Path({other!r}).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert Path({other!r}).exists(), "the other file's test did not run beside this one"
    time.sleep({linger})
'''


def test_test_files_run_side_by_side_and_the_summary_keeps_their_order(tmp_path):
    """Two test files in two lanes: each file's test waits for the other's to start, so they pass only
    when they run at the same time (with LANES=1 the first fails). The second finishes first; summary.md
    still lists them in the planned order."""
    files = [tmp_path / "test_lane_a.py", tmp_path / "test_lane_b.py"]
    marks = [tmp_path / "a-started", tmp_path / "b-started"]
    for f, mine, other, linger in zip(files, marks, marks[::-1], (3, 0)):
        f.write_text(LANE_TEST.format(gpu_mark=GPU_MARK, mine=str(mine), other=str(other), linger=linger))
    r = run_script(tmp_path, {"PYTHON": sys.executable, "TESTS": " ".join(map(str, files)),
                              "STEPS": "test_lane_a test_lane_b", "LANES": "2"}, timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = summary_rows(tmp_path / "out")
    assert list(rows) == ["test_lane_a", "test_lane_b"], rows
    assert [rows[n][0] for n in rows] == ["ok", "ok"] and [rows[n][3] for n in rows] == ["1 passed"] * 2, rows
    done = [line.split("\t")[0] for line in (tmp_path / "work" / "steps.tsv").read_text().splitlines()]
    assert done == ["test_lane_b", "test_lane_a"], done


# ------------------------------------------------------------------ a step stopped by its limit

OVERRUN = '''\
import subprocess, sys, time
import pytest

# Ignores SIGTERM, as a worker stuck in a collective may; its argv carries the test's token.
SLEEPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


{gpu_mark}
def test_overruns():
    # A launcher in its own session (as test_parallel_semantics starts torchrun) ...
    subprocess.Popen([sys.executable, "-c", SLEEPER, {token!r}], start_new_session=True)
    # ... and one whose parent has already exited (a daemon): init's, unless someone reaps it.
    subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                      + repr(SLEEPER) + ", {token!r}], start_new_session=True)"]).wait()
    open({ready!r}, "w").close()  # both started: the limit found the test running
    time.sleep(600)
'''


GPU_MARK = "@pytest.mark.gpu"  # filled in, so that this file itself holds no GPU-marked test for the script


def processes_with(token, whole_arg=False):
    """Live processes whose command line holds `token` (whole_arg: as one of its arguments, as the
    sleepers have it, not inside the code of the launcher that starts one)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmdline = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if (token in cmdline.split(b"\0")) if whole_arg else (token in cmdline):
            found.append(int(d.name))
    return found


def test_a_step_stopped_by_its_limit_leaves_no_process_behind(tmp_path):
    token = f"gpu-checks-overrun-{os.getpid()}-{time.time_ns()}"
    ready = tmp_path / "sleepers-started"
    test_file = tmp_path / "test_overrun.py"
    test_file.write_text(OVERRUN.format(token=token, gpu_mark=GPU_MARK, ready=str(ready)))
    try:
        # The limit must end the step after the fake test has started its sleepers. Under load pytest can
        # take longer than the limit to get there: then nothing was tested, and the run is repeated with
        # a limit four times as long. GRACE is the script's own: pytest, interrupted, writes its junit
        # file in it (seen to take over 2 s on a loaded CPU); the sleepers ignore SIGTERM and wait it out.
        for limit in (4, 16, 64):
            t = time.monotonic()
            r = run_script(tmp_path, {"PYTHON": sys.executable, "TESTS": str(test_file), "STEPS": "test_overrun",
                                      "L_OTHER": str(limit), "GRACE": "15"}, timeout=limit + 120)
            wall = time.monotonic() - t
            if ready.exists():
                break
        assert ready.exists(), "pytest did not reach the fake test within 64 s"
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        time.sleep(0.5)
        assert processes_with(token.encode()) == [], "processes the step started are still running"
        rows = summary_rows(tmp_path / "out")
        assert rows["test_overrun"][0] == "TIMED OUT" and rows["test_overrun"][4] == "stopped in test_overruns", rows
        assert wall < limit + 75, wall  # the limit and GRACE (15 s) bound the step, not the sleepers' 600 s
        assert {"gpu_checks/logs/test_overrun.log", "gpu_checks/junit-overrun.xml"} <= archive_names(tmp_path / "out")
    finally:
        for pid in processes_with(token.encode()):  # a failed run must not leave them to CI
            os.kill(pid, signal.SIGKILL)


def test_the_script_stopped_by_a_signal_stops_its_steps_and_still_packs(tmp_path):
    """SIGTERM to the script while two test files run in two lanes: both steps stop, with every process
    they started, and both are named in summary.md."""
    token = f"gpu-checks-signal-{os.getpid()}-{time.time_ns()}"
    files = [tmp_path / "test_overrun.py", tmp_path / "test_overrun2.py"]
    for i, f in enumerate(files):
        f.write_text(OVERRUN.format(token=token, gpu_mark=GPU_MARK, ready=str(tmp_path / f"started{i}")))
    script = start_script(tmp_path, {"PYTHON": sys.executable, "TESTS": " ".join(map(str, files)),
                                      "STEPS": "test_overrun test_overrun2", "L_OTHER": "100", "GRACE": "2"})
    try:
        deadline = time.monotonic() + 90
        while len(processes_with(token.encode(), whole_arg=True)) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)  # until both steps' two sleepers run
        assert len(processes_with(token.encode(), whole_arg=True)) == 4, "the steps did not start their sleepers"
        script.send_signal(signal.SIGTERM)
        out, err = script.communicate(timeout=60)
        assert script.returncode == 143, out[-3000:] + err[-2000:]
        time.sleep(0.5)
        assert processes_with(token.encode()) == [], "processes the steps started are still running"
        rows = summary_rows(tmp_path / "out")
        assert [rows[n][0] for n in ("test_overrun", "test_overrun2")] == ["STOPPED (script ended)"] * 2, rows
        assert {"gpu_checks/logs/test_overrun.log", "gpu_checks/logs/test_overrun2.log",
                "gpu_checks/summary.md"} <= archive_names(tmp_path / "out")
    finally:
        kill_script(script)
        for pid in processes_with(token.encode()):
            os.kill(pid, signal.SIGKILL)
