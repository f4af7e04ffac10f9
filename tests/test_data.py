"""data.py: the per-class train/val split and its rounding, the two folder layouts, file discovery,
image modes, the train/val transforms, and the order the file reads in.

    python -m pytest tests/test_data.py -q
"""
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, make_image_folder
from data import build_datasets, build_transforms, split_dataset
from utils import normalization
from utils.config import load_config


def split_of(root, **kw):
    """split_dataset of the data section data.path=root with the data keys given."""
    return split_dataset(_data_cfg(root, **kw))


def as_names(samples):
    return [(os.path.basename(p), label) for p, label in samples]


@pytest.fixture
def uneven_root(tmp_path):
    """Three classes of 10, 5 and 20 images: per-class rounding is visible."""
    root = tmp_path / "uneven"
    for name, n in (("a_cls", 10), ("b_cls", 5), ("c_cls", 20)):
        make_image_folder(root, per_class=n, classes=(name,), size=(8, 8))
    return root


# --------------------------------------------------------------------------- split

def test_split_is_per_class_and_respects_val_rate(uneven_root):
    split = split_of(uneven_root, val_rate=0.2, split_seed=0)
    assert split.classes == ["a_cls", "b_cls", "c_cls"]
    val_per_class = [sum(1 for _, y in split.val if y == c) for c in range(3)]
    train_per_class = [sum(1 for _, y in split.train if y == c) for c in range(3)]
    assert val_per_class == [2, 1, 4]
    assert train_per_class == [8, 4, 16]
    # Disjoint, complete, and every label is the folder the file sits in.
    all_paths = [p for p, _ in [*split.train, *split.val]]
    assert len(set(all_paths)) == 35
    for p, label in [*split.train, *split.val]:
        assert os.path.basename(os.path.dirname(p)) == split.classes[label]

    half = split_of(uneven_root, val_rate=0.5, split_seed=0)
    assert [sum(1 for _, y in half.val if y == c) for c in range(3)] == [5, round(2.5), 10]


def test_split_rounds_each_class_to_the_nearest_image(tmp_path):
    """At the default data.val_rate=0.2, classes of 7, 8, 12 and 13 images owe 1.4, 1.6, 2.4 and 2.6
    validation images: each class rounds its own share to the nearest image, neither down nor up."""
    root = tmp_path / "remainders"
    for name, n in (("a", 7), ("b", 8), ("c", 12), ("d", 13)):
        make_image_folder(root, per_class=n, classes=(name,), size=(8, 8))
    split = split_of(root, val_rate=0.2, split_seed=0)
    assert [sum(y == c for _, y in split.val) for c in range(4)] == [1, 2, 2, 3]
    assert [sum(y == c for _, y in split.train) for c in range(4)] == [6, 6, 10, 10]


def test_split_is_deterministic_and_leaves_global_rng_alone(uneven_root):
    first = split_of(uneven_root, val_rate=0.3, split_seed=7)

    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
    second = split_of(uneven_root, val_rate=0.3, split_seed=7)
    after = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())

    assert as_names(first.train) == as_names(second.train)
    assert as_names(first.val) == as_names(second.val)
    assert before[0] == after[0]
    assert np.array_equal(before[1], after[1])
    assert torch.equal(before[2], after[2])

    # A different global seed does not change it; a different split_seed does.
    torch.manual_seed(999)
    assert as_names(split_of(uneven_root, val_rate=0.3, split_seed=7).val) == as_names(first.val)
    assert as_names(split_of(uneven_root, val_rate=0.3, split_seed=8).val) != as_names(first.val)


@pytest.mark.slow
def test_split_is_identical_in_another_process(uneven_root):
    """What every rank and every later run computes: a fresh interpreter, other hash seed, other cwd."""
    here = split_of(uneven_root, val_rate=0.3, split_seed=7)
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import torch; torch.manual_seed(5);"
            "from data import split_dataset; from utils.config import load_config;"
            "s = split_dataset(load_config(['data.path=' + sys.argv[2], 'data.val_rate=0.3',"
            " 'data.split_seed=7']).data);"
            "print(json.dumps({'classes': s.classes, 'train': list(s.train), 'val': list(s.val)}))")
    out = subprocess.run([sys.executable, "-c", code, str(REPO), str(uneven_root)], capture_output=True,
                         text=True, check=True, cwd=uneven_root.parent,
                         env={**os.environ, "PYTHONHASHSEED": "4321"}, timeout=120)
    there = json.loads(out.stdout)
    assert there["classes"] == here.classes
    assert [tuple(x) for x in there["train"]] == list(here.train)
    assert [tuple(x) for x in there["val"]] == list(here.val)


