"""data.channels=1: grey images stay one channel from the decoder to the model, and after training.

    python -m pytest tests/test_channels.py -q

One grey train.py run (in this process, so the batches reaching the model can be watched) serves the
checks of what a user sees: the checkpoint's first convolution, predict.py and export.py on the run.
The rest is in-process and small: the luma decoding, the gpu pipeline on the CPU, the summed-kernel
adaptation (exact, in float64) and the first-convolution finder on torchvision's families (on the meta
device: the real modules without memory or initialisation).
"""
import contextlib
import csv
import io
import json

import pytest
import torch
import torchvision
from PIL import Image
from torch import nn
from torchvision import transforms as T
from torchvision.io import ImageReadMode, decode_jpeg, read_file

import export
import model as model_py
import predict
import train
from conftest import FAST_ARGS, make_image_folder, run_entry
from data import build_datasets, make_loader
from utils import normalization
from utils.config import load_config
from utils.decoding import DraftRandomResizedCrop, DraftResize, load_image, load_rgb
from utils.samplers import ShardSampler, epoch_sampler

CPU = torch.device("cpu")
GREY = ["data.channels=1"]


def grey_reference(path, size=32, resize=36):
    """The val pixels of a grey run, made without the template's decoding: libjpeg's grey output
    (torchvision's decode_jpeg, GRAY: what nvJPEG gives too), then torchvision's PIL resize and crop."""
    y = decode_jpeg(read_file(str(path)), mode=ImageReadMode.GRAY)
    img = Image.fromarray(y[0].numpy(), "L")
    return T.Compose([T.Resize(resize), T.CenterCrop(size), T.PILToTensor()])(img)


def normalised(pixels, channels=1):
    mean, std = normalization.imagenet_stats(channels)
    return normalization.normalize(pixels, torch.tensor(mean).view(1, -1, 1, 1), torch.tensor(std).view(1, -1, 1, 1))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch on one thread here, as run_entry gives the scripts it starts: on a loaded machine two threads
    per tiny op wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def grey_run(tmp_path_factory):
    """train.py's main, data.channels=1, 1 epoch of resnet18 at 32 px on 5 classes x 4 colour JPEGs;
    every input the model gets is recorded (a forward pre-hook on the model build_model returns)."""
    root = tmp_path_factory.mktemp("grey")
    data, run_dir, shapes = make_image_folder(root / "flowers", per_class=4), root / "run", []
    real_build = train.build_model

    def build(*a, **k):
        m = real_build(*a, **k)
        m.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
        return m

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(train, "build_model", build)
        train.main([*FAST_ARGS, "--data-path", str(data), "--output-dir", str(run_dir), *GREY])
    return {"data": data, "run_dir": run_dir, "shapes": shapes, "out": out.getvalue()}


