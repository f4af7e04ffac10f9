"""The entry scripts' wrapper: a UserError becomes one `error:` line and its exit code, no traceback
(a collective's timeout too, through utils/errors.py), and the refusal of a one-process script under
a launcher.

Set TRAIN_DEBUG=1 in the environment to get the full Python traceback as well.
"""
import argparse
import datetime
import functools
import os
import sys
import traceback


from utils.distributed_utils import restart_store, cleanup
from utils.errors import OUT_OF_MEMORY, UserError, allocation, collective_timeout, one_line

# How long a rank other than 0 waits for rank 0 to print an error they share; past it, it prints the
# line itself (rank 0 hung or lost), late rather than never.
SHARED_ERROR_WAIT_S = 60
_PRINTED_KEY = "cli/shared_error_printed"


def debug_enabled():
    return os.environ.get("TRAIN_DEBUG", "0").lower() not in ("", "0", "false", "no")


def cli_entry(main):
    """Wrap an entry script's main(): UserError -> `error: ...` and its exit code."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if debug_enabled():
                traceback.print_exc()
            print_error(e)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr, flush=True)
            sys.exit(130)
        except OUT_OF_MEMORY as e:  # where no line of the script's own says more
            if debug_enabled():
                traceback.print_exc()
            print_error(UserError(f"out of device memory{allocation(e)}", exit_code=1))
            sys.exit(1)
        except RuntimeError as e:
            timeout = collective_timeout(e)
            if timeout is None:
                raise
            if debug_enabled():
                traceback.print_exc()
            print_error(timeout)  # by each rank that waited: the stuck one cannot
            sys.exit(timeout.exit_code)
        finally:
            # However main ends, leave no process group behind (a no-op outside DDP), so a
            # script's main() can also be called twice in one process, as the tests do.
            cleanup()

    return wrapper


def refuse_launcher(script):
    """A one-process script started by torchrun or another launcher (WORLD_SIZE > 1 in the
    environment) would run WORLD_SIZE trainings that know nothing of each other, on one GPU,
    all writing one run directory: stop, before any data is read, naming the script to use."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world.isdigit() and int(world) > 1:
        raise UserError(f"{script} trains as one process, but a launcher started {world} of them (WORLD_SIZE="
                        f"{world}): each would train alone and all would write one run directory; launch "
                        "train_multi_gpu_ddp.py instead (or train_multi_gpu_fsdp.py to shard the model)",
                        every_rank=True)


def print_error(e):
    """The `error:` line of UserError `e`: by the rank that raised it, or once for an error that every
    rank raises (e.every_rank), by rank 0.

    torchrun stops every worker as soon as one exits, so under it a rank other than 0 exits only once
    rank 0 has printed the line: it waits for the key rank 0 sets in torchrun's store after printing.
    The exit code alone then makes torchrun stop the group."""
    line = f"error: {one_line(e)}"
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    if not getattr(e, "every_rank", False):
        print(line, file=sys.stderr, flush=True)
        return
    try:
        store = restart_store(int(os.environ.get("WORLD_SIZE", "1")),
                               datetime.timedelta(seconds=SHARED_ERROR_WAIT_S))  # None outside torchrun
    except RuntimeError:  # torchrun's store unreachable: no way to agree, so no rank stays silent
        store, rank = None, "0"
    if rank == "0":
        print(line, file=sys.stderr, flush=True)
        try:
            if store is not None:
                store.set(_PRINTED_KEY, "1")
        except RuntimeError:
            pass  # the line is out; the others print it too after their wait
    elif store is not None:
        try:
            store.wait([_PRINTED_KEY], datetime.timedelta(seconds=SHARED_ERROR_WAIT_S))
        except RuntimeError:
            print(line, file=sys.stderr, flush=True)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the config's flags and the tools (predict.py, export.py): a bad argument is one
    `error:` line, exit 2, instead of argparse's usage text."""

    def error(self, message):
        raise UserError(message)
