"""Image folders -> datasets, split, transforms and loaders.

Two layouts are accepted under `data.path`:

    flower_photos/daisy/*.jpg, flower_photos/roses/*.jpg, ...        split here by data.val_rate
    root/train/daisy/*.jpg ... and root/val/daisy/*.jpg ...           split already made
    root/train/, root/val/ and root/test/                              test/ is what --eval-only evaluates

The split is per class and driven by its own seeded generator, so it is the
same on every rank and every run and never touches the global RNG.

Real folders are messy. Hidden and non-image files are ignored (and counted);
a class folder without images is skipped with a warning. An image that cannot
be decoded (zero bytes, truncated, not an image, over data.max_image_pixels)
is replaced by the next readable one, warned about once with its path and
counted as `bad_images` in metrics.jsonl; data.bad_image=error stops instead,
and data.verify=true decodes every image once before training.
"""
import contextlib
import enum
import functools
import itertools
import os
import random
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, default_collate
# The numpy seed torch's worker loop gives a fresh worker (private, unchanged since torch 1.9).
from torch.utils.data._utils.worker import _generate_state
from torchvision import transforms
from torchvision.transforms import functional as TF

from model import use_channels_last
from utils.config import config_to_dict, load_config
from utils.distributed_utils import broadcast_object, gather_objects, get_rank, get_world_size, is_main_process
from utils.errors import RUNTIME_EXIT, BadImageError, UserError
from utils.gpu_pipeline import GpuLoader, resolve_pipeline
from utils.normalization import normalize

# PIL's own decompression-bomb check warns or fails without naming the file;
# load_rgb applies data.max_image_pixels itself, with the path in the message.
Image.MAX_IMAGE_PIXELS = None

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PREFETCH_FACTOR = 4  # batches each loader worker keeps ready (tools/ddp_check.py counts them in /dev/shm)


@dataclass
class Split:
    classes: list          # index -> class name, sorted
    train: list            # [(path, label), ...]
    val: list
    ignored: list = field(default_factory=list)   # hidden and non-image files found under the root
    test: list = field(default_factory=list)      # root/test/, when the root has one: for --eval-only


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
    samples = []
    for label, name in enumerate(classes):
        samples.extend((p, label) for p in _images_in(Path(root) / name, ignored))
    return samples


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


def split_dataset(root, val_rate=0.2, split_seed=0):
    """Read the class folders under `root` and split them into train/val (no collectives: see shared_split)."""
    _walk.cache_clear()
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"data path '{root}' does not exist or is not a folder; "
                        "set --data-path (the offline demo set: python demo/flowers.py data/demo_flowers)")
    top = _class_dirs(root)
    # Hidden files beside the class folders (.DS_Store, the demo set's .complete marker) are no one's
    # mistake; files inside class folders are counted below, hidden or not.
    ignored = [str(root / f) for f in os.listdir(root) if (root / f).is_file() and not f.startswith(".")]
    if top in (["train", "val"], ["test", "train", "val"]):
        for other in top[:-2] + ["val"]:
            if _class_dirs(root / other) != _class_dirs(root / "train"):
                raise UserError(f"'{root}/train' and '{root}/{other}' must hold the same class folders")
        classes = _non_empty_classes(root / "train", _class_dirs(root / "train"))
        split = Split(classes, _scan(root / "train", classes, ignored), _scan(root / "val", classes, ignored))
        if "test" in top:
            split.test = _scan(root / "test", classes, ignored)
    else:
        classes = _non_empty_classes(root, top)
        split = Split(classes, [], [])
        gen = torch.Generator().manual_seed(split_seed)
        for label, name in enumerate(classes):
            files = _images_in(root / name, ignored)
            order = torch.randperm(len(files), generator=gen).tolist()
            n_val = int(round(len(files) * val_rate))
            if n_val == len(files):
                raise UserError(f"class '{name}' has {len(files)} image(s) and data.val_rate={val_rate} "
                                "puts all of them in validation, none in training; lower data.val_rate "
                                "or add images")
            if n_val == 0 and val_rate > 0:
                warn(f"class '{name}' has {len(files)} image(s): data.val_rate={val_rate} leaves it "
                     "no validation image, so val_acc does not measure it")
            for i, idx in enumerate(order):
                (split.val if i < n_val else split.train).append((files[idx], label))
    if not classes and ignored:
        raise UserError(f"data path '{root}' holds files but no class folders; put each class's "
                        "images in its own sub-folder (flower_photos/daisy/*.jpg, ...)")
    if len(classes) < 2:
        raise UserError(f"data path '{root}' holds {len(classes)} class folder(s) with images; "
                        "a classifier needs at least 2 (one sub-folder of images per class)")
    if not split.train:
        raise UserError(f"no training images (.jpg/.jpeg/.png) found under '{root}'")
    split.ignored = ignored
    if ignored:
        hidden = sum(os.path.basename(p).startswith(".") for p in ignored)
        warn(f"ignored {len(ignored)} file(s) under '{root}' that are not images "
             f"({hidden} hidden), e.g. '{ignored[0]}'")
    _walk.cache_clear()
    return split


