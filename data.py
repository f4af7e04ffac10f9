"""Image folders -> the split, transforms, datasets and loaders: what to change for your data.

Read top to bottom, each part is one thing you may change:

    split_dataset     which images are training and which validation (data.val_rate or data.folds, data.split_seed)
    build_transforms  the augmentation: add yours to `train` after the crop
    build_datasets    the datasets the training reads (ImageList: (path, label) -> (image, label))
    make_loader       workers, batching and the input path (data.num_workers, data.pipeline)

The file closes with how the folders are read (is_image_file, hidden files, empty class folders).
The machinery they stand on is in utils/: decoding.py (a JPEG decoded only as large as the crop
needs), sample_list.py (samples forked workers share), samplers.py (each epoch's order),
loader.py (persistent workers reseeded per epoch) and gpu_pipeline.py (data.pipeline=gpu).

Two layouts are accepted under `data.path`:

    flower_photos/daisy/*.jpg, flower_photos/roses/*.jpg, ...        split here by data.val_rate
    root/train/daisy/*.jpg ... and root/val/daisy/*.jpg ...           split already made
    root/train/, root/val/ and root/test/                              test/ is what --eval-only evaluates

or a label file (data.labels, utils/label_file.py) lists the images under `data.path` and their labels,
one or several per image, with an optional split column (train/val/test) that fixes the split;
or data.shards names tar shards that tools/make_shards.py packed from either, in a folder or at an
http(s):// or s3:// URL (utils/shards.py, docs/shards.md): the same images, the same split, read by index.

The split rule, for folders and label files alike, is utils/splits.py's: per class, by its own seeded
generator (or data.folds' stratified folds), so it is the same on every rank and every run, the same for
folders and a label file that lists the same images, and it never touches the global RNG.

Real folders are messy. Hidden and non-image files are ignored (and counted);
a class folder without images is skipped with a warning. An image that cannot
be decoded (zero bytes, truncated, not an image, over data.max_image_pixels)
is replaced by the next readable one, warned about once with its path and
counted as `bad_images` in metrics.jsonl; data.bad_image=error stops instead,
and data.verify=true decodes every image once before training.
"""
import functools
import os
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from model import use_channels_last
from utils.config import config_to_dict, load_config
from utils.decoding import MODES, BadImage, DraftRandomResizedCrop, DraftResize, load_image
from utils.distributed_utils import broadcast_object, gather_objects, get_rank, is_main_process
from utils.errors import RUNTIME_EXIT, BadImageError, UserError
from utils.gpu_pipeline import GpuLoader, resolve_pipeline
from utils.label_file import read_label_file
from utils.loader import PREFETCH_FACTOR, PersistentLoader, collate, reseed_worker
from utils.normalization import IMAGENET_MEAN, IMAGENET_STD, imagenet_stats, normalize  # noqa: F401 (data.IMAGENET_*)
from utils.sample_list import BadStatus, SampleList, verify_images
from utils.shards import ShardReader, read_index
from utils.splits import SPLITS, refuse_fixed_split, seeded_split, split_samples

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


# --------------------------------------------------------------------------- the split

@dataclass
class Split:
    classes: list          # index -> class name, sorted
    train: SampleList      # (path, label) pairs
    val: SampleList
    ignored: list = field(default_factory=list)   # hidden and non-image files found under the root
    test: SampleList = field(default_factory=SampleList)  # root/test/ or a label file's test rows: for --eval-only
    multilabel: bool = False  # samples are (path, sorted tuple of class indices): data.labels, data.task
    shards: object = None  # data.shards: a utils.shards.ShardReader, and the samples' paths are the shards' own
    rows: dict = field(default_factory=dict)  # data.shards: per part (train/val/test), each sample's row in the shards


