"""train.global_batch: the same images per optimizer step, the same lr and the same weights on any
process count, through the real entry scripts on CPU.

    python -m pytest tests/test_global_batch.py -q

One torchrun launch of 4 gloo processes runs train_multi_gpu_ddp.py's main() at world size 4
(accumulation 1), then in ranks 0 and 1 as a group of 2 (accumulation 2) (tests/_ddp_worker.py
--global-batch); train.py (accumulation 4), train_multi_gpu_dp.py (on CPU one process without the
wrapper, its batch the global 8: accumulation 1) and the elastic restart run in this process. The model
is TinyNet (GroupNorm: no batch statistics) on unaugmented inputs: BatchNorm without SyncBN and the
per-rank augmentation streams differ by design between world sizes (docs/parallelism.md).
"""
import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, free_port, make_image_folder
from _resume_utils import run_main, single_thread

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ddp_worker as worker  # noqa: E402
from test_parallel_semantics import TORCHRUN, model_tensors, rel_err, spawn, wait_all  # noqa: E402

N, B = worker.GLOBAL_BATCH, worker.GB_BATCH
CLASSES = ("daisy", "dandelion", "roses", "sunflowers")  # x 5 images: 16 train, 4 val


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("gbatch_data"), per_class=5, classes=CLASSES)


@pytest.fixture(scope="module")
def plain(image_root):
    """TinyNet on unaugmented inputs for this module's in-process runs, on one thread as the workers."""
    with pytest.MonkeyPatch.context() as mp, single_thread():
        worker.use_plain_tiny_net(mp)
        yield


@pytest.fixture(scope="module")
def runs(image_root, plain, tmp_path_factory):
    """{label: (run dir, what rank 0 printed)} of the four layouts of one global batch of 8."""
    out = tmp_path_factory.mktemp("gbatch_runs")
    launch = spawn(TORCHRUN + ["--nproc_per_node=4", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                               REPO / "tests" / "_ddp_worker.py", out, image_root, "--global-batch", free_port()])
    printed = {}
    try:
        with pytest.MonkeyPatch.context() as mp:
            for label, script, extra in (("train.py", "train", []), ("dp", "train_multi_gpu_dp", [f"train.batch_size={N}"])):
                with contextlib.redirect_stdout(io.StringIO()) as f:
                    rc = run_main(load_script(script), worker.global_batch_args(image_root, out / label, *extra), mp)
                printed[label] = f.getvalue()
                assert rc == 0, printed[label][-3000:]
    finally:
        [(rc, stdout, stderr)] = wait_all([launch], timeout=400)
    assert rc == 0, f"worker launch failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    # Rank 0 prints both of its runs' lines, world 4's first.
    world4, world2 = stdout.split("run directory: ")[1:3]
    return {"train.py": (out / "train.py", printed["train.py"]), "dp": (out / "dp", printed["dp"]),
            "ddp4": (out / "world4", world4), "ddp2": (out / "world2", world2)}


def layout(run_dir, name="last.pt"):
    state = torch.load(Path(run_dir) / "checkpoints" / name, map_location="cpu", weights_only=True)
    return state["data"], state["config"]["train"]["global_batch"]


@pytest.mark.slow
def test_same_weights_on_1_2_4_processes_and_dataparallel(runs):
    """1 process x 4 accumulated batches of 2, 2 x 2, 4 x 1, and DP's one batch of 8: every optimizer step
    sees the same 8 images (the sampler's one permutation, dealt to the ranks) at the same lr: the same
    weights to 1e-5."""
    single = model_tensors(runs["train.py"][0])
    torch.manual_seed(0)
    init = worker.TinyNet(len(CLASSES)).state_dict()  # what every run starts from (train.seed 0)
    for name, w in single.items():
        assert rel_err(w, init[name]) > 1e-3, f"{name} barely moved: the comparison would be vacuous"
    for label in ("ddp2", "ddp4", "dp"):
        other = model_tensors(runs[label][0])
        for name, w in single.items():
            assert rel_err(other[name], w) <= 1e-5, (label, name)
    accum = {"train.py": 4, "ddp2": 2, "ddp4": 1, "dp": 1}
    for label, (run_dir, printed) in runs.items():
        # The lr is optim.lr whatever the layout: scale_lr (on) does not multiply it by the world size.
        assert f", lr 0.05, amp off, {accum[label]} batches per step, global batch {N}".replace(
            ", 1 batches per step", "") in printed, (label, printed[-2000:])
        data, global_batch = layout(run_dir)
        assert global_batch == N and data["batch_size"] * data["world_size"] * data["accum_steps"] == N, label
        assert data["accum_steps"] == accum[label] and data["steps_per_epoch"] == 2, (label, data)


@pytest.mark.slow
def test_elastic_restart_from_2_processes_to_1_keeps_the_global_batch(runs, plain, image_root, tmp_path, capsys,
                                                                       monkeypatch):
    """The world-2 run's epoch-1 checkpoint, resumed by train_multi_gpu_ddp.py as one process: one line
    says how the accumulation changed (2 -> 4), the global batch stays 8, and epoch 2 ends where the
    uninterrupted 1-process run ends."""
    ckpt = runs["ddp2"][0] / "checkpoints" / "epoch_001.pt"
    args = ["--resume", str(ckpt)] + worker.global_batch_args(image_root, tmp_path / "elastic")
    rc = run_main(load_script("train_multi_gpu_ddp"), args, monkeypatch)
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    resumed, single = model_tensors(tmp_path / "elastic"), model_tensors(runs["train.py"][0])
    for name, w in single.items():
        assert rel_err(resumed[name], w) <= 1e-5, name
    lines = [x for x in out.splitlines() if x.startswith("note:") and "train.global_batch" in x]
    assert lines == [f"note: train.global_batch={N} kept: 2 -> 1 process(es), accumulation 2 -> 4 batches of "
                     f"{B} per step"], out[-3000:]
    assert f"1 process(es) on cpu, lr 0.05, amp off, 4 batches per step, global batch {N}" in out
    data, global_batch = layout(tmp_path / "elastic")
    assert (global_batch, data["world_size"], data["accum_steps"]) == (N, 1, 4)
    epochs = [json.loads(x)["epoch"] for x in (tmp_path / "elastic" / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [2]


@pytest.mark.parametrize("overrides, line", [
    (["train.global_batch=12", "train.batch_size=8"],
     "error: train.global_batch=12 does not divide into --batch-size 8 x 1 process(es) = 8 images per "
     "micro-batch; use --batch-size 4, 6, 12 (dividing its 12 per process), or a global batch of 8 or 16"),
    (["train.global_batch=8", "train.accum_steps=2"],
     "error: train.global_batch=8 sets the accumulation itself (global batch / (batch size x processes)); "
     "drop train.accum_steps=2"),
], ids=["not_divisible", "with_accum_steps"])
def test_a_global_batch_that_cannot_hold_is_one_error_line(overrides, line, image_root, tmp_path, capsys,
                                                           monkeypatch):
    args = ["--data-path", str(image_root), "--output-dir", str(tmp_path / "run"), "--device", "cpu",
            "model.name=resnet18", "data.img_size=32", "data.val_resize=36", "data.num_workers=0", *overrides]
    rc = run_main(load_script("train"), args, monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [line]
    assert not (tmp_path / "run" / "checkpoints").exists()
