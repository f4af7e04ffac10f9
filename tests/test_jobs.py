"""utils/jobs.py: what a job runs, where its output goes, which GPU and port it gets.

    python -m pytest tests/test_jobs.py -q

The jobs here are tiny Python programs that print their own argv and environment: no torch is
started; the real training runs through these functions in tests/test_kfold.py.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
from utils.jobs import Job, job_argv, job_threads, run_job, run_jobs, slot_devices

# Prints {"argv": ..., "cuda": CUDA_VISIBLE_DEVICES, "omp": OMP_NUM_THREADS, "t": its start} as one
# line; then, when its argv holds "nap", sleeps 1 s; holding "fail", prints an error line and another and exits 3.
ECHO = ("import json, os, sys, time; print(json.dumps({'argv': sys.argv[1:], 'cuda': os.environ.get("
        "'CUDA_VISIBLE_DEVICES'), 'omp': os.environ.get('OMP_NUM_THREADS'), 't': time.time()})); "
        "'nap' in sys.argv and time.sleep(1); 'fail' in sys.argv and "
        "(print('error: bad value'), print('last words'), sys.exit(3))")


def echoed(result):
    """The last line the job printed (job.log is appended to, run after run)."""
    return json.loads((result.run_dir / "job.log").read_text().splitlines()[-1])


def test_a_job_gets_its_run_dir_its_overrides_and_resume_auto_once_the_dir_holds_a_run(tmp_path):
    lines = []
    first = run_job([sys.executable, "-c", ECHO], tmp_path / "a", ["data.fold=1"], log=lines.append)
    assert (first.rc, first.error_line) == (0, None)
    assert echoed(first)["argv"] == ["--output-dir", str(tmp_path / "a"), "data.fold=1"]
    assert json.loads(lines[0])["argv"] == echoed(first)["argv"]  # streamed as well
    (tmp_path / "a" / "checkpoints").mkdir()
    (tmp_path / "a" / "checkpoints" / "last.pt").write_bytes(b"")
    again = run_job([sys.executable, "-c", ECHO], tmp_path / "a", ["data.fold=1"])
    log = (tmp_path / "a" / "job.log").read_text().splitlines()
    assert len(log) == 4  # appended: "$ command" and the output, twice
    assert json.loads(log[3])["argv"] == ["--output-dir", str(again.run_dir), "--resume", "auto", "data.fold=1"]


def test_a_failed_job_reports_its_error_line(tmp_path):
    result = run_job([sys.executable, "-c", ECHO, "fail"], tmp_path / "b", [])
    assert (result.rc, result.error_line) == (3, "error: bad value")


def test_torchrun_gets_a_free_master_port_of_its_own_unless_the_user_gave_one(tmp_path):
    cmd = ["torchrun", "--nproc_per_node=2", "train_multi_gpu_ddp.py", "--epochs", "1"]
    a, b = job_argv(cmd, tmp_path, []), job_argv(cmd, tmp_path, [])
    assert a[0:2] == ["torchrun", "--master_port=" + a[1].split("=")[1]] and a[2:5] == cmd[1:4]
    assert a[1] != b[1]
    module = job_argv([sys.executable, "-m", "torch.distributed.run", "x.py"], tmp_path, [])
    assert module[3].startswith("--master_port=") and module[4] == "x.py"
    assert job_argv(["torchrun", "--master_port=1234", "x.py"], tmp_path, [])[:3] == ["torchrun", "--master_port=1234",
                                                                                      "x.py"]
    assert not any("master_port" in a for a in job_argv(["python", "train.py"], tmp_path, []))  # no launcher


def test_slots_give_each_parallel_job_its_own_gpu_or_group(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [slot_devices(k) for k in range(3)] == ["0", "1", "2"]
    assert [slot_devices(k, 2) for k in range(2)] == ["0,1", "2,3"]
    assert slot_devices(1, 2, visible="4,5,6,7") == "6,7"
    jobs = [Job([sys.executable, "-c", ECHO, "nap"], tmp_path / f"j{i}", [f"i={i}"], name=f"j{i}") for i in range(4)]
    start = time.time()
    results = run_jobs(jobs, parallel=2)
    seen = [echoed(r) for r in results]
    assert [r.rc for r in results] == [0] * 4
    # Two at a time: each pair of jobs running together holds slots 0 and 1.
    assert sorted(s["cuda"] for s in seen[:2]) == ["0", "1"] and {s["cuda"] for s in seen} == {"0", "1"}
    assert abs(seen[0]["t"] - seen[1]["t"]) < 0.9 and time.time() - start < 3.9  # one after another: >= 4 s
    serial = run_jobs(jobs[:1], parallel=1)
    assert echoed(serial[0])["cuda"] is None  # one at a time: the caller's devices, untouched


def test_jobs_side_by_side_split_the_cores_unless_omp_num_threads_is_yours(tmp_path, monkeypatch):
    """Every process takes all cores by default: two jobs' thread pools would fight over them."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    jobs = [Job([sys.executable, "-c", ECHO], tmp_path / name) for name in "ab"]
    assert [echoed(r)["omp"] for r in run_jobs(jobs, parallel=2)] == ["4", "4"]
    assert echoed(run_jobs(jobs[:1], parallel=1)[0])["omp"] is None  # alone: torch's own default
    assert job_threads(["torchrun", "--nproc_per_node=2", "train_multi_gpu_ddp.py"], 2) == 2
    assert job_threads(["torchrun", "--nproc-per-node", "4", "x.py", "--nproc_per_node=1"], 4) == 1
    assert job_threads(["torchrun", "--nproc_per_node=gpu", "x.py"], 2) is None  # torchrun's own rule
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert [echoed(r)["omp"] for r in run_jobs(jobs, parallel=2)] == ["3", "3"]