def split_dataset(data_cfg):
    """The data section -> Split: the class folders under data.path, or the label file data.labels, split
    into train and val by data.val_rate or data.folds (utils/splits.py), as data.task says (auto, single
    or multi-label). No collectives: see shared_split."""
    if data_cfg.shards:
        return _shard_split(data_cfg)
    if data_cfg.labels:
        return _label_file_split(data_cfg)
    _walk.cache_clear()
    root = Path(data_cfg.path)
    if not root.is_dir():
        raise UserError(f"data path '{root}' does not exist or is not a folder; "
                        "set --data-path (the offline demo set: python demo/flowers.py data/demo_flowers)")
    top = _class_dirs(root)
    # Hidden files beside the class folders (.DS_Store, the demo set's .complete marker) are no one's
    # mistake; files inside class folders are counted below, hidden or not.
    ignored = [str(root / f) for f in os.listdir(root) if (root / f).is_file() and not f.startswith(".")]
    if top in (["train", "val"], ["test", "train", "val"]):
        refuse_fixed_split(data_cfg, f"'{root}' holds train/ and val/", "point data.path at the class folders")
        for other in top[:-2] + ["val"]:
            if _class_dirs(root / other) != _class_dirs(root / "train"):
                raise UserError(f"'{root}/train' and '{root}/{other}' must hold the same class folders")
        classes = _non_empty_classes(root / "train", _class_dirs(root / "train"))
        split = Split(classes, *(_scan(root / part, classes, ignored) for part in SPLITS[:2]))
        if "test" in top:
            split.test = _scan(root / "test", classes, ignored)
    else:
        classes = _non_empty_classes(root, top)
        samples = _scan(root, classes, ignored)
        if data_cfg.folds:
            # Folders reach their folds in the seeded per-class order, as they always have: runs resume on it.
            samples = samples.take(seeded_split(samples, classes, data_cfg.split_seed, lambda name, n: 0)[0])
        split = Split(classes, *split_samples(samples, classes, data_cfg, warn=warn))
    if not classes and ignored:
        raise UserError(f"data path '{root}' holds files but no class folders; put each class's "
                        "images in its own sub-folder (flower_photos/daisy/*.jpg, ...)")
    if len(classes) < 2:
        raise UserError(f"data path '{root}' holds {len(classes)} class folder(s) with images; "
                        "a classifier needs at least 2 (one sub-folder of images per class)")
    if not len(split.train):
        raise UserError(f"no training images (.jpg/.jpeg/.png) found under '{root}'")
    split.ignored = ignored
    if ignored:
        hidden = sum(os.path.basename(p).startswith(".") for p in ignored)
        warn(f"ignored {len(ignored)} file(s) under '{root}' that are not images "
             f"({hidden} hidden), e.g. '{ignored[0]}'")
    _walk.cache_clear()
    if data_cfg.task == "multi":  # class folders trained as multi-label: one label per image
        split.multilabel = True
        for part in SPLITS:
            setattr(split, part, getattr(split, part).as_multilabel())
    return split


def _label_file_split(data_cfg):
    """data.labels -> Split. The file's split column fixes the split; without one, the rows are split by
    the rule folders are (utils/splits.py: the same images give the same split)."""
    labels = data_cfg.labels
    table = read_label_file(labels, data_cfg.path)
    if data_cfg.task == "single" and table.multi_rows:
        first = int(np.flatnonzero(np.diff(table.samples.label_offsets) > 1)[0])
        raise UserError(f"data.task=single, but {table.multi_rows} row(s) of data.labels '{labels}' name several "
                        f"labels, e.g. line {table.lines[first]}; set data.task=multi (or auto), or give one "
                        "label per row")
    samples, classes = table.samples, table.classes
    multilabel = table.multilabel or data_cfg.task == "multi"
    if multilabel:
        samples = samples.as_multilabel()
    if len(classes) < (1 if multilabel else 2):
        raise UserError(f"data.labels '{labels}' names {len(classes)} class(es); a classifier needs at least 2")
    split = Split(classes, SampleList(), SampleList(), multilabel=multilabel)
    if table.split is not None:
        refuse_fixed_split(data_cfg, f"data.labels '{labels}' has a split column", "drop the column")
        for code, part in enumerate(SPLITS):
            setattr(split, part, samples.take(np.flatnonzero(table.split == code)))
        if not len(split.val):
            raise UserError(f"data.labels '{labels}' has a split column but no 'val' row; mark some rows val")
    else:
        split.train, split.val = split_samples(samples, classes, data_cfg, table.groups, warn)
    if not len(split.train):
        raise UserError(f"data.labels '{labels}' has no training rows")
    _warn_unseen_labels(split, labels)
    return split


