"""Run a training command as a job in a run directory of its own, one or several at a time:
the plumbing tools/kfold.py and tools/sweep.py share.

    result = run_job(["python", "train.py", "--config", "configs/demo.yaml"], "runs/cv/fold_0",
                     ["data.folds=5", "data.fold=0"], slot=0, log=print)
    results = run_jobs([Job(command, "runs/cv/fold_0", ["data.fold=0"]), ...], parallel=2, log=print)

`command` is the user's command exactly as typed (`python train.py ...`, or `torchrun
--nproc_per_node=2 train_multi_gpu_ddp.py ...`). A job runs it with `--output-dir RUN_DIR`, the
overrides (key=value) and, when RUN_DIR already holds a run, `--resume auto`: a job started again
continues from its last.pt. A torchrun command gets a free --master_port, so jobs side by side on
one machine do not collide; slot k gives the job the k-th GPU (or the k-th group of gpus_per_job)
through CUDA_VISIBLE_DEVICES, and jobs side by side split the CPU cores (OMP_NUM_THREADS, unless
yours is set). Its output goes to RUN_DIR/job.log (appended to), and line by line to
`log` when one is given. A SIGTERM or SIGINT to the caller reaches every running job once (a run
then saves last.pt and stops), and no new job starts; a caller killed outright takes its jobs with it.
"""
import contextlib
import ctypes
import io
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from utils import run_dir as run_files
from utils.errors import UserError

TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_live = set()              # the Popen of every running job, for the signal forwarding
_lock = threading.Lock()
_ports = set()             # ports handed out by this process: two jobs never get the same one
_stopping = threading.Event()


@dataclass
class JobResult:
    rc: int                       # the command's exit status (0: done)
    error_line: Optional[str]     # rc != 0: its last `error:` line, or its last line; else None
    run_dir: Path


@dataclass
class Job:
    command: list                 # as the user typed it
    run_dir: Path
    overrides: list = field(default_factory=list)   # key=value, appended after the command
    name: str = ""                # prefixes its lines on the console (run_jobs)


def torchrun_position(command):
    """Where a torchrun command's launcher arguments start (after `torchrun` or `python -m
    torch.distributed.run`), or None for any other command."""
    for i, arg in enumerate(command):
        if os.path.basename(arg) == "torchrun":
            return i + 1
        if arg == "-m" and i + 1 < len(command) and command[i + 1] in TORCHRUN_MODULES:
            return i + 2
        if arg.endswith(".py"):  # the script itself: what follows is its own arguments
            return None
    return None


def free_port():
    """A TCP port free now and not handed to another job of this process."""
    while True:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        with _lock:
            if port not in _ports:
                _ports.add(port)
                return port


def job_argv(command, run_dir, overrides):
    """The command a job runs: the user's, a free --master_port for torchrun, the run directory,
    --resume auto when the directory already holds a run, then the overrides."""
    argv = [str(a) for a in command]
    at = torchrun_position(argv)
    launcher_args = argv[at:] if at is not None else []
    # A --master_port or a rendezvous endpoint of the user's own (several machines) is kept.
    if at is not None and not any(a.startswith(("--master_port", "--master-port", "--rdzv_endpoint",
                                                "--rdzv-endpoint", "--standalone")) for a in launcher_args):
        argv[at:at] = [f"--master_port={free_port()}"]
    run_dir = Path(run_dir)
    argv += ["--output-dir", str(run_dir)]
    # A run killed before its first checkpoint leaves checkpoints/ or metrics.jsonl, which only
    # --resume auto may continue (it starts afresh when there is no last.pt).
    if run_files.holds_run(run_dir):
        argv += ["--resume", "auto"]
    return argv + [str(o) for o in overrides]


def slot_devices(slot, gpus_per_job=None, visible=None):
    """CUDA_VISIBLE_DEVICES for slot k: the k-th GPU, or the k-th group of gpus_per_job, counted in
    the caller's own CUDA_VISIBLE_DEVICES when it has one."""
    per = gpus_per_job or 1
    wanted = range(slot * per, (slot + 1) * per)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        if wanted[-1] >= len(ids):
            raise ValueError(f"slot {slot} x {per} GPU(s) needs GPU {wanted[-1]}, "
                             f"but CUDA_VISIBLE_DEVICES={visible} holds {len(ids)}")
        return ",".join(ids[i] for i in wanted)
    return ",".join(map(str, wanted))


