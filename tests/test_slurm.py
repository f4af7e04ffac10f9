"""slurm/train_ddp.sbatch on a real one-node SLURM cluster (slurmctld + slurmd, 2 CPUs, no cgroups).

    sudo bash slurm/local_cluster.sh && python -m pytest -m slurm -q     # .ci/run does both

The CPU demo as a user submits it: one torchrun with 2 gloo workers per node. A
plain run must complete into one run directory with a plain-text output file; a
USR1 (what `#SBATCH --signal=B:USR1@120` sends before the time limit) must make the
job save, requeue itself and finish with the metrics of the uninterrupted run. The launch
without torchrun (srun, one task per process) must train exactly like the torchrun job.
Skipped, with the reason, where no cluster answers (no root or no apt to install one).
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import time

import pytest

from _resume_utils import TIMING, assert_same_weights, load
from conftest import FAST_ARGS, REPO, free_port, make_image_folder

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SBATCH = REPO / "slurm" / "train_ddp.sbatch"


def _cluster_up():
    if not shutil.which("sbatch"):
        return "no SLURM here: `sudo bash slurm/local_cluster.sh` installs and starts one (needs root and apt)"
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        r = None
    if r is None or r.returncode != 0 or not re.search(r"idle|mixed|allocated", r.stdout):
        return "SLURM is installed but no controller/node answers: run `sudo bash slurm/local_cluster.sh`"
    return None


@pytest.fixture(scope="module", autouse=True)
def cluster():
    reason = _cluster_up()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("slurm") / "flowers")  # 2 ranks x 3 steps per epoch


PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else os.sys.executable


def run_args(data):
    return ["--data-path", str(data), *FAST_ARGS, "train.epochs=2", "train.amp=off", "train.log_every=1",
            "ddp.backend=gloo"]


def submit(data, out, log):
    """sbatch the script as a user would, sized for this 1-node, 2-CPU cluster; returns the job id."""
    env = {**os.environ, "OUTPUT_DIR": str(out), "NPROC_PER_NODE": "2", "RDZV_PORT": str(free_port()),
           "PYTHON": PYTHON}
    r = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2",
                        "--time=10", f"--output={log}", str(SBATCH), *run_args(data)],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def job(job_id):
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=10).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_done(job_id, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job(job_id)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return info
        time.sleep(1)
    subprocess.run(["scancel", job_id], timeout=10)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s: {job(job_id)}")


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm_straight")
    out, log = root / "runs" / "demo", root / "job.out"
    info = wait_done(submit(data, out, log))
    return out, log, info


def test_sbatch_cpu_demo_completes_in_one_run_directory_with_a_plain_output_file(straight):
    out, log, info = straight
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-3000:]
    assert [p.name for p in out.parent.iterdir()] == ["demo"]  # one run directory, written by rank 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert "\r" not in text  # no tqdm redraws in the job's file
    steps = re.findall(r"^epoch (\d)/2  step (\d)/3  loss \d+\.\d{4}  \d+ img/s  lr \S+  ETA \d+:\d\d:\d\d$", text, re.M)
    assert steps == [(str(e), str(s)) for e in range(1, 3) for s in range(1, 4)], text[-3000:]  # once each: rank 0


def test_usr1_saves_requeues_and_the_job_finishes_like_an_uninterrupted_one(straight, data, tmp_path):
    out, log = tmp_path / "run", tmp_path / "job.out"
    job_id = submit(data, out, log)
    deadline = time.time() + 180
    # After epoch 1's first step, warn as --signal=B:USR1@120 would: the stop lands in epoch 1 or at its end.
    while not (log.exists() and "epoch 1/2  step 1/3" in log.read_text()):
        assert time.time() < deadline and job(job_id).get("JobState") in ("PENDING", "RUNNING"), log.read_text()
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=10)
    info = wait_done(job_id)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-3000:]
    assert "USR1 received" in text
    saved = [x for x in text.splitlines() if x.startswith("error: stopped by SIGTERM")]
    assert len(saved) == 1 and "last.pt is saved" in saved[0], text[-3000:]
    assert len(re.findall(r"resumed from .*last\.pt", text)) == 1, text[-3000:]
    assert load(out / "checkpoints" / "last.pt")["epoch"] == 2
    assert_same_weights(straight[0] / "checkpoints" / "last.pt", out / "checkpoints" / "last.pt")
    assert untimed(straight[0]) == untimed(out)  # metrics.jsonl equal, timings aside


def test_srun_without_torchrun_trains_exactly_like_the_torchrun_job(straight, data, tmp_path):
    """docs/multi-node.md's launch without torchrun: srun starts one task per process and
    init_distributed_mode reads SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID."""
    out, log = tmp_path / "run", tmp_path / "job.out"
    launch = " ".join(shlex.quote(a) for a in [PYTHON, "train_multi_gpu_ddp.py", "--output-dir", str(out),
                                                "--resume", "auto", *run_args(data)])
    script = (f'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) '
              f"MASTER_PORT={free_port()} OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1\nsrun {launch}")
    r = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                        "--time=10", f"--output={log}", f"--wrap={script}"],
                       capture_output=True, text=True, cwd=REPO, timeout=30)
    assert r.returncode == 0, r.stderr
    info = wait_done(r.stdout.strip().split(";")[0])
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-3000:]
    assert "2 process(es)" in text and len(re.findall(r"^epoch 1/2  step 1/3 ", text, re.M)) == 1, text[-3000:]
    assert_same_weights(straight[0] / "checkpoints" / "last.pt", out / "checkpoints" / "last.pt")
    assert untimed(straight[0]) == untimed(out)


def untimed(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if k not in TIMING and not k.endswith("_seconds")} for m in lines]