def _shard_split(data_cfg):
    """data.shards -> Split: the shards' split field fixes the split; without one, the rows are split by the rule
    folders and label files are (utils/splits.py), on the paths they were packed from: the same split."""
    where = data_cfg.shards
    if data_cfg.labels:
        raise UserError(f"data.shards and data.labels both name the data; the shards '{where}' carry their labels: "
                        "set data.labels=null (or data.shards=null)")
    index, rows = read_index(where, data_cfg.shard_retries)
    classes, multilabel = index["classes"], index["multilabel"]
    paths = [r["path"] for r in rows]
    if multilabel:
        counts = [len(r["label"]) for r in rows]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        samples = SampleList.from_arrays(paths, label_offsets=offsets,
                                         label_values=[v for r in rows for v in r["label"]])
        if data_cfg.task == "single":
            raise UserError(f"data.task=single, but the images of data.shards '{where}' are multi-label; "
                            "set data.task=multi (or auto)")
    else:
        samples = SampleList.from_arrays(paths, labels=[r["label"] for r in rows])
    if multilabel or data_cfg.task == "multi":
        samples = samples.as_multilabel()
    codes = np.array([SPLITS.index(r["split"]) if r.get("split") else -1 for r in rows], dtype=np.int64)
    split = Split(classes, SampleList(), SampleList(), multilabel=samples.multilabel,
                  shards=ShardReader(where, index, data_cfg.shard_cache or os.path.join(tempfile.gettempdir(),
                                     "shard_cache"), int(data_cfg.shard_cache_gb * 2**30), data_cfg.shard_retries,
                                     _places(rows)))
    if (codes >= 0).any():
        refuse_fixed_split(data_cfg, f"data.shards '{where}' carry a split", "make the shards from unsplit data")
        for code, part in enumerate(SPLITS):
            split.rows[part] = np.flatnonzero(codes == code)
    else:
        if data_cfg.folds and index.get("source") == "folders":
            # As split_dataset does for folders: their folds are made in the seeded per-class order.
            order = seeded_split(samples, classes, data_cfg.split_seed, lambda name, n: 0)[0]
        else:
            order = np.arange(len(samples))
        groups = [r.get("group") for r in rows]
        groups = [groups[i] for i in order] if any(g is not None for g in groups) else None
        ordered = samples.take(order)
        # Each picked sample's row, found by its path (the paths are unique): bytes, not a tuple per sample.
        at = dict(zip(_path_keys(ordered), range(len(ordered))))
        parts = split_samples(ordered, classes, data_cfg, groups, warn)
        for part, picked in zip(SPLITS, parts):
            split.rows[part] = order[np.fromiter(map(at.__getitem__, _path_keys(picked)), np.int64, len(picked))]
    for part in SPLITS:
        setattr(split, part, samples.take(split.rows.get(part, np.zeros(0, dtype=np.int64))))
    if not len(split.train) or ((codes >= 0).any() and not len(split.val)):
        raise UserError(f"data.shards '{where}' hold {len(split.train)} training and {len(split.val)} validation "
                        "images; a fixed split needs both")
    _warn_unseen_labels(split, f"data.shards '{where}'")
    return split


def _places(rows):
    """(offsets, sizes) of each row's image in its shard, from samples.jsonl; None for shards made without them."""
    if not rows or "offset" not in rows[0]:
        return None
    return (np.fromiter((r["offset"] for r in rows), np.int64, len(rows)),
            np.fromiter((r["size"] for r in rows), np.int64, len(rows)))