def check_slots(jobs, per_job, flag, what):
    """Every slot's GPUs exist, before any job starts: a job given a GPU that is not there would train on
    the CPU unnoticed. `flag` (--n-jobs, --parallel) and `what` (trial, fold) name them in the one error
    line. A machine without CUDA has no slots to check (the jobs share its CPUs)."""
    import torch
    try:  # within the caller's CUDA_VISIBLE_DEVICES, when it has one
        slot_devices(jobs - 1, per_job)
    except ValueError as e:
        raise UserError(f"{flag} {jobs}: {e}") from None
    count = torch.cuda.device_count()
    if not os.environ.get("CUDA_VISIBLE_DEVICES") and 0 < count < jobs * per_job:
        raise UserError(f"{flag} {jobs} x {per_job} GPU(s) per {what} needs {jobs * per_job} GPUs; "
                        f"this machine has {count}: lower {flag} (or --gpus-per-job)")


def _death_signal():
    """Linux: a function the child calls before exec so that it gets SIGTERM when the caller dies
    (prctl PR_SET_PDEATHSIG): no job runs on orphaned. Looked up here, not in the forked child."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)


_die_with_parent = _death_signal()


def job_threads(command, sharing):
    """OMP_NUM_THREADS for one of `sharing` jobs side by side: this machine's cores split over the jobs'
    processes (a torchrun job has --nproc_per_node of them). Each process would otherwise take every core
    (torch's default), and their thread pools would fight: two demo folds on 2 cores took 4x as long
    (BENCHMARKS.md). None (left alone): one job at a time, the user's own OMP_NUM_THREADS, or a torchrun
    --nproc_per_node that is not a number (torchrun's own rule then applies)."""
    if sharing <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    procs, at = "1", torchrun_position(command)
    if at is not None:
        from torch.distributed.run import get_args_parser  # torchrun's own reading of its arguments
        # A command torchrun refuses: torchrun itself will say so, once.
        with contextlib.suppress(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            procs = get_args_parser().parse_args(command[at:]).nproc_per_node
    if not str(procs).isdigit():
        return None
    procs = int(procs)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // (sharing * procs))


def run_job(command, run_dir, overrides, slot=None, gpus_per_job=None, log=None, *, on_start=None, sharing=1):
    """Run one job to its end -> JobResult(rc, error_line, run_dir). on_start(proc), if given, gets the
    job's Popen once it runs (tools/sweep.py sends a pruned trial's run its SIGTERM). sharing: how many
    jobs run side by side on this machine (their share of the cores: job_threads)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = job_argv(command, run_dir, overrides)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if slot is not None:
        env["CUDA_VISIBLE_DEVICES"] = slot_devices(slot, gpus_per_job)
    threads = job_threads([str(a) for a in command], sharing)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    last = error = None
    with open(run_dir / run_files.JOB_LOG, "a", encoding="utf-8") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        # Its own session: a Ctrl-C reaches it once, forwarded (below), not also from the terminal.
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", env=env, start_new_session=True,
                                preexec_fn=_die_with_parent)
        with _lock:
            _live.add(proc)
        try:
            if on_start is not None:
                on_start(proc)
            for line in proc.stdout:
                out.write(line)
                out.flush()
                line = line.rstrip("\n")
                if line.strip():
                    last = line
                if line.startswith("error:"):
                    error = line
                if log is not None:
                    log(line)
            rc = proc.wait()
        finally:
            with _lock:
                _live.discard(proc)
    return JobResult(rc, None if rc == 0 else (error or last or f"exit status {rc}"), run_dir)


def _forward(signum, frame):
    _stopping.set()
    with _lock:
        for proc in _live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)


@contextlib.contextmanager
def forwarding_signals():
    """SIGTERM and SIGINT reach every running job (once) and stop new ones from starting; installed
    only in the main thread, where Python allows signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def stopping():
    """True after a SIGTERM or SIGINT was forwarded: start no further job."""
    return _stopping.is_set()


class Slots:
    """N device slots for jobs side by side: `with slots.take() as k:` holds slot k for one job."""

    def __init__(self, n):
        self.free = queue.SimpleQueue()
        for k in range(n):
            self.free.put(k)

    @contextlib.contextmanager
    def take(self):
        k = self.free.get()
        try:
            yield k
        finally:
            self.free.put(k)


def run_jobs(jobs, parallel=1, gpus_per_job=None, log=None):
    """Run `jobs` (Job) N at a time -> their JobResults, in order; None for a job not started because
    of a SIGTERM/SIGINT. parallel=1 runs them one after another with the caller's devices; N > 1
    gives each running job its own slot (GPU). `log(line)` sees every line, prefixed by the job's name."""
    slots = Slots(parallel)

    def one(job):
        if stopping():
            return None
        prefix = f"[{job.name}] " if job.name else ""
        with slots.take() as k:
            return run_job(job.command, job.run_dir, job.overrides, slot=k if parallel > 1 else None,
                           gpus_per_job=gpus_per_job, sharing=parallel,
                           log=None if log is None else (lambda line: log(prefix + line)))

    with forwarding_signals(), ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(one, jobs))
