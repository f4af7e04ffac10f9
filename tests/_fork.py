"""`python ...` and `torchrun ...` started by a test, forked from the test process instead of exec'd.

A new interpreter spends about 7 CPU-s importing torch and torchvision before a script's first line;
the suite starts some two hundred of them, on two cores. conftest.py swaps subprocess.Popen for
ForkPopen: a child whose command is this interpreter running a script (`python [-u] SCRIPT ...`,
`-m MODULE ...`, `-c CODE ...`) is forked and runs it as the interpreter would, with the
command's stdio, cwd, environment and session; the repository's modules are imported afresh, so
nothing a test changed in them reaches the child. `-m torch.distributed.run` runs torchrun's own
code, whose agent forks its workers the same way. Everything else (bash, sbatch, git, an
interpreter with other options or an environment that changes how Python starts) is exec'd as usual,
and so is every child of a test marked `real_exec`: one that needs what only a new process shows,
such as torchrun's messages about its subprocess workers.

Each forked child writes its command line and rank to REGISTRY/<pid>, since /proc shows the test
process's: cmdline_of(pid) and rank_of(pid) read it there, or from /proc for an exec'd child.
"""
import atexit
import builtins
import faulthandler
import importlib.machinery
import io
import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENABLED = True  # conftest turns it off for tests marked real_exec
REGISTRY = None  # a folder, set by install()
RealPopen = subprocess.Popen
_LOCK = threading.RLock()  # pipes are made and the fork taken under it: no other child inherits them
# Environment keys that change how the interpreter starts: a child with them set otherwise is exec'd.
_STARTUP_KEYS = ("PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONSTARTUP", "PYTHONSAFEPATH",
                 "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONMALLOC", "PYTHONIOENCODING", "PYTHONUTF8",
                 "LD_PRELOAD", "LD_LIBRARY_PATH", "MALLOC_CONF")
_BASE_PATH = [p for p in sys.path if p.startswith((sys.prefix, sys.base_prefix))]
_START_ENV = dict(os.environ)


def install(registry):
    global REGISTRY
    REGISTRY = Path(registry)
    REGISTRY.mkdir(parents=True, exist_ok=True)
    subprocess.Popen = ForkPopen


def _started(pid):
    """Process `pid`'s start time in clock ticks (/proc/PID/stat): a reused pid has another."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _registered(pid):
    try:
        entry = json.loads((REGISTRY / str(pid)).read_text())
        return entry if entry["started"] == _started(pid) else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def cmdline_of(pid):
    """The command line of process `pid` as a list: what it was started with."""
    entry = _registered(pid)
    if entry is not None:
        return entry["argv"]
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def rank_of(pid):
    """RANK of a torchrun worker `pid`, or None."""
    entry = _registered(pid)
    if entry is not None:
        return entry.get("rank")
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _forkable(args, env):
    """The interpreter's arguments when `args` is this interpreter running Python code, else None."""
    if not (ENABLED and isinstance(args, (list, tuple)) and len(args) > 1):
        return None
    if os.path.realpath(str(args[0])) != os.path.realpath(sys.executable):
        return None
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS") != "1":  # the test process's OpenMP pool is not fork-safe beyond 1
        return None
    if any(env.get(k) != _START_ENV.get(k) for k in _STARTUP_KEYS):
        return None
    rest, i = [str(a) for a in args[1:]], 0
    while i < len(rest) and rest[i] == "-u":
        i += 1
    if i == len(rest) or (rest[i].startswith("-") and rest[i] not in ("-m", "-c")):
        return None
    return rest


class ForkPopen(RealPopen):
    """subprocess.Popen that forks a Python child instead of exec'ing a new interpreter for it."""

    def __init__(self, args, *a, **kw):
        with _LOCK:
            super().__init__(args, *a, **kw)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        python_args = None if (shell or executable or preexec_fn or gid is not None or gids or uid is not None
                               or umask >= 0 or process_group not in (None, -1)) else _forkable(args, env)
        if python_args is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                          c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                                          start_new_session, process_group)
        _flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _reset_lock()
                if start_new_session:
                    os.setsid()
                for fd, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
                    if fd != -1:
                        os.dup2(fd, target)
                for fd in {p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite} - {-1, 0, 1, 2}:
                    os.close(fd)
                if cwd is not None:
                    os.chdir(cwd)
                if env is not None:
                    os.environ.clear()
                    os.environ.update({str(k): str(v) for k, v in env.items()})
                _register([sys.executable, *python_args])
                code = run_python(python_args)
            except BaseException:  # noqa: B036 - the child must never return into the test
                traceback.print_exc()
            finally:
                _flush()
                os._exit(code)
        self.pid = pid
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _reset_lock():
    global _LOCK
    _LOCK = threading.RLock()  # the parent's is held by the thread that forked; nothing releases it here


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _register(argv, rank=None):
    if REGISTRY is not None:  # a forked child's copy of the test process's module: the same folder
        pid = os.getpid()
        (REGISTRY / str(pid)).write_text(json.dumps({"argv": argv, "rank": rank, "started": _started(pid)}))


