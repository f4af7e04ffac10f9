"""When DDP refuses: a model with an unused branch, and the old launcher's --local-rank.

    python -m pytest tests/test_ddp_errors.py -q

The unused branch is a MODELS entry registered by tests/_unused_branch.py before the real
train_multi_gpu_ddp.py runs under torchrun with 2 gloo processes.
"""
import os

import pytest

from conftest import FAST_ARGS, REPO, free_port, run_entry
from utils.config import load_config

pytestmark = pytest.mark.slow


def ddp_unused_branch(data, out, *extra):
    """train_multi_gpu_ddp.py on the unused_branch model, 2 gloo processes, through tests/_unused_branch.py."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(REPO / "tests" / "_unused_branch.py"), "train_multi_gpu_ddp.py",
           *FAST_ARGS, "model.name=unused_branch", "--data-path", data, "--output-dir", out, *extra]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def test_an_unused_branch_stops_in_one_line_naming_the_key_and_trains_with_it(image_root, tmp_path):
    r = ddp_unused_branch(image_root, tmp_path / "refused")
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1, (r.stdout + r.stderr)[-3000:]
    assert "ddp.find_unused_parameters=true" in errors[0] and "(aux.weight, aux.bias)" in errors[0], errors
    assert "Expected to have finished reduction" not in r.stdout + r.stderr  # torch's page-long message
    r = ddp_unused_branch(image_root, tmp_path / "trained", "ddp.find_unused_parameters=true")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert (tmp_path / "trained" / "checkpoints" / "last.pt").is_file()


@pytest.mark.parametrize("flag", [["--local-rank=0"], ["--local_rank", "0"]])
def test_the_old_launchers_local_rank_trains_with_a_note(flag, image_root, tmp_path):
    r = run_entry("train_multi_gpu_ddp.py", *flag, *FAST_ARGS, "--data-path", image_root,
                  "--output-dir", tmp_path / "run")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.count("note: --local-rank is torch.distributed.launch's; torchrun is the launcher to use") == 1
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


def test_local_rank_from_the_environment_wins_over_the_flag(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    load_config(["--local-rank=0"])
    assert os.environ["LOCAL_RANK"] == "1"
    monkeypatch.delenv("LOCAL_RANK")
    load_config(["--local_rank", "3"])
    assert os.environ["LOCAL_RANK"] == "3"  # alone, the flag names this process's device, as it did
