"""The PIL path's input: uint8 batches normalised on the device, and big JPEGs decoded small.

    python -m pytest tests/test_decoding.py -q

- validation pixels, through the real loader and the loop's device pass, equal torchvision's
  Resize + CenterCrop + ToTensor + Normalize; training pixels are torchvision's RandomResizedCrop
  + flip with the same draws, within one level;
- a float-only transform after the documented ConvertImageDtype gets the same model input;
- the pictures (train/augmented_samples, worst mistakes) show the same pixels as before;
- the crop's resize runs on one torch thread (the training process's, with data.num_workers=0);
- a large JPEG: the crop box keeps torchvision's distribution in the original's pixels (a
  Kolmogorov-Smirnov test, as for the gpu pipeline's sampler), it is decoded at the smallest DCT
  scale that leaves the box at least the output size, and validation, drafted by the same rule,
  stays close to a full decode.
"""
import csv
import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

import data
from conftest import make_image_folder
from test_gpu_pipeline import box_features, ks_statistic
from utils import decoding, figures, normalization
from utils.config import load_config
from utils.samplers import ShardSampler

CPU = torch.device("cpu")
MEAN, STD = data.IMAGENET_MEAN, data.IMAGENET_STD


def reference(img_size, val_resize):
    """torchvision's reference transforms, as the template had them: float32, normalised per image."""
    norm = T.Normalize(MEAN, STD)
    return (T.Compose([T.RandomResizedCrop(img_size), T.RandomHorizontalFlip(), T.ToTensor(), norm]),
            T.Compose([T.Resize(val_resize), T.CenterCrop(img_size), T.ToTensor(), norm]))


def loaders(root, *extra):
    cfg = load_config(["--data-path", str(root), "data.img_size=32", "data.val_resize=36", "data.num_workers=0",
                       "data.val_rate=0.5", *extra])
    train_set, val_set, _ = data.build_datasets(cfg.data)
    val = data.make_loader(val_set, 4, ShardSampler(val_set), cfg.data, CPU, train=False)
    return train_set, val_set, val


@pytest.mark.parametrize("channels_last", [False, True])
def test_validation_pixels_equal_torchvisions(tmp_path, channels_last):
    root = make_image_folder(tmp_path / "f", per_class=4, size=(52, 40))
    _, val_set, val = loaders(root)
    norm = normalization.normalization_of(val.dataset, CPU)
    got, raw = [], []
    for images, _ in val:
        raw.append(images)
        got.append(normalization.model_input(images, CPU, norm, channels_last))
    assert all(x.dtype == torch.uint8 for x in raw)  # what the workers pass: a quarter of float32's bytes
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x in raw)  # utils.loader.collate: a plain copy
    got = torch.cat(got)
    ref_val = reference(32, 36)[1]
    expected = torch.stack([ref_val(decoding.load_rgb(path)) for path, _ in val_set.samples])
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert got.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_train_pixels_are_torchvisions_crop_and_flip_within_one_level(tmp_path):
    """The same seed, the same random draws: the same boxes and flips as torchvision's PIL path; torch's
    uint8 resize is within one grey level of PIL's."""
    root = make_image_folder(tmp_path / "f", per_class=4, size=(52, 40))
    train_set, _, _ = loaders(root)
    ref_train = reference(32, 36)[0]
    torch.manual_seed(0)
    ours = torch.stack([train_set[i][0] for i in range(len(train_set))])
    torch.manual_seed(0)
    theirs = torch.stack([ref_train(decoding.load_rgb(path)) for path, _ in train_set.samples])
    ours = normalization.model_input(ours, CPU, normalization.normalization_of(train_set, CPU))
    one_level = 1 / 255 / min(STD) + 1e-5
    assert (ours - theirs).abs().max() <= one_level
    assert (ours - theirs).abs().mean() < 0.1 * one_level  # mostly equal, not just close


