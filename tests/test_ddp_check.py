"""tools/ddp_check.py under the real launcher: 2 gloo processes on CPU, its verdict lines and exit code.

    python -m pytest tests/test_ddp_check.py -q

The CUDA check (gpu p2p) can only say "skipped (no CUDA)" here; tools/gpu_checks.sh is where GPUs are.
"""
import importlib.util
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, free_port, make_image_folder

TOOL = REPO / "tools" / "ddp_check.py"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
QUICK = ["--bandwidth-mb", "1,4", "--timeout-s", "60"]  # small all-reduces: the check, not a benchmark


def ddp_check(*args, nproc=2, timeout=120):
    """(rc, stdout, stderr) of `torchrun --nproc_per_node=nproc tools/ddp_check.py args`; a hang fails the test."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(TOOL), *QUICK, *map(str, args)]
    # Its own session, so a hang can be killed with torchrun's workers.
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"tools/ddp_check.py hung for {timeout} s")
    return proc.returncode, out, err


def verdicts(out):
    """{check name: (tag, text)} from the lines `TAG   name: text`."""
    found = {}
    for line in out.splitlines():
        m = re.match(r"(ok|FAIL|skip|info) +([a-z0-9 -]+): (.*)$", line)
        if m:
            found[m.group(2)] = (m.group(1), m.group(3))
    return found


def load_tool():
    spec = importlib.util.spec_from_file_location("ddp_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_check_passes_on_two_gloo_processes():
    rc, out, err = ddp_check("--config", "configs/demo.yaml", "data.num_workers=2", "train.batch_size=4")
    v = verdicts(out)
    assert rc == 0, out + err[-3000:]
    assert v["process group"][0] == "ok" and "gloo, world size 2" in v["process group"][1], out
    assert "ranks per node {" in v["process group"][1] and ": 2}" in v["process group"][1], out
    assert v["gpu p2p"] == ("skip", "skipped (no CUDA)"), out
    assert v["all-reduce"] == ("ok", "sum over 2 ranks = 3 (expected 3)"), out
    assert v["bandwidth"][0] == "ok" and re.search(r"1 MB [0-9.]+ GB/s, 4 MB [0-9.]+ GB/s", v["bandwidth"][1]), out
    # 2 processes x 2 workers x prefetch 4 x batch 4 x 3*64*64 bytes (demo's img_size 64, uint8): a few MB
    assert v["shm"][0] == "ok" and "2 process(es) x 2 workers x prefetch 4 x batch 4" in v["shm"][1], out
    assert v["env"][0] == "info" and "MASTER_PORT=" in v["env"][1], out
    assert v["summary"] == ("ok", "every check passed"), out
    assert len(out.splitlines()) == len([ln for ln in out.splitlines() if verdicts(ln)]), "only rank 0 prints verdicts"


@pytest.mark.slow
def test_too_small_shm_fails_with_the_fix_and_exit_1():
    # 2 x 2 workers x 4 x 400,000 images x 12 KB (img_size 64, uint8) = 79 GB: more than any /dev/shm here.
    rc, out, err = ddp_check("--config", "configs/demo.yaml", "data.num_workers=2", "train.batch_size=400000")
    v = verdicts(out)
    assert rc == 1, out + err[-3000:]
    tag, text = v["shm"]
    assert tag == "FAIL" and "loaders need 78.64 GB" in text and "fix: Docker: docker run --shm-size=8g" in text, out
    assert v["all-reduce"][0] == "ok" and v["summary"][0] == "FAIL" and "shm" in v["summary"][1], out


def test_shm_need_counts_what_the_training_loader_holds(tmp_path):
    from data import build_datasets
    from utils.loader import PREFETCH_FACTOR
    from utils.config import load_config
    tool, cpu = load_tool(), torch.device("cpu")
    make_image_folder(tmp_path / "data", per_class=4, size=(90, 70))
    cfg = load_config(["--config", "configs/demo.yaml", "data.num_workers=3", "train.batch_size=8",
                       f"data.path={tmp_path / 'data'}"])
    sample = build_datasets(cfg.data)[0][0][0]  # one training sample, as a worker sends it
    need, how = tool.shm_need(cfg, cpu, procs_on_node=2)
    assert need == 2 * 3 * PREFETCH_FACTOR * 8 * sample.numel() * sample.element_size(), how
    assert sample.dtype == torch.uint8 and need == 2 * 3 * PREFETCH_FACTOR * 8 * 3 * 64 * 64, how
    # num_workers=-1 means what data.resolve_num_workers makes of it: no workers on the CPU.
    assert tool.shm_need(load_config([]), cpu, procs_on_node=2)[0] == 0
