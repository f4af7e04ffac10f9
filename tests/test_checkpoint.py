"""Checkpoint files: safe loading, refusal of a foreign run, write failures, atomic writes, portability.

    python -m pytest tests/test_checkpoint.py -q

Entry scripts run in this process (their main()), so a fault can be injected
with a monkeypatch instead of a hook in the product code.
"""
import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import train
import train_multi_gpu_ddp
import train_multi_gpu_dp
from _resume_utils import load, metrics, one_thread, run_args, run_main  # noqa: F401
from conftest import REPO, free_port, make_image_folder
from model import create_model
from utils import checkpoint as ckpt
from utils.config import load_config
from utils.optim import build_optimizer, build_scheduler

pytestmark = pytest.mark.usefixtures("one_thread")
ONE_EPOCH = ("train.batch_size=12",)  # 25 train images: 2 steps per epoch


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("ckpt") / "flowers")


@pytest.fixture(scope="module")
def small_run(data, tmp_path_factory, one_thread):
    """One epoch of train.py: a genuine checkpoint to resume from."""
    out = tmp_path_factory.mktemp("small") / "run"
    mp = pytest.MonkeyPatch()
    try:
        assert run_main(train, run_args(data, out, *ONE_EPOCH, epochs=1), mp) == 0
    finally:
        mp.undo()
    return out


def _error_line(capsys):
    """The run's one `error:` line (stderr also carries the progress bars)."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error" in x.lower() or "Traceback" in x]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


class _RunsCode:
    """Unpickling this calls exec(code): what a malicious 'checkpoint' would do."""

    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


@pytest.mark.parametrize("flag", ["--resume", "--weights"])
def test_a_file_carrying_code_is_refused_and_the_code_never_runs(flag, data, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {"fc.weight": torch.zeros(1)}, "optimizer": {}, "epoch": 1,
                "payload": _RunsCode(f"open({str(marker)!r}, 'w').close()")}, evil)
    # The file is armed: a plain (unsafe) load really runs the code.
    torch.load(evil, weights_only=False)
    assert marker.exists()
    marker.unlink()

    code = run_main(train, run_args(data, tmp_path / "run", epochs=1, flags=[flag, evil]), monkeypatch)
    line = _error_line(capsys)
    assert code == 2 and str(evil) in line and "cannot load" in line
    assert not marker.exists()


def test_checkpoint_of_another_architecture_or_class_count_is_refused(small_run, data, tmp_path, monkeypatch,
                                                                      capsys):
    last = small_run / "checkpoints" / "last.pt"
    args = run_args(data, tmp_path / "a", "model.name=resnet34", flags=["--resume", last])
    assert run_main(train, args, monkeypatch) == 2
    assert "checkpoint is a resnet18, this run builds a resnet34" in _error_line(capsys)

    four = make_image_folder(tmp_path / "four", classes=("daisy", "roses", "sunflowers", "tulips"))
    assert run_main(train, run_args(four, tmp_path / "b", flags=["--resume", last]), monkeypatch) == 2
    line = _error_line(capsys)
    assert "checkpoint has 5 classes" in line and "the data has 4" in line
    assert not (tmp_path / "a" / "metrics.jsonl").exists()  # refused before any training or writing


def test_disk_full_during_save_keeps_the_previous_last_pt_and_stops(data, tmp_path, monkeypatch, capsys):
    real_save, calls = torch.save, []

    def save_until_disk_full(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:  # epoch 2's save: half a file, then the disk is full
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_until_disk_full)
    out = tmp_path / "run"
    code = run_main(train, run_args(data, out, *ONE_EPOCH, epochs=3), monkeypatch)
    line = _error_line(capsys)
    assert code == 1
    assert "could not write checkpoint" in line and "No space left on device" in line and "intact" in line
    state = load(out / "checkpoints" / "last.pt")
    assert (state["epoch"], state["epoch_step"]) == (1, 0)
    assert [m["epoch"] for m in metrics(out)] == [1]  # the failed epoch is not reported as done
    assert not list((out / "checkpoints").glob(".*.tmp"))


def test_checkpoints_move_between_train_ddp_and_dp(small_run, data, tmp_path, monkeypatch, capsys):
    """train.py -> DDP -> train.py -> DP -> train.py, each resuming the previous one's last.pt."""
    prev = small_run / "checkpoints" / "last.pt"
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for epochs, script in enumerate([train_multi_gpu_ddp, train, train_multi_gpu_dp, train], start=2):
        out = tmp_path / f"{epochs}-{script.__name__}"
        with monkeypatch.context() as m:
            if script is train_multi_gpu_ddp:  # a real process group of one: the DDP wrapper and its 'module.'
                for k, v in env.items():
                    m.setenv(k, v)
            code = run_main(script, run_args(data, out, *ONE_EPOCH, epochs=epochs, flags=["--resume", prev]), m)
        assert code == 0, capsys.readouterr().err
        assert f"resumed from {prev} at epoch {epochs}" in capsys.readouterr().out
        prev = out / "checkpoints" / "last.pt"
        state = load(prev)
        assert state["epoch"] == epochs and state["global_step"] == 2 * epochs
        assert not [k for k in state["model"] if k.startswith(("module.", "_orig_mod."))]