def _path_keys(samples):
    """Each sample's path as bytes, straight from the SampleList's arrays."""
    blob, ends = samples.paths.tobytes(), samples.offsets.tolist()
    return [blob[a:b] for a, b in zip(ends[:-1], ends[1:])]


def all_samples(path, labels=None):
    """Every image under `path` (class folders, or a root with train/ val/ [test/]), or each row of the label
    file `labels`, before any split: (SampleList, class names, split per row (an index into SPLITS, -1 = none),
    group per row or None). What tools/make_shards.py packs."""
    if labels:
        table = read_label_file(labels, path)
        codes = table.split.astype(np.int64) if table.split is not None else np.full(len(table.samples), -1)
        return table.samples, table.classes, codes, table.groups
    _walk.cache_clear()
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"'{root}' does not exist or is not a folder")
    top = _class_dirs(root)
    if top in (["train", "val"], ["test", "train", "val"]):
        classes = _non_empty_classes(root / "train", _class_dirs(root / "train"))
        parts = [(code, _scan(root / part, classes, [])) for code, part in enumerate(SPLITS) if part in top]
    else:
        classes = _non_empty_classes(root, top)
        parts = [(-1, _scan(root, classes, []))]
    rows = [(p, label, code) for code, part in parts for p, label in part]
    if len(classes) < 2 or not rows:
        raise UserError(f"'{root}' holds {len(classes)} class folder(s) with images; shards need at least 2")
    samples = SampleList.from_arrays([p for p, _, _ in rows], labels=[label for _, label, _ in rows])
    return samples, classes, np.array([c for _, _, c in rows], dtype=np.int64), None


def _warn_unseen_labels(split, labels):
    """A label with no training image cannot be learnt: say which, before training."""
    def counts(samples):
        values = samples.label_values if samples.multilabel else samples.labels
        return np.bincount(values, minlength=len(split.classes))
    in_train, in_val = counts(split.train), counts(split.val)
    for what, which in (("have no positive in train", (in_train == 0) & (in_val == 0)),
                        ("are in val but never in train", (in_train == 0) & (in_val > 0))):
        names = [split.classes[i] for i in np.flatnonzero(which)]
        if names:
            warn(f"data.labels '{labels}': {len(names)} label(s) {what}, e.g. "
                 f"{', '.join(map(repr, names[:3]))}; the model cannot learn them")


def shared_split(data_cfg):
    """split_dataset, run by global rank 0 alone and handed to every rank (one broadcast).

    One scan instead of one per rank: no metadata storm on a shared filesystem, and the
    split is rank 0's on every rank. Each rank then checks that its node sees the data
    (two stats); a node that does not is named in one line. Called by every rank.
    """
    result = None
    if get_rank() == 0:
        try:
            result = ("ok", split_dataset(data_cfg))
        except UserError as e:
            result = ("error", str(e), e.exit_code)
    result = broadcast_object(result)
    if result[0] == "error":
        raise UserError(result[1], exit_code=result[2], every_rank=True)
    split = result[1]
    # A label file's images may lie anywhere (absolute paths): the first images are the probe.
    probes = [] if data_cfg.labels or data_cfg.shards else [str(data_cfg.path)]
    # Shards are read by each process as it needs them; a shard it cannot reach stops it, named (utils/shards.py).
    probes += [samples[0][0] for samples in (split.train, split.val) if len(samples) and not data_cfg.shards]
    mine = None if all(os.path.exists(p) for p in probes) else node_name()
    missing = sorted({name for name in gather_objects(mine) if name})
    if missing:
        raise UserError(f"data path '{data_cfg.path}' is missing on {', '.join(missing)}: every node needs the data "
                        "at the same path (copy it there, or use a shared filesystem)", every_rank=True)
    return split


# --------------------------------------------------------------------------- transforms

