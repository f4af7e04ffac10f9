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
from conftest import FAST_ARGS, make_image_folder, run_entry

import data
from utils.config import load_config
from utils.errors import UserError


def write_csv(path, rows, header="path,label"):
    path.write_text(header + "\n" + "".join(",".join(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Five classes x 6 images, their folder split, and label files listing the same images."""
    base = tmp_path_factory.mktemp("labels")
    root = make_image_folder(base / "flowers")
    folders = data.split_dataset(root)
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    listed = [(rel(p), folders.classes[c]) for p, c in folders.train + folders.val]
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
        split = data.split_dataset(images["root"], labels=file)
        assert split.classes == folders.classes
        assert list(split.train) == folders.train and list(split.val) == folders.val
        assert not split.multilabel and len(split.test) == 0


def test_split_column_fixes_the_split(images, tmp_path):
    rows = [(p, c, ("val", "train", "train", "test")[i % 4]) for i, (p, c) in enumerate(images["listed"])]
    file = write_csv(tmp_path / "s.csv", rows, "path,label,split")
    for seed in (0, 1):  # data.split_seed and data.val_rate play no part
        split = data.split_dataset(images["root"], val_rate=0.5, split_seed=seed, labels=file)
        for part, name in ((split.train, "train"), (split.val, "val"), (split.test, "test")):
            want = [(str(images["root"] / p), split.classes.index(c)) for p, c, s in rows if s == name]
            assert list(part) == want, name


def test_multilabel_contract(images, tmp_path):
    """Rows naming several labels: Split.multilabel, CSR samples, multi-hot float32 targets in batches."""
    rows = [(p, f"{c};roses" if i % 3 == 0 else c) for i, (p, c) in enumerate(images["listed"])]
    file = write_csv(tmp_path / "m.csv", rows)
    split = data.split_dataset(images["root"], labels=file)
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
    assert data.split_dataset(images["root"], labels=images["csv"], task="multi").train[0][1] == (
        data.split_dataset(images["root"], labels=images["csv"]).train[0][1],)
    several = sum(len(set(c.split(";"))) > 1 for _, c in rows)
    refusal = rf"data.task=single, but {several} row\(s\) .* name several labels, e.g. line 2"
    with pytest.raises(UserError, match=refusal):
        data.split_dataset(images["root"], labels=file, task="single")


def test_label_file_run_equals_folder_run(images):
    """train.py on a label file listing the folder split gives the class-folder run's numbers."""
    runs = {}
    for name, extra in (("folders", []), ("file", [f"data.labels={images['fixed']}"])):
        proc = run_entry("train.py", *FAST_ARGS, "--data-path", images["root"], *extra,
                         "--output-dir", images["base"] / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = [json.loads(line) for line in (images["base"] / name / "metrics.jsonl").read_text().splitlines()]
        indices = json.loads((images["base"] / name / "class_indices.json").read_text())
        assert indices == {str(i): c for i, c in enumerate(images["folders"].classes)}
    last = [{k: r[-1][k] for k in ("val_acc", "val_loss", "train_loss")} for r in runs.values()]
    assert last[0] == last[1]