def _kill_while_saving(ckpt_dir):
    """Start a process that saves last.pt in a loop; SIGKILL it once last.pt exists and a save's temp
    file is seen. -> the names left in ckpt_dir."""
    saver = subprocess.Popen([sys.executable, "-c", f"""
import sys, torch
sys.path.insert(0, {str(REPO)!r})
from utils.checkpoint import atomic_save
big = torch.arange(4_000_000, dtype=torch.float32)  # 16 MB: a save takes a while
for i in range(1_000_000):
    atomic_save({{"i": i, "t": big + i}}, {str(ckpt_dir / "last.pt")!r})
"""], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 60
        while not ((ckpt_dir / "last.pt").exists() and list(ckpt_dir.glob(".*.tmp"))):
            assert time.time() < deadline and saver.poll() is None, "no save in flight was ever seen"
            time.sleep(0.005)
        saver.send_signal(signal.SIGKILL)
        saver.wait()
    finally:
        saver.kill()
        saver.wait()
    return sorted(p.name for p in ckpt_dir.iterdir())


def test_a_process_killed_while_saving_never_tears_last_pt(tmp_path):
    """Killed with a save in flight, a process leaves last.pt whole (and its temp file, which a
    resumed run removes). The kill can still land between two saves; then it is tried again."""
    for attempt in range(5):
        ckpt_dir = tmp_path / f"checkpoints{attempt}"
        left = _kill_while_saving(ckpt_dir)
        state = load(ckpt_dir / "last.pt")
        assert torch.equal(state["t"], torch.arange(4_000_000, dtype=torch.float32) + state["i"])
        if len(left) > 1:
            break
    assert len(left) == 2 and left[0].endswith(".tmp") and left[1] == "last.pt", left  # killed mid-save
    ckpt.remove_stale_temps(ckpt_dir)  # what a resumed run does first
    assert [p.name for p in ckpt_dir.iterdir()] == ["last.pt"]


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_best_and_epoch_files_keep_their_epoch_without_a_second_copy(links, tmp_path, monkeypatch):
    """best.pt and epoch_NNN.pt share last.pt's file while it is that epoch's (one copy on disk);
    the next last.pt replaces it by rename, so they keep their epoch. Without hard links: copies."""
    if not links:
        monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EPERM, "no links")))
    d = tmp_path / "checkpoints"
    d.mkdir()
    for epoch, best in [(1, True), (2, False), (3, False)]:
        ckpt.save_checkpoint({"epoch": epoch, "t": torch.full((4,), float(epoch))}, d, is_best=best, keep_last=2)
    assert {p.name: load(p)["epoch"] for p in d.iterdir()} == \
        {"last.pt": 3, "best.pt": 1, "epoch_002.pt": 2, "epoch_003.pt": 3}
    assert (d / "last.pt").samefile(d / "epoch_003.pt") == links
    assert not (d / "best.pt").samefile(d / "last.pt")