def build_transforms(img_size, val_resize, min_crop_scale=0.08, channels=3):
    """(train, val) transforms: an image from utils.decoding.load_image -> uint8 (C, H, W), C = data.channels
    (3, or 1 for grey: each step below takes either; the mean and std follow). The loop makes each
    batch float, normalised with NormalizeOnDevice's mean and std, on the device: the workers pass a
    quarter of the bytes. Add your augmentation to `train` after the crop, which gives a uint8 tensor
    (torchvision's transforms take one). One that needs floats: put transforms.ConvertImageDtype(
    torch.float) before it; NormalizeOnDevice then normalises in the workers, as Normalize does.
    data.pipeline=gpu reproduces only the crop, flip and normalisation and refuses anything else."""
    mean, std = imagenet_stats(channels)
    train = transforms.Compose([
        # torchvision's RandomResizedCrop, but a big JPEG is decoded only as large as the crop needs.
        DraftRandomResizedCrop(img_size, scale=(min_crop_scale, 1.0)),
        transforms.RandomHorizontalFlip(),
        NormalizeOnDevice(mean, std),
    ])
    val = transforms.Compose([
        DraftResize(val_resize),  # torchvision's Resize, decoding a big JPEG small as well
        transforms.CenterCrop(img_size),
        transforms.PILToTensor(),
        NormalizeOnDevice(mean, std),
    ])
    return train, val


class NormalizeOnDevice(transforms.Normalize):
    """torchvision's Normalize, done later: a uint8 tensor passes unchanged, and the training loop
    normalises whole batches on the device with this mean and std (utils/normalization.py). A float
    tensor (values 0..1, as ToTensor gives) is normalised here, by the same formula."""

    def forward(self, tensor):
        if tensor.dtype == torch.uint8:
            return tensor
        mean, std = (torch.as_tensor(v, dtype=tensor.dtype, device=tensor.device).view(-1, 1, 1)
                     for v in (self.mean, self.std))
        return normalize(tensor, mean, std, scale=1)


def trained_data_config(config):
    """The data section a checkpoint's model was trained with (`config`: the checkpoint's config dict),
    each key it lacks (an older or hand-made checkpoint) taken from configs/default.yaml; without
    data.channels it was trained on RGB, as model.load_trained builds it."""
    return {**config_to_dict(load_config([]))["data"], "channels": 3, **(config.get("data") or {})}


# --------------------------------------------------------------------------- datasets

def build_datasets(data_cfg, eval_only=False):
    """The config's data section -> (train dataset, val dataset, class names).

    eval_only: no training set (None: nothing of it is checked, decoded or loaded), and the
    second dataset is root/test/ when the root has one (its `split` says which).
    """
    split = shared_split(data_cfg)
    if eval_only:
        split.train, split.val = SampleList(), split.test if len(split.test) else split.val
    train, val = split.train, split.val
    known_bad = 0
    if data_cfg.verify and split.shards is not None:
        raise UserError("data.verify=true decodes image files before training, and data.shards has none; an "
                        "unreadable image in a shard is counted in bad_images when met: set data.verify=false",
                        every_rank=True)
    if data_cfg.verify:
        bad = verify_images([p for s in (train, val) for p, _ in s], data_cfg.max_image_pixels)
        for _, why in bad:
            warn(f"verify: {why}")
        if bad and data_cfg.bad_image == "error":
            raise BadImageError(f"data.verify found {len(bad)} unreadable image(s), listed above; fix or "
                                "remove them, or set data.bad_image=warn to skip them")
        if is_main_process():
            print(f"verify: {len(train) + len(val)} images checked, {len(bad)} unreadable"
                  + (" (skipped)" if bad else ""), flush=True)
        if bad:
            bad_paths = {path for path, _ in bad}
            train, val = (s.take([i for i, (p, _) in enumerate(s) if p not in bad_paths]) for s in (train, val))
        known_bad = len(bad)
    train_tf, val_tf = build_transforms(data_cfg.img_size, data_cfg.val_resize, data_cfg.min_crop_scale,
                                        data_cfg.channels)
    opts = dict(bad_image=data_cfg.bad_image, max_pixels=data_cfg.max_image_pixels, channels=data_cfg.channels,
                num_classes=len(split.classes))
    if split.shards is not None:
        part = "test" if eval_only and len(split.test) else "val"
        lists = {"train": functools.partial(ShardImageList, rows=split.rows.get("train"), reader=split.shards),
                 "val": functools.partial(ShardImageList, rows=split.rows.get(part), reader=split.shards)}
    else:
        lists = {"train": ImageList, "val": ImageList}
    held_out = lists["val"](val, val_tf, **opts)
    held_out.split = "test" if eval_only and len(split.test) else "val"
    # data.pipeline's choice is the training transform's; the held-out loader takes the same path.
    held_out.train_transform = train_tf
    train_set = None if eval_only else lists["train"](train, train_tf, known_bad=known_bad, **opts)
    return train_set, held_out, split.classes


