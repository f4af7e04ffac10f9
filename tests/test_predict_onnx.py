"""predict_onnx.py: the predictor without torch agrees with predict.py, pixel for pixel and row for row.

    python -m pytest tests/test_predict_onnx.py -q

On the shared finished run (conftest.trained_run), exported once to ONNX. Its preprocessing gives the
model input predict.py's transform and normalisation give, on the kinds of files a user has (a large JPEG
decoded small, a phone photo turned by its EXIF tag, PNGs with alpha or 16 bits, CMYK, grey runs); in a
real process where `import torch` fails, it prints predict.py's table and writes its --out file, with the
same top-1 and probabilities within 1e-5.
"""
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import bad_files
import export
import predict_onnx
from _resume_utils import single_thread
from conftest import run_entry
from data import IMG_EXTENSIONS, build_transforms
from test_decoding import quadrants
from utils import normalization
from utils.decoding import load_image

pytestmark = pytest.mark.slow

# A sitecustomize that makes `import torch` (and torchvision) fail in the process it starts in.
NO_TORCH = '''import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision"):
            raise ImportError(f"{name} is blocked: predict_onnx.py must not need it")
sys.meta_path.insert(0, _NoTorch())
'''


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    """(the .onnx file, a folder of images of every kind predict.py reads)."""
    root = tmp_path_factory.mktemp("onnx")
    out = root / "model.onnx"
    with single_thread():
        export.main([str(trained_run["run_dir"]), "--format", "onnx", "--out", str(out), "--speed-repeats", "0"])
    images = root / "images"
    images.mkdir()
    for name in ("daisy", "roses", "tulips"):
        for src in sorted((trained_run["data"] / name).glob("*.jpg"))[:2]:
            (images / src.name).write_bytes(src.read_bytes())
    write_odd_files(images)
    return out, images


def write_odd_files(folder):
    rng = np.random.default_rng(0)
    smooth = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((400, 300), Image.BICUBIC)
    smooth.save(folder / "large.jpg", quality=90)  # 400 x 300 -> 48 x 36: decoded at 1/8
    bad_files.rotated_jpeg(folder / "phone.jpg", quadrants((120, 80)), 6)
    bad_files.rotated_jpeg(folder / "phone_flipped.jpg", quadrants((50, 40)), 3)
    bad_files.rgba_png(folder / "rgba.png")
    bad_files.gray16_png(folder / "grey16.png")
    bad_files.cmyk_jpeg(folder / "cmyk.jpg")
    bad_files.palette_png(folder / "palette.png")
    Image.new("RGB", (20, 30), (200, 10, 10)).save(folder / "smaller_than_the_crop.png")


@pytest.mark.parametrize("channels", [3, 1])
def test_the_preprocessing_is_predict_pys_pixel_for_pixel(exported, channels):
    """Each file's model input from the sidecar alone equals predict.py's (its val transform, normalised as
    the loop normalises), to float32 rounding."""
    _, images = exported
    spec = {"channels": channels, "crop": 32, "resize": 36, "exif_orientation": True, "max_image_pixels": 0,
            "mean": list(normalization.imagenet_stats(channels)[0]), "std": list(normalization.imagenet_stats(channels)[1])}
    transform = build_transforms(32, 36, channels=channels)[1]
    norm = normalization.normalization_of(transform, torch.device("cpu"))
    files = sorted(images.iterdir())
    assert len(files) == 14
    for path in files:
        theirs = normalization.model_input(load_image(path, transform, mode="L" if channels == 1 else "RGB")[None],
                                           torch.device("cpu"), norm)[0].numpy()
        ours = predict_onnx.preprocess(path, spec)
        assert ours.dtype == np.float32 and ours.shape == theirs.shape == (channels, 32, 32), path.name
        assert np.abs(ours - theirs).max() <= 1e-6, (path.name, np.abs(ours - theirs).max())


def test_without_torch_it_prints_and_writes_what_predict_py_does(exported, trained_run, tmp_path):
    """predict_onnx.py in a process where `import torch` raises, against predict.py on the same images:
    the same paths and top classes in the table, the same CSV columns, the same top-1, probabilities
    within 1e-5; its JSON holds the same."""
    model, images = exported
    block = tmp_path / "no_torch"
    block.mkdir()
    (block / "sitecustomize.py").write_text(NO_TORCH)
    env = {"PYTHONPATH": str(block)}
    blocked = subprocess.run([sys.executable, "-c", "import numpy, PIL, onnxruntime; import torch"], text=True,
                             capture_output=True, env={**os.environ, **env})
    assert blocked.returncode == 1 and "torch is blocked" in blocked.stderr  # the blocker blocks, the rest loads
    outs = {}
    for kind, suffix in (("onnx", ".csv"), ("onnx", ".json"), ("torch", ".csv")):
        out = tmp_path / f"{kind}{suffix}"
        if kind == "onnx":
            proc = run_entry("predict_onnx.py", model, images, "--out", out, env=env)
        else:
            proc = run_entry("predict.py", trained_run["run_dir"], images, "--device", "cpu", "--out", out)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[kind, suffix] = out, proc.stdout
    ours, theirs = (list(csv.DictReader(outs[k, ".csv"][0].open())) for k in ("onnx", "torch"))
    assert len(ours) == 14 and list(ours[0]) == list(theirs[0]) == ["path"] + [
        x for k in range(1, 6) for x in (f"class{k}", f"prob{k}")]
    for a, b in zip(ours, theirs):
        assert a["path"] == b["path"] and a["class1"] == b["class1"], (a, b)
        assert all(abs(float(a[f"prob{k}"]) - float(b[f"prob{k}"])) < 1e-5 for k in range(1, 6)), (a, b)
    as_json = json.loads(outs["onnx", ".json"][0].read_text())  # predict.py writes through the same function
    assert [(r["path"], r["top"][0]["class"]) for r in as_json] == [(r["path"], r["class1"]) for r in theirs]
    shown = [[ln.split()[:2] for ln in outs[k, ".csv"][1].splitlines()[:10]] for k in ("onnx", "torch")]
    assert shown[0] == shown[1] and len(shown[0]) == 10  # each path and its top class
    assert outs["onnx", ".csv"][1].splitlines()[10] == "... and 4 more"


def test_its_image_extensions_are_data_pys():
    assert predict_onnx.IMG_EXTENSIONS == IMG_EXTENSIONS


def test_bad_inputs_are_one_error_line(exported, tmp_path):
    model, images = exported
    lone = tmp_path / "lone.onnx"
    lone.write_bytes(model.read_bytes())
    for args, text in (((lone, images), "no sidecar"), ((model, images, "--out", tmp_path / "p.txt"), "must end in .csv"),
                       ((tmp_path / "none.onnx", images), "does not exist"),
                       ((model, tmp_path / "nothing*.jpg"), "matches no image")):
        proc = run_entry("predict_onnx.py", *args)
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and text in proc.stderr, proc.stderr
        assert len(proc.stderr.splitlines()) == 1
