"""User-facing errors: one line on stderr and a non-zero exit, no traceback.

Anything a user can cause (a typo in a config, a missing folder, an impossible
batch size) is raised as a `UserError`; utils/cli.py prints it as `error: ...`.
The runtime errors a user can act on are translated here, each into one such line:
a collective's timeout, out of memory, an op without a deterministic kernel, and
DDP's parameters that took no part in the loss.
"""
import re

import torch

USAGE_EXIT = 2    # bad config, bad flag, bad path: the command line must change
RUNTIME_EXIT = 1  # the run started and could not go on (NaN loss, failed save, ...)


class UserError(Exception):
    """An error the user can fix; `exit_code` 2 for usage/config, 1 for runtime.

    `every_rank=True` marks an error that every rank raises identically (a bad
    config, a NaN loss found by the shared all-reduce): only rank 0 prints it.
    """

    def __init__(self, message, exit_code=USAGE_EXIT, every_rank=False):
        super().__init__(message)
        self.exit_code = exit_code
        self.every_rank = every_rank


class BadImageError(UserError):
    """An image file that cannot be decoded while data.bad_image=error: a runtime failure.

    Raised in a DataLoader worker it reaches the main process rebuilt from its
    class and text alone, so the exit code must be the class's default.
    """

    def __init__(self, message, exit_code=RUNTIME_EXIT):
        super().__init__(message, exit_code)


def one_line(e):
    """The message of a UserError, also when a DataLoader worker raised it.

    The loader re-raises a worker's exception as the same class with a text of
    "Caught X in DataLoader worker process N. Original Traceback ...", whose
    last line is "module.X: message".
    """
    msg = str(e)
    if "Original Traceback" in msg:
        msg = msg.rstrip().splitlines()[-1].split(": ", 1)[-1]
    return msg


# gloo's "Timed out waiting 1800000ms for recv operation to complete", NCCL's watchdog message.
_TIMEOUT = re.compile(r"Timed out waiting (\d+) ?ms for \w+ operation|Watchdog caught collective operation timeout")


def collective_timeout(e):
    """A collective that waited past the process group's timeout (ddp.timeout_minutes) as a UserError
    naming the timeout, the rank waited for where torch says, and the likely causes; else None."""
    text = str(e)
    found = _TIMEOUT.search(text)
    if not found:
        return None
    waited = f" {int(found.group(1)) / 60000:g} min" if found.group(1) else ""
    peer = re.search(r"\brank[ :=]+(\d+)", text)
    return UserError(f"a collective waited{waited} (ddp.timeout_minutes) for "
                     f"{'rank ' + peer.group(1) if peer else 'a rank'} that did not answer: a rank stopped or "
                     "hung (a stuck filesystem, a lost node), broken GPU peer-to-peer (NCCL_P2P_DISABLE=1), "
                     "too little shared memory for the loaders, or a collective that only some ranks run; check "
                     "with tools/ddp_check.py, see docs/troubleshooting.md", exit_code=RUNTIME_EXIT)


# torch >= 2.5 raises torch.OutOfMemoryError for every device; 2.4 has torch.cuda.OutOfMemoryError
# (which later torch keeps as the same class).
OUT_OF_MEMORY = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError)


def allocation(e):
    """"; tried to allocate 2.00 GiB with 1.06 GiB free" from torch's out-of-memory message, or ""."""
    text = str(e)
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    free = re.search(r"of which ([\d.]+ [KMGT]?i?B) is free", text)
    return "".join([f"; tried to allocate {asked.group(1)}" if asked else "",
                    f" with {free.group(1)} free" if asked and free else ""])


def out_of_memory(e, cfg, dist_info, script_name):
    """Out of device memory in the loop as one line naming the batch size, the process and what to
    try, each only where it applies; torch's "Tried to allocate ... of which ... is free" kept."""
    batch, accum, world = cfg.train.batch_size, cfg.train.accum_steps, dist_info.world_size
    detail = allocation(e)
    where = f"rank {dist_info.rank} of {world}" if world > 1 else "the only process"
    tries = []
    fixed = cfg.train.global_batch  # when set, it derives the accumulation itself
    if batch > 1 and fixed:
        smaller = f"--batch-size {batch // 2}" if fixed % (batch // 2 * world) == 0 else "a smaller --batch-size"
        tries.append(f"{smaller} (train.global_batch={fixed} stays: the accumulation grows)")
    elif batch > 1:
        smaller = (f"--batch-size {batch // 2} with train.accum_steps={2 * accum}" if batch % 2 == 0 else
                   "a smaller --batch-size with a larger train.accum_steps")
        tries.append(f"{smaller} (the global batch stays {batch * accum * world})")
    if not cfg.model.activation_checkpointing:
        tries.append("model.activation_checkpointing=true" + (" (with train.compile=false)" if cfg.train.compile else ""))
    if script_name != "fsdp":
        tries.append("train_multi_gpu_fsdp.py, which shards the model over the GPUs")
    advice = f": try {', or '.join(tries)}" if tries else ""
    return UserError(f"out of memory on {dist_info.device} ({where}) at --batch-size {batch}"
                     f"{' per process' if world > 1 else ''}{detail}{advice}", exit_code=RUNTIME_EXIT)


def nondeterministic_op(e):
    """torch's "X does not have a deterministic implementation, but you set
    'torch.use_deterministic_algorithms(True)'" as one error line naming X; None for any other error."""
    found = re.match(r"(\S+) does not have a deterministic implementation", str(e))
    if found is None:
        return None
    return UserError(f"train.deterministic=true, and {found.group(1)} has no deterministic kernel on this device; "
                     "run with train.deterministic=false, or replace the op in the model",
                     exit_code=RUNTIME_EXIT, every_rank=True)


def unused_parameters(e, net):
    """DDP's "Expected to have finished reduction in the prior iteration" (a forward that left some
    parameters out of the loss) as one error line naming the key and the parameters; None for any
    other error. `net`: the bare network DDP wraps. Every rank raises it, at the step after the one that
    skipped them."""
    text = str(e)
    if "Expected to have finished reduction in the prior iteration" not in text:
        return None
    # torch names their indices among the module's trained parameters (names only under DETAIL).
    found = re.search(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)", text)
    trained = [name for name, p in net.named_parameters() if p.requires_grad]
    names = [trained[int(i)] for i in found.group(1).split() if int(i) < len(trained)] if found else []
    which = f" ({', '.join(names[:8])}{', ...' if len(names) > 8 else ''})" if names else ""
    return UserError(f"DDP found parameters that took no part in the loss{which}; a model that skips some on "
                     "purpose needs ddp.find_unused_parameters=true (see docs/troubleshooting.md)",
                     exit_code=RUNTIME_EXIT, every_rank=True)
