"""Image folders -> datasets, split, transforms and loaders.

Two layouts are accepted under `data.path`:

    flower_photos/daisy/*.jpg, flower_photos/roses/*.jpg, ...        split here by data.val_rate
    root/train/daisy/*.jpg ... and root/val/daisy/*.jpg ...           split already made

The split is per class and driven by its own seeded generator, so it is the
same on every rank and every run and never touches the global RNG.
"""
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchvision import transforms

from utils.errors import UserError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class Split:
    classes: list          # index -> class name, sorted
    train: list            # [(path, label), ...]
    val: list


def is_image_file(path):
    name = os.path.basename(path)
    return not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS)


def _class_dirs(root):
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def _images_in(folder):
    # Sorted so the list, and therefore the split, does not depend on the filesystem's order.
    return sorted(str(Path(dirpath) / f)
                  for dirpath, _, files in os.walk(folder, followlinks=True)
                  for f in files if is_image_file(f))


def _scan(root, classes):
    samples = []
    for label, name in enumerate(classes):
        samples.extend((p, label) for p in _images_in(Path(root) / name))
    return samples


def split_dataset(root, val_rate=0.2, split_seed=0):
    """Read the class folders under `root` and split them into train/val."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"data path '{root}' does not exist or is not a folder; "
                        "set --data-path (or data.demo=true to generate the demo set there)")
    top = _class_dirs(root)
    if top == ["train", "val"]:
        classes = _class_dirs(root / "train")
        if _class_dirs(root / "val") != classes:
            raise UserError(f"'{root}/train' and '{root}/val' must hold the same class folders")
        split = Split(classes, _scan(root / "train", classes), _scan(root / "val", classes))
    else:
        classes = top
        split = Split(classes, [], [])
        gen = torch.Generator().manual_seed(split_seed)
        for label, name in enumerate(classes):
            files = _images_in(root / name)
            order = torch.randperm(len(files), generator=gen).tolist()
            n_val = int(round(len(files) * val_rate))
            for i, idx in enumerate(order):
                (split.val if i < n_val else split.train).append((files[idx], label))
    if len(classes) < 2:
        raise UserError(f"data path '{root}' holds {len(classes)} class folder(s); "
                        "a classifier needs at least 2 (one sub-folder of images per class)")
    if not split.train:
        raise UserError(f"no training images (.jpg/.jpeg/.png) found under '{root}'")
    return split


def build_transforms(img_size, val_resize, min_crop_scale=0.08):
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train = transforms.Compose([
        transforms.RandomResizedCrop(img_size, scale=(min_crop_scale, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        normalize,
    ])
    val = transforms.Compose([
        transforms.Resize(val_resize),
        transforms.CenterCrop(img_size),
        transforms.ToTensor(),
        normalize,
    ])
    return train, val


def load_rgb(path):
    with Image.open(path) as img:
        return img.convert("RGB")


class ImageList(Dataset):
    """(path, label) pairs -> (tensor, label); any image mode becomes RGB."""

    def __init__(self, samples, transform=None):
        self.samples = samples
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, label = self.samples[index]
        img = load_rgb(path)
        if self.transform is not None:
            img = self.transform(img)
        return img, label


def build_datasets(data_cfg):
    """The config's data section -> (train dataset, val dataset, class names)."""
    if data_cfg.demo:
        from utils.demo_dataset import ensure_demo_dataset
        ensure_demo_dataset(data_cfg.path, images_per_class=data_cfg.demo_images_per_class)
    split = split_dataset(data_cfg.path, data_cfg.val_rate, data_cfg.split_seed)
    train_tf, val_tf = build_transforms(data_cfg.img_size, data_cfg.val_resize, data_cfg.min_crop_scale)
    return ImageList(split.train, train_tf), ImageList(split.val, val_tf), split.classes


def epoch_sampler(dataset, seed, num_replicas=1, rank=0):
    """Shuffled order that depends only on (seed, epoch), set with set_epoch().

    A fixed order per epoch is what lets a resumed run see the same batches as
    an uninterrupted one. With num_replicas > 1 it hands each rank a disjoint
    shard (it is DistributedSampler, padded to equal length).
    """
    return DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)


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


def make_loader(dataset, batch_size, sampler, data_cfg, device, train, procs_per_node=1):
    workers = resolve_num_workers(data_cfg.num_workers, device, procs_per_node)
    if train and len(sampler) < batch_size:
        raise UserError(f"{len(sampler)} training images per process is fewer than the batch size "
                        f"{batch_size}; lower --batch-size")
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
        pin_memory=data_cfg.pin_memory and device.type == "cuda",
        # A last training batch of one image would break BatchNorm; dropping it costs < 1 batch per epoch.
        drop_last=train,
        # Re-seeded every epoch by the loop, so augmentation is reproducible and resumable.
        generator=torch.Generator(),
        prefetch_factor=4 if workers > 0 else None,
    )
