"""Run an entry script with one injected fault, for tests/test_ddp_resume.py. Not a product file.

    python -m torch.distributed.run --nproc_per_node=2 tests/_faults.py nan:1:4 train_multi_gpu_ddp.py ARGS...

nan:RANK:STEP   on rank RANK, the training loss of the STEP-th step (0-based, counted over the
                whole process) and of every later one is NaN, as an overflow would make it.
stop:RANK:STEP  on the first attempt, rank RANK stops (SIGSTOP) at its STEP-th step (0-based).
                A restart drops a ddp.timeout_minutes=... argument: the short timeout that ends
                the first attempt would otherwise bound every collective of the restarted run too.
kill:RANK:STEP  on the first attempt, rank RANK dies (SIGKILL) at its STEP-th step (0-based).
kill:RANK:STEP:STEP2  ... and on the second attempt (torchrun's first restart) at its STEP2-th step.
term:RANK:N     rank RANK alone gets a SIGTERM at its N-th evaluation batch (1-based), as from a
                scheduler that signals one process.
nospace:RANK:E  on rank RANK saving epoch E's checkpoint fails: the disk is full.
oom:WHERE:N     out of device memory, as torch raises it, at the N-th (1-based) call of WHERE: forward
                (a torchvision ResNet's forward without gradients: the start-up probe, evaluation,
                predict.py), ema (the EMA copy of train.ema_decay) or restore (loading a checkpoint's
                weights into the model).
none            no fault (SEEN_LOG alone).
jpegoom:RANK:N  on rank RANK, nvJPEG's batched decode (data.gpu_decode=per_batch) runs out of device
                memory from its N-th call on (0-based), as torch raises it.

The fault is a monkeypatch made before the script runs, so the product code has
no test hooks; everything else is the real script under the real launcher.
With SEEN_LOG=FILE set, each rank appends a line per image its loaders fetch (log_seen).
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


def log_seen(path, patch=setattr):
    """Each image a loader fetches, as "ATTEMPT<tab>RANK<tab>EPOCH<tab>train|val<tab>PATH" appended to `path`
    (ATTEMPT: torchrun's restart count; EPOCH: 0-based, of the epoch being trained or evaluated)."""
    import data
    import run
    now = {"epoch": -1, "train": None}
    train_one_epoch, getitems = run.train_one_epoch, data.ImageList.__getitems__

    def epoch(step, loader, n, *args, **kwargs):
        now.update(epoch=n, train=loader.dataset)
        return train_one_epoch(step, loader, n, *args, **kwargs)

    def fetch(self, indices):
        head = (f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\t{os.environ.get('RANK', '0')}\t"
                f"{now['epoch']}\t{'train' if self is now['train'] else 'val'}")
        with open(path, "a") as f:
            f.write("".join(f"{head}\t{self.samples[i][0]}\n" for i in indices))
        return getitems(self, indices)

    patch(run, "train_one_epoch", epoch)
    patch(data.ImageList, "__getitems__", fetch)


def inject_stop(rank, step, sig="SIGSTOP", then=None):
    """The first attempt's rank RANK stops itself (SIGSTOP) before its STEP-th training step: a rank
    that stops answering, as on a hung filesystem. A torchrun restart runs on unharmed, unless `then`:
    the second attempt's rank RANK stops too, before its then-th step.
    sig="SIGKILL": the rank dies there instead, as on a lost machine."""
    import signal
    import engine
    real = engine.Criterion.__call__
    calls = {"train": 0}

    def criterion(self, logits, targets):
        calls["train"] += 1
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        at = {"0": step, "1": then}.get(attempt)
        if at is not None and int(os.environ.get("RANK", "0")) == rank and calls["train"] == at + 1:
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


OOM_TEXT = ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 139.8 GiB of which "
            "1.02 GiB is free.")


def _oom():
    import torch
    return getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)(OOM_TEXT)  # torch 2.4: the latter


def inject_oom(where, n):
    """The n-th call of `where` raises torch's out-of-memory error instead of running."""
    import torch
    if where == "forward":
        import torchvision
        owner, name = torchvision.models.ResNet, "_forward_impl"
    elif where == "ema":
        from utils import optim
        owner, name = optim.WeightEMA, "__init__"
    elif where == "restore":
        owner, name = torch.nn.Module, "load_state_dict"
    else:
        sys.exit(f"unknown oom place {where!r}")
    real, calls = getattr(owner, name), {"n": 0}

    def fake(*args, **kwargs):
        if where != "forward" or not torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == n:
                raise _oom()
        return real(*args, **kwargs)

    setattr(owner, name, fake)


def inject_jpeg_oom(rank, n):
    from utils import gpu_pipeline
    real, calls = gpu_pipeline._decode_jpegs, {"n": 0}

    def decode(parts, *args, **kwargs):
        calls["n"] += 1
        if int(os.environ.get("RANK", "0")) == rank and calls["n"] > n:
            raise _oom()
        return real(parts, *args, **kwargs)

    gpu_pipeline._decode_jpegs = decode


if __name__ == "__main__":
    fault, script, *args = sys.argv[1:]
    kind, *params = fault.split(":")
    if kind == "oom":
        params = [params[0], int(params[1])]
    faults = {"nan": inject_nan, "stop": inject_stop,
              "kill": lambda rank, step, then=None: inject_stop(rank, step, sig="SIGKILL", then=then),
              "term": inject_eval_signal, "nospace": inject_disk_full, "jpegoom": inject_jpeg_oom, "oom": inject_oom,
              "none": lambda: None}
    if kind not in faults:
        sys.exit(f"unknown fault {fault!r}")
    faults[kind](*(params if kind == "oom" else map(int, params)))
    if os.environ.get("SEEN_LOG"):
        log_seen(os.environ["SEEN_LOG"])
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
