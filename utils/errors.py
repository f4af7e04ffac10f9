"""User-facing errors: one line on stderr and a non-zero exit, no traceback.

Anything a user can cause (a typo in a config, a missing folder, an impossible
batch size) is raised as a `UserError`; utils/cli.py prints it as `error: ...`.
"""

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
