"""data.pipeline=gpu: same augmentation distribution, same validation, reproducible, works in the real scripts.

    python -m pytest tests/test_gpu_pipeline.py -q            # CPU; the CUDA part skips without a GPU

In-process tests use this file's own plain transforms (plain_transforms), not data.build_transforms:
that one is the user's to edit, and an added ColorJitter is refused by the device path on purpose.
"""
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms import functional as TF

from torchvision import transforms as T

import data
import train as train_script
from conftest import FAST_ARGS, make_image_folder, run_entry
from data import build_datasets, make_loader
from torch.utils.data import DataLoader
from utils import gpu_pipeline, normalization
from utils.config import load_config
from utils.decoding import DraftRandomResizedCrop, DraftResize
from utils.distributed_utils import resolve_device
from utils.errors import UserError
from utils.gpu_pipeline import (GpuLoader, check_cache_fits, crop_theta, pinned_block_bytes, resolve_pipeline,
                                 sample_crops)
from utils.samplers import ShardSampler, epoch_sampler


def plain_transforms(img_size, val_resize, min_crop_scale=0.08, channels=3):
    """(train, val) as data.build_transforms ships them: exactly the steps the device path reproduces."""
    norm = data.NormalizeOnDevice(*data.imagenet_stats(channels))
    train = T.Compose([DraftRandomResizedCrop(img_size, scale=(min_crop_scale, 1.0)), T.RandomHorizontalFlip(),
                       norm])
    return train, T.Compose([DraftResize(val_resize), T.CenterCrop(img_size), T.PILToTensor(), norm])


@pytest.fixture(autouse=True)
def plain_transform(monkeypatch):
    """data.py (build_datasets, make_loader, hence train.main) builds plain_transforms in these tests."""
    monkeypatch.setattr(data, "build_transforms", plain_transforms)


# Image sizes like flower_photos (240-500 px) plus extreme strips that force the centre-crop fallback.
SIZES = [(240, 500), (333, 500), (500, 375), (480, 480), (260, 300), (60, 500), (500, 40)]


def ks_statistic(a, b):
    """Two-sample Kolmogorov-Smirnov distance between the empirical CDFs of a and b."""
    a, b = torch.sort(torch.as_tensor(a, dtype=torch.float64))[0], torch.sort(torch.as_tensor(b, dtype=torch.float64))[0]
    grid = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, grid, right=True) / len(a)
    cdf_b = torch.searchsorted(b, grid, right=True) / len(b)
    return (cdf_a - cdf_b).abs().max().item()


def box_features(boxes, heights, widths):
    top, left, h, w = (torch.as_tensor(c, dtype=torch.float64) for c in zip(*boxes))
    H, W = torch.as_tensor(heights, dtype=torch.float64), torch.as_tensor(widths, dtype=torch.float64)
    return {"area_fraction": h * w / (H * W), "aspect": w / h,
            "centre_y": (top + h / 2) / H, "centre_x": (left + w / 2) / W}


