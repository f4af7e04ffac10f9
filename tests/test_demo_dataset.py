"""The offline demo flower set: layout, image format, determinism, safe concurrent
creation and whether the five classes can actually be told apart.

Small image sizes keep the whole file to a few seconds on CPU.
"""
import json
import multiprocessing
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import utils.demo_dataset as demo
from utils.demo_dataset import (CLASS_NAMES, FLOWER_PHOTOS_COUNTS, MARKER_NAME, ensure_demo_dataset,
                                generate_demo_dataset, render_demo_image)

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL = {"min_size": 64, "max_size": 96}   # fast, and still every drawing path


def files_of(root):
    """Relative path -> bytes, for everything under root (hidden files included)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def listing(root):
    return sorted(p.name for p in Path(root).iterdir())


# --------------------------------------------------------------------------- layout and format

def test_int_count_gives_flower_photos_layout(tmp_path):
    root = generate_demo_dataset(tmp_path / "flowers", images_per_class=3, **SMALL)
    assert root == tmp_path / "flowers"
    assert listing(root) == sorted([MARKER_NAME, *CLASS_NAMES])
    for name in CLASS_NAMES:
        assert listing(root / name) == [f"{name}_{i:04d}.jpg" for i in range(3)]
    marker = json.loads((root / MARKER_NAME).read_text())
    assert marker["images_per_class"] == {c: 3 for c in CLASS_NAMES}
    assert (marker["seed"], marker["min_size"], marker["max_size"]) == (0, 64, 96)


def test_dict_counts_are_per_class(tmp_path):
    counts = {"daisy": 1, "dandelion": 4, "roses": 2, "sunflowers": 3, "tulips": 1}
    root = generate_demo_dataset(tmp_path / "flowers", images_per_class=counts, **SMALL)
    assert {name: len(listing(root / name)) for name in CLASS_NAMES} == counts


def test_flower_photos_counts_are_the_real_ones():
    assert tuple(FLOWER_PHOTOS_COUNTS) == CLASS_NAMES
    assert sum(FLOWER_PHOTOS_COUNTS.values()) == 3670


@pytest.mark.parametrize("bad", [
    {"images_per_class": 0},
    {"images_per_class": -2},
    {"images_per_class": True},
    {"images_per_class": 2.5},
    {"images_per_class": {"daisy": 2}},                                   # classes missing
    {"images_per_class": {**FLOWER_PHOTOS_COUNTS, "orchids": 1}},         # unknown class
    {"images_per_class": 1, "min_size": 300, "max_size": 200},
    {"images_per_class": 1, "seed": -1},
    {"images_per_class": 1, "quality": 0},
    {"images_per_class": 1, "workers": 0},
])
def test_bad_arguments_are_rejected_before_writing(tmp_path, bad):
    with pytest.raises(ValueError):
        generate_demo_dataset(tmp_path / "flowers", **bad)
    with pytest.raises(ValueError):
        ensure_demo_dataset(tmp_path / "other", **bad)
    assert listing(tmp_path) == []


def test_images_are_rgb_jpegs_with_sizes_in_range(tmp_path):
    # The default size range, as the training recipe uses it.
    root = generate_demo_dataset(tmp_path / "flowers", images_per_class=4)
    sizes = []
    for name in CLASS_NAMES:
        for path in sorted((root / name).iterdir()):
            with Image.open(path) as img:
                assert img.format == "JPEG" and img.mode == "RGB"
                img.load()  # decodes completely, not just the header
                sizes.append(img.size)
    assert all(240 <= w <= 500 and 240 <= h <= 500 for w, h in sizes)
    # Width and height are drawn independently, so the set is not all squares of one size.
    assert len({w for w, _ in sizes}) > 5 and any(w != h for w, h in sizes)


def test_custom_size_range_is_respected(tmp_path):
    root = generate_demo_dataset(tmp_path / "flowers", images_per_class=4, min_size=100, max_size=120)
    paths = sorted(root.rglob("*.jpg"))
    assert len(paths) == 20
    for path in paths:
        with Image.open(path) as img:
            assert 100 <= img.width <= 120 and 100 <= img.height <= 120


# --------------------------------------------------------------------------- determinism

def test_same_arguments_give_identical_bytes_and_other_seed_differs(tmp_path):
    py_state, np_state = random.getstate(), np.random.get_state()
    a = files_of(generate_demo_dataset(tmp_path / "a", images_per_class=3, seed=7, **SMALL))
    b = files_of(generate_demo_dataset(tmp_path / "b", images_per_class=3, seed=7, **SMALL))
    c = files_of(generate_demo_dataset(tmp_path / "c", images_per_class=3, seed=8, **SMALL))
    assert a == b
    assert a.keys() == c.keys()
    images = [k for k in a if k.endswith(".jpg")]
    assert len(images) == 15 and all(a[k] != c[k] for k in images)
    # Generation must not disturb anyone else's random streams.
    assert random.getstate() == py_state
    assert np.array_equal(np.random.get_state()[1], np_state[1])


def test_small_set_is_a_prefix_of_a_larger_one(tmp_path):
    small = files_of(generate_demo_dataset(tmp_path / "small", images_per_class=2, **SMALL))
    large = files_of(generate_demo_dataset(tmp_path / "large", images_per_class=3, **SMALL))
    images = [k for k in small if k.endswith(".jpg")]
    assert len(images) == 10 and all(small[k] == large[k] for k in images)


def test_worker_processes_do_not_change_the_output(tmp_path):
    serial = files_of(generate_demo_dataset(tmp_path / "serial", images_per_class=2, workers=1, **SMALL))
    parallel = files_of(generate_demo_dataset(tmp_path / "parallel", images_per_class=2, workers=2, **SMALL))
    assert serial == parallel


def test_render_demo_image_is_the_saved_image(tmp_path):
    root = generate_demo_dataset(tmp_path / "flowers", images_per_class=2, seed=3, **SMALL)
    img = render_demo_image("tulips", index=1, seed=3, **SMALL)
    with Image.open(root / "tulips" / "tulips_0001.jpg") as saved:
        assert saved.size == img.size
        # JPEG is lossy; the decoded file must still be close to the rendered image.
        diff = np.abs(np.asarray(saved, dtype=int) - np.asarray(img, dtype=int))
    assert diff.mean() < 8


# --------------------------------------------------------------------------- ensure_demo_dataset

def test_ensure_generates_once_then_leaves_the_folder_alone(tmp_path, monkeypatch):
    root = tmp_path / "data" / "flowers"   # parent does not exist yet
    assert ensure_demo_dataset(root, images_per_class=2, **SMALL) == root
    assert listing(root.parent) == ["flowers"]  # no temporary folder left behind
    before = files_of(root)
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    assert len([k for k in before if k.endswith(".jpg")]) == 10

    def must_not_run(*args, **kwargs):
        raise AssertionError("regenerated a complete demo set")

    monkeypatch.setattr(demo, "generate_demo_dataset", must_not_run)
    assert ensure_demo_dataset(root, images_per_class=2, **SMALL) == root
    assert files_of(root) == before
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == stamps


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_ensure_publishes_with_ordinary_permissions(tmp_path):
    # A temporary folder is owner-only; the published set must not stay that way.
    root = ensure_demo_dataset(tmp_path / "flowers", images_per_class=1, **SMALL)
    (tmp_path / "plain").mkdir()
    assert stat.S_IMODE(root.stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode)


def test_ensure_warns_when_the_existing_set_was_made_differently(tmp_path):
    root = ensure_demo_dataset(tmp_path / "flowers", images_per_class=1, **SMALL)
    before = files_of(root)
    with pytest.warns(UserWarning, match="made with"):
        ensure_demo_dataset(root, images_per_class=2, **SMALL)
    assert files_of(root) == before


def test_ensure_fills_an_empty_folder(tmp_path):
    root = tmp_path / "flowers"
    root.mkdir()
    ensure_demo_dataset(root, images_per_class=1, **SMALL)
    assert (root / MARKER_NAME).is_file()
    assert listing(tmp_path) == ["flowers"]


@pytest.mark.parametrize("contents", [{"notes.txt": "mine"}, {"cats/notes.txt": "no images", "dogs/a.jpg": ""}])
def test_ensure_refuses_a_folder_that_is_not_a_data_set(tmp_path, contents):
    root = tmp_path / "flowers"
    for rel, text in contents.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    with pytest.raises(FileExistsError, match="not writing into it"):
        ensure_demo_dataset(root, images_per_class=1, **SMALL)
    assert sorted(files_of(root)) == sorted(contents)
    assert listing(tmp_path) == ["flowers"]


@pytest.mark.parametrize("layout", ["class_folders", "train_val"])
def test_ensure_accepts_an_existing_data_set_in_a_layout_data_py_reads(tmp_path, layout):
    root = tmp_path / "flowers"
    for split in (["."] if layout == "class_folders" else ["train", "val"]):
        for name in ("cats", "dogs"):
            (root / split / name).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(root / split / name / "0.png")
    before = files_of(root)
    assert ensure_demo_dataset(root, images_per_class=1, **SMALL) == root
    assert files_of(root) == before and listing(tmp_path) == ["flowers"]


def test_failed_generation_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo, "_render", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_demo_dataset(tmp_path / "flowers", images_per_class=1, **SMALL)
    assert listing(tmp_path) == []


def _ensure_in_child(root, barrier, results):
    # Module level, so that a spawned process can import it.
    try:
        barrier.wait(timeout=60)
        ensure_demo_dataset(root, images_per_class=4, seed=5, **SMALL)
        results.put("ok")
    except BaseException as e:  # reported to the parent, which fails the test
        results.put(repr(e))


def test_concurrent_ensure_from_several_processes(tmp_path):
    """Like DDP ranks: all start together, one set survives, no temporary folder is left."""
    ctx = multiprocessing.get_context("spawn")
    root = tmp_path / "shared" / "flowers"
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(str(root), barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert outcomes == ["ok"] * 3
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert listing(root.parent) == ["flowers"]
    expected = files_of(generate_demo_dataset(tmp_path / "reference", images_per_class=4, seed=5, **SMALL))
    assert files_of(root) == expected


# --------------------------------------------------------------------------- CLI

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "utils.demo_dataset", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_writes_then_reports_nothing_to_do(tmp_path):
    out = tmp_path / "flowers"
    first = _cli(str(out), "--images-per-class", "2", "--seed", "3")
    assert first.returncode == 0, first.stderr
    assert len(first.stdout.splitlines()) == 1 and first.stdout.startswith("wrote 10 images")
    assert sorted(p.name for p in out.rglob("*.jpg"))[:2] == ["daisy_0000.jpg", "daisy_0001.jpg"]
    second = _cli(str(out), "--images-per-class", "2", "--seed", "3")
    assert second.returncode == 0 and "nothing written" in second.stdout


def test_cli_rejects_bad_arguments(tmp_path):
    bad = _cli(str(tmp_path / "flowers"), "--images-per-class", "0")
    assert bad.returncode == 2 and bad.stderr.startswith("error:")
    both = _cli(str(tmp_path / "flowers"), "--images-per-class", "5", "--flower-photos-counts")
    assert both.returncode == 2
    assert listing(tmp_path) == []


# --------------------------------------------------------------------------- are the classes learnable?

def _colour_features(root):
    """sqrt of a 4x4x4 RGB histogram of a 32x32 thumbnail, with the class of each image."""
    features, labels = [], []
    for label, name in enumerate(CLASS_NAMES):
        for path in sorted((root / name).iterdir()):
            with Image.open(path) as img:
                q = np.asarray(img.convert("RGB").resize((32, 32), Image.BOX), dtype=int) // 64
            codes = (q[..., 0] * 16 + q[..., 1] * 4 + q[..., 2]).ravel()
            features.append(np.sqrt(np.bincount(codes, minlength=64) / codes.size))
            labels.append(label)
    return np.array(features), np.array(labels)


def _fit_linear_probe(x, y, steps=500, lr=0.5, l2=1e-3):
    """Multinomial logistic regression by full-batch gradient descent; returns a predict function."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    x = (x - mean) / std
    w, b, onehot = np.zeros((x.shape[1], len(CLASS_NAMES))), np.zeros(len(CLASS_NAMES)), np.eye(len(CLASS_NAMES))[y]
    for _ in range(steps):
        z = x @ w + b
        p = np.exp(z - z.max(1, keepdims=True))
        grad = (p / p.sum(1, keepdims=True) - onehot) / len(x)
        w -= lr * (x.T @ grad + l2 * w)
        b -= lr * grad.sum(0)
    return lambda xt: np.argmax(((xt - mean) / std) @ w + b, axis=1)