def node_name():
    """This machine, as a user would look for it: host name and torchrun's (or SLURM's) node rank."""
    rank = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID"))
    return socket.gethostname() + (f" (node rank {rank})" if rank is not None else "")


def shared_split(root, val_rate=0.2, split_seed=0):
    """split_dataset, run by global rank 0 alone and handed to every rank (one broadcast).

    One scan instead of one per rank: no metadata storm on a shared filesystem, and the
    split is rank 0's on every rank. Each rank then checks that its node sees the data
    (two stats); a node that does not is named in one line. Called by every rank.
    """
    result = None
    if get_rank() == 0:
        try:
            result = ("ok", split_dataset(root, val_rate, split_seed))
        except UserError as e:
            result = ("error", str(e), e.exit_code)
    result = broadcast_object(result)
    if result[0] == "error":
        raise UserError(result[1], exit_code=result[2], every_rank=True)
    split = result[1]
    probes = [str(root)] + [samples[0][0] for samples in (split.train, split.val) if samples]
    mine = None if all(os.path.exists(p) for p in probes) else node_name()
    missing = sorted({name for name in gather_objects(mine) if name})
    if missing:
        raise UserError(f"data path '{root}' is missing on {', '.join(missing)}: every node needs the data "
                        "at the same path (copy it there, or use a shared filesystem)", every_rank=True)
    return split


def _transform_args(data_cfg):
    return dict(img_size=data_cfg.img_size, val_resize=data_cfg.val_resize, min_crop_scale=data_cfg.min_crop_scale)


def trained_data_config(config):
    """The data section a checkpoint's model was trained with (`config`: the checkpoint's config dict),
    each key it lacks (an older or hand-made checkpoint) taken from configs/default.yaml."""
    return {**config_to_dict(load_config([]))["data"], **(config.get("data") or {})}


