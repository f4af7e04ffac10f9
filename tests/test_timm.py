"""timm's models by name (model.name=timm/<name>) have what a torchvision model has.

    python -m pytest tests/test_timm.py -q

One torchrun launch (2 gloo processes, this file as their script) trains timm/test_resnet three times
through train_multi_gpu_ddp.py's main(), with an EMA, MixUp/CutMix and label smoothing: straight,
stopped by a real SIGTERM to rank 0 in epoch 2, and the stopped run resumed with --resume auto. It
must end bit for bit as the straight one. The rest runs in this process: --weights with
--freeze-layers (timm's BatchNormAct2d frozen too), export, pretrained weights from a Hugging Face
cache the test writes, FSDP's blocks, and the one-line errors: timm missing, weights missing.
"""
import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch

# conftest (imported by _resume_utils) puts the repository on sys.path: first, for this file as torchrun's script.
from _resume_utils import assert_same_run, load, metrics, one_thread, run_args, run_main  # noqa: F401
from conftest import make_image_folder, run_entry
import export
import predict
import train
from model import build_model, create_model
from utils.config import load_config
from utils.fsdp import find_blocks

timm = pytest.importorskip("timm")  # requirements.txt installs it; an optional dependency for users

DDP = "train_multi_gpu_ddp.py"
RECIPE = ("model.name=timm/test_resnet", "train.log_every=1", "train.ema_decay=0.9", "data.mixup_alpha=0.2",
          "data.cutmix_alpha=0.2", "optim.label_smoothing=0.1")
SIGTERM_AT = 5  # rank 0's 5th training batch of the stopped run: epoch 2's 2nd step


def ddp_worker(data, root):
    """torchrun's script: the three runs on every rank through the entry script's main(), one torch
    start-up for them all (tests/_fsdp_worker.py's run_scripts); each rank's exit codes to rank<R>.json."""
    import engine
    from _fsdp_worker import run_scripts

    straight, stopped = root / "straight", root / "stopped"
    taken = []

    def signal_in_stopped_run(images, labels):
        in_stopped_run = str(stopped) in sys.argv and "--resume" not in sys.argv  # run_scripts sets argv
        if in_stopped_run and os.environ["RANK"] == "0":
            taken.append(1)
            if len(taken) == SIGTERM_AT:
                os.kill(os.getpid(), signal.SIGTERM)

    engine.register_batch_hook(signal_in_stopped_run)  # this worker process ends after the three runs
    runs = [run_args(data, straight, *RECIPE, epochs=2), run_args(data, stopped, *RECIPE, epochs=2),
            run_args(data, stopped, *RECIPE, epochs=2, flags=["--resume", "auto"])]
    codes = run_scripts([(DDP, [str(a) for a in args]) for args in runs])
    (root / f"rank{os.environ['RANK']}.json").write_text(json.dumps(codes))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    root = tmp_path_factory.mktemp("timm_ddp")
    data = make_image_folder(root / "flowers")  # 2 ranks x 3 steps per epoch
    r = run_entry("tests/test_timm.py", data, root, nproc=2, timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return {"root": root, "log": r.stdout + r.stderr, "codes": [json.loads((root / f"rank{i}.json").read_text()) for i in (0, 1)]}


@pytest.mark.slow
def test_a_timm_model_trains_under_ddp_and_resumes_bit_for_bit(ddp):
    root = ddp["root"]
    assert ddp["codes"] == [[0, 128 + signal.SIGTERM, 0]] * 2, ddp["log"][-3000:]
    assert "stopped by SIGTERM in epoch 2" in ddp["log"] and "at epoch 2 after its step" in ddp["log"]
    straight, resumed = load(root / "straight" / "checkpoints" / "last.pt"), load(root / "stopped" / "checkpoints" / "last.pt")
    assert straight["config"]["model"]["name"] == "timm/test_resnet" and "layer4.0.conv1.weight" in straight["model"]
    assert_same_run(root / "straight", root / "stopped")
    assert straight["ema"].keys() == resumed["ema"].keys()
    assert all(torch.equal(v, resumed["ema"][k]) for k, v in straight["ema"].items()), "the EMA weights differ"
    assert [m["epoch"] for m in metrics(root / "stopped")] == [1, 2] and "val_acc_ema" in metrics(root / "stopped")[0]


# --------------------------------------------------------------------------- in this process

@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory, one_thread):
    """train.py with --weights (a timm state_dict saved by torch.save) and --freeze-layers, 1 epoch of
    timm/test_efficientnet, whose BatchNorms are timm's BatchNormAct2d."""
    root = tmp_path_factory.mktemp("timm_frozen")
    torch.manual_seed(7)
    weights = timm.create_model("test_efficientnet", num_classes=5).state_dict()
    torch.save(weights, root / "w.pth")
    mp = pytest.MonkeyPatch()
    try:
        args = run_args(make_image_folder(root / "flowers"), root / "run", "model.name=timm/test_efficientnet",
                        epochs=1, flags=["--weights", root / "w.pth", "--freeze-layers", "True"])
        assert run_main(train, args, mp) == 0
    finally:
        mp.undo()
    return {"run": root / "run", "weights": weights}