class ImageList(Dataset):
    """(path, label) pairs -> (tensor, label); any image mode becomes RGB, or grey with channels=1. The
    pairs are kept as a SampleList (`samples`), which forked workers read without copying it.

    Multi-label samples (path, tuple of class indices) give (tensor, target), target a float32
    multi-hot (num_classes,): 1.0 for each of the image's labels. `multilabel` and `num_classes`
    (given, or one more than the largest label) say which.

    An unreadable image is replaced by the next readable one (same index ->
    same substitute, so batch sizes, step counts and DDP shards stay equal),
    or raises BadImageError with bad_image="error". Which files are bad is kept
    in a shared-memory tensor of BadStatus codes, so what DataLoader workers find
    reaches the main process (see sync_bad_images). Rank 0 warns at once; other
    ranks' finds are reported at epoch end.
    The training loop calls `sync_bad_images` of any dataset that has one.
    """

    def __init__(self, samples, transform=None, bad_image="warn", max_pixels=0, known_bad=0, channels=3,
                 num_classes=None):
        self.samples = samples if isinstance(samples, SampleList) else SampleList(samples)
        self.multilabel = self.samples.multilabel
        values = self.samples.label_values if self.multilabel else self.samples.labels
        self.num_classes = num_classes if num_classes is not None else int(values.max(initial=-1)) + 1
        self.transform = transform
        self.channels = channels  # 3: decoded to RGB; 1: to grey (data.channels)
        self.bad_image = bad_image
        self.max_pixels = max_pixels
        self.known_bad = known_bad  # removed before training by data.verify; counted in bad_images
        self.report_now = is_main_process()
        self.bad_status = torch.full((max(len(samples), 1),), BadStatus.NOT_KNOWN, dtype=torch.uint8).share_memory_()

    def __len__(self):
        return len(self.samples)

    @property
    def targets(self):
        """The class index of every sample (torchvision's name for it, as in ImageFolder); for
        multi-label, each sample's tuple of class indices."""
        return self.samples.label_tuples() if self.multilabel else self.samples.labels.tolist()

    def target(self, label):
        """A sample's label as the loop takes it: the class index, or the multi-hot float32 vector."""
        if not self.multilabel:
            return label
        hot = torch.zeros(self.num_classes, dtype=torch.float32)
        hot[list(label)] = 1.0
        return hot

    def __getitem__(self, index):
        n = len(self.samples)
        for i in range(index, index + n):
            i %= n
            if self.bad_status[i] != BadStatus.NOT_KNOWN:
                continue
            try:
                img, label = self.load(i, self.transform)
            except BadImage as e:
                if self.bad_image == "error":
                    raise BadImageError(f"{e}; fix or remove it, or set data.bad_image=warn to skip "
                                        "unreadable images") from None
                self.bad_status[i] = BadStatus.REPORTED if self.report_now else BadStatus.FOUND
                if self.report_now:
                    print(f"warning: skipping unreadable image: {e}", file=sys.stderr, flush=True)
                continue
            return img, self.target(label)
        raise UserError(f"none of the {n} images could be read (see the warnings above)", RUNTIME_EXIT)

    def load(self, i, transform=None):
        """Sample i decoded (through `transform`): (image, label); BadImage if it cannot be."""
        path, label = self.samples[i]
        return load_image(path, transform, self.max_pixels, MODES[self.channels]), label

    def file_bytes(self, i):
        """Sample i's encoded file as it is (data.pipeline=gpu decodes JPEGs from these on the device)."""
        with open(self.samples[i][0], "rb") as f:
            return f.read()

    def __getitems__(self, indices):
        """One batch, as DataLoader's workers fetch it; a persistent worker reseeds at an epoch's first."""
        reseed_worker(self, indices)
        return [self[i] for i in indices]

    def sync_bad_images(self):
        """The number of unreadable files found so far, over all ranks and loader workers.

        A collective: every rank calls it (fit does, after each epoch). Rank 0
        warns about the files only other ranks met; all ranks then skip them.
        """
        mine = (self.bad_status != BadStatus.NOT_KNOWN).nonzero().flatten().tolist()
        found = sorted(set().union(*gather_objects(mine)))
        for i in found:
            if self.bad_status[i] != BadStatus.REPORTED and self.report_now:
                try:
                    self.load(i)
                except BadImage as e:
                    print(f"warning: skipping unreadable image: {e}", file=sys.stderr, flush=True)
        self.bad_status[found] = BadStatus.REPORTED
        return len(found) + self.known_bad