def test_a_float_only_transform_after_convert_image_dtype_sees_floats_and_the_model_the_same_input(tmp_path):
    """The documented way (data.build_transforms): ConvertImageDtype(torch.float) before a transform that
    needs floats; NormalizeOnDevice then normalises in the worker and the loop takes the batch as it is."""
    root = make_image_folder(tmp_path / "f", per_class=4, size=(52, 40))
    seen = []

    def float_only(x):
        assert x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1, x.dtype
        seen.append(1)
        return x

    train_set, _, _ = loaders(root)
    steps = train_set.transform.transforms
    edited = T.Compose(steps[:-1] + [T.ConvertImageDtype(torch.float), T.Lambda(float_only), steps[-1]])
    batches = {}
    for name, tf in (("uint8", train_set.transform), ("float", edited)):
        train_set.transform = tf
        torch.manual_seed(0)
        images = torch.stack([train_set[i][0] for i in range(len(train_set))])
        batches[name] = normalization.model_input(images, CPU, normalization.normalization_of(train_set, CPU))
    assert len(seen) == len(train_set)
    assert torch.allclose(batches["uint8"], batches["float"], atol=1e-5)


def test_the_pictures_show_the_pixels_the_model_sees(tmp_path):
    """sample_picture undoes the device pass's normalisation; worst_picture reads uint8 dataset items:
    both give the pixels /255, as the float path did."""
    root = make_image_folder(tmp_path / "f", per_class=4, size=(52, 40))
    _, val_set, _ = loaders(root)
    pixels = torch.stack([val_set[i][0] for i in range(4)])
    normalised = normalization.model_input(pixels, CPU, normalization.normalization_of(val_set, CPU))
    shown = figures.denormalize(normalised, *normalization.mean_std(val_set))  # sample_picture's way
    assert torch.allclose(shown, pixels / 255, atol=1e-6)
    assert torch.equal(figures.denormalize(pixels, *normalization.mean_std(val_set)), pixels / 255)  # worst_picture's


# --------------------------------------------------------------------------- large JPEGs decoded small