def build_transforms(img_size, val_resize, min_crop_scale=0.08):
    """(train, val) transforms: an image from load_image -> uint8 (3, H, W). The training loop makes each
    batch float, normalised with NormalizeOnDevice's mean and std, on the device: the workers pass a
    quarter of the bytes. Add your augmentation to `train` after the crop, which gives a uint8 tensor
    (torchvision's transforms take one). One that needs floats: put transforms.ConvertImageDtype(
    torch.float) before it; NormalizeOnDevice then normalises in the workers, as Normalize does.
    data.pipeline=gpu reproduces only the crop, flip and normalisation and refuses anything else."""
    train = transforms.Compose([
        RandomResizedCrop(img_size, scale=(min_crop_scale, 1.0)),  # a big JPEG is decoded small: see below
        transforms.RandomHorizontalFlip(),
        NormalizeOnDevice(IMAGENET_MEAN, IMAGENET_STD),
    ])
    val = transforms.Compose([
        Resize(val_resize),
        transforms.CenterCrop(img_size),
        transforms.PILToTensor(),
        NormalizeOnDevice(IMAGENET_MEAN, IMAGENET_STD),
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


def draft_scale(width, height, out_width, out_height):
    """How much smaller a JPEG can be decoded when its width x height pixels become out_width x
    out_height: the largest of 1, 2, 4 and 8 (DCT scaling, PIL's draft) that still leaves that many."""
    s = min(width // max(out_width, 1), height // max(out_height, 1), 8)
    return 1 << (max(s, 1).bit_length() - 1)


class RandomResizedCrop(transforms.RandomResizedCrop):
    """torchvision's RandomResizedCrop with the same random draws and boxes, giving a uint8 tensor.
    The box is drawn in the original's pixels first; a JPEG from load_image is then decoded at the
    smallest scale that leaves the box at least the output size (a 4000x3000 photo: mostly 1/4 or
    1/8, several times faster). The box is resized on uint8 by torch's antialiased bilinear, within
    one level of PIL's and about 3x faster."""

    def forward(self, img):
        if not isinstance(img, Image.Image):
            return super().forward(img)
        top, left, h, w = self.get_params(img, self.scale, self.ratio)
        img, s = decode(img, draft_scale(w, h, self.size[1], self.size[0]))
        # The box in the decoded pixels (to the nearest one where the JPEG was decoded smaller).
        box = TF.pil_to_tensor(img)[:, round(top / s):round((top + h) / s), round(left / s):round((left + w) / s)]
        with one_thread():
            # interpolate resizes uint8 as it is; TF.resize would go through float and back.
            if self.interpolation != transforms.InterpolationMode.BILINEAR:
                return TF.resize(box, list(self.size), self.interpolation, antialias=self.antialias)
            return torch.nn.functional.interpolate(box[None], size=self.size, mode="bilinear", antialias=True)[0]


@contextlib.contextmanager
def one_thread():
    """torch on one thread for one image's op: in the main process (data.num_workers=0) waking its
    other threads costs more than they save, 20x on a loaded 2-core machine. A worker has one anyway."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Resize(transforms.Resize):
    """torchvision's Resize. A JPEG not decoded yet (load_image) is decoded at the smallest scale that
    leaves it at least the output size (RandomResizedCrop's rule); that size is torchvision's, computed
    from the original's."""

    def forward(self, img):
        if not isinstance(img, Image.Image):
            return super().forward(img)
        w, h = img.size
        out_w, out_h = self.output_size(w, h)
        img, s = decode(img, draft_scale(w, h, out_w, out_h))
        if s == 1:
            return super().forward(img)
        return img.resize((out_w, out_h), TF.pil_modes_mapping[self.interpolation], box=(0, 0, w / s, h / s))

    def output_size(self, w, h):
        """torchvision's (width, height) for a w x h image; (w, h) itself under max_size (never drafted)."""
        size = [self.size] if isinstance(self.size, int) else list(self.size)
        if len(size) == 2:
            return size[1], size[0]
        if self.max_size is not None or size[0] is None:
            return w, h
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(size[0] * long / short)
        return (size[0], new_long) if w <= h else (new_long, size[0])


def collate(batch):
    """DataLoader's default_collate, except for uint8 images as PILToTensor leaves them, (3, H, W) views of
    H x W x 3 pixels: stacked as they lie, a plain copy where a (N, 3, H, W) batch takes a transposing one,
    several times slower. Such a batch is (N, 3, H, W) in channels_last memory; the device pass reads it so."""
    first = batch[0][0] if isinstance(batch[0], (tuple, list)) and len(batch[0]) == 2 else None
    if (isinstance(first, torch.Tensor) and first.dtype == torch.uint8 and first.dim() == 3
            and first.permute(1, 2, 0).is_contiguous()):
        images = default_collate([img.permute(1, 2, 0) for img, _ in batch])
        return images.permute(0, 3, 1, 2), default_collate([label for _, label in batch])
    return default_collate(batch)


class BadImage(Exception):
    """A file that cannot be decoded into an image; the message names it and says why."""


def to_rgb(img):
    """Any PIL mode -> 8-bit RGB (CMYK, RGBA, L, P, 16-bit grey, ...)."""
    if img.mode.startswith("I"):
        # 16-bit grey: convert("RGB") would clip every value over 255 to white; scale instead.
        arr = np.asarray(img).astype(np.int64).clip(0, 65535)
        if img.mode != "I" or arr.max() > 255:
            arr = arr >> 8
        img = Image.fromarray(arr.astype(np.uint8), "L")
    elif img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # PIL warns on P + transparency -> RGB; this way is silent
    return img.convert("RGB")


def _decode_error(path, e):
    why = (str(e).splitlines() or [type(e).__name__])[0].replace(f" '{path}'", "")
    return BadImage(f"cannot decode '{path}': {why}")


def load_rgb(path, max_pixels=0, undecoded=False):
    """Decode `path` to RGB; raise BadImage naming the file if it cannot be decoded.
    undecoded: a JPEG comes back with only its header read, for `decode` to decode at the size needed."""
    try:
        if os.path.getsize(path) == 0:
            raise BadImage(f"'{path}' is empty (0 bytes)")
        img = Image.open(path)  # reads the header only
        w, h = img.size
        if max_pixels and w * h > max_pixels:
            img.close()
            raise BadImage(f"'{path}' is {w}x{h} = {w * h} pixels, over data.max_image_pixels="
                           f"{max_pixels} (a decompression-bomb guard); raise it if you trust the file")
        if undecoded and img.format == "JPEG":
            return img
        with img:
            return to_rgb(img)
    except BadImage:
        raise
    except Exception as e:  # noqa: BLE001 - whatever PIL raises on a broken file is the file's fault
        raise _decode_error(path, e) from None


def decode(img, scale=1):
    """An image from load_rgb -> (8-bit RGB, how many times smaller it was decoded). A JPEG not decoded
    yet is decoded at 1/scale of each side (rounded up); any other image is as it is."""
    w = img.width
    try:
        drafted = img.draft(img.mode, (w // scale, img.height // scale)) if scale > 1 else None
        if img.mode == "RGB":
            img.load()  # in place: an RGB JPEG, the usual case, is not copied
        else:
            img = to_rgb(img)
    except Exception as e:  # noqa: BLE001 - as in load_rgb
        raise _decode_error(getattr(img, "filename", "the image"), e) from None
    # draft() answers (mode, the original's extent in the new pixels); None where it did nothing.
    return img, (round(w / drafted[1][2]) if drafted else 1)


def load_image(path, transform=None, max_pixels=0):
    """`path` through `transform`; BadImage if it cannot be decoded. When the transform begins with this
    file's RandomResizedCrop or Resize, a JPEG reaches it undecoded, to be decoded only as large as needed."""
    first = getattr(transform, "transforms", [transform])[0] if transform is not None else None
    img = load_rgb(path, max_pixels, undecoded=isinstance(first, (RandomResizedCrop, Resize)))
    return img if transform is None else transform(img)


class BadStatus(enum.IntEnum):
    """What ImageList.bad_status holds for each file (one uint8 per sample)."""
    NOT_KNOWN = 0   # not known to be bad: it decoded, or was not read yet
    FOUND = 1       # failed to decode, and rank 0 has not warned about it yet
    REPORTED = 2    # failed to decode, and rank 0 has warned about it


class SampleList:
    """(path, label) pairs packed into three numpy arrays: every path's bytes end to end, where each
    starts, and the labels. Indexing and iterating give (path, label) tuples, as the list did.

    A Python list of tuples is two objects per image, and a forked DataLoader worker that merely
    reads one writes its reference count, so every worker slowly copies the whole list
    (pytorch/pytorch#13246): gigabytes at a million images, 8 workers and 8 ranks. Three arrays
    are three objects, and reading them writes nothing (BENCHMARKS.md measures both)."""

    def __init__(self, samples=()):
        encoded, labels = [], []
        for path, label in samples:
            encoded.append(os.fsencode(path))  # fsencode: a name that is not valid UTF-8 round-trips
            labels.append(label)
        self.paths = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in encoded], out=self.offsets[1:])
        self.labels = np.array(labels, dtype=np.int64)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        index %= len(self)
        start, end = self.offsets[index], self.offsets[index + 1]
        return os.fsdecode(self.paths[start:end].tobytes()), int(self.labels[index])

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class ImageList(Dataset):
    """(path, label) pairs -> (tensor, label); any image mode becomes RGB. The pairs are kept as
    a SampleList (`samples`), which forked workers read without copying it.

    An unreadable image is replaced by the next readable one (same index ->
    same substitute, so batch sizes, step counts and DDP shards stay equal),
    or raises BadImageError with bad_image="error". Which files are bad is kept
    in a shared-memory tensor of BadStatus codes, so what DataLoader workers find
    reaches the main process (see sync_bad_images). Rank 0 warns at once; other
    ranks' finds are reported at epoch end.
    The training loop calls `sync_bad_images` of any dataset that has one.
    """

    def __init__(self, samples, transform=None, bad_image="warn", max_pixels=0, known_bad=0):
        self.samples = samples if isinstance(samples, SampleList) else SampleList(samples)
        self.transform = transform
        self.bad_image = bad_image
        self.max_pixels = max_pixels
        self.known_bad = known_bad  # removed before training by data.verify; counted in bad_images
        self.report_now = is_main_process()
        self.bad_status = torch.full((max(len(samples), 1),), BadStatus.NOT_KNOWN, dtype=torch.uint8).share_memory_()

    def __len__(self):
        return len(self.samples)

    @property
    def targets(self):
        """The class index of every sample (torchvision's name for it, as in ImageFolder)."""
        return self.samples.labels.tolist()

    def __getitem__(self, index):
        n = len(self.samples)
        for i in range(index, index + n):
            i %= n
            if self.bad_status[i] != BadStatus.NOT_KNOWN:
                continue
            path, label = self.samples[i]
            try:
                img = load_image(path, self.transform, self.max_pixels)
            except BadImage as e:
                if self.bad_image == "error":
                    raise BadImageError(f"{e}; fix or remove it, or set data.bad_image=warn to skip "
                                        "unreadable images") from None
                self.bad_status[i] = BadStatus.REPORTED if self.report_now else BadStatus.FOUND
                if self.report_now:
                    print(f"warning: skipping unreadable image: {e}", file=sys.stderr, flush=True)
                continue
            return img, label
        raise UserError(f"none of the {n} images could be read (see the warnings above)", RUNTIME_EXIT)

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
                    load_rgb(self.samples[i][0], self.max_pixels)
                except BadImage as e:
                    print(f"warning: skipping unreadable image: {e}", file=sys.stderr, flush=True)
        self.bad_status[found] = BadStatus.REPORTED
        return len(found) + self.known_bad


def _check_file(path, max_pixels):
    try:
        load_rgb(path, max_pixels)
        return None
    except BadImage as e:
        return path, str(e)


def verify_images(paths, max_pixels):
    """Decode every image once (data.verify); return (path, why) of the unreadable ones.

    Each rank checks a disjoint share with a few threads (PIL releases the GIL
    while decoding) and all ranks get the full list.
    """
    mine = paths[get_rank()::get_world_size()]
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        bad = [m for m in pool.map(_check_file, mine, [max_pixels] * len(mine)) if m]
    return sorted(m for part in gather_objects(bad) for m in part)


def build_datasets(data_cfg, eval_only=False):
    """The config's data section -> (train dataset, val dataset, class names).

    eval_only: no training set (None: nothing of it is checked, decoded or loaded), and the
    second dataset is root/test/ when the root has one (its `split` says which).
    """
    split = shared_split(data_cfg.path, data_cfg.val_rate, data_cfg.split_seed)
    if eval_only:
        split.train, split.val = [], split.test or split.val
    known_bad = 0
    if data_cfg.verify:
        bad = verify_images([p for p, _ in split.train + split.val], data_cfg.max_image_pixels)
        for _, why in bad:
            warn(f"verify: {why}")
        if bad and data_cfg.bad_image == "error":
            raise BadImageError(f"data.verify found {len(bad)} unreadable image(s), listed above; fix or "
                                "remove them, or set data.bad_image=warn to skip them")
        if is_main_process():
            print(f"verify: {len(split.train) + len(split.val)} images checked, {len(bad)} unreadable"
                  + (" (skipped)" if bad else ""), flush=True)
        bad_paths = {path for path, _ in bad}
        split.train = [s for s in split.train if s[0] not in bad_paths]
        split.val = [s for s in split.val if s[0] not in bad_paths]
        known_bad = len(bad)
    train_tf, val_tf = build_transforms(**_transform_args(data_cfg))
    opts = dict(bad_image=data_cfg.bad_image, max_pixels=data_cfg.max_image_pixels)
    held_out = ImageList(split.val, val_tf, **opts)
    held_out.split = "test" if eval_only and split.test else "val"
    train_set = None if eval_only else ImageList(split.train, train_tf, known_bad=known_bad, **opts)
    return train_set, held_out, split.classes


def epoch_sampler(dataset, seed, num_replicas=1, rank=0, kind="shuffle"):
    """Training order that depends only on (seed, epoch), set with set_epoch().

    A fixed order per epoch is what lets a resumed run see the same batches as
    an uninterrupted one. With num_replicas > 1 each rank gets a disjoint shard
    of equal length. kind (data.sampler):
      shuffle   each image once per epoch (DistributedSampler, its last shard padded with repeats);
      balanced  every class drawn equally often, rare classes repeating (BalancedSampler);
                an epoch has as many steps as with shuffle.
    No dataset (an --eval-only run's training set) gives None.
    """
    if dataset is None:
        return None
    if kind == "shuffle":
        return DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
    if kind == "balanced":
        if not hasattr(dataset, "targets"):
            raise TypeError(f"{type(dataset).__name__} has no .targets (a label per sample) to balance classes by")
        return BalancedSampler(list(dataset.targets), seed, num_replicas, rank)
    raise ValueError(f"unknown sampler kind {kind!r}; expected 'shuffle' or 'balanced'")


class BalancedSampler(Sampler):
    """Class-balanced order for DDP, a function of (seed, epoch) only, set with set_epoch().

    One epoch is T = ceil(N / W) * W draws (N images, W ranks: as many steps as
    DistributedSampler), and rank r takes positions r, r+W, r+2W, ... of it.
    Each of the C classes present in `labels` fills floor(T/C) or ceil(T/C) of
    the T slots, so over all ranks every class count is within 1 of T/C (the
    tolerance; one rank's share is balanced only on average). Which classes get
    the extra slot starts at a random offset each epoch. Within a class, images
    come from fresh random permutations of it, one after another: a class with
    enough images repeats none, a rare one repeats each image equally often, +-1.
    Every rank computes the same sequence from its own generator; nothing else
    is kept between epochs, so a fresh iterator replays the epoch exactly
    (mid-epoch resume skips batches of it).
    """

    def __init__(self, labels, seed=0, num_replicas=1, rank=0):
        labels = torch.as_tensor(labels, dtype=torch.long)
        _, sizes = torch.unique(labels, return_counts=True)
        # Image indices of each class present, in index order: O(N log N), not one pass per class.
        self.members = torch.argsort(labels, stable=True).split(sizes.tolist())
        self.seed, self.num_replicas, self.rank, self.epoch = seed, num_replicas, rank, 0
        self.total = -(-len(labels) // num_replicas) * num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.total // self.num_replicas

    def epoch_order(self):
        """The whole epoch's sequence of dataset indices, all ranks' shares interleaved."""
        if not self.members:
            return torch.zeros(0, dtype=torch.long)
        g = torch.Generator().manual_seed(self.seed + self.epoch)  # as DistributedSampler derives it
        n_cls = len(self.members)
        base, extra = divmod(self.total, n_cls)
        slots = torch.full((n_cls,), base)
        # A fixed set of classes with the extra slot would favour them every epoch; rotate it.
        offset = int(torch.randint(n_cls, (1,), generator=g))
        slots[(offset + torch.arange(extra)) % n_cls] += 1
        picks = []
        for idx, n in zip(self.members, slots.tolist()):
            cycles = -(-n // len(idx))
            # `cycles` independent permutations in one op (float64 keys: ties are negligible).
            perms = torch.rand(cycles, len(idx), generator=g, dtype=torch.float64).argsort(dim=1, stable=True)
            picks.append(idx[perms.flatten()[:n]])
        order = torch.cat(picks)
        return order[torch.randperm(len(order), generator=g)]

    def __iter__(self):
        return iter(self.epoch_order()[self.rank::self.num_replicas].tolist())


class ShardSampler(Sampler):
    """Rank r takes samples r, r+W, r+2W, ...: no padding, so no image is counted twice.

    DistributedSampler pads the last shard with repeats, which makes a
    distributed accuracy differ from the single-process one; evaluation sums
    correct counts over these exact shards instead.
    """

    def __init__(self, dataset, num_replicas=1, rank=0):
        self.indices = list(range(rank, len(dataset), num_replicas))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def resolve_num_workers(requested, device, procs_per_node=1):
    if requested >= 0:
        return requested
    if device.type != "cuda":
        return 0  # on CPU the training math already uses every core; workers would compete
    return max(1, min(8, (os.cpu_count() or 1) // procs_per_node))


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
    # The fast path (data.pipeline, utils/gpu_pipeline.py) reproduces the train transform built above, or refuses.
    if resolve_pipeline(data_cfg.pipeline, device, build_transforms(**_transform_args(data_cfg))[0]) == "gpu":
        return GpuLoader(dataset, batch_size, sampler, data_cfg, device, train, workers=workers,
                         channels_last=use_channels_last(channels_last, device), verbose=is_main_process(),
                         procs_per_node=procs_per_node)
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


class SeededBatch(list):
    """A batch of dataset indices, with the (iteration, base seed) of the epoch it belongs to."""

    def __init__(self, indices, epoch):
        super().__init__(indices)
        self.epoch = epoch


class _EpochSeededBatches:
    """The loader's batches, each tagged with its epoch's (iteration, base seed)."""

    def __init__(self, batch_sampler):
        self.batch_sampler, self.epoch = batch_sampler, None

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        epoch = self.epoch
        return (SeededBatch(batch, epoch) for batch in self.batch_sampler)


class PersistentLoader(DataLoader):
    """A DataLoader whose workers live across epochs (persistent_workers) and still take each
    epoch's seeds as fresh workers would: reseeding loader.generator before an epoch fixes that
    epoch's augmentation, and a resumed run (its workers fresh) sees the same draws.

    Each iteration draws a base seed from loader.generator, as a fresh iterator draws its fresh
    workers' seeds, and every batch carries it (SeededBatch). A worker reseeds at the first batch
    of a new epoch it meets, in task order, so batches of an epoch that were prefetched but never
    taken (accum_steps' tail) still run on the old seeds. The dataset does it in __getitems__
    (ImageList, with reseed_worker); a dataset without one would keep one stream for all epochs."""

    def __iter__(self):
        seeded = self._index_sampler
        iteration = seeded.epoch[0] + 1 if seeded.epoch else 0
        seeded.epoch = (iteration, int(torch.empty((), dtype=torch.int64).random_(generator=self.generator)))
        return super().__iter__()

    @property
    def _index_sampler(self):
        # DataLoader's iterators take their batches from this (private) property.
        if "_seeded" not in self.__dict__:
            self.__dict__["_seeded"] = _EpochSeededBatches(self.batch_sampler)
        return self.__dict__["_seeded"]


def reseed_worker(dataset, batch):
    """In a DataLoader worker, at the first `batch` of an epoch (a SeededBatch): seed random, torch
    and numpy exactly as torch's worker loop seeds a fresh worker (base seed + worker id)."""
    info = torch.utils.data.get_worker_info()
    epoch = getattr(batch, "epoch", None)
    if info is None or epoch is None or epoch == getattr(dataset, "_worker_epoch", None):
        return
    dataset._worker_epoch = epoch
    base_seed = epoch[1]
    random.seed(base_seed + info.id)
    torch.manual_seed(base_seed + info.id)
    np.random.seed(_generate_state(base_seed, info.id))