def test_classes_are_distinct_in_colour_alone(tmp_path):
    """Held-out images (another seed) are classified from colour statistics of 32x32 thumbnails.

    Shape carries the class too (a CNN uses both), so this is a lower bound on
    how learnable the set is; chance is 0.2. Both rules stay below 1.0 because
    backgrounds, flower sizes and counts vary independently of the class.
    """
    x, y = _colour_features(generate_demo_dataset(tmp_path / "train", 30, seed=0, min_size=112, max_size=176))
    xt, yt = _colour_features(generate_demo_dataset(tmp_path / "test", 20, seed=1, min_size=112, max_size=176))

    mean, std = x.mean(0), x.std(0) + 1e-6
    z, zt = (x - mean) / std, (xt - mean) / std
    class_means = np.stack([z[y == c].mean(0) for c in range(len(CLASS_NAMES))])
    nearest_mean = np.argmin(((zt[:, None] - class_means[None]) ** 2).sum(-1), axis=1)
    ncm_accuracy = float(np.mean(nearest_mean == yt))
    assert ncm_accuracy >= 0.8, f"nearest-class-mean accuracy {ncm_accuracy:.2f}"

    probe_accuracy = float(np.mean(_fit_linear_probe(x, y)(xt) == yt))
    assert probe_accuracy >= 0.85, f"linear-probe accuracy {probe_accuracy:.2f}"