# Today's splits of a small fixture, written down: existing runs and their resumes rely on the same seed giving
# the same images, in the same order (the order is the sampler's input), so a change to the split is seen here.
PINNED = {
    "folders": (dict(val_rate=0.3, split_seed=7),
                "a_003:0 a_002:0 a_004:0 b_002:1 b_000:1 c_005:2 c_004:2 c_002:2 c_001:2 c_003:2",
                "a_000:0 a_001:0 b_001:1 c_006:2 c_000:2"),
    "folder folds": (dict(split_seed=5, folds=3, fold=1),
                     "a_001:0 a_000:0 a_002:0 b_002:1 b_001:1 c_001:2 c_006:2 c_005:2 c_004:2 c_000:2",
                     "a_003:0 a_004:0 b_000:1 c_003:2 c_002:2"),
    "folders multi": (dict(val_rate=0.5, split_seed=0, task="multi"),
                      "a_001:0 a_003:0 a_002:0 b_000:1 c_003:2 c_005:2 c_001:2",
                      "a_004:0 a_000:0 b_001:1 b_002:1 c_006:2 c_002:2 c_004:2 c_000:2"),
    "label file": (dict(val_rate=0.3, split_seed=3, labels=True),
                   "a_003:0+1 a_004:0 a_002:0 b_000:1 b_002:1 c_003:1+2 c_001:2 c_005:1+2 c_000:2 c_004:1+2",
                   "a_001:0 a_000:0 b_001:1 c_002:2 c_006:1+2"),
    "label file folds": (dict(split_seed=2, folds=3, fold=2, labels=True),
                         "c_006:1+2 c_002:2 a_000:0 b_001:1 b_000:1 a_003:0+1 c_000:2 c_003:1+2 a_004:0 a_001:0 "
                         "c_004:1+2 a_002:0",
                         "c_005:1+2 b_002:1 c_001:2"),
}


@pytest.mark.parametrize("case", list(PINNED))
def test_split_is_todays_for_the_same_seed(tmp_path, case):
    """Class folders of 5, 3 and 7 images, and a label file listing them out of path order, every third row
    also labelled b, in groups g0..g4: each case's train and val, in order, are the ones recorded."""
    root = tmp_path / "pinned"
    for name, n in (("a", 5), ("b", 3), ("c", 7)):
        make_image_folder(root, per_class=n, classes=(name,), size=(8, 8))
    files = sorted(os.path.relpath(p, root) for p in map(str, root.rglob("*.jpg")))
    random.Random(1).shuffle(files)
    rows = [f"{f},{f[0]}{';b' if i % 3 == 0 else ''},g{i % 5}" for i, f in enumerate(files)]
    (tmp_path / "pinned.csv").write_text("path,label,group\n" + "\n".join(rows) + "\n")
    kw, train, val = PINNED[case]
    if kw.get("labels"):
        kw = {**kw, "labels": tmp_path / "pinned.csv"}
    split = split_of(root, **kw)

    def names(samples):
        return " ".join(f"{os.path.basename(p)[:-4]}:{'+'.join(map(str, y)) if isinstance(y, tuple) else y}"
                        for p, y in samples)
    assert (names(split.train), names(split.val)) == (train, val)


def test_split_order_is_the_path_strings_order_even_for_names_that_are_not_utf8():
    """Rows are split in sorted() order of their paths; a name that is not UTF-8 (byte 0x80 reads as the
    surrogate U+DC80) sorts after 'é' as a string, though before it as bytes."""
    from utils.sample_list import SampleList
    from utils.splits import path_order
    paths = [os.fsdecode(b"/r/a/\x80.jpg"), "/r/a/\u00e9.jpg", "/r/a/b.jpg", "/r/a/\u00e9a.jpg"]
    samples = SampleList([(p, 0) for p in paths])
    assert [paths[i] for i in path_order(samples)] == sorted(paths)
    assert [paths[1:][i] for i in path_order(samples.take([1, 2, 3]))] == sorted(paths[1:])


def test_presplit_root_is_used_as_is(tmp_path):
    root = tmp_path / "presplit"
    make_image_folder(root / "train", per_class=4, classes=("cat", "dog"), size=(8, 8))
    make_image_folder(root / "val", per_class=2, classes=("cat", "dog"), size=(8, 8))
    split = split_of(root, val_rate=0.5, split_seed=0)  # val_rate is ignored here
    assert split.classes == ["cat", "dog"]
    assert len(split.train) == 8 and len(split.val) == 4
    assert all(f"{os.sep}train{os.sep}" in p for p, _ in split.train)
    assert all(f"{os.sep}val{os.sep}" in p for p, _ in split.val)
    assert sorted(y for _, y in split.val) == [0, 0, 1, 1]


