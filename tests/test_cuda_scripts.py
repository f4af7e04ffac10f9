"""train.py, DataParallel and DDP on CUDA (FSDP: test_fsdp.py): a demo-sized epoch each, SyncBN, resume.

    python -m pytest tests/test_cuda_scripts.py -q          # needs CUDA; skipped without it

Runs as part of `pytest -m gpu` in tools/gpu_checks.sh. CUDA_SCRIPTS_DEVICE=cpu rehearses
the same runs on a CPU (the SyncBN count is then checked as the CPU warning instead).
"""
import json
import os

import pytest
import torch

from conftest import FAST_ARGS, make_image_folder, run_entry

DEVICE = os.environ.get("CUDA_SCRIPTS_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")]
RESNET34_BATCHNORMS = 36


def _args(data, out, *extra):
    # FAST_ARGS sets --device cpu first; the later --device wins (argparse keeps the last).
    return [*FAST_ARGS, "--device", DEVICE, "--data-path", data, "--output-dir", out, *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("cuda") / "flowers", per_class=8)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("script,nproc", [("train.py", None), ("train_multi_gpu_dp.py", None),
                                          ("train_multi_gpu_ddp.py", 1)])
def test_each_script_trains_an_epoch_on_the_device(script, nproc, data, tmp_path):
    out = tmp_path / "run"
    r = run_entry(script, *_args(data, out), nproc=nproc, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"on {DEVICE}" in r.stdout, r.stdout[-2000:]
    assert len(_metrics(out)) == 1 and (out / "checkpoints" / "last.pt").is_file()


def test_ddp_syncbn_converts_every_batchnorm_of_resnet34(data, tmp_path):
    out = tmp_path / "run"
    r = run_entry("train_multi_gpu_ddp.py", *_args(data, out, "model.name=resnet34", "--syncBN", "True"),
                  nproc=1, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    if DEVICE == "cuda":
        assert f"SyncBatchNorm: {RESNET34_BATCHNORMS} BatchNorm layers" in r.stdout, r.stdout[-2000:]
    else:
        assert r.stdout.count("SyncBatchNorm needs CUDA GPUs") == 1


def test_a_resumed_run_continues_on_the_device(data, tmp_path):
    out = tmp_path / "run"
    first = run_entry("train.py", *_args(data, out, "train.epochs=2"), timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_entry("train.py", *_args(data, out, "train.epochs=3", "--resume", "auto"), timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and f"on {DEVICE}" in again.stdout, again.stdout[-2000:]
    assert [m["epoch"] for m in _metrics(out)] == [1, 2, 3]


def test_dp_with_device_cpu_on_a_gpu_machine_trains_on_the_cpu(data, tmp_path):
    """With GPUs present, --device cpu must not hand the model to DataParallel (it would take every GPU)."""
    out = tmp_path / "run"
    r = run_entry("train_multi_gpu_dp.py", *FAST_ARGS, "--data-path", data, "--output-dir", out, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no GPU: one cpu process without DataParallel" in r.stdout and "on cpu" in r.stdout
    assert len(_metrics(out)) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dataparallel_replicas_compute_in_the_chosen_autocast_dtype():
    """DataParallel runs each replica in a thread of its own, where autocast's dtype falls back to fp16.
    Two replicas on GPU 0 show it with one GPU: bare, the outputs are fp16; wrapped, bf16."""
    from torch.nn.parallel import parallel_apply

    from train_multi_gpu_dp import AutocastForward
    layer = torch.nn.Linear(8, 4).cuda()
    x = torch.randn(2, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # in this thread the dtype holds
        bare = parallel_apply([layer, layer], [(x,), (x,)], devices=[0, 0])
        wrapped_layer = AutocastForward(layer, torch.bfloat16)
        wrapped = parallel_apply([wrapped_layer, wrapped_layer], [(x,), (x,)], devices=[0, 0])
    assert {t.dtype for t in wrapped} == {torch.bfloat16}
    # torch's own behaviour, the reason for the wrapper (if a later torch passes the dtype on, this
    # line fails and the wrapper can go).
    assert {t.dtype for t in bare} == {torch.float16}


def test_an_fp16_run_resumes_a_bf16_checkpoint(data, tmp_path):
    """train.amp=fp16 builds a fused optimizer under a GradScaler; resuming a bf16 run's checkpoint
    (a plain optimizer's state) once asserted at the first step. On the CPU rehearsal amp is off."""
    out = tmp_path / "run"
    first = run_entry("train.py", *_args(data, out, "train.epochs=1", "train.amp=bf16"), timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_entry("train.py", *_args(data, out, "train.epochs=2", "train.amp=fp16", "--resume", "auto"),
                      timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout, again.stdout[-2000:]
    if DEVICE == "cuda":
        assert "amp torch.float16" in again.stdout, again.stdout[-2000:]
    assert [m["epoch"] for m in _metrics(out)] == [1, 2]
    assert all(m["train_loss"] == m["train_loss"] for m in _metrics(out))  # no NaN