def test_a_grey_run_feeds_the_model_one_channel_and_saves_a_one_channel_first_conv(grey_run):
    # 15 training images in 3 steps of 4, then 5 validation images in 2 batches.
    assert grey_run["shapes"] == [(4, 1, 32, 32)] * 3 + [(4, 1, 32, 32), (1, 1, 32, 32)]
    assert "data.channels=1: the first convolution 'conv1' of resnet18 reads 1 channel" in grey_run["out"]
    state = torch.load(grey_run["run_dir"] / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    assert state["config"]["data"]["channels"] == 1
    assert tuple(state["model"]["conv1.weight"].shape) == (64, 1, 7, 7)


def test_predict_on_a_grey_run_reads_grey_and_agrees_with_an_eager_forward(grey_run, tmp_path):
    daisy, out = grey_run["data"] / "daisy", tmp_path / "p.csv"
    with contextlib.redirect_stdout(io.StringIO()):
        predict.main([str(grey_run["run_dir"]), str(daisy), "--out", str(out), "--device", "cpu", "--topk", "5"])
    rows = list(csv.DictReader(out.open()))
    model, classes, _, _ = model_py.load_trained(grey_run["run_dir"])
    assert model.conv1.in_channels == 1
    batch = torch.stack([grey_reference(r["path"]) for r in rows])
    assert batch.shape == (4, 1, 32, 32)
    with torch.no_grad():
        top = (model(normalised(batch)).double() / model.temperature).softmax(1).topk(5, dim=1)  # calibrated
    for row, probs, idx in zip(rows, top.values.tolist(), top.indices.tolist()):
        assert [row[f"class{k}"] for k in range(1, 6)] == [classes[c] for c in idx]
        assert [float(row[f"prob{k}"]) for k in range(1, 6)] == pytest.approx(probs, abs=2e-6)


def test_export_of_a_grey_run_takes_one_channel_and_matches_eager(grey_run, tmp_path):
    out = tmp_path / "grey.torchscript.pt"
    with contextlib.redirect_stdout(io.StringIO()):
        export.main([str(grey_run["run_dir"]), "--format", "torchscript", "--out", str(out)])
    sidecar = json.loads((tmp_path / "grey.torchscript.pt.json").read_text())
    assert sidecar["input_size"] == [1, 32, 32] and sidecar["preprocess"].startswith("grey (L), ")
    assert (sidecar["mean"], sidecar["std"]) == ([0.449], [0.226])
    model = model_py.load_trained(grey_run["run_dir"])[0]
    x = normalised(grey_reference(next((grey_run["data"] / "roses").iterdir()))[None])  # (1, 1, 32, 32)
    with torch.no_grad(), torch.jit.optimized_execution(False):  # one run: the JIT's optimising passes cost more
        assert (torch.jit.load(str(out))(x) - model(x)).abs().max() < 1e-5


def test_a_colour_jpeg_decodes_to_its_luma_plane_as_nvjpeg_does_on_every_path(tmp_path):
    """Whole, drafted (a JPEG decoded at 1/4 size) and through the train crop: one channel, and at full
    size exactly libjpeg's grey output (torchvision's decode_jpeg GRAY; nvJPEG's GRAY is the same plane)."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (96, 128, 3), generator=gen, dtype=torch.uint8).numpy()
    Image.fromarray(noise).save(tmp_path / "c.jpg", quality=90)
    y = decode_jpeg(read_file(str(tmp_path / "c.jpg")), mode=ImageReadMode.GRAY)
    whole = load_rgb(tmp_path / "c.jpg", mode="L")
    assert whole.mode == "L" and torch.equal(T.PILToTensor()(whole), y)
    small = load_image(tmp_path / "c.jpg", T.Compose([DraftResize(24), T.PILToTensor()]), mode="L")
    assert small.shape == (1, 24, 32)
    # At 1/4 size the DCT-scaled decode is an average of the full plane's 4x4 blocks, to rounding.
    blocks = y.float().view(1, 24, 4, 32, 4).mean(dim=(2, 4))
    assert (small.float() - blocks).abs().mean() < 3
    crop = load_image(tmp_path / "c.jpg", T.Compose([DraftRandomResizedCrop(16)]), mode="L")
    assert crop.shape == (1, 16, 16) and crop.dtype == torch.uint8
    # A colour PNG: its luma (ITU-R 601: 0.299 R + 0.587 G + 0.114 B), not one of its channels.
    luma = noise.astype(float) @ [0.299, 0.587, 0.114]
    for kind in ("RGB", "RGBA"):
        Image.fromarray(noise).convert(kind).save(tmp_path / "c.png")
        grey = load_rgb(tmp_path / "c.png", mode="L")
        assert grey.mode == "L" and abs(torch.tensor(luma) - T.PILToTensor()(grey)[0]).max() <= 1, kind


def test_the_gpu_pipeline_caches_and_augments_one_channel_on_the_cpu(tmp_path):
    """data.pipeline=gpu, grey: the decode-once cache holds one channel (a third of the bytes); its val
    batches equal the PIL path's; the per-batch JPEG decoding (decode_jpeg GRAY) gives the cache's batches."""
    root = make_image_folder(tmp_path / "f", per_class=4, size=(52, 40))
    base = ["--data-path", str(root), *FAST_ARGS, "data.val_rate=0.5", *GREY]

    def loaders(*extra):
        cfg = load_config([*base, *extra])
        train_set, val_set, _ = build_datasets(cfg.data)
        return (make_loader(train_set, 4, epoch_sampler(train_set, 0), cfg.data, CPU, train=True),
                make_loader(val_set, 4, ShardSampler(val_set), cfg.data, CPU, train=False))

    def epoch(loader):
        if hasattr(loader.sampler, "set_epoch"):  # the training loaders: the same crops in every pipeline
            loader.sampler.set_epoch(0)
            loader.generator.manual_seed(5)
        return [x for x, _ in loader]

    (pil_train, pil_val), (once, once_val) = loaders(), loaders("data.pipeline=gpu", "data.gpu_decode=once")
    per_batch, per_batch_val = loaders("data.pipeline=gpu", "data.gpu_decode=per_batch")
    assert tuple(once.images.shape) == (10, 1, 45, 45)  # 1.25 x val_resize 36
    pil = [normalised(x) for x in epoch(pil_val)]
    assert all(torch.equal(a, b) for a, b in zip(pil, epoch(once_val))) and len(pil) == 3
    for a, b in zip(epoch(once), epoch(per_batch)):
        assert a.shape == b.shape == (4, 1, 32, 32)
        assert (a - b).abs().mean() < 0.01 and (a - b).abs().max() < 0.05
    for a, b in zip(pil, epoch(per_batch_val)):
        assert a.shape == b.shape and (a - b).abs().mean() < 0.05
    assert epoch(pil_train)[0].shape == (4, 1, 32, 32)


@pytest.fixture
def hub_squeezenet(tmp_path, monkeypatch):
    """squeezenet1_1's IMAGENET1K_V1 file (a small model with weights) in a temporary torch hub cache:
    a seeded 1000-class state_dict."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    path = model_py.hub_file(torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1)
    path.parent.mkdir(parents=True)
    torch.manual_seed(7)
    torch.save(torchvision.models.squeezenet1_1(num_classes=1000).state_dict(), path)


def test_summed_kernels_give_the_rgb_model_on_the_grey_image_repeated(hub_squeezenet, tmp_path):
    """model.pretrained and model.weights (an RGB file) into a grey model: the first convolution's
    kernels are the RGB ones summed, every other tensor is the RGB model's, and on a grey image g the grey
    model's logits are the RGB model's on (g, g, g). Exact in math: that convolution is linear, W1 * x = (W_R + W_G + W_B) * x =
    W_R * x + W_G * x + W_B * x, with x = (g/255 - 0.449) / 0.226 in every channel. So the check is in
    float64. With ImageNet's own mean and std per channel the three inputs differ, and so would
    the logits: one (mean, std) for all three is what makes the summed kernel exact. The one rounding
    left is the float32 sum of the kernels as stored (6e-8 of each weight), hence 1e-6."""
    def build(channels, **cfg):
        torch.manual_seed(0)  # the same fresh head in both
        keys = [f"model.{k}={v}" for k, v in cfg.items()]
        c = load_config(["model.name=squeezenet1_1", "data.img_size=32", *keys, f"data.channels={channels}"])
        return model_py.build_model(c.model, 5, CPU, verbose=False, img_size=32, channels=channels).eval().double()

    rgb, grey = build(3, pretrained="IMAGENET1K_V1"), build(1, pretrained="IMAGENET1K_V1")
    torch.save(rgb.float().state_dict(), tmp_path / "rgb.pt")
    rgb.double()
    from_file = build(1, weights=tmp_path / "rgb.pt")
    assert "(features.0.weight: its 3 input channels summed into 1" in model_py.load_weights(
        model_py.create_model("squeezenet1_1", 5, channels=1), tmp_path / "rgb.pt")
    g = torch.randint(0, 256, (2, 1, 32, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    x = normalised(g).double()
    with torch.no_grad():
        want = rgb(x.expand(-1, 3, -1, -1))
        for m in (grey, from_file):
            assert torch.equal(m.features[0].weight, rgb.features[0].weight.float().sum(1, keepdim=True).double())
            assert all(torch.equal(v, rgb.state_dict()[k]) for k, v in m.state_dict().items()
                       if k != "features.0.weight")
            assert (m(x) - want).abs().max() < 1e-6
        per_channel = normalised(g.expand(-1, 3, -1, -1), channels=3).double()
        assert (rgb(per_channel) - want).abs().max() > 1e-3  # why the grey mean and std are one pair


FAMILIES = {"resnet18": "conv1", "vgg11": "features.0", "mobilenet_v3_small": "features.0.0",
            "efficientnet_b0": "features.0.0", "convnext_tiny": "features.0.0", "vit_b_16": "conv_proj",
            "swin_t": "features.0.0"}


@pytest.mark.parametrize("name", FAMILIES)
def test_the_first_convolution_of_each_torchvision_family_is_found_and_reads_one_channel(name):
    with torch.device("meta"):  # the real modules, without memory or initialisation (vgg11: 133M parameters)
        m = model_py.create_model(name, num_classes=5, img_size=32, channels=1)
        conv_name, conv = model_py.find_first_conv(m)
        assert (conv_name, conv.in_channels, conv.weight.shape[1]) == (FAMILIES[name], 1, 1)
        assert m.eval()(torch.zeros(2, 1, 32, 32)).shape == (2, 5)


def test_your_own_model_gets_in_chans_or_its_first_conv_adapted(monkeypatch):
    built = []

    def with_in_chans(num_classes, in_chans):
        built.append(in_chans)
        return nn.Sequential(nn.Conv2d(in_chans, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))

    monkeypatch.setitem(model_py.MODELS, "mine", with_in_chans)
    monkeypatch.setitem(model_py.MODELS, "plain", lambda num_classes: with_in_chans(num_classes, 3))
    assert model_py.create_model("mine", 5, channels=1)[0].in_channels == 1 and built == [1]
    assert model_py.create_model("plain", 5, channels=1)[0].weight.shape == (4, 1, 3, 3)


def no_conv(num_classes):
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes))


def test_a_model_whose_first_convolution_is_not_found_is_refused_in_one_line(tmp_path):
    """At config time, before the data is read (the data path does not exist). A process of its own,
    the model registered in MODELS by tests/_with_model.py."""
    proc = run_entry("tests/_with_model.py", "no_conv", "test_channels:no_conv", "train.py", *FAST_ARGS,
                     "--data-path", tmp_path / "none", "model.name=no_conv", *GREY)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err == [
        "error: data.channels=1: model.name=no_conv has no nn.Conv2d, not one of 3 to sum into 1; give its "
        "MODELS constructor an in_chans argument and build it for in_chans channels, or set data.channels=3"]
