"""Unit tests of utils/distributed_utils.py, no processes launched (the launches are in
tests/test_parallel_semantics.py).

    python -m pytest tests/test_distributed_utils.py -q

Launch environment (torchrun and SLURM variables) and SyncBN conversion as the
DDP script does it. (That no collective sits under a rank guard is checked over the
whole code base in tests/test_code_rules.py.)
"""
import socket

import pytest
import torch
from torch import nn

from model import create_model
from utils import distributed_utils as du

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "USE_LIBUV")


@pytest.fixture
def env(monkeypatch):
    """No launcher variables; whatever the code under test sets in os.environ is undone afterwards."""
    for name in LAUNCH_VARS:
        monkeypatch.setenv(name, "x")  # recorded first, so the delenv below is undone to "absent"
        monkeypatch.delenv(name)
    return monkeypatch


def test_read_launch_env_torchrun_and_slurm(env):
    assert du.read_launch_env() is None
    for name, value in {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}.items():
        env.setenv(name, value)
    assert du.read_launch_env() == (3, 8, 1)
    # torchrun inside an srun allocation: torchrun's own variables describe the process.
    for name, value in {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "2"}.items():
        env.setenv(name, value)
    assert du.read_launch_env() == (5, 16, 2)


def test_init_distributed_mode_under_slurm(env):
    """srun without torchrun: rank, world and local rank from SLURM_*, gloo on CPU, a default master."""
    for name, value in {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                        "SLURM_NTASKS_PER_NODE": "4"}.items():
        env.setenv(name, value)
    joined = {}
    env.setattr(du.dist, "init_process_group", lambda **kw: joined.update(kw))
    info = du.init_distributed_mode("cpu")
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 8, 1, 4)
    assert info.distributed and info.device == torch.device("cpu")
    assert (joined["backend"], joined["rank"], joined["world_size"]) == ("gloo", 3, 8)
    assert du.os.environ["MASTER_ADDR"] == "127.0.0.1" and du.os.environ["MASTER_PORT"] == "29500"


WINDOWS_WHEEL_ERROR = "use_libuv was requested but PyTorch was build without libuv support"


def test_the_store_follows_use_libuv_else_the_build(env):
    """The Windows wheels have no libuv, and torch >= 2.4 asks for it by default: decide once, with
    USE_LIBUV from the environment winning, and leave USE_LIBUV=0 behind for env:// rendezvous."""
    def probe_must_not_run():
        raise AssertionError("USE_LIBUV was set: no probe")
    for value, expected in (("0", False), ("1", True)):
        environ = {"USE_LIBUV": value}
        assert du.store_libuv(environ, probe_must_not_run) is expected and environ == {"USE_LIBUV": value}
    environ = {}
    assert du.store_libuv(environ, lambda: False) is False and environ == {"USE_LIBUV": "0"}
    for has in (True, None):  # a build with libuv, or a torch without the switch: nothing to set
        environ = {}
        assert du.store_libuv(environ, lambda: has) is bool(has) and environ == {}


def test_has_libuv_reads_the_builds_error(env):
    assert du.has_libuv() is True  # the Linux wheels have it

    def windows_wheel(*args, **kwargs):
        raise RuntimeError(WINDOWS_WHEEL_ERROR)

    def before_the_switch(*args, use_libuv=None, **kwargs):
        raise TypeError("__init__(): incompatible constructor arguments")
    env.setattr(du.dist, "TCPStore", windows_wheel)
    assert du.has_libuv() is False
    env.setattr(du.dist, "TCPStore", before_the_switch)
    assert du.has_libuv() is None


def test_a_build_without_libuv_joins_over_the_plain_store(env):
    """A launch from the environment (RANK, MASTER_PORT...) on a build without libuv: the process group
    forms over the plain TCPStore; with libuv's default the Windows wheel raises the error above."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        env.setenv(name, value)
    env.setattr(du, "has_libuv", lambda: False)
    try:
        du.init_distributed_mode("cpu")
        store = du.dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        assert du.os.environ["USE_LIBUV"] == "0" and store.libuvBackend is False
    finally:
        du.cleanup()


def test_the_restart_store_follows_use_libuv(env):
    """Under torchrun the project opens the agent's store itself (restart_store): the same choice."""
    opened = []
    env.setattr(du.dist, "TCPStore", lambda *args, **kwargs: opened.append(kwargs) or du.dist.HashStore())
    for name, value in {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "USE_LIBUV": "0"}.items():
        env.setenv(name, value)
    assert du.restart_store(2, None) is not None
    assert opened[-1]["use_libuv"] is False


def test_no_launcher_means_a_group_of_one_process(env, capsys):
    """`python train_multi_gpu_ddp.py` without torchrun: a real one-process group, so DDP can wrap the model."""
    try:
        info = du.init_distributed_mode("cpu")
        assert (info.rank, info.world_size, info.distributed) == (0, 1, True)
        assert du.dist.is_initialized() and du.dist.get_world_size() == 1
        assert du.reduce_value(torch.tensor(3.0), average=False).item() == 3.0
    finally:
        du.cleanup()
    assert "no torchrun or srun environment" in capsys.readouterr().out


def count(model, kind):
    return sum(type(m) is kind for m in model.modules())


def test_sync_bn_converts_every_batchnorm_of_resnet34():
    """What `--syncBN True` does on CUDA: every BatchNorm2d of ResNet34 (36 of them) becomes a
    SyncBatchNorm with the same weights. The conversion itself needs no GPU."""
    model = create_model("resnet34", num_classes=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n_bn = count(model, nn.BatchNorm2d)
    assert n_bn == 36  # stem 1 + 16 basic blocks x 2 + 3 downsample projections
    converted = du.convert_sync_bn(model, True, torch.device("cuda", 0))
    assert count(converted, nn.SyncBatchNorm) == n_bn and count(converted, nn.BatchNorm2d) == 0
    after = converted.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_sync_bn_on_cpu_warns_once_and_keeps_batchnorm(capsys):
    model = create_model("resnet18", num_classes=5)
    assert du.convert_sync_bn(model, True, torch.device("cpu"), verbose=True) is model
    assert du.convert_sync_bn(model, True, torch.device("cpu"), verbose=False) is model  # rank 1..
    assert du.convert_sync_bn(model, False, torch.device("cuda", 0)) is model             # --syncBN False
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: --syncBN True ignored"), lines
    assert count(model, nn.SyncBatchNorm) == 0
