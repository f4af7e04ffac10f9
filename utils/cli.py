"""The entry scripts' wrapper: a UserError becomes one `error:` line and its exit code, no traceback.

Set TRAIN_DEBUG=1 in the environment to get the full Python traceback as well.
"""
import argparse
import functools
import os
import sys
import time
import traceback

from utils.distributed_utils import cleanup
from utils.errors import UserError, one_line

SHARED_ERROR_GRACE_S = 5


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
            # An error of one rank is printed by that rank; one that all ranks share
            # is printed once. The exit code alone makes torchrun stop the group.
            launch_rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
            if not (getattr(e, "every_rank", False) and launch_rank != "0"):
                print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
            elif "TORCHELASTIC_RUN_ID" in os.environ:
                # torchrun stops every worker as soon as one exits; a moment's wait lets rank 0,
                # which alone prints a shared error, get there (under load it can be seconds behind).
                time.sleep(SHARED_ERROR_GRACE_S)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr, flush=True)
            sys.exit(130)
        finally:
            # However main ends, leave no process group behind (a no-op outside DDP), so a
            # script's main() can also be called twice in one process, as the tests do.
            cleanup()

    return wrapper


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the config's flags and the tools (predict.py, export.py): a bad argument is one
    `error:` line, exit 2, instead of argparse's usage text."""

    def error(self, message):
        raise UserError(message)
