"""data.folds / data.fold: stratified k-fold cross-validation, fold i of K the validation set.

    python tools/kfold.py --folds 5 --dir runs/cv -- python train.py --config configs/demo.yaml
    python train.py --config configs/demo.yaml data.folds=5 data.fold=2 --output-dir runs/cv/fold_2

scikit-learn's StratifiedKFold, seeded by data.split_seed: the folds are disjoint and cover the
images, and per class they differ by at most one image. With a label file's `group` column its
StratifiedGroupKFold: a group (a patient, a plant, a video) lies in one fold only, and the classes
are spread as evenly as whole groups allow; a row without a group is a group of its own.
Multi-label rows are stratified by their rarest label, as the data.val_rate split is. The rows
are put in path order first, so the folds depend on the images alone, the same on every rank
(rank 0 splits, data.shared_split) and in every run.
"""
import warnings

import numpy as np

from utils.errors import UserError
from utils.label_file import path_order, stratum
from utils.sample_list import SampleList


def fold_split(samples, classes, folds, fold, seed, groups=None, warn=None):
    """(train, val) samples: fold `fold` of `folds` of `samples` ((path, label) pairs or a SampleList)
    is the validation set, the other folds the training set."""
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


def refuse_fixed_split(folds, source, fix):
    """data.folds makes the split; data whose split is already made (`source`) is refused in one line."""
    raise UserError(f"data.folds={folds} makes its own split, but {source}, which fixes one; {fix}, "
                    "or set data.folds=0")
