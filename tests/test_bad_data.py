"""Bad and unusual image folders fed to the real entry scripts (README: "What happens when...").

    python -m pytest tests/test_bad_data.py -q

One messy folder (every recoverable problem at once) is trained once in this
process and each case asserts its own outcome on that run; the fatal cases
each get their own short call. A loader worker's error is one case here; how loader
workers on DDP ranks report and count unreadable files is asserted on tests/test_entry_scripts.py's
torchrun run, whose data holds them.
"""
import json
import os
import re

import pytest

import train
from bad_files import BROKEN, GOOD_MODES, call_main, cmyk_jpeg, error_line, gray16_png, tree_hash, truncated_jpeg
from conftest import FAST_ARGS, make_image_folder
from utils.decoding import load_rgb
from utils.run_dir import read_metrics


def make_messy_folder(base):
    """daisy: 6 good + every image mode; roses: 6 good + every broken file + an upper-case .JPEG;
    tulips: a symlink to a folder elsewhere; tiny: 2 images (no val image at val_rate 0.2);
    empty_class: no images; plus a hidden file and a text file. 30 images, 4 of them unreadable."""
    root = make_image_folder(base / "flowers", per_class=6, classes=("daisy", "roses"))
    for name, write in GOOD_MODES.items():
        write(root / "daisy" / name)
    for name, write in BROKEN.items():
        write(root / "roses" / name)
    cmyk_jpeg(root / "roses" / "UPPER.JPEG")
    (root / "daisy" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root / "roses" / "notes.txt").write_text("downloaded from ...\n")
    (root / "empty_class").mkdir()
    make_image_folder(base / "elsewhere", per_class=6, classes=("tulips",))
    os.symlink(base / "elsewhere" / "tulips", root / "tulips", target_is_directory=True)
    make_image_folder(root, per_class=2, classes=("tiny",))
    return root


def classes_of(run_dir):
    return list(json.loads((run_dir / "class_indices.json").read_text()).values())


def skip_warnings(text):
    return [line for line in text.splitlines() if "skipping unreadable image" in line]


@pytest.fixture(scope="module")
def messy(tmp_path_factory):
    base = tmp_path_factory.mktemp("messy")
    root = make_messy_folder(base)
    run_dir = base / "run"
    code, out, err = call_main(train.main, FAST_ARGS + ["--data-path", root, "--output-dir", run_dir])
    return {"code": code, "out": out, "err": err, "text": out + err, "root": root, "run": run_dir}


def test_messy_folder_trains_to_the_end_and_counts_bad_images(messy):
    assert messy["code"] == 0, messy["text"][-3000:]
    lines = read_metrics(messy["run"])
    assert len(lines) == 1 and lines[0]["bad_images"] == len(BROKEN)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_unreadable_file_is_warned_once_with_its_path(messy, name):
    path = str(messy["root"] / "roses" / name)
    assert len([w for w in skip_warnings(messy["text"]) if f"'{path}'" in w]) == 1, messy["text"][-3000:]


def test_decompression_bomb_names_the_file_and_the_limit(messy):
    (warning,) = [w for w in skip_warnings(messy["text"]) if "bomb.png" in w]
    assert "100000x100000" in warning and "data.max_image_pixels" in warning


def test_every_image_mode_and_upper_case_extension_trains_as_rgb(messy):
    # 30 images found (so UPPER.JPEG counts), 4 classes, and none of the mode files was skipped.
    assert "25 train / 5 val images, 4 classes" in messy["text"]
    assert not [w for w in skip_warnings(messy["text"]) if any(m in w for m in [*GOOD_MODES, "UPPER.JPEG"])]


def test_16_bit_png_becomes_mid_grey_not_white(tmp_path):
    gray16_png(tmp_path / "g.png", value=30000)
    assert load_rgb(tmp_path / "g.png").getpixel((3, 3)) == (117, 117, 117)  # 30000 >> 8


def test_symlinked_class_folder_is_a_class(messy):
    assert "tulips" in classes_of(messy["run"])


def test_hidden_and_non_image_files_are_ignored_and_counted(messy):
    assert "ignored 2 file(s)" in messy["err"] and "(1 hidden)" in messy["err"]