def test_weights_load_and_freeze_layers_trains_the_head_alone(frozen_run):
    """Every tensor but the head's, BatchNorm statistics included, ends as --weights gave it."""
    trained = load(frozen_run["run"] / "checkpoints" / "last.pt")["model"]
    given = frozen_run["weights"]
    changed = {k for k, v in trained.items() if not torch.equal(v, given[k])}
    assert changed == {"classifier.weight", "classifier.bias"}
    assert any(k.endswith("running_var") for k in trained)


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_export_takes_a_timm_run(frozen_run, tmp_path, fmt, capsys):
    out = tmp_path / f"m.{fmt}"
    assert export.main([str(frozen_run["run"]), "--format", fmt, "--out", str(out), "--speed-repeats", "0"]) <= 1e-4
    side = json.loads(out.with_name(out.name + ".json").read_text())
    assert side["model"] == "timm/test_efficientnet" and out.is_file()


def test_predict_cam_takes_a_timm_models_last_feature_module(frozen_run, tmp_path, capsys):
    """No table entry for timm's classes: its own feature_info names the layer (test_efficientnet: blocks.4)."""
    images = sorted((frozen_run["run"].parent / "flowers" / "daisy").iterdir())[:2]
    rows = predict.main([str(frozen_run["run"]), *map(str, images), "--cam", str(tmp_path / "cam"), "--device", "cpu"])
    out = capsys.readouterr().out
    assert "2 Grad-CAM overlay(s) (layer blocks.4)" in out, out[-600:]
    assert len(rows) == 2 and len(list((tmp_path / "cam").glob("*_cam_*.png"))) == 2


def test_sync_bn_keeps_the_activation_inside_timms_batchnorm(capsys):
    """--syncBN on CUDA converts timm's BatchNormAct2d (its activation inside) to SyncBatchNormAct, not to a
    bare SyncBatchNorm. The conversion needs no GPU; only SyncBatchNorm's forward does."""
    from timm.layers import BatchNormAct2d
    from timm.layers.norm_act import SyncBatchNormAct
    from utils.distributed_utils import convert_sync_bn
    net = create_model("timm/test_efficientnet", num_classes=5)
    acts = [type(m.act) for m in net.modules() if isinstance(m, BatchNormAct2d)]
    assert acts and any(a is not torch.nn.Identity for a in acts)
    synced = [m for m in convert_sync_bn(net, True, torch.device("cuda")).modules()
              if isinstance(m, torch.nn.SyncBatchNorm)]
    # torch's own converter keeps the `act` child too, but as a bare SyncBatchNorm whose forward skips it.
    assert all(isinstance(m, SyncBatchNormAct) for m in synced) and [type(m.act) for m in synced] == acts
    assert f"SyncBatchNorm: {len(acts)} BatchNorm layers" in capsys.readouterr().out