# A real `python tools/<tool>.py ...` process on a machine that reports two GPUs (torch.cuda.device_count
# patched before the tool runs; this machine has none): the slot check runs before any job starts.
TWO_GPUS = ("import runpy, sys, torch; torch.cuda.device_count = lambda: 2; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("tool, argv, line", [
    ("kfold", ["--folds", "3", "--parallel", "3", "--dir", "{tmp}/cv"],
     "error: --parallel 3 x 1 GPU(s) per fold needs 3 GPUs; this machine has 2: lower --parallel (or --gpus-per-job)"),
    ("kfold", ["--folds", "4", "--parallel", "2", "--gpus-per-job", "2", "--dir", "{tmp}/cv"],
     "error: --parallel 2 x 2 GPU(s) per fold needs 4 GPUs; this machine has 2: lower --parallel (or --gpus-per-job)"),
    ("sweep", ["{tmp}/space.yaml", "--trials", "4", "--n-jobs", "3", "--dir", "{tmp}/sw"],
     "error: --n-jobs 3 x 1 GPU(s) per trial needs 3 GPUs; this machine has 2: lower --n-jobs (or --gpus-per-job)"),
])
def test_more_parallel_jobs_than_gpus_is_one_error_line_before_any_job(tmp_path, tool, argv, line):
    (tmp_path / "space.yaml").write_text("optim.lr: {low: 0.001, high: 0.1, log: true}\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    r = subprocess.run([sys.executable, "-c", TWO_GPUS, str(REPO / "tools" / f"{tool}.py"), *argv, "--",
                        sys.executable, "-c", "raise SystemExit('a job started')"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [line], r.stdout + r.stderr
    assert not (tmp_path / "cv" / "fold_0").exists() and not (tmp_path / "sw").exists()


def test_as_many_parallel_folds_as_gpus_pass_the_check(tmp_path):
    """--parallel 8 over 2 folds runs 2 at once: 2 GPUs are enough."""
    r = subprocess.run([sys.executable, "-c", TWO_GPUS, str(REPO / "tools" / "kfold.py"), "--folds", "2",
                        "--parallel", "8", "--dir", str(tmp_path / "cv"), "--", sys.executable, "-c", ECHO],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert "GPU(s) per fold needs" not in r.stderr, r.stderr
    assert (tmp_path / "cv" / "fold_1" / "job.log").is_file(), r.stdout + r.stderr