def gradient_jpeg(width, height):
    """Red grows with x, green with y: a crop's colours say where in the original it came from."""
    x = (np.arange(width) + 0.5) / width * 255
    y = (np.arange(height) + 0.5) / height * 255
    rgb = np.stack(np.broadcast_arrays(x[None, :], y[:, None], np.full((height, width), 128.0)), axis=-1)
    buf = io.BytesIO()
    Image.fromarray(np.round(rgb).astype(np.uint8)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def box_from_pixels(crop, width, height):
    """(top, left, h, w) in the original's pixels, read back from a gradient_jpeg crop (either flip)."""
    out_h, out_w = crop.shape[1:]
    red, green = crop[0].double().mean(0) / 255, crop[1].double().mean(1) / 255
    x0, x1 = sorted((red[0].item() * width, red[-1].item() * width))
    y0, y1 = green[0].item() * height, green[-1].item() * height
    # Output pixel j samples the box at (j + 0.5) / out of its width.
    w, h = (x1 - x0) * out_w / (out_w - 1), (y1 - y0) * out_h / (out_h - 1)
    return y0 - h / (2 * out_h), x0 - w / (2 * out_w), h, w


@pytest.fixture
def decodes(monkeypatch):
    """Every utils.decoding.decode call's (scale asked, the decoded image's size)."""
    log, real = [], decoding.decode

    def recording(img, scale=1):
        out, s = real(img, scale)
        log.append((s, out.size))
        return out, s

    monkeypatch.setattr(decoding, "decode", recording)
    return log


def test_crops_of_a_large_jpeg_keep_torchvisions_distribution_in_original_pixels(tmp_path, decodes):
    W, H, n, out = 512, 384, 1000, 16
    path = tmp_path / "big.jpg"
    path.write_bytes(gradient_jpeg(W, H))
    crop = T.Compose([decoding.DraftRandomResizedCrop(out), T.RandomHorizontalFlip()])
    torch.manual_seed(1)
    ours = [box_from_pixels(decoding.load_image(path, crop), W, H) for _ in range(n)]
    torch.manual_seed(2)
    theirs = [T.RandomResizedCrop.get_params(torch.empty(1, H, W), (0.08, 1.0), (3 / 4, 4 / 3)) for _ in range(n)]
    bound = 1.95 * math.sqrt(2 / n)  # KS critical value at alpha = 0.001 for two samples of n
    mine, ref = box_features(ours, [H] * n, [W] * n), box_features(theirs, [H] * n, [W] * n)
    for key in mine:
        assert ks_statistic(mine[key], ref[key]) < bound, key
    scales = [s for s, _ in decodes]
    assert len(scales) == n and min(scales) >= 4 and scales.count(8) > n / 2  # decoded at 1/4 or 1/8 of each side
    assert all(size == (-(-W // s), -(-H // s)) for s, size in decodes)


@pytest.mark.parametrize("width, height, out_w, out_h", [(1024, 768, 32, 32), (4000, 3000, 224, 224),
                                                         (900, 500, 224, 224), (333, 500, 224, 224),
                                                         (300, 200, 341, 256), (4000, 3000, 341, 256)])
def test_the_draft_scale_is_the_smallest_decode_that_keeps_the_output_size(width, height, out_w, out_h):
    for w in range(max(1, width // 7), width + 1, max(1, width // 50)):
        for h in range(max(1, height // 7), height + 1, max(1, height // 50)):
            s = decoding.draft_scale(w, h, out_w, out_h)
            assert s in (1, 2, 4, 8)
            assert s == 1 or (w / s >= out_w and h / s >= out_h)  # never smaller than the output
            assert s == 8 or w / (2 * s) < out_w or h / (2 * s) < out_h  # half again would be too small


def test_validation_of_a_large_jpeg_is_drafted_by_the_same_rule_and_close_to_a_full_decode(tmp_path, decodes):
    rng = np.random.default_rng(0)
    smooth = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize((1600, 1200), Image.BICUBIC)
    grain = rng.integers(-8, 9, (1200, 1600, 1))
    Image.fromarray(np.clip(np.asarray(smooth, dtype=np.int64) + grain, 0, 255).astype(np.uint8)).save(
        tmp_path / "photo.jpg", quality=90)
    val = data.build_transforms(224, 256)[1]
    ours = decoding.load_image(tmp_path / "photo.jpg", val)
    assert decodes == [(4, (400, 300))]  # 1600 x 1200 -> 341 x 256: a quarter of each side still covers it
    full = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])(decoding.load_rgb(tmp_path / "photo.jpg"))
    diff = (ours.int() - full.int()).abs().double()
    assert ours.shape == full.shape and diff.mean() < 1.5 and diff.max() <= 16, (diff.mean(), diff.max())


def test_the_crop_resizes_on_one_thread_and_gives_the_others_back(monkeypatch):
    """With data.num_workers=0 the crop runs in the training process: torch's other threads, woken for one
    small image, cost 20x on a loaded 2-core machine. The setting is restored for the model."""
    seen, real = [], torch.nn.functional.interpolate
    monkeypatch.setattr(torch.nn.functional, "interpolate",
                        lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = decoding.DraftRandomResizedCrop(16)(Image.new("RGB", (40, 30), (10, 200, 30)))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1] and out.shape == (3, 16, 16) and out.dtype == torch.uint8


# --------------------------------------------------------------------------- EXIF orientation

def quadrants(size=(48, 32)):
    """An upright picture no turn or mirror leaves the same: four flat quadrants of different colours."""
    w, h = size
    img = Image.new("RGB", size, (230, 30, 30))
    img.paste((30, 200, 40), (w // 2, 0, w, h // 2))
    img.paste((40, 40, 220), (0, h // 2, w // 2, h))
    img.paste((240, 230, 40), (w // 2, h // 2, w, h))
    return img


def level_diff(a, b):
    """Mean absolute difference of two images (PIL or uint8 CHW tensors) of the same extent, in levels."""
    a, b = (np.asarray(x) if isinstance(x, Image.Image) else x.permute(1, 2, 0).squeeze(-1).numpy() for x in (a, b))
    assert a.shape == b.shape, (a.shape, b.shape)
    return np.abs(a.astype(np.int64) - b.astype(np.int64)).mean()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_pil_decode_path_turns_a_phone_photo_upright(tmp_path, orientation):
    """A JPEG stored as the sensor read it, its EXIF tag saying how to turn it: the whole decode (RGB and
    grey), validation's drafted resize and training's drafted crop all see the upright picture. A picture
    whose stored pixels were used as they are would be 50 levels off or more."""
    import bad_files
    up = quadrants()
    path = bad_files.rotated_jpeg(tmp_path / "phone.jpg", up, orientation)
    assert level_diff(decoding.load_rgb(path), up) < 8
    assert level_diff(decoding.load_rgb(path, mode="L"), up.convert("L")) < 8
    small = decoding.load_image(path, T.Compose([decoding.DraftResize(16), T.PILToTensor()]))  # decoded at 1/2
    assert level_diff(small, up.resize((24, 16), Image.BILINEAR)) < 12
    # The whole picture as the box (scale 1, its own aspect ratio): the crop is the upright picture, halved.
    crop = decoding.load_image(path, decoding.DraftRandomResizedCrop((16, 24), scale=(1, 1), ratio=(1.5, 1.5)))
    assert level_diff(crop, up.resize((24, 16), Image.BILINEAR)) < 12


@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_device_decoders_pixels_are_turned_as_pil_turns_them(orientation):
    """nvJPEG and decode_jpeg return the stored pixels; gpu_pipeline.upright_tensor turns them exactly as
    PIL's ImageOps.exif_transpose does (the reference), grey or colour, for every orientation."""
    from PIL import ImageOps
    from utils.gpu_pipeline import upright_tensor
    stored = np.random.default_rng(orientation).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    tagged = Image.fromarray(stored)
    tagged.info["exif"] = exif.tobytes()
    expected = np.asarray(ImageOps.exif_transpose(tagged))
    ours = upright_tensor(torch.from_numpy(stored).permute(2, 0, 1), orientation).permute(1, 2, 0).numpy()
    assert np.array_equal(ours, expected)
    assert np.array_equal(upright_tensor(torch.from_numpy(stored[None, :, :, 0]), orientation)[0].numpy(),
                          expected[:, :, 0])


@pytest.mark.slow
def test_train_and_predict_see_phone_photos_upright(tmp_path):
    """train.py on phone photos (stored turned, their EXIF tags turning them upright), with the device
    pipeline decoding every batch by torchvision's decode_jpeg on the CPU; predict.py then names a plain
    upright picture's class, and a phone photo's. Two classes that differ only in which colour is on top:
    a model trained on the stored pixels has learnt the other class for some of the turns."""
    import bad_files
    from conftest import FAST_ARGS, run_entry
    top, bottom = (220, 30, 30), (30, 40, 220)
    pictures = {}
    for name, (a, b) in {"red_on_top": (top, bottom), "blue_on_top": (bottom, top)}.items():
        img = Image.new("RGB", (40, 32), b)
        img.paste(a, (0, 0, 40, 16))
        pictures[name] = img
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(8):
            bad_files.rotated_jpeg(tmp_path / "data" / name / f"{i}.jpg", img, (3, 6, 8, 4)[i % 4])
        img.save(tmp_path / f"plain_{name}.jpg", quality=95)
        bad_files.rotated_jpeg(tmp_path / f"phone_{name}.jpg", img, 6)
    run = tmp_path / "run"
    proc = run_entry("train.py", *FAST_ARGS, "--data-path", tmp_path / "data", "--output-dir", run, "train.epochs=4",
                     "data.min_crop_scale=0.6", "data.pipeline=gpu", "data.gpu_decode=per_batch", "data.val_rate=0.25",
                     )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "JPEGs decoded on cpu every batch" in proc.stdout
    out = tmp_path / "pred.csv"
    proc = run_entry("predict.py", run, *sorted(tmp_path.glob("*_on_top.jpg")), "--device", "cpu", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {Path(r["path"]).name: r for r in csv.DictReader(out.open())}
    assert {n: r["class1"] for n, r in rows.items()} == {f"{kind}_{c}.jpg": c for kind in ("plain", "phone")
                                                      for c in pictures}, rows
