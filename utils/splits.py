"""The split rule: which images train and which validate, for class folders and label files alike.

    data.folds = 0   each class's data.val_rate share is val, drawn by one generator seeded with data.split_seed
                     and walked over the classes in order
    data.folds = K   fold data.fold of K is val, the other folds train: scikit-learn's StratifiedKFold seeded by
                     data.split_seed, or its StratifiedGroupKFold when a label file has a `group` column (a patient,
                     a plant, a video lies in one fold only; a row without a group is a group of its own)

    python train.py --config configs/demo.yaml data.folds=5 data.fold=2 --output-dir runs/cv/fold_2

Both rules see the rows in path order, so the split depends on the images alone: the same on every rank (rank 0
splits, data.shared_split), in every run, and whether class folders or a label file list the images. A multi-label
row is split with its rarest label (fewest rows; ties: the first class), so a rare label still gets its share of
validation. Per class the folds differ by at most one image. The global RNG is never touched.
"""
import os
import warnings

import numpy as np
import torch

from utils.errors import UserError
from utils.sample_list import SampleList

SPLITS = ("train", "val", "test")  # a label file's split column, and a root's train/ val/ test/ folders


def split_samples(samples, classes, data_cfg, groups=None, warn=None):
    """(train, val) SampleLists of `samples` ((path, label) pairs or a SampleList) by the data section's rule:
    data.folds' fold data.fold, else data.val_rate's share of each class. groups: a label file's group per row."""
    samples = samples if isinstance(samples, SampleList) else SampleList(samples)
    if data_cfg.folds:
        return fold_split(samples, classes, data_cfg.folds, data_cfg.fold, data_cfg.split_seed, groups, warn)
    train, val = seeded_split(samples, classes, data_cfg.split_seed,
                              lambda name, n: val_count(name, n, data_cfg.val_rate, warn))
    return samples.take(train), samples.take(val)


def seeded_split(samples, classes, seed, count):
    """(train rows, val rows): per class, the rows in path order shuffled by one generator seeded with `seed`
    over the classes in order; the first count(name, n) of a class's n shuffled rows go to validation."""
    key = stratum(samples, len(classes))
    by_path = path_order(samples)
    order = by_path[np.argsort(key[by_path], kind="stable")]
    bounds = np.searchsorted(key[order], np.arange(len(classes) + 1))
    gen = torch.Generator().manual_seed(seed)
    train, val = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for label, name in enumerate(classes):
        rows = order[bounds[label]:bounds[label + 1]]
        if not len(rows):
            continue  # a label only ever second to a rarer one
        perm = torch.randperm(len(rows), generator=gen).numpy()
        n_val = count(name, len(rows))
        val.append(rows[perm[:n_val]])
        train.append(rows[perm[n_val:]])
    return np.concatenate(train), np.concatenate(val)


def val_count(name, n, val_rate, warn=None):
    """How many of a class's n images go to validation; none left for training is refused."""
    n_val = int(round(n * val_rate))
    if n_val == n:
        raise UserError(f"class '{name}' has {n} image(s) and data.val_rate={val_rate} "
                        "puts all of them in validation, none in training; lower data.val_rate "
                        "or add images")
    if n_val == 0 and val_rate > 0 and warn is not None:
        warn(f"class '{name}' has {n} image(s): data.val_rate={val_rate} leaves it "
             "no validation image, so val_acc does not measure it")
    return n_val


def fold_split(samples, classes, folds, fold, seed, groups=None, warn=None):
    """(train, val) samples: fold `fold` of `folds` of `samples` is the validation set, the other folds train."""
    # Imported here: only a run with data.folds pays for scikit-learn.
    from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold

    samples = samples if isinstance(samples, SampleList) else SampleList(samples)
    order = path_order(samples)
    y = stratum(samples, len(classes))[order]
    if groups is None:
        splitter, extra = StratifiedKFold(folds, shuffle=True, random_state=seed % 2**32), ()
    else:
        # Groups compare as text (JSON Lines may mix numbers and names); an empty one is the row's own.
        named = [f"\0row {r}" if groups[r] in (None, "") else str(groups[r]) for r in order]
        splitter, extra = StratifiedGroupKFold(folds, shuffle=True, random_state=seed % 2**32), (named,)
        if len(set(named)) < folds:
            raise UserError(f"data.folds={folds}, but the label file's group column names {len(set(named))} "
                            "group(s); each fold needs at least one: lower data.folds")
    if len(samples) < folds:
        raise UserError(f"data.folds={folds} needs at least {folds} images, the data has {len(samples)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the least populated class has only n members": said below, in one line
        for i, (train, val) in enumerate(splitter.split(np.zeros(len(y)), y, *extra)):
            if i == fold:
                break
    counts = np.bincount(y, minlength=len(classes))
    few = np.flatnonzero((counts > 0) & (counts < folds))
    if len(few) and warn is not None:
        warn(f"data.folds={folds}: {len(few)} class(es) have fewer images than folds, e.g. "
             f"'{classes[few[0]]}' ({counts[few[0]]}); some folds validate none of their images")
    return samples.take(np.sort(order[train])), samples.take(np.sort(order[val]))


def refuse_fixed_split(data_cfg, source, fix):
    """data.folds makes the split; data whose split is already made (`source`) is refused in one line."""
    if data_cfg.folds:
        raise UserError(f"data.folds={data_cfg.folds} makes its own split, but {source}, which fixes one; {fix}, "
                        "or set data.folds=0")


def stratum(samples, n_classes):
    """The class each row is split by: its label or, multi-label, its rarest label (fewest rows; ties:
    the first class)."""
    if not samples.multilabel:
        return samples.labels
    counts = np.bincount(samples.label_values, minlength=n_classes)
    # Each row's rarest label: the smallest (row count, class index) among its labels.
    score = counts[samples.label_values] * n_classes + samples.label_values
    rows = np.repeat(np.arange(len(samples)), np.diff(samples.label_offsets))
    best = np.full(len(samples), np.iinfo(np.int64).max)
    np.minimum.at(best, rows, score)
    return best % n_classes


def path_order(samples):
    """The rows sorted by path, as sorted() sorts the path strings: a split made in this order depends on the
    images, not on a file's row order or the filesystem's."""
    try:
        samples.paths.tobytes().decode("utf-8")
    except UnicodeDecodeError:
        # A name that is not UTF-8 decodes to surrogates, which sort as strings do not as bytes: the slow way.
        names = [os.fsdecode(samples.paths[a:b].tobytes()) for a, b in zip(samples.offsets[:-1], samples.offsets[1:])]
        return np.array(sorted(range(len(names)), key=names.__getitem__), dtype=np.int64)
    # UTF-8 bytes sort as their strings do: a fixed-width bytes array sorts without a str per row.
    lengths = np.diff(samples.offsets)
    width = max(int(lengths.max(initial=0)), 1)
    grid = np.zeros((len(samples), width), dtype=np.uint8)
    grid[np.arange(width) < lengths[:, None]] = samples.paths
    return np.argsort(grid.view(f"S{width}").ravel(), kind="stable")
