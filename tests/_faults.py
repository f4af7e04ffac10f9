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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def inject_nan(rank, step):
    """The training loss goes through engine.Criterion.__call__ whatever loss it computes, so a
    criterion of one's own (a focal loss, say) still gets the NaN."""
    import engine
    real = engine.Criterion.__call__
    calls = {"train": 0}

    def criterion(self, logits, targets):
        loss = real(self, logits, targets)
        calls["train"] += 1
        if int(os.environ.get("RANK", "0")) == rank and calls["train"] > step:
            return loss * float("nan")
        return loss

    engine.Criterion.__call__ = criterion


if __name__ == "__main__":
    fault, script, *args = sys.argv[1:]
    kind, *params = fault.split(":")
    if kind != "nan":
        sys.exit(f"unknown fault {fault!r}")
    inject_nan(*map(int, params))
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
