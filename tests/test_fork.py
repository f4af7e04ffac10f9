"""tests/_fork.py: a Python child forked from the test process sees what an exec'd one sees.

    python -m pytest tests/test_fork.py -q

Each case runs one probe both ways, forked and exec'd (_fork.ENABLED off), and compares what it
reports: its argv, cwd, environment, sys.path, stdio buffering, signal handlers, warning filters, which
of the repository's modules are imported, its output and its exit status.
"""
import json
import os
import subprocess
import sys

import pytest

import _fork
from conftest import REPO

PROBE = """import json, os, signal, sys, warnings
repo = {REPO!r}
mine = sorted(n for n, m in sys.modules.items() if n != "_fork" and (getattr(m, "__file__", None) or "").startswith(repo + os.sep)
              and ".venv" not in m.__file__)
print(json.dumps(dict(argv=sys.argv, cwd=os.getcwd(), path=sys.path, env=os.environ.get("PROBE_KEY"), mine=mine,
                      term=signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, pipe=signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
                      buffered=[type(s.buffer).__name__ for s in (sys.stdout, sys.stderr)], filters=len(warnings.filters))))
sys.stderr.write("to stderr\\n")
if sys.argv[-1] == "raise":
    raise RuntimeError("boom")
sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else "a message")
""".replace("{REPO!r}", repr(str(REPO)))


def both_ways(cmd, cwd):
    """(forked, exec'd) results of one command, run from cwd."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROBE_KEY": "seen"}
    results = []
    for forked in (True, False):
        _fork.ENABLED = forked
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        finally:
            _fork.ENABLED = True
        results.append(proc)
    return results


@pytest.mark.parametrize("last", ["3", "0", "raise", "text"])
def test_a_script_reports_the_same_state_output_and_exit_status(tmp_path, last):
    (tmp_path / "probe.py").write_text(PROBE)
    forked, execd = both_ways([sys.executable, "probe.py", "a b", last], tmp_path)
    assert forked.returncode == execd.returncode == {"3": 3, "0": 0, "raise": 1, "text": 1}[last]
    assert json.loads(forked.stdout) == json.loads(execd.stdout)
    state = json.loads(forked.stdout)
    assert state["argv"] == ["probe.py", "a b", last] and state["env"] == "seen" and state["mine"] == []
    assert state["path"][0] == str(tmp_path)
    tail = {"3": "", "0": "", "raise": "RuntimeError: boom", "text": "a message"}[last]
    for proc in (forked, execd):
        assert proc.stderr.startswith("to stderr\n") and proc.stderr.rstrip().endswith(tail)


def test_unbuffered_and_the_c_and_m_forms_match(tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    for cmd in ([sys.executable, "-u", "probe_mod.py", "0"], [sys.executable, "-m", "probe_mod", "0"],
                [sys.executable, "-c", PROBE, "0"]):
        forked, execd = both_ways(cmd, tmp_path)
        assert forked.returncode == execd.returncode == 0
        f, e = json.loads(forked.stdout), json.loads(execd.stdout)
        assert f == e, cmd


def test_a_test_edit_of_a_repository_module_never_reaches_the_child(monkeypatch):
    import utils.errors
    monkeypatch.setattr(utils.errors, "UserError", None)
    forked, execd = both_ways([sys.executable, "-c", "import utils.errors; print(utils.errors.UserError is None)"], REPO)
    assert forked.stdout == execd.stdout == "False\n"


def test_the_registry_gives_a_forked_childs_command_line(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "marker"], cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for _ in range(100):
            if _fork._registered(proc.pid):
                break
            subprocess.run(["sleep", "0.05"])
        assert _fork.cmdline_of(proc.pid) == [sys.executable, "-c", "import time; time.sleep(30)", "marker"]
        assert open(f"/proc/{proc.pid}/cmdline", "rb").read().split(b"\0")[0] != b"-c"  # /proc shows pytest's
    finally:
        proc.kill()
        proc.wait()