def test_resume_command_repeats_the_run_with_output_dir_and_resume_auto():
    argv = ["train.py", "--epochs", "30", "--resume", "old.pt", "--output-dir=runs/x", "optim.lr=0.1",
            "resume=foo"]
    assert ckpt.resume_command("runs/a b", argv=argv) == \
        "python train.py --output-dir 'runs/a b' --resume auto --epochs 30 optim.lr=0.1"
    assert ckpt.resume_command("runs/a", 8, 8, argv=["train_multi_gpu_ddp.py", "--syncBN", "True"]) == \
        "torchrun --nproc_per_node=8 train_multi_gpu_ddp.py --output-dir runs/a --resume auto --syncBN True"


def test_a_restarted_worker_continues_from_the_run_directory(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    last = tmp_path / "checkpoints" / "last.pt"
    assert ckpt.find_resume_path("auto", tmp_path) is None            # a first start: fresh
    assert ckpt.find_resume_path(None, tmp_path, restarted=True) is None
    last.write_bytes(b"")
    assert ckpt.find_resume_path("auto", tmp_path) == last
    other = tmp_path / "other.pt"
    other.write_bytes(b"")
    assert ckpt.find_resume_path(str(other), tmp_path) == other
    assert ckpt.find_resume_path(str(other), tmp_path, restarted=True) == last  # newer than --resume PATH


def test_an_fp16_run_resumes_a_checkpoint_that_has_no_scaler_state(small_run):
    """CPU, fp32 and bf16 runs save the disabled scaler's state, {}; torch refuses to load {} into an
    enabled GradScaler, so resuming them with train.amp=fp16 used to stop with a traceback."""
    state = load(small_run / "checkpoints" / "last.pt")
    assert state["scaler"] == {}
    with pytest.raises(RuntimeError, match="source state dict is empty"):
        torch.amp.GradScaler("cpu", enabled=True).load_state_dict(state["scaler"])
    cfg = load_config(["model.name=resnet18"])
    model = create_model("resnet18", len(state["classes"]))
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.epochs, 10)
    scaler = torch.amp.GradScaler("cpu", enabled=True)  # what build_scaler(torch.float16, ...) gives on CUDA
    restored = ckpt.restore(state, model, optimizer, scheduler, scaler, state["classes"], "resnet18")
    assert (restored.epoch, restored.global_step) == (state["epoch"], state["global_step"])
    assert scaler.is_enabled() and scaler.get_scale() == 2.0 ** 16  # a fresh loss scale


def test_train_compile_on_the_cpu_trains_the_plain_models_weights(small_run, data, tmp_path, monkeypatch, capsys):
    """train.compile=true through train.py's own path, on the CPU with dynamo's eager backend (inductor
    would need a C++ compiler here): the run ends, its checkpoint is the plain model's (no '_orig_mod.'),
    and it holds the weights the uncompiled run of the same command trained."""
    real_compile, compiled = torch.compile, []

    def eager_compile(model, **kw):
        compiled.append(type(model).__name__)
        return real_compile(model, **{**kw, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", eager_compile)
    torch._dynamo.reset()
    out = tmp_path / "compiled"
    try:
        assert run_main(train, run_args(data, out, *ONE_EPOCH, "train.compile=true", epochs=1), monkeypatch) == 0
    finally:
        torch._dynamo.reset()
    assert len(compiled) == 1, compiled
    got, plain = load(out / "checkpoints" / "last.pt"), load(small_run / "checkpoints" / "last.pt")
    assert list(got["model"]) == list(plain["model"])
    for key, value in plain["model"].items():
        assert torch.allclose(got["model"][key].double(), value.double(), rtol=1e-4, atol=1e-6), key
    assert [m["val_acc"] for m in metrics(out)] == [m["val_acc"] for m in metrics(small_run)]