class ShardImageList(ImageList):
    """ImageList over data.shards: sample i is row rows[i] of the shards, its file's bytes read by index
    (utils/shards.py), decoded as a file's would be. Everything else, bad images included, is ImageList's."""

    def __init__(self, samples, transform=None, rows=None, reader=None, **opts):
        super().__init__(samples, transform, **opts)
        self.rows, self.reader = np.asarray(rows, dtype=np.int64), reader

    def load(self, i, transform=None):
        path, label = self.samples[i]
        shard, data = self.reader.image(int(self.rows[i]))
        # Named as the file it was ("cannot decode 'a/1.jpg' in 'shard-000003.tar'").
        return load_image(f"{path}' in '{shard}", transform, self.max_pixels, MODES[self.channels], data=data), label

    def file_bytes(self, i):
        return self.reader.image(int(self.rows[i]))[1]


# --------------------------------------------------------------------------- loaders

def unlabelled_set(folder, like):
    """Every image under `folder` (recursively), read as the dataset `like` reads its own (transform,
    channels, bad-image rule), each labelled 0: images of none of the classes (eval.ood)."""
    _walk.cache_clear()
    paths = _images_in(folder)
    if not paths:
        raise UserError(f"--ood '{folder}' holds no images (.jpg/.jpeg/.png/...)", every_rank=True)
    dataset = ImageList([(p, 0) for p in paths], like.transform, like.bad_image, like.max_pixels,
                        channels=like.channels, num_classes=like.num_classes)
    dataset.train_transform = getattr(like, "train_transform", None)
    return dataset


