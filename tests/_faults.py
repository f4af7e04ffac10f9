"""Run an entry script with one injected fault, for tests/test_kill_resume.py. Not a product file.

    python -m torch.distributed.run --nproc_per_node=2 tests/_faults.py nan:1:4 train_multi_gpu_ddp.py ARGS...

nan:RANK:STEP   on rank RANK, the training loss of the STEP-th step (0-based, counted over the
                whole process) and of every later one is NaN, as an overflow would make it.

The fault is a monkeypatch made before the script runs, so the product code has
no test hooks; everything else is the real script under the real launcher.
"""
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def inject_nan(rank, step):
    real = F.cross_entropy
    calls = {"train": 0}

    def cross_entropy(logits, labels, *args, **kwargs):
        loss = real(logits, labels, *args, **kwargs)
        if torch.is_grad_enabled():  # training step, not evaluation (no_grad)
            calls["train"] += 1
            if int(os.environ.get("RANK", "0")) == rank and calls["train"] > step:
                return loss * float("nan")
        return loss

    F.cross_entropy = cross_entropy


if __name__ == "__main__":
    fault, script, *args = sys.argv[1:]
    kind, *params = fault.split(":")
    if kind != "nan":
        sys.exit(f"unknown fault {fault!r}")
    inject_nan(*map(int, params))
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
