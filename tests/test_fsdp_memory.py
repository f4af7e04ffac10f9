"""tools/fsdp_memory.py on the CPU: each size measured from the same start, and a clean exit.

    python -m pytest tests/test_fsdp_memory.py -q

The peak memory it reports needs CUDA (NaN here); what the CPU can check is that no FSDP model of
an earlier size is still alive when the next one starts, and that the process group's threads are
gone before the interpreter shuts down, so the run ends with exit code 0.
"""
import argparse
import gc
import importlib.util
import json
import os

import pytest
import torch
from torch import nn

import model
from conftest import REPO, run_entry
from utils import distributed_utils as du
from utils import fsdp

pytestmark = pytest.mark.skipif(fsdp.fully_shard is None or fsdp.TORCH_VERSION < fsdp.CPU_FSDP_TORCH,
                                reason="FSDP2 on the CPU needs torch >= 2.6 (2.4 and 2.5 need CUDA streams)")
TOOL = REPO / "tools" / "fsdp_memory.py"
# Runs a script and, as the interpreter begins to shut down, prints how many gloo threads are left.
# One left then may free a collective's tensor during the shutdown, which needs the GIL: the
# process aborts ("terminate called without an active exception") when that thread runs late.
AT_EXIT = """import atexit, os, runpy, sys
def report():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{tid}/comm").read())
        except OSError:
            pass
    gloo = sum(n.startswith(("pt_gloo", "gloo")) for n in names)
    sys.stderr.write(f"gloo threads at exit: {gloo}\\n")  # one write: the ranks share the pipe
atexit.register(report)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def load_tool():
    spec = importlib.util.spec_from_file_location("fsdp_memory", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def live_fsdp_modules():
    return sum(fsdp.FSDPModule in type(o).__mro__ for o in gc.get_objects())


def gloo_threads():
    """This process's gloo worker and transport threads, by thread id."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(("pt_gloo", "gloo")):
                    found.add(tid)
        except OSError:  # the thread ended meanwhile
            pass
    return found


@pytest.fixture
def group_of_one(capsys):
    info = du.init_distributed_mode("cpu")  # no launcher: a real gloo group of one process
    try:
        yield info
    finally:
        du.cleanup()
        capsys.readouterr()


def small_cnn(width):
    def build(num_classes):
        return nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, width, 3),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))
    return build


def test_each_size_starts_without_the_previous_sizes_fsdp_model(group_of_one, monkeypatch):
    """Two sizes of the ladder in a row: the first one's sharded model is gone when the second starts."""
    tool, starts = load_tool(), []
    for width in (8, 16):
        monkeypatch.setitem(model.MODELS, f"cnn{width}", small_cnn(width))
    real = tool.one_run
    monkeypatch.setattr(tool, "one_run", lambda *a: starts.append(live_fsdp_modules()) or real(*a))
    args = argparse.Namespace(batch=2, steps=1, warmup=1, size=16)
    gc.disable()  # only the tool's own collection may free the cycles
    try:
        rows = [tool.measured(name, "fsdp", args, group_of_one) for name in ("cnn8", "cnn16")]
        left = live_fsdp_modules()
    finally:
        gc.enable()
    assert [r["params"] for r in rows] == [8 * 27 + 8 + 16 + 8 * 72 + 8 + 8000 + 1000,
                                           16 * 27 + 16 + 32 + 16 * 144 + 16 + 16000 + 1000]
    assert starts == [0, 0] and left == 0


def test_cleanup_after_fsdp_ends_gloos_threads_before_the_interpreter_does(capsys):
    """FSDP2 models in reference cycles and DTensor's cached meshes hold the group: destroying it
    alone left its threads running into interpreter shutdown."""
    before = gloo_threads()
    info = du.init_distributed_mode("cpu")
    try:
        torch.manual_seed(0)
        sharded = fsdp.shard_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)),
                                 fsdp.make_mesh(info.device, 1), verbose=False)
        sharded(torch.randn(2, 4)).sum().backward()
        assert gloo_threads() - before
        del sharded
    finally:
        du.cleanup()
    capsys.readouterr()
    assert gloo_threads() - before == set()


@pytest.mark.slow
def test_quick_run_writes_its_table_and_leaves_no_gloo_thread_at_exit(tmp_path):
    wrapper = tmp_path / "at_exit.py"
    wrapper.write_text(AT_EXIT)
    r = run_entry(wrapper, TOOL, "--quick", "--out-dir", tmp_path / "out", nproc=2)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert [x for x in r.stderr.splitlines() if x.startswith("gloo threads")] == ["gloo threads at exit: 0"] * 2
    assert "largest that trains: ddp mobilenet_v3_small, fsdp mobilenet_v3_small" in r.stdout
    rows = json.loads((tmp_path / "out" / "fsdp_memory.json").read_text())["rows"]
    assert [(x["wrap"], "error" in x, x["params"]) for x in rows] == [("ddp", False, 2542856),
                                                                     ("fsdp", False, 2542856)] * 2