def test_class_folder_without_images_is_skipped_with_a_warning(messy):
    assert "empty_class' holds no images" in messy["err"]
    assert classes_of(messy["run"]) == ["daisy", "roses", "tiny", "tulips"]


def test_val_rate_leaving_a_class_no_val_image_warns(messy):
    assert "class 'tiny' has 2 image(s): data.val_rate=0.2 leaves it no validation image" in messy["err"]


def test_verify_lists_bad_images_before_training_and_skips_them(messy, tmp_path):
    code, out, err = call_main(train.main, FAST_ARGS + ["--data-path", messy["root"], "--output-dir",
                                                        tmp_path / "run", "data.verify=true"])
    assert code == 0, (out + err)[-3000:]
    assert "verify: 30 images checked, 4 unreadable (skipped)" in out
    for name in BROKEN:
        assert len([line for line in err.splitlines() if line.startswith("warning: verify:") and name in line]) == 1
    assert not skip_warnings(out + err)  # removed up front, never met while training
    train_n, val_n = map(int, re.search(r"(\d+) train / (\d+) val images", out).groups())
    assert train_n + val_n == 30 - len(BROKEN)
    assert read_metrics(tmp_path / "run")[0]["bad_images"] == len(BROKEN)


def test_verify_with_bad_image_error_stops_before_training(messy, tmp_path):
    code, out, err = call_main(train.main, FAST_ARGS + ["--data-path", messy["root"], "--output-dir",
                                                        tmp_path / "run", "data.verify=true", "data.bad_image=error"])
    line = error_line(code, out, err, 1)
    assert "data.verify found 4 unreadable image(s)" in line
    assert not (tmp_path / "run").exists()


def test_bad_image_error_stops_naming_the_file(tmp_path):
    root = make_image_folder(tmp_path / "flowers", per_class=6, classes=("daisy", "roses"))
    truncated_jpeg(root / "roses" / "cut.jpg")
    code, out, err = call_main(train.main, FAST_ARGS + ["--data-path", root, "--output-dir", tmp_path / "run",
                                                        "data.bad_image=error"])
    line = error_line(code, out, err, 1)
    assert f"'{root / 'roses' / 'cut.jpg'}'" in line and "truncated" in line
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


def test_bad_image_error_from_a_loader_worker_is_one_line(tmp_path):
    """Raised in a DataLoader worker, the error crosses a process boundary: still one line, exit 1."""
    root = make_image_folder(tmp_path / "flowers", per_class=6, classes=("daisy", "roses"))
    (root / "daisy" / "page.jpg").write_text("<html>")
    code, out, err = call_main(train.main, FAST_ARGS + ["--data-path", root, "--output-dir", tmp_path / "run",
                                                        "data.bad_image=error", "data.num_workers=1"])
    line = error_line(code, out, err, 1)
    assert f"cannot decode '{root / 'daisy' / 'page.jpg'}'" in line
    assert "DataLoader worker" not in line


# -- fatal data problems: exit 2 before any training, the earlier run left as it was -----------

def _no_val_for_training(root):
    make_image_folder(root, per_class=1, classes=("lonely",))
    return ["data.val_rate=0.6"]


FATAL = {
    "root_missing": (lambda root: ["--data-path", root / "nope"], "does not exist"),
    "root_empty": (lambda root: [], "holds 0 class folder(s)"),
    "images_but_no_class_folders": (lambda root: cmyk_jpeg(root / "a.jpg") or [], "no class folders"),
    "only_one_class": (lambda root: make_image_folder(root, 6, ("daisy",)) and [], "holds 1 class folder"),
    "val_rate_leaves_no_train_image": (
        lambda root: make_image_folder(root, 6, ("daisy", "roses")) and _no_val_for_training(root),
        "class 'lonely' has 1 image(s) and data.val_rate=0.6 puts all of them in validation"),
}


@pytest.mark.parametrize("case", sorted(FATAL))
def test_fatal_data_problem_is_one_line_and_damages_nothing(messy, tmp_path, case):
    setup, needle = FATAL[case]
    root = tmp_path / "data"
    root.mkdir()
    extra = setup(root)
    before = tree_hash(messy["run"])
    code, out, err = call_main(train.main, FAST_ARGS + ["--data-path", root, "--output-dir", messy["run"],
                                                        *extra])
    assert needle in error_line(code, out, err, 2)
    assert tree_hash(messy["run"]) == before
