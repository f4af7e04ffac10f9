"""Run an entry script with one injected fault, for tests/test_ddp_resume.py. Not a product file.

    python -m torch.distributed.run --nproc_per_node=2 tests/_faults.py nan:1:4 train_multi_gpu_ddp.py ARGS...

nan:RANK:STEP   on rank RANK, the training loss of the STEP-th step (0-based, counted over the
                whole process) and of every later one is NaN, as an overflow would make it.
stop:RANK:STEP  on the first attempt, rank RANK stops (SIGSTOP) at its STEP-th step (0-based).
                A restart drops a ddp.timeout_minutes=... argument: the short timeout that ends
                the first attempt would otherwise bound every collective of the restarted run too.
kill:RANK:STEP  on the first attempt, rank RANK dies (SIGKILL) at its STEP-th step (0-based).
term:RANK:N     rank RANK alone gets a SIGTERM at its N-th evaluation batch (1-based), as from a
                scheduler that signals one process.
nospace:RANK:E  on rank RANK saving epoch E's checkpoint fails: the disk is full.

The fault is a monkeypatch made before the script runs, so the product code has
no test hooks; everything else is the real script under the real launcher.
With FAULT_ERRORS=FILE set, each rank appends "RANK<tab>message" for every error it raises (printed
or not: under torchrun one rank prints a shared error), as the error handling receives it.
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


def inject_stop(rank, step, sig="SIGSTOP"):
    """The first attempt's rank RANK stops itself (SIGSTOP) before its STEP-th training step: a rank
    that stops answering, as on a hung filesystem. A torchrun restart runs on unharmed.
    sig="SIGKILL": the rank dies there instead, as on a lost machine."""
    import signal
    import engine
    real = engine.Criterion.__call__
    calls = {"train": 0}

    def criterion(self, logits, targets):
        calls["train"] += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and int(os.environ.get("RANK", "0")) == rank and calls["train"] == step + 1:
            os.kill(os.getpid(), getattr(signal, sig))
        return real(self, logits, targets)

    engine.Criterion.__call__ = criterion


def inject_eval_signal(rank, n):
    """Criterion.per_image gives evaluation's per-image losses (training does not call it)."""
    import signal
    import engine
    real = engine.Criterion.per_image
    calls = {"eval": 0}

    def per_image(self, logits, labels):
        calls["eval"] += 1
        if int(os.environ.get("RANK", "0")) == rank and calls["eval"] == n:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, logits, labels)

    engine.Criterion.per_image = per_image


def inject_disk_full(rank, epoch):
    import errno
    import torch
    real = torch.save

    def save(obj, f, *a, **k):
        if int(os.environ.get("RANK", "0")) == rank and isinstance(obj, dict) and obj.get("epoch") == epoch:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *a, **k)

    torch.save = save


if __name__ == "__main__":
    fault, script, *args = sys.argv[1:]
    kind, *params = fault.split(":")
    faults = {"nan": inject_nan, "stop": inject_stop,
              "kill": lambda rank, step: inject_stop(rank, step, sig="SIGKILL"),
              "term": inject_eval_signal, "nospace": inject_disk_full}
    if kind not in faults:
        sys.exit(f"unknown fault {fault!r}")
    faults[kind](*map(int, params))
    if os.environ.get("FAULT_ERRORS"):
        import utils.cli
        from utils.errors import one_line
        real_print_error = utils.cli.print_error

        def print_error(e):
            with open(os.environ["FAULT_ERRORS"], "a") as f:
                f.write(f"{os.environ.get('RANK', '0')}\t{one_line(e)}\n")
            real_print_error(e)

        utils.cli.print_error = print_error
    if kind == "stop" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        args = [a for a in args if not a.startswith("ddp.timeout_minutes=")]
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
