"""data.labels: a CSV or JSON Lines label file instead of class folders, multi-label samples, bad label files.

The data side only: the split a file gives, the samples and targets the datasets hold, the runs of the
real entry scripts on a label file, and the one-line refusals of bad files.
"""
import json
import os
import random

import numpy as np
import pytest
import torch
from bad_files import call_main
from conftest import FAST_ARGS, make_image_folder

import data
import train
from utils.config import load_config
from utils.errors import UserError
from utils.run_dir import read_metrics


def split_of(root, **kw):
    """data.split_dataset of the data section data.path=root with the data keys given."""
    return data.split_dataset(load_config([f"data.path={root}", *(f"data.{k}={v}" for k, v in kw.items())]).data)


def write_csv(path, rows, header="path,label"):
    path.write_text(header + "\n" + "".join(",".join(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Five classes x 6 images, their folder split, and label files listing the same images."""
    base = tmp_path_factory.mktemp("labels")
    root = make_image_folder(base / "flowers")
    folders = split_of(root)
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    listed = [(rel(p), folders.classes[c]) for p, c in [*folders.train, *folders.val]]
    random.Random(0).shuffle(listed)  # not in the folders' order
    csv = write_csv(base / "labels.csv", listed)
    jsonl = base / "labels.jsonl"
    jsonl.write_text("".join(json.dumps({"path": p, "label": c}) + "\n" for p, c in listed))
    # The folder split written down, in its order, as a split column.
    fixed = write_csv(base / "fixed.csv", [(rel(p), folders.classes[c], part) for part in ("train", "val")
                                           for p, c in getattr(folders, part)], "path,label,split")
    return dict(base=base, root=root, folders=folders, listed=listed, csv=csv, jsonl=jsonl, fixed=fixed)


def test_csv_and_jsonl_read_to_the_folder_split(images):
    """Without a split column a label file is split as its folders would be: same images, same split."""
    folders = images["folders"]
    for file in (images["csv"], images["jsonl"]):
        split = split_of(images["root"], labels=file)
        assert split.classes == folders.classes
        assert list(split.train) == list(folders.train) and list(split.val) == list(folders.val)
        assert not split.multilabel and len(split.test) == 0


def test_split_column_fixes_the_split(images, tmp_path):
    rows = [(p, c, ("val", "train", "train", "test")[i % 4]) for i, (p, c) in enumerate(images["listed"])]
    file = write_csv(tmp_path / "s.csv", rows, "path,label,split")
    for seed in (0, 1):  # data.split_seed and data.val_rate play no part
        split = split_of(images["root"], val_rate=0.5, split_seed=seed, labels=file)
        for part, name in ((split.train, "train"), (split.val, "val"), (split.test, "test")):
            want = [(str(images["root"] / p), split.classes.index(c)) for p, c, s in rows if s == name]
            assert list(part) == want, name


def test_multilabel_contract(images, tmp_path):
    """Rows naming several labels: Split.multilabel, CSR samples, multi-hot float32 targets in batches."""
    rows = [(p, f"{c};roses" if i % 3 == 0 else c) for i, (p, c) in enumerate(images["listed"])]
    file = write_csv(tmp_path / "m.csv", rows)
    split = split_of(images["root"], labels=file)
    assert split.multilabel
    roses = split.classes.index("roses")
    want = {str(images["root"] / p): tuple(sorted({split.classes.index(n) for n in c.split(";")})) for p, c in rows}
    got = dict(list(split.train) + list(split.val))
    assert got == want
    assert len(split.train) + len(split.val) == len(rows)
    samples = split.train
    assert samples.multilabel and samples.label_offsets.dtype == np.int64 and len(samples.label_offsets) == 26
    assert np.bincount(samples.label_values, minlength=5)[roses] == sum(roses in t for _, t in samples)
    cfg = load_config(["--data-path", str(images["root"]), f"data.labels={file}", "data.img_size=32",
                       "data.val_resize=36"])
    train_set, val_set, classes = data.build_datasets(cfg.data)
    assert train_set.multilabel and val_set.multilabel and train_set.num_classes == 5
    loader = torch.utils.data.DataLoader(train_set, batch_size=4, collate_fn=data.collate)
    images_, target = next(iter(loader))
    assert target.dtype == torch.float32 and target.shape == (4, 5)
    first = [train_set.samples[i][1] for i in range(4)]
    assert target.tolist() == [[float(c in t) for c in range(5)] for t in first]
    # data.task: multi forces it on a single-label file; single refuses a multi-label one in one line.
    assert split_of(images["root"], labels=images["csv"], task="multi").train[0][1] == (
        split_of(images["root"], labels=images["csv"]).train[0][1],)
    several = sum(len(set(c.split(";"))) > 1 for _, c in rows)
    refusal = rf"data.task=single, but {several} row\(s\) .* name several labels, e.g. line 2"
    with pytest.raises(UserError, match=refusal):
        split_of(images["root"], labels=file, task="single")


@pytest.fixture(scope="module")
def runs(images):
    """train.py on the class folders, and on fixed.csv: the folder split written down, with each val
    image listed three times as a `test` row (15 rows). Both in this process: the numbers are the point."""
    rows = images["fixed"].read_text(encoding="utf-8").splitlines()
    test = [r.replace(",val", ",test") for r in rows if r.endswith(",val")] * 3
    images["fixed"].write_text("\n".join(rows + test) + "\n", encoding="utf-8")
    out = {}
    for name, extra in (("folders", []), ("file", [f"data.labels={images['fixed']}"])):
        code, _, err = call_main(train.main, [*FAST_ARGS, "--data-path", images["root"], *extra,
                                              "--output-dir", images["base"] / name])
        assert code == 0, err[-3000:]
        out[name] = images["base"] / name
    return out


def test_label_file_run_equals_folder_run(images, runs):
    """A label file listing the folder split gives the class-folder run's numbers, and the same class_indices.json."""
    last = [{k: read_metrics(runs[name])[-1][k] for k in ("val_acc", "val_loss", "train_loss")}
            for name in ("folders", "file")]
    assert last[0] == last[1]
    for name in ("folders", "file"):
        indices = json.loads((runs[name] / "class_indices.json").read_text())
        assert indices == {str(i): c for i, c in enumerate(images["folders"].classes)}


def test_eval_only_on_test_rows(images, runs):
    """--eval-only evaluates the file's test rows, each counted once."""
    out = images["base"] / "eval"
    train.main([*map(str, FAST_ARGS), "--data-path", str(images["root"]), f"data.labels={images['fixed']}",
                "--eval-only", "--resume", str(runs["file"] / "checkpoints" / "best.pt"), "--output-dir", str(out)])
    result = json.loads((out / "eval.json").read_text())
    assert result["split"] == "test" and result["val_count"] == 15
    assert [sum(row) for row in result["val_confusion"]] == [3] * 5
    assert result["val_acc"] == read_metrics(runs["file"])[-1]["val_acc"]  # the val images, each thrice


# --------------------------------------------------------------------------- bad label files

def _bad(images, tmp_path, text=None, raw=None, name="bad.csv"):
    file = tmp_path / name
    file.write_bytes(raw if raw is not None else text.format(**_names(images)).encode("utf-8"))
    return file


def _names(images):
    (p0, c0), (p1, c1) = images["listed"][:2]
    return dict(p0=p0, c0=c0, p1=p1, c1=c1)


BAD_FILES = {
    "no header": ("{p0},{c0}\n{p1},{c1}\n", r"has no header row naming a 'path' and a 'label' column"),
    "no path column": ("file,label\n{p0},{c0}\n", r"has no header row naming a 'path' and a 'label' column"),
    "missing images": ("path,label\n{p0},{c0}\nnope/1.jpg,x\n{p1},{c1}\nnope/2.jpg,x\nnope/3.jpg,x\nnope/4.jpg,x\n",
                       r": 4 of 6 row\(s\) name an image that does not exist .* e.g. line 3 '.*nope/1.jpg', "
                       r"line 5 '.*nope/2.jpg', line 6 '.*nope/3.jpg'$"),
    "too few fields": ("path,label,split\n{p0},{c0},train\n{p1},{c1}\n", r"line 3 has 2 field\(s\), the header 3$"),
    "empty label": ("path,label\n{p0},{c0}\n{p1}, \n", r": 1 row\(s\) have an empty path or label, e.g. line 3;"),
    "empty label in a list": ("path,label\n{p0},{c0};\n", r": 1 row\(s\) have an empty path or label, e.g. line 2;"),
    "unknown split": ("path,label,split\n{p0},{c0},train\n{p1},{c1},valid\n",
                      r"line 3: unknown split 'valid' \(1 row\(s\) like it\); the split column takes train, val, test"),
    "duplicate path": ("path,label\n{p0},{c0}\n{p1},{c1}\n{p0},{c1}\n",
                       r"lists '.*' on line 2 and again on line 4 with other labels \(1 such row\(s\)\)"),
    "not UTF-8": (None, r"is not UTF-8 text \(line 2, byte 20: b'\\xe9'\); save it as UTF-8"),
    "bad JSON line": ('{{"path": "{p0}", "label": "{c0}"}}\n{{"path": "{p1}"\n', r"line 2 is not JSON"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_label_file_is_one_error_line(images, tmp_path, case):
    text, message = BAD_FILES[case]
    raw = "path,label\ndaisy/caf\u00e9.jpg,daisy\n".encode("latin-1") if text is None else None
    file = _bad(images, tmp_path, text, raw, "bad.jsonl" if "JSON" in case else "bad.csv")
    with pytest.raises(UserError, match=message) as e:
        split_of(images["root"], labels=file)
    assert "\n" not in str(e.value)


def test_bad_label_file_stops_the_real_script(images, tmp_path, capsys):
    """The user's view, train.py's main: one error: line, exit 2, no run directory made."""
    file = _bad(images, tmp_path, BAD_FILES["missing images"][0])
    with pytest.raises(SystemExit) as e:
        train.main([*map(str, FAST_ARGS), "--data-path", str(images["root"]), f"data.labels={file}",
                    "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert e.value.code == 2 and len(errors) == 1, err
    assert "4 of 6 row(s) name an image that does not exist" in errors[0]
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_labels_unseen_in_train_are_warned(images, tmp_path, capsys):
    names = _names(images)
    rows = [(p, c, "train") for p, c in images["listed"][2:] if c not in (names["c0"], names["c1"])]
    rows += [(names["p0"], names["c0"], "val"), (names["p1"], f"{names['c1']};zèbre 斑马", "test")]
    split = split_of(images["root"], labels=write_csv(tmp_path / "w.csv", rows, "path,label,split"))
    assert split.classes[-1] == "zèbre 斑马" and split.multilabel  # kept as written
    err = capsys.readouterr().err
    assert f"1 label(s) are in val but never in train, e.g. '{names['c0']}'" in err
    assert f"2 label(s) have no positive in train, e.g. '{names['c1']}', 'zèbre 斑马'" in err


def test_pipelines(images, tmp_path):
    """data.pipeline=gpu takes a single-label label file (on CPU here); the balanced sampler and the gpu
    pipeline refuse multi-label data in one line each."""
    from utils.gpu_pipeline import GpuLoader
    from utils.samplers import ShardSampler, epoch_sampler
    cpu, sizes = torch.device("cpu"), ["data.img_size=32", "data.val_resize=36", "data.pipeline=gpu"]
    cfg = load_config(["--data-path", str(images["root"]), f"data.labels={images['csv']}", *sizes])
    _, val_set, _ = data.build_datasets(cfg.data)
    loader = data.make_loader(val_set, 4, ShardSampler(val_set), cfg.data, cpu, train=False)
    assert isinstance(loader, GpuLoader)
    assert torch.cat([y for _, y in loader]).tolist() == [c for _, c in images["folders"].val]
    rows = [(p, f"{c};roses") for p, c in images["listed"]]
    cfg = load_config(["--data-path", str(images["root"]), f"data.labels={write_csv(tmp_path / 'm.csv', rows)}",
                       *sizes])
    train_set, _, _ = data.build_datasets(cfg.data)
    with pytest.raises(UserError, match=r"^data.sampler=balanced draws each class equally often, .* "
                                        r"use data.sampler=shuffle$"):
        epoch_sampler(train_set, 0, kind="balanced")
    with pytest.raises(UserError, match=r"^data.pipeline=gpu takes single-label data only"):
        data.make_loader(train_set, 4, epoch_sampler(train_set, 0), cfg.data, cpu, train=True)