def test_extensions_are_case_insensitive(tmp_path):
    root = tmp_path / "mixed"
    for cls in ("a", "b"):
        d = root / cls
        d.mkdir(parents=True)
        for i, ext in enumerate((".jpg", ".JPG", ".jpeg", ".JPEG", ".png", ".PNG", ".Jpg")):
            Image.new("RGB", (8, 8), (i * 30, 0, 0)).save(d / f"img{i}{ext}",
                                                            format="PNG" if "png" in ext.lower() else "JPEG")
        (d / "notes.txt").write_text("not an image")
        (d / "Thumbs.db").write_bytes(b"\0")
        Image.new("RGB", (8, 8)).save(d / ".hidden.jpg")
    split = split_of(root, val_rate=0.0, split_seed=0)
    assert len(split.val) == 0
    found = sorted(os.path.basename(p) for p, y in split.train if y == 0)
    assert found == sorted(f"img{i}{ext}" for i, ext in
                           enumerate((".jpg", ".JPG", ".jpeg", ".JPEG", ".png", ".PNG", ".Jpg")))


# --------------------------------------------------------------------------- images and transforms

def _data_cfg(path, **kw):
    return load_config([f"data.path={path}", *(f"data.{k}={v}" for k, v in kw.items())]).data


def test_any_image_mode_becomes_rgb(tmp_path):
    root = tmp_path / "modes"
    modes = {"L": ".jpg", "CMYK": ".jpg", "P": ".png", "RGBA": ".png", "LA": ".png", "1": ".png",
             "I;16": ".png", "RGB": ".JPEG"}
    for cls in ("x", "y"):
        (root / cls).mkdir(parents=True)
        for m, ext in modes.items():
            Image.new(m, (50, 30)).save(root / cls / f"{m.replace(';', '_')}{ext}")
    train_set, val_set, classes = build_datasets(_data_cfg(root, val_rate=0.5, img_size=16, val_resize=20))
    assert classes == ["x", "y"]
    assert len(train_set) + len(val_set) == 2 * len(modes)
    for ds in (train_set, val_set):
        for i in range(len(ds)):
            img, label = ds[i]
            assert img.shape == (3, 16, 16) and img.dtype == torch.uint8 and label in (0, 1)


@pytest.mark.parametrize("size", [(300, 200), (120, 400), (64, 64)])
def test_transforms_give_square_crops_of_img_size(size):
    train_tf, val_tf = build_transforms(img_size=48, val_resize=56, min_crop_scale=0.3)
    img = Image.new("RGB", size, (200, 30, 30))
    assert train_tf(img).shape == (3, 48, 48)
    val = val_tf(img)
    assert val.shape == (3, 48, 48) and val.dtype == torch.uint8
    # Normalized with the ImageNet statistics on the device: a pure colour maps to (c/255 - mean) / std.
    cpu = torch.device("cpu")
    val = normalization.model_input(val[None], cpu, normalization.normalization_of(val_tf, cpu))[0]
    expected = (torch.tensor([200, 30, 30]) / 255 - torch.tensor([0.485, 0.456, 0.406])) \
        / torch.tensor([0.229, 0.224, 0.225])
    assert torch.allclose(val[:, 24, 24], expected, atol=1e-5)


def test_train_transform_crops_and_flips_at_random_val_transform_does_not():
    """Each random step of the train transform is seen to fire, over a fixed seed's draws (so the
    outcome is fixed), however the colours are augmented."""
    torch.manual_seed(0)
    # The flip: at min_crop_scale=1 a square's crop is the whole image, so only the flip can move its
    # black left half to the right. p=0.5: 200 draws give 100 +- 35 (5 sigma) mirrored.
    whole_tf, _ = build_transforms(img_size=32, val_resize=36, min_crop_scale=1.0)
    halves = Image.new("RGB", (64, 64))
    halves.paste((255, 255, 255), (32, 0, 64, 64))
    mirrored = sum(bool(t[:, :, :16].sum() > t[:, :, 16:].sum()) for t in (whole_tf(halves) for _ in range(200)))
    assert 65 <= mirrored <= 135, mirrored
    # The crop: 20 draws of a gradient give 20 different images, even with any flip undone.
    train_tf, val_tf = build_transforms(img_size=32, val_resize=36, min_crop_scale=0.08)
    img = Image.new("RGB", (64, 48))
    img.putdata([(x * 4 % 256, y * 5 % 256, (x * y) % 256) for y in range(48) for x in range(64)])
    distinct = len({frozenset((t.numpy().tobytes(), t.flip(-1).numpy().tobytes()))
                    for t in (train_tf(img) for _ in range(20))})
    assert distinct == 20
    first = val_tf(img)
    assert all(torch.equal(first, val_tf(img)) for _ in range(5))


# --------------------------------------------------------------------------- the file itself

def test_data_py_defines_what_its_first_screen_lists_in_that_order():
    """data.py is read top to bottom by someone adapting it to their data: its docstring lists the
    parts a user changes, and the file defines them in the same order, each once."""
    text = (REPO / "data.py").read_text()
    first_screen = text[:text.index('"""', 3)]
    parts = ["split_dataset", "build_transforms", "build_datasets", "make_loader"]
    listed = [first_screen.index(f"\n    {name}  ") for name in parts]
    assert listed == sorted(listed)
    defined = [line.split("(")[0].removeprefix("def ") for line in text.splitlines() if line.startswith("def ")]
    assert [name for name in defined if name in parts] == parts