@pytest.mark.parametrize("min_scale", [0.08, 0.35])
def test_crop_boxes_have_torchvision_distribution(min_scale):
    n_per = 700
    heights = [h for h, _ in SIZES for _ in range(n_per)]
    widths = [w for _, w in SIZES for _ in range(n_per)]
    boxes, flip = sample_crops(heights, widths, torch.Generator().manual_seed(1), scale=(min_scale, 1.0))
    ours = box_features(boxes.tolist(), heights, widths)
    torch.manual_seed(2)
    ref_boxes = []
    for h, w in zip(heights, widths):  # get_params only reads the size
        ref_boxes.append(RandomResizedCrop.get_params(torch.empty(1, h, w), (min_scale, 1.0), (3 / 4, 4 / 3)))
    ref = box_features(ref_boxes, heights, widths)
    n = len(heights)
    bound = 1.95 * math.sqrt(2 / n)  # KS critical value at alpha = 0.001 for two samples of n
    for key in ours:
        assert ks_statistic(ours[key], ref[key]) < bound, key
    # Boxes are whole pixels inside the image, never below the configured area (except the fallback).
    b = boxes
    assert torch.equal(b, b.round()) and (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all()
    assert (b[:, 0] + b[:, 2] <= torch.tensor(heights)).all() and (b[:, 1] + b[:, 3] <= torch.tensor(widths)).all()
    photo_like = n_per * 5  # the strips come last: their fallback crops may be smaller
    assert ours["area_fraction"][:photo_like].min() > min_scale * 0.98
    assert abs(flip.double().mean().item() - 0.5) < 4 * math.sqrt(0.25 / n)


def test_batched_crop_equals_crop_then_resize():
    """The affine grid reproduces crop + bilinear resize + flip of torchvision on a square image."""
    gen = torch.Generator().manual_seed(0)
    S, out = 64, 24
    img = F.avg_pool2d(torch.rand(1, 3, S + 3, S + 3, generator=gen), 4, stride=1)  # smooth, S x S
    boxes = torch.tensor([[8.0, 5.0, 40.0, 30.0], [0.0, 0.0, 64.0, 64.0], [20.0, 30.0, 12.0, 16.0]])
    flip = torch.tensor([False, True, True])
    theta = crop_theta(boxes, flip, [S] * 3, [S] * 3)
    grid = F.affine_grid(theta, (3, 3, out, out), align_corners=False)
    ours = F.grid_sample(img.expand(3, -1, -1, -1), grid, mode="bilinear", padding_mode="border",
                         align_corners=False)
    for k, (top, left, h, w) in enumerate(boxes.int().tolist()):
        ref = TF.resized_crop(img, top, left, h, w, [out, out], antialias=False)
        if flip[k]:
            ref = ref.flip(-1)
        # Inside the box both interpolate the same pixels; on its edge resized_crop clamps to the box
        # while the grid reads the neighbours just outside it, so the outer 2 pixels are left out.
        assert (ours[k] - ref[0])[:, 2:-2, 2:-2].abs().max() < 1e-4, k


OVERRIDES = FAST_ARGS[2:]  # FAST_ARGS minus its leading "--device cpu": flags must precede key=value items
assert FAST_ARGS[:2] == ["--device", "cpu"]


def _cfg(root, *extra, device="cpu"):
    return load_config(["--data-path", str(root), "--device", device, *OVERRIDES, "data.val_rate=0.5", *extra])


def _loaders(cfg, device=torch.device("cpu")):
    train_set, val_set, _ = build_datasets(cfg.data)
    train = make_loader(train_set, cfg.train.batch_size, epoch_sampler(train_set, 0), cfg.data, device, train=True,
                        channels_last=cfg.model.channels_last)
    val = make_loader(val_set, cfg.train.batch_size, ShardSampler(val_set), cfg.data, device, train=False,
                      channels_last=cfg.model.channels_last)
    return train, val


def test_validation_matches_pil_path_on_same_weights(tmp_path):
    """Same weights, PIL vs gpu val loader: the same logits, so the same accuracy. The PIL loader's uint8
    batches go through the loop's own device pass (normalization.model_input); the gpu loader's are float already."""
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    torch.manual_seed(0)
    from model import create_model
    model = create_model("resnet18", 5).eval()
    outs = {}
    cpu = torch.device("cpu")
    for pipe in ("pil", "gpu"):
        _, val = _loaders(_cfg(root, f"data.pipeline={pipe}"))
        norm = normalization.normalization_of(val.dataset, cpu)
        with torch.no_grad():
            logits, labels = zip(*[(model(normalization.model_input(x, cpu, norm)), y) for x, y in val])
        outs[pipe] = torch.cat(logits), torch.cat(labels)
    assert torch.equal(outs["pil"][1], outs["gpu"][1])
    assert len(outs["gpu"][1]) == 20  # every val image exactly once (ShardSampler, no padding)
    assert (outs["pil"][0] - outs["gpu"][0]).abs().max() < 1e-4
    acc = {k: (v[0].argmax(1) == v[1]).double().mean().item() for k, v in outs.items()}
    assert abs(acc["pil"] - acc["gpu"]) <= 0.005


def test_train_batches_reproducible_per_epoch_and_sharded(tmp_path):
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    train, _ = _loaders(_cfg(root, "data.pipeline=gpu"))

    def epoch(e, seed):
        train.sampler.set_epoch(e)
        train.generator.manual_seed(seed)
        return [x for x, _ in train]

    a, b, c = epoch(0, 5), epoch(0, 5), epoch(0, 6)
    assert len(a) == len(train) == 20 // 4 and a[0].shape == (4, 3, 32, 32)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])  # another seed: other crops
    assert a[0].mean().abs() < 3 and 0.05 < a[0].std() < 3  # normalised, not raw 0..255
    # DDP: each rank reads its own half through the sampler it is given.
    train_set = train.dataset
    cfg = _cfg(root, "data.pipeline=gpu")
    halves = [make_loader(train_set, 2, epoch_sampler(train_set, 0, 2, r), cfg.data, torch.device("cpu"), True)
              for r in (0, 1)]
    idx = [set(h.sampler) for h in halves]
    assert not idx[0] & idx[1] and len(idx[0] | idx[1]) == 20


def test_pipeline_key_is_validated():
    with pytest.raises(UserError, match="data.pipeline"):
        load_config(["data.pipeline=dali"])


def test_an_empty_validation_split_trains(tmp_path, capsys):
    """data.val_rate=0: the val cache is empty (torch.cat([]) used to fail in build_cache).
    train.py's main in this process, so that it sees plain_transforms."""
    root = make_image_folder(tmp_path / "f", per_class=4)
    args = [*FAST_ARGS, "--data-path", str(root), "--output-dir", str(tmp_path / "run"), "data.pipeline=gpu",
            "data.val_rate=0"]
    try:
        train_script.main(args)
    except SystemExit as e:
        pytest.fail(f"exit {e.code}: {capsys.readouterr().err[-2000:]}")
    assert "20 train / 0 val images" in capsys.readouterr().out


def _with_color_jitter(monkeypatch):
    """The train transform plus a ColorJitter, as a user would add it to data.py; counts its calls."""
    real = data.build_transforms
    calls = []

    class CountingJitter(T.ColorJitter):
        def forward(self, img):
            calls.append(1)
            return super().forward(img)

    def build(*a, **k):
        train, val = real(*a, **k)
        train.transforms.insert(2, CountingJitter(brightness=0.4))
        return train, val

    monkeypatch.setattr(data, "build_transforms", build)
    return calls


@pytest.mark.parametrize("pipeline", ["pil", "gpu", "auto"])
def test_an_added_augmentation_is_applied_or_refused_never_dropped(pipeline, tmp_path, monkeypatch, capsys):
    root = make_image_folder(tmp_path / "f", per_class=4)
    calls = _with_color_jitter(monkeypatch)
    args = [*FAST_ARGS, "--data-path", str(root), "--output-dir", str(tmp_path / "run"),
            f"data.pipeline={pipeline}"]
    try:
        train_script.main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    if pipeline == "gpu":
        assert code == 2 and not calls
        assert [line for line in err.splitlines() if line.startswith("error:")] == [
            "error: data.pipeline=gpu reproduces RandomResizedCrop, RandomHorizontalFlip, PILToTensor or "
            "ToTensor, and Normalize only, and the train transform (data.py) also has CountingJitter; use data.pipeline=pil "
            "(or auto), or implement it in utils/gpu_pipeline.py"]
        assert not (tmp_path / "run").exists()  # refused before any work
    else:  # pil, and auto (pil on a CPU): every training image went through the jitter
        assert code == 0 and len(calls) == 3 * 4, err[-2000:]  # 16 train images: 3 full batches of 4


def test_auto_takes_the_device_path_only_where_it_reproduces_the_transform(monkeypatch):
    cuda0 = torch.device("cuda", 0)  # resolve_pipeline only reads .type: no GPU needed
    plain = plain_transforms(32, 36)[0]
    assert resolve_pipeline("auto", cuda0, plain) == "gpu"
    assert resolve_pipeline("auto", torch.device("cpu"), plain) == "pil"
    _with_color_jitter(monkeypatch)
    assert resolve_pipeline("auto", cuda0, data.build_transforms(32, 36)[0]) == "pil"


def test_device_path_takes_its_parameters_from_the_transform(tmp_path):
    """Crop size, scale and ratio, flip probability, mean and std come from the dataset's transform."""
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    train, _ = _loaders(_cfg(root, "data.pipeline=gpu", "data.min_crop_scale=0.5"))
    crop, flip, norm = train.dataset.transform.transforms
    assert (train.out_size, train.scale, train.ratio, train.flip_p) == (tuple(crop.size), crop.scale,
                                                                        crop.ratio, flip.p)
    assert train.scale == (0.5, 1.0)
    assert train.mean.flatten().tolist() == pytest.approx(list(norm.mean))
    assert train.std.flatten().tolist() == pytest.approx(list(norm.std))


@pytest.mark.parametrize("need_gib, available_gib, sharing, refused", [
    (1.0, 4.0, 1, False),   # a quarter of what there is
    (2.0, 4.0, 1, False),   # exactly half
    (2.1, 4.0, 1, True),
    (1.0, 16.0, 8, False),  # 8 processes on the node: 1 GiB each of 16 is half of a 2 GiB share
    (1.1, 16.0, 8, True),
])
def test_a_cache_over_half_of_its_memory_share_is_refused(need_gib, available_gib, sharing, refused):
    """The rule for DDP: each rank caches the whole set; refuse before decoding what cannot fit."""
    call = lambda: check_cache_fits(need_gib * 2**30, available_gib * 2**30, sharing, "pinned host memory")  # noqa: E731
    if refused:
        with pytest.raises(UserError, match=rf"would cache {need_gib:.2f} GiB in pinned host memory, over half "
                                            rf"of the {available_gib:.2f} GiB available"):
            call()
    else:
        call()


def test_a_pinned_cache_is_budgeted_at_its_power_of_two_block():
    """torch's pinned allocator rounds a block up to a power of two: 2.1 GiB takes 4 GiB. Of 6 GiB
    available the raw 2.1 fits under half (3 GiB), the real block does not; unpinned, 2.1 GiB is let through."""
    assert [pinned_block_bytes(n) for n in (0, 1, 4096, 4097, 3 * 2**30)] == [0, 1, 4096, 8192, 4 * 2**30]
    need, available = int(2.1 * 2**30), 6 * 2**30
    check_cache_fits(need, available, 1, "host memory")
    with pytest.raises(UserError, match=r"would cache 2.10 GiB \(a 4.00 GiB pinned block\) in pinned host memory, "
                                        r"over half of the 6.00 GiB available"):
        check_cache_fits(need, available, 1, "pinned host memory", pinned=True)
    check_cache_fits(2 * 2**30, 4 * 2**30, 1, "pinned host memory", pinned=True)  # a power of two: no rounding


def test_the_loader_checks_the_budget_before_decoding(tmp_path, monkeypatch):
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    cfg = _cfg(root, "data.pipeline=gpu", "data.cache_size=64", "data.gpu_decode=once")
    train_set, _, _ = build_datasets(cfg.data)
    # 20 train images x 3 x 64 x 64 bytes = 245,760; 2 processes on the node with 900 kB: over half of 450 kB.
    monkeypatch.setattr(gpu_pipeline, "host_available_bytes", lambda: 900_000)
    monkeypatch.setattr(gpu_pipeline, "build_cache", lambda *a, **k: pytest.fail("decoded before the check"))
    with pytest.raises(UserError, match=r"would cache 0.2 MiB in host memory, over half of the 0.9 MiB "
                                        r"available / 2 processes on this node"):
        make_loader(train_set, 4, epoch_sampler(train_set, 0), cfg.data, torch.device("cpu"), True,
                    procs_per_node=2)


GIB = 2**30


@pytest.mark.parametrize("gpu_free, host_available, refusal", [
    # 10,000 images at 320 px: a 2.86 GiB cache. 8 processes x 8 workers: 17 chunks of 32 in flight each.
    (80 * GIB, 4 * GIB, None),  # a whole host copy per process would need 8 x 2 x 2.86 GiB of the host
    (80 * GIB, 2 * GIB, "would cache 159.4 MiB in host memory on its way to cuda:0, over half of the "
                        "2.00 GiB available / 8 processes on this node"),
    (4 * GIB, 64 * GIB, "would cache 2.86 GiB in the memory of cuda:0, over half of the 4.00 GiB available"),
])
def test_a_device_cache_counts_its_gpu_and_the_nodes_host_memory(gpu_free, host_available, refusal, monkeypatch):
    """The cache on the GPU is built there chunk by chunk: the node's host memory must hold every
    process's chunks in flight at once, not a copy of the cache per process."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (gpu_free, 141 * GIB))
    monkeypatch.setattr(gpu_pipeline, "host_available_bytes", lambda: host_available)
    why = gpu_pipeline.cache_memory_refusal(10_000, 3 * 320 * 320, torch.device("cuda", 0), on_device=True,
                                            pin=False, workers=8, procs_per_node=8)
    assert why == (refusal and "data.pipeline=gpu " + refusal)


def test_a_device_cache_short_of_host_memory_is_refused_under_once(tmp_path, monkeypatch):
    """data.gpu_decode=once, the cache on cuda:0 with room on the GPU, but not enough host memory for the
    node's processes to decode it: one line, before anything is decoded or put on the device (on this CPU
    machine anything put on cuda:0 would raise)."""
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    cfg = _cfg(root, "data.pipeline=gpu", "data.cache_size=64", "data.gpu_decode=once")
    train_set, _, _ = build_datasets(cfg.data)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * GIB, 141 * GIB))
    monkeypatch.setattr(gpu_pipeline, "host_available_bytes", lambda: 900_000)
    monkeypatch.setattr(gpu_pipeline, "build_cache", lambda *a, **k: pytest.fail("decoded before the check"))
    # 20 images x 3 x 64 x 64 = 0.2 MiB in flight (fewer than a chunk), 2 processes: over half of 450 kB.
    with pytest.raises(UserError, match=r"^data.pipeline=gpu would cache 0.2 MiB in host memory on its way to "
                                        r"cuda:0, over half of the 0.9 MiB available / 2 processes on this node"):
        GpuLoader(train_set, 4, epoch_sampler(train_set, 0), cfg.data, torch.device("cuda", 0), True,
                  verbose=False, procs_per_node=2)


def test_the_cache_is_built_chunk_by_chunk_into_its_destination(tmp_path):
    """build_cache copies each decoded chunk straight into the cache tensor: with the cache on another
    device (here 'meta', which stands for the GPU and takes no memory) no host tensor larger than a
    chunk is ever made. Neither the chunk size nor a worker changes what is cached."""
    from torch.utils._python_dispatch import TorchDispatchMode
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    train_set, _, _ = build_datasets(_cfg(root, "data.pipeline=gpu").data)
    item, size, chunk = gpu_pipeline._TrainCacheItem(64), 3 * 64 * 64, 4
    largest = []

    class HostTensors(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    largest.append(t.untyped_storage().nbytes())
            return out

    on_device = torch.empty(len(train_set), 3, 64, 64, dtype=torch.uint8, device="meta")
    with HostTensors():
        sizes, labels = gpu_pipeline.build_cache(train_set, item, 0, on_device, chunk=chunk)
    assert len(train_set) == 20 and max(largest) == chunk * size  # the collated chunk; the cache is 5 times that
    assert labels.tolist() == [label for _, label in train_set.samples] and (sizes == torch.tensor([40, 52])).all()
    chunked, whole = (torch.empty(20, 3, 64, 64, dtype=torch.uint8) for _ in range(2))
    assert torch.equal(gpu_pipeline.build_cache(train_set, item, 0, chunked, chunk=chunk)[1], labels)
    gpu_pipeline.build_cache(train_set, item, 1, whole, chunk=32)
    assert torch.equal(chunked, whole) and chunked.float().std() > 10

def test_make_loader_passes_channels_last_on_cuda_only(tmp_path, monkeypatch):
    """model.channels_last reaches the device path's loader on CUDA (else the loop converts every
    batch again); on the CPU it stays off, as for the model. GpuLoader is recorded, not built, for cuda."""
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    cfg = _cfg(root, "data.pipeline=gpu")
    train_set, _, _ = build_datasets(cfg.data)
    cpu = make_loader(train_set, 4, epoch_sampler(train_set, 0), cfg.data, torch.device("cpu"), True,
                      channels_last=True)
    assert isinstance(cpu, GpuLoader) and cpu.channels_last is False
    built = []
    monkeypatch.setattr(data, "GpuLoader", lambda *a, **k: built.append(k))
    for flag in (True, False):
        make_loader(train_set, 4, epoch_sampler(train_set, 0), cfg.data, torch.device("cuda", 0), True,
                    channels_last=flag)
    assert [k["channels_last"] for k in built] == [True, False]


def test_channels_last_batches_hold_the_same_numbers(tmp_path):
    """GpuLoader(channels_last=True) writes that layout directly; train and val values are unchanged."""
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    cfg = _cfg(root, "data.pipeline=gpu")
    train_set, val_set, _ = build_datasets(cfg.data)
    cpu = torch.device("cpu")
    for dataset, sampler, train in ((train_set, epoch_sampler(train_set, 0), True),
                                    (val_set, ShardSampler(val_set), False)):
        batches = {}
        for layout in (False, True):
            loader = GpuLoader(dataset, 4, sampler, cfg.data, cpu, train, channels_last=layout, verbose=False)
            loader.generator.manual_seed(1)
            batches[layout] = [x for x, _ in loader]
        for x, y in zip(batches[False], batches[True]):
            assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
            assert x.is_contiguous() and torch.equal(x, y)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_pipeline_matches_cpu_and_never_syncs(tmp_path):
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    cfg = _cfg(root, "data.pipeline=gpu", device="cuda")
    dev = resolve_device("cuda")
    train_gpu, val_gpu = _loaders(cfg, dev)
    train_cpu, val_cpu = _loaders(cfg)
    # data.cache_on_device: the cache lives in GPU memory and batches are gathered there. (A device
    # comparison, cuda:0 != cuda, once sent this cache down the host branch, which failed.)
    assert train_gpu.images.is_cuda and train_gpu.on_device
    assert cfg.model.channels_last and train_gpu.channels_last and val_gpu.channels_last  # the default on CUDA
    for loader in (train_gpu, train_cpu):
        loader.sampler.set_epoch(0)
        loader.generator.manual_seed(3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host<->device sync while batching raises
    try:
        gpu_batches = [(x, y) for x, y in train_gpu]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for (xg, yg), (xc, yc) in zip(gpu_batches, train_cpu):
        assert xg.is_cuda and torch.equal(yg.cpu(), yc) and xg.is_contiguous(memory_format=torch.channels_last)
        assert (xg.cpu() - xc).abs().max() < 1e-3  # same boxes, same interpolation, other hardware
    for (xg, _), (xc, _) in zip(val_gpu, val_cpu):
        assert (xg.cpu() - xc).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.slow
@cuda
def test_cuda_scripts_with_gpu_pipeline_and_compile(tmp_path):
    root = make_image_folder(tmp_path / "f", per_class=6)
    args = ["--data-path", root, "--device", "cuda", *OVERRIDES, "data.pipeline=gpu"]
    r = run_entry("train.py", "--output-dir", tmp_path / "a", *args, "train.compile=true")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_entry("train_multi_gpu_ddp.py", "--output-dir", tmp_path / "b", *args, nproc=1)
    assert r.returncode == 0, r.stderr[-2000:]


# --------------------------------------------------------------------------- data.gpu_decode=per_batch

def test_auto_decodes_every_batch_when_the_cache_does_not_fit(tmp_path, monkeypatch, capsys):
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    cfg = _cfg(root, "data.pipeline=gpu", "data.cache_size=64")  # data.gpu_decode=auto, the default
    train_set, _, _ = build_datasets(cfg.data)
    monkeypatch.setattr(gpu_pipeline, "host_available_bytes", lambda: 900_000)
    monkeypatch.setattr(gpu_pipeline, "build_cache", lambda *a, **k: pytest.fail("decoded into a cache"))
    loader = make_loader(train_set, 4, epoch_sampler(train_set, 0), cfg.data, torch.device("cpu"), True,
                         procs_per_node=2)
    assert ("gpu pipeline: 20 train images, JPEGs decoded on cpu every batch (data.pipeline=gpu would cache "
            "0.2 MiB in host memory") in capsys.readouterr().out
    batches = [x for x, _ in loader]
    assert len(batches) == 5 and batches[0].shape == (4, 3, 32, 32)


def _epoch(loader, epoch=0, seed=5):
    loader.sampler.set_epoch(epoch)
    loader.generator.manual_seed(seed)
    return [(x, y) for x, y in loader]


def test_per_batch_decoding_gives_the_cache_paths_batches(tmp_path):
    """Same crops, flips and normalisation as the decode-once cache: only the resize to the cache square
    differs (torch's antialiased bilinear on the device, PIL's in the cache). Workers change nothing."""
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    once, _ = _loaders(_cfg(root, "data.pipeline=gpu", "data.gpu_decode=once"))
    per_batch, _ = _loaders(_cfg(root, "data.pipeline=gpu", "data.gpu_decode=per_batch"))
    workers, _ = _loaders(_cfg(root, "data.pipeline=gpu", "data.gpu_decode=per_batch", "data.num_workers=2"))
    assert per_batch.jpeg is not None and once.jpeg is None and len(per_batch) == len(once) == 5
    a, b, c = _epoch(once), _epoch(per_batch), _epoch(workers)
    for (xa, ya), (xb, yb), (xc, yc) in zip(a, b, c):
        assert torch.equal(ya, yb) and torch.equal(yb, yc)
        assert torch.equal(xb, xc)  # the workers only read bytes: nothing random happens there
        assert (xa - xb).abs().mean() < 0.01 and (xa - xb).abs().max() < 0.05, (xa - xb).abs().max()
    assert not torch.equal(_epoch(per_batch, seed=6)[0][0], b[0][0])  # the generator draws the crops


def test_per_batch_decoding_falls_back_per_image_for_what_is_not_a_plain_jpeg(tmp_path, monkeypatch, capsys):
    """PNGs and a CMYK JPEG arrive decoded by the dataset's PIL loading, the RGB JPEGs as bytes for the
    device; a truncated JPEG, which the decoder refuses, is warned about and replaced by the next image,
    as on the PIL path. Validation pixels match the PIL path's within rounding."""
    import bad_files
    root = make_image_folder(tmp_path / "f", per_class=3, size=(52, 40))
    bad_files.rgba_png(root / "daisy" / "rgba.png")
    bad_files.grayscale_png(root / "roses" / "grey.png")
    bad_files.cmyk_jpeg(root / "tulips" / "cmyk.jpg")
    bad_files.truncated_jpeg(root / "sunflowers" / "cut.jpg")
    cfg = _cfg(root, "data.pipeline=gpu", "data.gpu_decode=per_batch", "data.val_rate=0")
    dataset, _, _ = build_datasets(cfg.data)
    dataset.transform = plain_transforms(32, 36)[1]  # the whole set, as validation sees it
    kinds = {}
    real_collate = gpu_pipeline._collate_encoded

    def collate(items):
        kinds.update({Path(dataset.samples[index][0]).name: kind for _, kind, _, _, _, index, _ in items})
        return real_collate(items)

    monkeypatch.setattr(gpu_pipeline, "_collate_encoded", collate)
    cpu = torch.device("cpu")
    ours = GpuLoader(dataset, 4, ShardSampler(dataset), cfg.data, cpu, train=False, verbose=False)
    got = [(x, y) for x, y in ours]
    assert {n: k for n, k in kinds.items() if not n.endswith("_000.jpg")} == {
        "rgba.png": gpu_pipeline.PIXELS, "grey.png": gpu_pipeline.PIXELS, "cmyk.jpg": gpu_pipeline.PIXELS,
        "cut.jpg": gpu_pipeline.ENCODED, **{f"{c}_{i:03d}.jpg": gpu_pipeline.ENCODED
                                            for c in ("daisy", "dandelion", "roses", "sunflowers", "tulips")
                                            for i in (1, 2)}}
    assert "warning: skipping unreadable image: cannot decode" in capsys.readouterr().err
    dataset.bad_status.zero_()  # the PIL path meets the truncated file afresh
    pil = DataLoader(dataset, 4, sampler=ShardSampler(dataset))
    norm = normalization.normalization_of(dataset, cpu)  # the PIL path's uint8 batches, as the loop normalises them
    for (x, y), (xp, yp) in zip(got, pil):
        assert torch.equal(y, yp)  # the truncated file's slot: the same substitute
        xp = normalization.model_input(xp, cpu, norm)
        assert (x - xp).abs().max() < 0.1, (x - xp).abs().max()  # a level or two of uint8 rounding
    assert sum(len(y) for _, y in got) == 19


