"""train.deterministic: the same bits on every run, and an op without a deterministic kernel as one line.

    python -m pytest tests/test_deterministic.py -q

In-process runs of train.py (resnet18, 32 px, augmentation on) with two DataLoader workers. On CUDA,
tools/gpu_checks.sh's `deterministic` step runs the same check and measures what the mode costs.
"""
import importlib.util

import pytest
import torch
from torch import nn

import model
from conftest import REPO, make_image_folder, run_entry
from _resume_utils import assert_same_weights, run_args, run_main, single_thread


def load_train():
    spec = importlib.util.spec_from_file_location("train", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def default_mode():
    """The mode is process-wide: leave it as this process had it for the tests that follow."""
    before = torch.are_deterministic_algorithms_enabled()
    with single_thread():
        yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("det_data"), per_class=4)


@pytest.mark.slow
def test_two_runs_with_workers_give_bitwise_equal_weights(image_root, tmp_path, capsys, monkeypatch):
    train = load_train()
    for name in ("a", "b"):
        args = run_args(image_root, tmp_path / name, "data.num_workers=2", "train.deterministic=true", epochs=1)
        assert run_main(train, args, monkeypatch) == 0, capsys.readouterr().err[-2000:]
        # Set by the run itself (use_device), not left over from elsewhere.
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
        torch.use_deterministic_algorithms(False)
    assert capsys.readouterr().out.count("amp off, deterministic") == 2
    assert_same_weights(tmp_path / "a" / "checkpoints" / "last.pt", tmp_path / "b" / "checkpoints" / "last.pt")


class UnpoolNet(nn.Module):
    """MaxUnpool2d has no deterministic CPU or CUDA kernel. Here it runs in training only (as a
    dropout-like layer's work does), so model.py's eval-mode start-up probe passes and the first
    training step meets it, as it meets an op whose backward alone lacks one (common on CUDA)."""

    def __init__(self, num_classes):
        super().__init__()
        self.conv, self.pool, self.unpool = nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2, return_indices=True), \
            nn.MaxUnpool2d(2)
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        x = self.conv(x)
        if self.training:
            x = self.unpool(*self.pool(x))
        return self.head(x.mean(dim=(2, 3)))


def test_an_op_without_a_deterministic_kernel_is_one_error_line(image_root, tmp_path):
    """A process of its own (the model registered by tests/_with_model.py): its whole stderr is the line."""
    args = run_args(image_root, tmp_path / "run", "model.name=unpool_net", "train.deterministic=true", epochs=1)
    proc = run_entry("tests/_with_model.py", "unpool_net", "test_deterministic:UnpoolNet", "train.py", *args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: train.deterministic=true, and max_unpooling2d_forward_out has no deterministic kernel on this "
        "device; run with train.deterministic=false, or replace the op in the model"]


@pytest.mark.parametrize("own, ok", [(":0:0", False), (":16:8", True)])
def test_a_users_own_cublas_workspace_config_is_checked_and_named(image_root, tmp_path, own, ok):
    """CUBLAS_WORKSPACE_CONFIG of the user's own: a value cuBLAS's deterministic kernels do not take is
    one error line naming it, before any data is read; one they take trains."""
    args = run_args(image_root, tmp_path / "run", "train.deterministic=true", epochs=1)
    proc = run_entry("train.py", *args, env={"CUBLAS_WORKSPACE_CONFIG": own})
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: train.deterministic=true, and CUBLAS_WORKSPACE_CONFIG=:0:0 in the environment: cuBLAS's "
        "deterministic kernels need :4096:8 or :16:8; unset it or set one of them"]
    assert not (tmp_path / "run").exists()