def fake_hf_cache(root, arch_tag, state):
    """The layout huggingface_hub writes: models--timm--<arch.tag>/{refs/main, snapshots/<commit>/model.safetensors}."""
    from safetensors.torch import save_file
    repo = root / f"models--timm--{arch_tag}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    save_file(state, str(repo / "snapshots" / commit / "model.safetensors"))
    return repo / "snapshots" / commit / "model.safetensors"


def test_pretrained_weights_come_from_the_local_hugging_face_cache_only(tmp_path, monkeypatch, capsys):
    """HF_HOME points at the test's cache; huggingface_hub reads it at its import (HF_HUB_CACHE), so that is
    set too. No host name may be looked up and no socket connect: nothing is downloaded (pytest.fail's
    exception is no Exception, so no library's retry or cache fallback can swallow it)."""
    from huggingface_hub import constants
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for obj, name in ((socket, "getaddrinfo"), (socket, "create_connection"), (socket.socket, "connect")):
        monkeypatch.setattr(obj, name, lambda *a, **k: pytest.fail(f"a download was tried: {a}"))
    torch.manual_seed(3)
    imagenet = timm.create_model("test_resnet", num_classes=1000).state_dict()
    path = fake_hf_cache(tmp_path / "hub", "test_resnet.r160_in1k", imagenet)
    cfg = load_config(["model.name=timm/test_resnet", "model.pretrained=DEFAULT", "data.img_size=32"])
    model = build_model(cfg.model, num_classes=5, device=torch.device("cpu"), img_size=32)
    assert f"pretrained timm/test_resnet.r160_in1k from {path}; head 'fc' freshly initialised" in capsys.readouterr().out
    own = model.state_dict()
    changed = {k for k, v in own.items() if v.shape != imagenet[k].shape or not torch.equal(v, imagenet[k])}
    assert changed == {"fc.weight", "fc.bias"} and own["fc.weight"].shape == (5, 96)
    grey = create_model("timm/test_resnet", num_classes=5, pretrained="r160_in1k", channels=1)
    assert torch.allclose(grey.conv1[0].weight, imagenet["conv1.0.weight"].sum(1, keepdim=True))


def error_lines(capsys):
    return [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]


def test_missing_weights_timm_and_names_are_one_line_each(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    base = run_args(make_image_folder(tmp_path / "flowers", per_class=1), tmp_path / "run", epochs=1)
    expected = tmp_path / "hub" / "models--timm--test_resnet.r160_in1k" / "snapshots" / "<commit>" / "model.safetensors"
    for overrides, text in ((["model.name=timm/test_resnet", "model.pretrained=DEFAULT"], f"expected {expected}"),
                            (["model.name=timm/test_resnet", "model.pretrained=in22k"], "choose one of r160_in1k"),
                            (["model.name=timm/test_resnt"], "did you mean 'timm/test_resnet'")):
        assert run_main(train, base + overrides, monkeypatch) == 2
        lines = error_lines(capsys)
        assert len(lines) == 1 and text in lines[0], lines
    monkeypatch.setitem(sys.modules, "timm", None)  # as if it were not installed: `import timm` fails
    assert run_main(train, base + ["model.name=timm/test_resnet"], monkeypatch) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].endswith("is a timm model and timm is not installed: pip install timm"), lines
    assert not (tmp_path / "run").exists()


def test_fsdp_and_checkpointing_blocks_are_timm_stages_blocks_or_layers():
    names = {n: [b for b, _ in find_blocks(create_model(f"timm/{n}", num_classes=4))]
             for n in ("test_resnet", "test_vit", "test_convnext")}
    assert names == {"test_resnet": ["layer1", "layer2", "layer3", "layer4"],
                     "test_vit": [f"blocks.{i}" for i in range(6)], "test_convnext": [f"stages.{i}" for i in range(4)]}


if __name__ == "__main__":  # the DDP launch's script (the ddp fixture above)
    ddp_worker(Path(sys.argv[1]), Path(sys.argv[2]))