def _stream(fd, mode, unbuffered, **kw):
    raw = io.FileIO(fd, mode, closefd=False)
    if unbuffered and mode == "w":  # as -u makes them: raw, every write passed straight on
        return io.TextIOWrapper(raw, encoding="utf-8", write_through=True, **kw)
    buffered = io.BufferedWriter(raw) if mode == "w" else io.BufferedReader(raw)
    return io.TextIOWrapper(buffered, encoding="utf-8", **kw)


def _fresh_process_state(unbuffered):
    """What a new interpreter would have: its own stdio, default signals, warnings and logging, no
    atexit handlers and none of the repository's modules imported yet."""
    sys.stdin = sys.__stdin__ = _stream(0, "r", unbuffered)
    sys.stdout = sys.__stdout__ = _stream(1, "w", unbuffered)
    sys.stderr = sys.__stderr__ = _stream(2, "w", unbuffered, errors="backslashreplace",
                                          line_buffering=not unbuffered)
    for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGALRM", "SIGCHLD", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.alarm(0)
    faulthandler.disable()
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    atexit._clear()
    for logger in [logging.root, *logging.Logger.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", ())):
            if type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
            elif type(handler) is logging.StreamHandler:
                handler.setStream(sys.stderr)
    logging.root.setLevel(logging.WARNING)
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if path.startswith(str(REPO) + os.sep) and not path.startswith(sys.prefix) and name != __name__:
            del sys.modules[name]
    torch = sys.modules.get("torch")
    if torch is not None:  # else the child imports it itself, fresh
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = torch.backends.cudnn.deterministic = False
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.manual_seed(67280421310721)  # torch's seed at start-up
    # Last: the calls above may import modules (sympy) that add filters of their own.
    warnings.resetwarnings()  # the interpreter's default filters, as in a release build
    warnings.onceregistry.clear()
    for action, category in (("ignore", ResourceWarning), ("ignore", ImportWarning),
                             ("ignore", PendingDeprecationWarning), ("ignore", DeprecationWarning)):
        warnings.simplefilter(action, category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


def run_python(args):
    """Run `python ARGS` in this process as the interpreter would (ARGS after any -u): -> exit code."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    while args and args[0] == "-u":
        args, unbuffered = args[1:], True
    _fresh_process_state(unbuffered)
    try:
        if args[0] == "-c":
            sys.argv, sys.path = ["-c", *args[2:]], ["", *_BASE_PATH]
            _run_as_main(args[1], "<string>")
        elif args[0] == "-m":
            sys.argv, sys.path = [args[1], *args[2:]], [os.getcwd(), *_BASE_PATH]
            if args[1] == "torch.distributed.run":
                _fork_torchrun_workers()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args[0])
            sys.argv, sys.path = [args[0], *args[1:]], [os.path.dirname(os.path.realpath(script)), *_BASE_PATH]
            with open(script, "rb") as f:
                _run_as_main(f.read(), script)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: B036 - as the interpreter: the traceback, then exit status 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # the interpreter waits for non-daemon threads, then runs atexit
    atexit._run_exitfuncs()
    _flush()
    return code


def _run_as_main(source, filename):
    """Run code as the interpreter runs a script or -c: in a new __main__, __file__ absolute, argv as given."""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    if filename != "<string>":
        main.__file__, main.__cached__ = filename, None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", filename)
    sys.modules["__main__"] = main
    exec(compile(source, filename, "exec"), main.__dict__)


def _fork_torchrun_workers():
    """torchrun's own launcher, its workers forked from it (start method fork) rather than exec'd."""
    import torch.distributed.launcher.api as launcher
    real = launcher.elastic_launch

    def elastic_launch(config, entrypoint):
        if entrypoint != os.getenv("PYTHON_EXEC", sys.executable):
            return real(config, entrypoint)
        config.start_method = "fork"
        return real(config, _worker)

    launcher.elastic_launch = elastic_launch


def _worker(*cmd_args):
    """One torchrun worker, forked by the agent: `python CMD_ARGS` in this process."""
    _register([sys.executable, *cmd_args], int(os.environ["RANK"]))
    code = run_python(list(cmd_args))
    if code:
        os._exit(code)  # the agent reads the exit status, as for an exec'd worker