def _watch_decodes(monkeypatch):
    """-> (weak references to every full-size image decoded, at each forward of the model how many of them
    are alive, the hook to remove when done)."""
    import weakref
    real, decoded, alive = gpu_pipeline._decode_jpegs, [], []

    def decode(parts, *device_and_mode):
        images = real(parts, *device_and_mode)
        decoded.extend(weakref.ref(img) for img in images)
        return images

    def count_alive(module, args):
        # The model's modules only: the val Resize and CenterCrop are modules too, and run on the decodes.
        if decoded and next(module.parameters(), None) is not None:
            alive.append(sum(ref() is not None for ref in decoded))

    monkeypatch.setattr(gpu_pipeline, "_decode_jpegs", decode)
    return decoded, alive, torch.nn.modules.module.register_module_forward_pre_hook(count_alive)


@pytest.mark.slow
def test_per_batch_decoding_trains_and_resumes_mid_epoch_exactly(tmp_path, monkeypatch, capsys):
    """train.py's main with data.gpu_decode=per_batch and a worker: a run stopped by Ctrl-C in epoch 2
    and resumed ends with the weights and metrics of the run that was not stopped. In the run that is not
    stopped, no full-size decode is still alive at any forward of the model (training step or evaluation):
    each batch lets go of them before it is handed on."""
    import signal

    from _resume_utils import assert_same_run, metrics, run_args, run_main
    root = make_image_folder(tmp_path / "f", per_class=4, size=(52, 40))
    keys = ["data.pipeline=gpu", "data.gpu_decode=per_batch", "data.num_workers=1", "data.val_rate=0.5"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    decodes, alive, hook = _watch_decodes(monkeypatch)
    try:
        try:
            assert run_main(train_script, run_args(root, tmp_path / "straight", *keys, epochs=2), monkeypatch) == 0
        finally:
            hook.remove()
        assert "JPEGs decoded on cpu every batch" in capsys.readouterr().out
        assert len(decodes) == 2 * (2 * 4 + 10) and alive == [0] * len(alive) and alive  # 2 steps, 10 val images
        real, decoded = gpu_pipeline.JpegBatches.decode, []

        def decode_then_interrupt(self, parts, meta):
            if self.loader.drop_last:  # the training loader
                decoded.append(1)
                if len(decoded) == 3:  # epoch 2's first batch (10 train images, batch 4: 2 steps an epoch)
                    os.kill(os.getpid(), signal.SIGINT)
            return real(self, parts, meta)

        monkeypatch.setattr(gpu_pipeline.JpegBatches, "decode", decode_then_interrupt)
        out = tmp_path / "resumed"
        assert run_main(train_script, run_args(root, out, *keys, epochs=2), monkeypatch) == 128 + signal.SIGINT
        assert "stopped by SIGINT in epoch 2" in capsys.readouterr().err
        monkeypatch.setattr(gpu_pipeline.JpegBatches, "decode", real)
        assert run_main(train_script, run_args(root, out, *keys, epochs=2, flags=["--resume", "auto"]),
                        monkeypatch) == 0
        assert "at epoch 2 after its step 1" in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
    assert len(metrics(out)) == 2
    assert_same_run(tmp_path / "straight", out)


@pytest.mark.gpu
@cuda
def test_cuda_per_batch_decoding_matches_cpu_decoding(tmp_path):
    """nvJPEG on the device and libjpeg on the CPU: the same batches within a few levels of rounding."""
    root = make_image_folder(tmp_path / "f", per_class=8, size=(52, 40))
    keys = ("data.pipeline=gpu", "data.gpu_decode=per_batch")
    (train_gpu, val_gpu), (train_cpu, val_cpu) = _loaders(_cfg(root, *keys, device="cuda"),
                                                          resolve_device("cuda")), _loaders(_cfg(root, *keys))
    assert train_gpu.jpeg is not None and train_gpu.channels_last
    for (xg, yg), (xc, yc) in zip(_epoch(train_gpu), _epoch(train_cpu)):
        assert xg.is_cuda and torch.equal(yg.cpu(), yc)
        assert (xg.cpu() - xc).abs().mean() < 0.05
    for (xg, _), (xc, _) in zip(val_gpu, val_cpu):
        assert (xg.cpu() - xc).abs().mean() < 0.05


def test_nvjpeg_out_of_memory_is_one_warning_not_a_corrupt_image(tmp_path):
    """train.py with data.gpu_decode=per_batch, nvJPEG out of device memory from its second batch on
    (tests/_faults.py): one warning line says so and the run trains on, those batches decoded by PIL; no
    image is called unreadable (the files are fine) and no batch is retried image by image."""
    from utils.run_dir import read_metrics
    root = make_image_folder(tmp_path / "f", per_class=4, size=(52, 40))
    proc = run_entry("tests/_faults.py", "jpegoom:0:1", "train.py", *FAST_ARGS, "--data-path", root,
                     "--output-dir", tmp_path / "run", "train.epochs=2", "data.pipeline=gpu",
                     "data.gpu_decode=per_batch", "data.val_rate=0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "nvJPEG" in line]
    assert len(said) == 1 and said[0].startswith("warning: nvJPEG ran out of cpu memory decoding 4 JPEG(s) "
                                                 "(CUDA out of memory. Tried to allocate 1.50 GiB"), proc.stderr
    assert "unreadable" not in proc.stderr, proc.stderr
    assert len(read_metrics(tmp_path / "run")) == 2
