"""Shared test helpers: tiny image folders and running the real entry scripts.

Tests run on CPU. Small models and 32 px images keep a whole run to seconds;
`slow` marks the ones that still take longer (they run in CI too). Every `python ...` or `torchrun ...`
child is a new interpreter, as a user's is: what a test reads of a process (stderr, exit status,
signals, warnings) is what a user would see.
"""
import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Arguments that make any entry script fast on CPU; a test appends its own after these.
FAST_ARGS = ["--device", "cpu", "model.name=resnet18", "data.img_size=32", "data.val_resize=36",
             "data.num_workers=0", "train.epochs=1", "train.batch_size=4", "train.log_every=2",
             "train.figures=false"]  # the pictures are tested on their own (conftest.trained_run)

CLASS_COLOURS = {"daisy": (240, 240, 240), "dandelion": (250, 220, 20), "roses": (200, 20, 30),
                 "sunflowers": (150, 90, 10), "tulips": (220, 80, 200)}


def make_image_folder(root, per_class=6, classes=tuple(CLASS_COLOURS), size=(40, 32), ext=".jpg"):
    """A class-per-folder root of small images, a distinct colour per class plus a gradient."""
    root = Path(root)
    for ci, name in enumerate(classes):
        colour = CLASS_COLOURS.get(name, ((ci * 80) % 256, (ci * 150) % 256, (ci * 40) % 256))
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = Image.new("RGB", size, colour)
            px = img.load()
            for x in range(size[0]):  # a little structure so crops differ
                px[x, (i + x) % size[1]] = (x * 6 % 256, i * 20 % 256, 128)
            img.save(root / name / f"{name}_{i:03d}{ext}")
    return root


@pytest.fixture
def image_root(tmp_path):
    """Five classes x 6 images: 25 train / 5 val with the default val_rate 0.2."""
    return make_image_folder(tmp_path / "flowers")


_PORTS = itertools.count()


def free_port():
    """A port for a test's rendezvous, free now and kept from the others' way: below the kernel's ephemeral
    range (32768+), where no socket that binds port 0 (gloo's pairs, another worker's clients) lands, and in
    a block of its own for each xdist worker. A port the OS picks, released and bound again later, could
    meanwhile be handed to another test's socket: EADDRINUSE."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    for _ in range(500):
        port = 15000 + 500 * (worker % 32) + next(_PORTS) % 500
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free port in this worker's block")


def run_entry(script, *args, nproc=None, env=None, timeout=300, cwd=REPO):
    """Run an entry script as a user would: `python script ...` or torchrun with `nproc` gloo processes."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if nproc:
        # No --master_port: on one node torchrun then binds a free port itself (c10d on localhost:0),
        # where one picked here could be taken by another test's gloo sockets before it binds.
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", str(REPO / script)]
    else:
        cmd = [sys.executable, str(REPO / script)]
    proc = subprocess.Popen(cmd + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full_env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun then stops its workers, which sit in sessions of their own and
        # would otherwise hang on until the process-group timeout.
        proc.terminate()
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def cmdline_of(pid):
    """The command line of process `pid` as a list (/proc/PID/cmdline), as pgrep -f reads it."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def rank_of(pid):
    """RANK of torchrun worker `pid` (its environment in /proc/PID/environ), or None."""
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def workers_of(launcher_pid):
    """{rank: pid} of the worker processes a torchrun agent started (its children, read from /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == launcher_pid:
                rank = rank_of(int(stat.parent.name))
                if rank is not None:
                    found[rank] = int(stat.parent.name)
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
    return found


def checkpoint_with_sizes(tmp_path, monkeypatch, state, data, img_size, val_resize):
    """A copy of checkpoint `state` whose config's data section is `data` (None: no data section), and
    configs/default.yaml with img_size and val_resize changed (monkeypatched in): -> the copy's path."""
    import torch
    import yaml

    import utils.config
    default = yaml.safe_load(utils.config.DEFAULT_CONFIG.read_text())
    default["data"].update(img_size=img_size, val_resize=val_resize)
    (tmp_path / "default.yaml").write_text(yaml.safe_dump(default))
    monkeypatch.setattr(utils.config, "DEFAULT_CONFIG", tmp_path / "default.yaml")
    config = {k: v for k, v in state["config"].items() if k != "data"}
    path = tmp_path / "sizes.pt"
    torch.save({**state, "config": {**config, **({"data": data} if data is not None else {})}}, path)
    return path


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one pytest worker more than this process may use cores. A test spends part of its time
    waiting (a rank's timeout, SLURM's scheduler, a server's start, a kill's poll): on 2 cores `.ci/run` kept
    the CPUs busy 156 % of 200 % with one worker per core, 173 % with one more (BENCHMARKS.md)."""
    return len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds; still runs in CI")
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")


@contextlib.contextmanager
def _process_state_kept():
    """os.environ and torch's determinism switches as they were: an entry script's main() run in this
    process sets them (train.deterministic: CUBLAS_WORKSPACE_CONFIG, use_deterministic_algorithms;
    LOCAL_RANK, MASTER_ADDR), and a later test or child would inherit them."""
    env = dict(os.environ)
    torch = sys.modules.get("torch")
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) if torch else None
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        if flags is not None:
            torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2:]


@pytest.fixture(scope="module", autouse=True)
def _module_process_state():
    """Around a module's shared fixtures (set up before any test's own fixtures)."""
    with _process_state_kept():
        yield


@pytest.fixture(autouse=True)
def _test_process_state():
    with _process_state_kept():
        yield


SESSION_FOLDERS = set()  # made by session-scoped fixtures, used by later modules


@pytest.fixture(scope="module", autouse=True)
def _remove_module_folders(tmp_path_factory, request):
    """Delete the folders a module's shared fixtures made once its tests pass, as pytest.ini does for
    each test's tmp_path: the suite's checkpoints would otherwise fill a small disk. The folders of
    session fixtures (SESSION_FOLDERS) stay."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for path in set(base.iterdir()) - before - SESSION_FOLDERS:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """One finished train.py run shared by the after-training tests (predict, export, eval-only,
    pictures): 3 epochs of resnet18 at 32 px on 5 classes x 6 images, epoch_NNN.pt of each kept,
    with an EMA of the weights beside them."""
    root = tmp_path_factory.mktemp("trained")
    SESSION_FOLDERS.add(root)
    data = make_image_folder(root / "flowers")
    run_dir = root / "run"
    base = [*FAST_ARGS, "--data-path", data, "train.figures=true", "train.worst_images=4", "train.ema_decay=0.5"]
    proc = run_entry("train.py", *base, "--output-dir", run_dir, "train.epochs=3", "train.keep_last=3")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {"data": data, "run_dir": run_dir, "base": base}