def make_loader(dataset, batch_size, sampler, data_cfg, device, train, procs_per_node=None, channels_last=False):
    """channels_last (model.channels_last): the gpu pipeline writes its batches in that layout on CUDA,
    so the loop's conversion finds nothing to do; elsewhere, as for the model, it is off."""
    if dataset is None:  # --eval-only: no training set
        return None
    # Processes on this node share its cores for workers; torchrun says how many.
    if procs_per_node is None:
        procs_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    workers = resolve_num_workers(data_cfg.num_workers, device, procs_per_node)
    if train and len(sampler) < batch_size:
        raise UserError(f"{len(sampler)} training images per process is fewer than the batch size "
                        f"{batch_size}; lower --batch-size")
    # The fast path (data.pipeline, utils/gpu_pipeline.py) reproduces the dataset's training transform, or
    # refuses; a held-out set carries the one it was built beside (build_datasets).
    augment = getattr(dataset, "transform", None) if train else getattr(dataset, "train_transform", None)
    pipeline = resolve_pipeline(data_cfg.pipeline, device, augment)
    if pipeline == "gpu" and getattr(dataset, "multilabel", False):
        # Its cache and batches carry one class index per image, not a multi-hot vector.
        if data_cfg.pipeline == "gpu":
            raise UserError("data.pipeline=gpu takes single-label data only, and this data is multi-label; "
                            "use data.pipeline=pil (or auto)", every_rank=True)
        pipeline = "pil"
    if pipeline == "gpu":
        return GpuLoader(dataset, batch_size, sampler, data_cfg, device, train, workers=workers,
                         channels_last=use_channels_last(channels_last, device), verbose=is_main_process(),
                         procs_per_node=procs_per_node, prefetch_factor=PREFETCH_FACTOR)
    # Workers that live across epochs spare a start per epoch per process; PersistentLoader still
    # gives every epoch the seeds fresh workers would take, so resumed runs stay exact.
    persistent = data_cfg.persistent_workers and workers > 0
    return (PersistentLoader if persistent else DataLoader)(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
        pin_memory=data_cfg.pin_memory and device.type == "cuda",
        # A last training batch of one image would break BatchNorm; dropping it costs < 1 batch per epoch.
        drop_last=train,
        # Re-seeded every epoch by the loop, so augmentation is reproducible and resumable.
        generator=torch.Generator(),
        prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
        persistent_workers=persistent,
        collate_fn=collate,
    )


def resolve_num_workers(requested, device, procs_per_node=1):
    if requested >= 0:
        return requested
    if device.type != "cuda":
        return 0  # on CPU the training math already uses every core; workers would compete
    return max(1, min(8, (os.cpu_count() or 1) // procs_per_node))


# --------------------------------------------------------------------------- reading the folders (for the split)

def is_image_file(path):
    name = os.path.basename(path)
    return not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS)


def _class_dirs(root):
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def warn(msg):
    """A data warning, printed by rank 0 only (every rank reads the same folders)."""
    if is_main_process():
        print(f"warning: {msg}", file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=None)
def _walk(folder):
    """(image files, other files) under `folder`, symlinks followed. Cached for one split_dataset
    call: a class folder is walked once, though both the class check and the split read it."""
    images, others = [], []
    for dirpath, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .ipynb_checkpoints, .git, ...
        for f in files:
            (images if is_image_file(f) else others).append(str(Path(dirpath) / f))
    # Sorted so the list, and therefore the split, does not depend on the filesystem's order.
    return tuple(sorted(images)), tuple(others)


def _images_in(folder, ignored=None):
    """Image files under `folder` (symlinks followed); everything else goes to `ignored`."""
    images, others = _walk(str(folder))
    if ignored is not None:
        ignored.extend(others)
    return list(images)


def _scan(root, classes, ignored):
    """The images of each class folder under `root`, class by class, each folder's in path order."""
    paths, labels = [], []
    for label, name in enumerate(classes):
        images = _images_in(Path(root) / name, ignored)
        paths.extend(images)
        labels.extend([label] * len(images))
    return SampleList.from_arrays(paths, labels=labels) if paths else SampleList()


def _non_empty_classes(root, names):
    """Class folders holding at least one image; an empty one is skipped, with a warning."""
    kept = []
    for name in names:
        if _images_in(Path(root) / name):
            kept.append(name)
        else:
            warn(f"class folder '{Path(root) / name}' holds no images (.jpg/.jpeg/.png...); "
                 "skipped, it is not a class")
    return kept


def node_name():
    """This machine, as a user would look for it: host name and torchrun's (or SLURM's) node rank."""
    rank = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID"))
    return socket.gethostname() + (f" (node rank {rank})" if rank is not None else "")
