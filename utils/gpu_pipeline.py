"""The fast input pipeline (data.pipeline=gpu): decode each image once, augment whole batches on the device.

PIL decoding and a crop per image in DataLoader workers cannot keep a large GPU fed. Here every image is
decoded once into a uint8 cache (or, for a set the cache cannot hold, batch by batch on the device), and
each step's crop, flip and normalisation are a few batched kernels whose random draws come from the CPU,
so runs stay reproducible. What it keeps equal to the PIL path, and its memory rules:
docs/gpu-pipeline.md.
"""
import copy
import io
import math
import os
import re
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import functional as TF

from utils.decoding import exif_orientation
from utils.errors import OUT_OF_MEMORY, UserError
from utils.normalization import normalization_of, normalize

RATIO = (3.0 / 4.0, 4.0 / 3.0)
DEVICE_TRAIN_STEPS = "RandomResizedCrop, RandomHorizontalFlip, PILToTensor or ToTensor, and Normalize"
CACHE_HINT = "; use data.gpu_decode=auto (decode every batch instead), data.pipeline=pil, or a smaller data.cache_size"


def _steps(transform):
    return list(getattr(transform, "transforms", [transform]))


# torchvision's ToTensor + Normalize, or data.py's uint8 steps + NormalizeOnDevice (subclasses count).
_TO_TENSOR = (T.ToTensor, T.PILToTensor)
_SAID = {"oom": False}  # the warnings said once per process


def _ends_in_tensor_and_normalize(steps):
    return len(steps) >= 2 and isinstance(steps[-2], _TO_TENSOR) and isinstance(steps[-1], T.Normalize)


def _train_steps(steps):
    """(crop, flip or None, normalize) for RandomResizedCrop, an optional flip, an optional ToTensor or
    PILToTensor and Normalize; None for anything else."""
    middle = steps[1:-1]
    if middle and isinstance(middle[-1], _TO_TENSOR):
        middle = middle[:-1]
    if (len(steps) >= 2 and isinstance(steps[0], T.RandomResizedCrop) and isinstance(steps[-1], T.Normalize)
            and len(middle) <= 1 and all(isinstance(t, T.RandomHorizontalFlip) for t in middle)):
        return steps[0], (middle[0] if middle else None), steps[-1]
    return None


def unsupported_train_steps(train_transform):
    """The steps of the train transform this path cannot reproduce ([] if it can do them all)."""
    steps = _steps(train_transform)
    if _train_steps(steps):
        return []
    known = (T.RandomResizedCrop, T.RandomHorizontalFlip, *_TO_TENSOR, T.Normalize)
    return [t for t in steps if not isinstance(t, known)] or steps


def resolve_pipeline(requested, device, train_transform):
    """data.pipeline -> 'pil' or 'gpu'; auto takes the fast path on CUDA when it can reproduce the transform."""
    unsupported = unsupported_train_steps(train_transform)
    if requested == "auto":
        return "gpu" if device.type == "cuda" and not unsupported else "pil"
    if requested == "gpu" and unsupported:
        names = ", ".join(type(t).__name__ for t in unsupported)
        raise UserError(f"data.pipeline=gpu reproduces {DEVICE_TRAIN_STEPS} only, and the train transform "
                        f"(data.py) also has {names}; use data.pipeline=pil (or auto), or implement it in "
                        "utils/gpu_pipeline.py")
    return requested


def host_available_bytes():
    """The host memory a new allocation can take now (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def pinned_block_bytes(n_bytes):
    """What torch.empty(n_bytes, pin_memory=True) really takes of the host."""
    # torch's CachingHostAllocator::allocate rounds every block up to a power of two (PowerOf2Ceil) unless
    # PYTORCH_ALLOC_CONF sets pinned_max_round_threshold_mb; counting the default errs on the safe side.
    return 1 << (int(n_bytes) - 1).bit_length() if n_bytes > 0 else 0


def check_cache_fits(need_bytes, available_bytes, sharing, where, pinned=False):
    """Refuse a cache over half of the memory it can have: `available_bytes` shared by `sharing` processes.
    pinned: the cache is one pinned host block, counted at its rounded size (pinned_block_bytes)."""
    why = cache_refusal(need_bytes, available_bytes, sharing, where, pinned)
    if why:
        raise UserError(why + CACHE_HINT)


def cache_refusal(need_bytes, available_bytes, sharing, where, pinned=False):
    """Why check_cache_fits would refuse this cache, or None if it fits (or the memory is unknown)."""
    if available_bytes is None:
        return None
    budget = available_bytes / max(sharing, 1) / 2
    taken = pinned_block_bytes(need_bytes) if pinned else need_bytes
    if taken <= budget:
        return None
    share = f" / {sharing} processes on this node" if sharing > 1 else ""
    rounded = f" (a {_size(taken)} pinned block)" if taken != need_bytes else ""
    return (f"data.pipeline=gpu would cache {_size(need_bytes)}{rounded} in {where}, over half of "
            f"the {_size(available_bytes)} available{share}")


def _size(n_bytes):
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


def resolve_cache_size(data_cfg):
    # 1.25 x the val resize keeps most crops at or above their source resolution (320 px at 224/256).
    return data_cfg.cache_size if data_cfg.cache_size > 0 else int(math.ceil(1.25 * data_cfg.val_resize))


def sample_crops(heights, widths, generator, scale=(0.08, 1.0), ratio=RATIO, attempts=10, flip_p=0.5):
    """RandomResizedCrop.get_params for a whole batch: (top, left, h, w) per image, plus flips.

    Same algorithm as torchvision: up to `attempts` tries of a uniform area
    fraction and a log-uniform aspect ratio; the first box that fits is placed
    uniformly; if none fits, the central crop clamped to `ratio`. Runs on the
    CPU with `generator`, so it is reproducible whatever the device.
    """
    H = torch.as_tensor(heights, dtype=torch.float64)
    W = torch.as_tensor(widths, dtype=torch.float64)
    n = H.shape[0]
    area = (H * W).unsqueeze(1)
    u_area = torch.rand(n, attempts, generator=generator, dtype=torch.float64)
    u_ratio = torch.rand(n, attempts, generator=generator, dtype=torch.float64)
    u_pos = torch.rand(n, 2, generator=generator, dtype=torch.float64)
    flip = torch.rand(n, generator=generator) < flip_p
    target = area * (scale[0] + (scale[1] - scale[0]) * u_area)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u_ratio)
    w = torch.round(torch.sqrt(target * aspect))
    h = torch.round(torch.sqrt(target / aspect))
    fits = (w > 0) & (w <= W.unsqueeze(1)) & (h > 0) & (h <= H.unsqueeze(1))
    first = fits.double().argmax(dim=1, keepdim=True)  # index of the first attempt that fits
    found = fits.any(dim=1)
    w = w.gather(1, first).squeeze(1)
    h = h.gather(1, first).squeeze(1)
    top = torch.floor(u_pos[:, 0] * (H - h + 1))
    left = torch.floor(u_pos[:, 1] * (W - w + 1))
    # Fallback: the central crop, its aspect ratio clamped into `ratio`.
    in_ratio = W / H
    fw = torch.where(in_ratio > ratio[1], torch.round(H * ratio[1]), W)
    fh = torch.where(in_ratio < ratio[0], torch.round(W / ratio[0]), H)
    ftop, fleft = torch.floor((H - fh) / 2), torch.floor((W - fw) / 2)
    boxes = torch.stack([torch.where(found, top, ftop), torch.where(found, left, fleft),
                         torch.where(found, h, fh), torch.where(found, w, fw)], dim=1)
    return boxes, flip


def crop_theta(boxes, flip, heights, widths):
    """Boxes in original pixels -> affine_grid matrices over the stretched square cache image.

    The cache holds an H x W image stretched to S x S, so a box maps to the
    same fractions of the square; with align_corners=False the output pixel
    centres land at the centres of the box's cells, as a crop + resize does.
    """
    H = torch.as_tensor(heights, dtype=torch.float64)
    W = torch.as_tensor(widths, dtype=torch.float64)
    top, left, h, w = boxes.unbind(1)
    sx, sy = w / W, h / H                            # box size as a fraction of the image
    cx, cy = (2 * left + w) / W - 1, (2 * top + h) / H - 1  # box centre in [-1, 1]
    theta = torch.zeros(boxes.shape[0], 2, 3, dtype=torch.float64)
    theta[:, 0, 0] = torch.where(flip, -sx, sx)
    theta[:, 0, 2] = cx
    theta[:, 1, 1] = sy
    theta[:, 1, 2] = cy
    return theta.float()


def _chw_uint8(img):
    """RGB or grey PIL image -> uint8 CHW tensor (C = 3 or 1), with memory of its own (not PIL's buffer)."""
    return torch.from_numpy(np.asarray(img).copy()).view(img.height, img.width, -1).permute(2, 0, 1)


class _TrainCacheItem:
    """PIL image -> (uint8 CHW stretched to size x size, its original (H, W))."""

    def __init__(self, size):
        self.size = size

    def __call__(self, img):
        w, h = img.size
        img = img.resize((self.size, self.size), Image.BILINEAR)  # PIL antialiases when shrinking
        return _chw_uint8(img), torch.tensor([h, w])

    def on_tensor(self, img):
        """The same for a uint8 CHW tensor (data.gpu_decode=per_batch): torch's antialiased bilinear."""
        return TF.resize(img, [self.size, self.size], interpolation=T.InterpolationMode.BILINEAR, antialias=True)


class _ValCacheItem:
    """PIL image -> uint8 CHW after exactly the PIL path's Resize + CenterCrop."""

    def __init__(self, geometric):
        self.geometric = geometric

    def __call__(self, img):
        img = self.geometric(img)
        return _chw_uint8(img), torch.tensor(img.size[::-1])

    def on_tensor(self, img):
        """The same steps on a uint8 CHW tensor (torchvision's Resize antialiases tensors too)."""
        return self.geometric(img)


# While the cache is built: images per decoded chunk, and the chunks each worker keeps ready.
CHUNK, CHUNK_PREFETCH = 32, 2


def build_cache(dataset, item_fn, workers, images, chunk=CHUNK):
    """Decode every image of `dataset` once (in `workers` processes) into `images`, a uint8 N x C x S x S
    tensor wherever the cache lives (C: 3, or 1 for grey) -> (sizes N x 2, labels N).

    Each decoded chunk is copied straight into `images`, so a cache on the device never passes through
    a host copy of itself: the host holds only the chunks in flight (chunks_in_flight). The dataset is
    copied with its transform swapped, so its own loading (RGB conversion, error messages) is exactly
    what the PIL path uses. An empty dataset (data.val_rate=0) gives an empty cache.
    """
    decoding = copy.copy(dataset)
    decoding.transform = item_fn
    loader = DataLoader(decoding, batch_size=chunk, shuffle=False, num_workers=workers,
                        prefetch_factor=CHUNK_PREFETCH if workers > 0 else None)
    sizes = torch.empty(len(dataset), 2, dtype=torch.long)
    labels, at = torch.empty(len(dataset), dtype=torch.long), 0
    for (pixels, hw), label in loader:
        images[at:at + len(label)].copy_(pixels)
        sizes[at:at + len(label)] = hw
        labels[at:at + len(label)] = label
        at += len(label)
    return sizes, labels


def chunks_in_flight(workers):
    # Those the workers keep ready, plus the one being copied.
    return CHUNK_PREFETCH * workers + 1


def cache_memory_refusal(n_images, item_bytes, device, on_device, pin, workers, procs_per_node):
    """Why a cache of n_images cannot be built here (check_cache_fits's rule), or None.

    A host cache is counted whole, on every process of the node. A device cache is counted against its
    GPU, and its chunks in flight while it is built against the host, on every process of the node."""
    need = n_images * item_bytes
    if not on_device:
        where = "pinned host memory" if pin else "host memory"
        return cache_refusal(need, host_available_bytes(), procs_per_node, where, pinned=pin)
    in_flight = min(n_images, chunks_in_flight(workers) * CHUNK) * item_bytes
    return (cache_refusal(need, torch.cuda.mem_get_info(device)[0], 1, f"the memory of {device}")
            or cache_refusal(in_flight, host_available_bytes(), procs_per_node,
                             f"host memory on its way to {device}"))


class GpuLoader:
    """Drop-in for the DataLoader that make_loader returns: len(), .sampler, .generator, .dataset.

    Yields (images, labels) already on `device`, normalised, channels_last
    when asked; the training loop's own .to(device) is then a no-op. The
    augmentation's parameters come from `dataset.transform` (_train_steps).
    The pixels come from the decode-once cache, or (data.gpu_decode, and see
    JpegBatches) from the JPEG files, decoded on the device batch by batch.
    prefetch_factor: the batches each worker of JpegBatches keeps ready (None: DataLoader's default).
    """

    def __init__(self, dataset, batch_size, sampler, data_cfg, device, train, workers=0,
                 channels_last=False, verbose=True, procs_per_node=1, prefetch_factor=None):
        self.dataset, self.batch_size, self.sampler = dataset, batch_size, sampler
        self.device, self.train, self.channels_last = device, train, channels_last
        steps = _steps(dataset.transform)
        norm = steps[-1]
        channels = getattr(dataset, "channels", 3)  # grey (data.channels=1): a third of the cache
        if train:
            crop, flip, _ = _train_steps(steps)
            self.out_size, self.scale, self.ratio = tuple(crop.size), tuple(crop.scale), tuple(crop.ratio)
            self.flip_p = flip.p if flip is not None else 0.0
            size = resolve_cache_size(data_cfg)
            item, shape = _TrainCacheItem(size), (channels, size, size)
        else:
            # The PIL path's val transform up to ToTensor + Normalize, which run on the device here.
            assert _ends_in_tensor_and_normalize(steps), f"unexpected val transform {steps}"
            item, shape = _ValCacheItem(T.Compose(steps[:-2])), (channels, data_cfg.img_size, data_cfg.img_size)
        self.generator = torch.Generator()  # reseeded every epoch by fit(): reproducible augmentation
        start = time.perf_counter()
        self.on_device = device.type == "cuda" and data_cfg.cache_on_device
        pin = device.type == "cuda" and not self.on_device
        # Decided before anything is allocated on the device or decoded.
        refusal = cache_memory_refusal(len(dataset), math.prod(shape), device, self.on_device, pin, workers,
                                       procs_per_node)
        if refusal and data_cfg.gpu_decode == "once":
            raise UserError(refusal + CACHE_HINT)
        self.mean, self.std = normalization_of(norm, device)  # Normalize's, on the device, for normalize()
        self.jpeg = None
        if data_cfg.gpu_decode == "per_batch" or refusal:
            # A set too large to cache: the workers read file bytes, each batch is decoded here.
            self.jpeg = JpegBatches(dataset, batch_size, sampler, train, workers, device, item.on_tensor,
                                    prefetch_factor)
            if verbose:
                print(f"gpu pipeline: {len(dataset)} {'train' if train else 'val'} images, JPEGs decoded on "
                      f"{device} every batch" + (f" ({refusal})" if refusal else ""), flush=True)
            return
        where = "device memory" if self.on_device else ("pinned host memory" if pin else "host memory")
        self.images = torch.empty((len(dataset), *shape), dtype=torch.uint8,
                                  device=device if self.on_device else "cpu", pin_memory=pin)
        self.sizes, labels = build_cache(dataset, item, workers, self.images)
        self.labels = labels.to(device)
        self.cache_seconds = time.perf_counter() - start
        self.cache_bytes = self.images.numel()
        if verbose:
            print(f"gpu pipeline: {len(dataset)} {'train' if train else 'val'} images decoded once into "
                  f"{self.cache_bytes / 2**20:.0f} MiB of {where} in {self.cache_seconds:.1f}s", flush=True)

    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.train else math.ceil(n / self.batch_size)

    def __iter__(self):
        if self.jpeg is not None:
            for pixels, sizes, labels in self.jpeg:
                yield self._augment(pixels, sizes, labels)
            return
        order = torch.as_tensor(list(self.sampler), dtype=torch.long)
        for b in range(len(self)):
            yield self._batch(order[b * self.batch_size:(b + 1) * self.batch_size])

    def _batch(self, idx):
        pin = self.device.type == "cuda"
        if not self.on_device:  # host cache: gather into pinned memory, copy async
            pixels = torch.empty((len(idx),) + tuple(self.images.shape[1:]), dtype=torch.uint8, pin_memory=pin)
            torch.index_select(self.images, 0, idx, out=pixels)
            pixels = pixels.to(self.device, non_blocking=True)
        else:
            pixels = self.images[_to(idx, self.device, pin)]
        return self._augment(pixels, self.sizes[idx], self.labels[_to(idx, self.device, pin)])

    def _augment(self, pixels, sizes, labels):
        """A batch as the cache holds it (uint8 on the device; train: stretched squares, with their
        original (H, W) in `sizes` on the host) -> the random resized crops and flips, normalised."""
        if self.train:
            heights, widths = sizes[:, 0], sizes[:, 1]
            boxes, flip = sample_crops(heights, widths, self.generator, self.scale, self.ratio, flip_p=self.flip_p)
            theta = _to(crop_theta(boxes, flip, heights, widths), self.device, self.device.type == "cuda")
            size = (len(labels), pixels.shape[1], *self.out_size)
            grid = F.affine_grid(theta, size, align_corners=False)
            # Interpolating uint8 values keeps normalisation identical to the PIL path's order of ops.
            pixels = F.grid_sample(pixels.float(), grid, mode="bilinear", padding_mode="border",
                                   align_corners=False)
        return normalize(pixels, self.mean, self.std, self.channels_last), labels


def _to(t, device, pin):
    # A small pinned copy is asynchronous: the host never waits for the GPU queue here.
    if device.type == "cpu":
        return t
    return (t.pin_memory() if pin else t).to(device, non_blocking=True)


# --------------------------------------------------------------------------- decoding every batch

ENCODED, PIXELS = 0, 1  # what a worker sends for one image: the file's bytes, or pixels PIL decoded


class EncodedFiles(Dataset):
    """Index -> (1-D uint8, kind, H, W, label, index, EXIF orientation), in the DataLoader workers.

    A JPEG that the device can decode as the PIL path would (RGB or grey, within
    data.max_image_pixels, not known bad) is sent as its file's bytes (ENCODED);
    for a grey dataset it is decoded to its luma plane there, as utils/decoding.py does.
    Anything else (PNG, CMYK JPEG, an unreadable file) goes through the dataset's
    own PIL loading, with its RGB conversion and bad-image substitution, and is
    sent as pixels (PIXELS, H x W), upright already. A JPEG's EXIF orientation (1-8) travels with its
    bytes: the decoders return the stored pixels, and JpegBatches turns them upright.
    """

    def __init__(self, dataset):
        self.pil = copy.copy(dataset)
        self.pil.transform = _chw_uint8
        self.max_pixels = getattr(dataset, "max_pixels", 0)

    def __len__(self):
        return len(self.pil)

    def __getitem__(self, index):
        label = self.pil.samples[index][1]
        raw, orientation = _jpeg_bytes(self.pil, index, self.max_pixels) if not self._known_bad(index) else (None, 1)
        if raw is not None:
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8), ENCODED, 0, 0, label, index, orientation
        pixels, label = self.pil[index]
        return pixels.flatten(), PIXELS, pixels.shape[1], pixels.shape[2], label, index, 1

    def _known_bad(self, index):
        status = getattr(self.pil, "bad_status", None)
        return status is not None and bool(status[index])


def _jpeg_bytes(dataset, index, max_pixels):
    """(image `index`'s file bytes, its EXIF orientation) if PIL reads it as an RGB or grey JPEG within max_pixels
    (its header only), else (None, 1). The bytes are the dataset's (file_bytes): a file's, or a shard's."""
    try:
        raw = dataset.file_bytes(index)
        with Image.open(io.BytesIO(raw)) as img:
            w, h = img.size
            ok = img.format == "JPEG" and img.mode in ("RGB", "L") and not (max_pixels and w * h > max_pixels)
            orientation = exif_orientation(img)
        return (raw, orientation) if ok else (None, 1)
    except Exception:  # noqa: BLE001 - the PIL path decides what is wrong with the file, and says so
        return None, 1


def _collate_encoded(items):
    """One buffer for the whole batch (one shared-memory block through IPC, not one per image)."""
    parts, kinds, heights, widths, labels, indices, orientations = zip(*items)
    meta = torch.tensor(list(zip(kinds, heights, widths, labels, indices, orientations)), dtype=torch.long)
    return torch.cat(parts), torch.tensor([len(p) for p in parts]), meta


class JpegBatches:
    """data.gpu_decode=per_batch: file bytes from DataLoader workers -> uint8 batches on `device` as the
    cache would hold them (train: each image stretched to the cache square, its (H, W) beside it; val: the
    PIL path's Resize + CenterCrop), for GpuLoader._augment.

    The JPEGs of a batch are decoded in one torchvision.io.decode_jpeg call on the device (nvjpeg on
    CUDA, libjpeg on the CPU); other images arrive decoded. The order is the sampler's; the workers draw
    nothing at random, so the crops (drawn from GpuLoader.generator) and a resumed run are as with the
    cache, and the workers can live across epochs.
    """

    def __init__(self, dataset, batch_size, sampler, train, workers, device, resize, prefetch_factor=None):
        self.device, self.resize = device, resize
        # nvJPEG's (and libjpeg's) GRAY mode writes the luma plane alone: NVJPEG_OUTPUT_Y, (1, H, W).
        self.mode = ImageReadMode.GRAY if getattr(dataset, "channels", 3) == 1 else ImageReadMode.RGB
        files = EncodedFiles(dataset)
        self.fallback = files.pil  # a JPEG the decoder refuses goes the PIL path, in this process
        self.loader = DataLoader(files, batch_size=batch_size, sampler=sampler, drop_last=train,
                                 num_workers=workers, collate_fn=_collate_encoded, persistent_workers=workers > 0,
                                 prefetch_factor=prefetch_factor if workers > 0 else None,
                                 generator=torch.Generator())  # the workers' base seed, not the global RNG

    def __iter__(self):
        for blob, lengths, meta in self.loader:
            images, labels = self.decode(blob.split(lengths.tolist()), meta.tolist())
            sizes = torch.tensor([img.shape[1:] for img in images], dtype=torch.long)
            pixels = torch.stack([self.resize(img) for img in images])
            # The full-size decodes (4.6 GB for 128 photos of 4000x3000) and the file bytes are not
            # kept alive through the step that trains on this batch, nor while the next one is decoded.
            del images, blob
            yield pixels, sizes, _to(torch.tensor(labels), self.device, self.device.type == "cuda")

    def decode(self, parts, meta):
        """-> (uint8 CHW images on the device, labels). A batch the decoder refuses is retried image by
        image; an image it refuses goes through the dataset's PIL loading (which warns and substitutes)."""
        images, labels = [None] * len(parts), [m[3] for m in meta]
        jpegs = [i for i, m in enumerate(meta) if m[0] == ENCODED]
        try:
            decoded = _decode_jpegs([parts[i] for i in jpegs], self.device, self.mode) if jpegs else []
        except RuntimeError as e:
            if _out_of_memory(e):  # not the files' fault: PIL decodes the whole batch, no retry per image
                self._say_out_of_memory(len(jpegs), e)
                decoded = [None] * len(jpegs)
            else:
                decoded = [self._decode_one(parts[i]) for i in jpegs]
        for i, img in zip(jpegs, decoded):
            images[i] = None if img is None else upright_tensor(img, meta[i][5])
        for i, (kind, h, w, _, index, _) in enumerate(meta):
            if kind == PIXELS:
                images[i] = parts[i].view(-1, h, w).to(self.device, non_blocking=True)
            elif images[i] is None:
                pixels, labels[i] = self.fallback[index]
                images[i] = pixels.to(self.device)
        return images, labels

    def _decode_one(self, part):
        try:
            return _decode_jpegs([part], self.device, self.mode)[0]
        except RuntimeError as e:
            if _out_of_memory(e):
                self._say_out_of_memory(1, e)
            return None

    def _say_out_of_memory(self, count, e):
        """Once per process (train and val loaders alike): the batch is decoded by PIL on the CPU instead
        (slower, the same pixels). Should that run out of device memory too, the run stops with the loop's
        one out-of-memory line."""
        if not _SAID["oom"]:
            _SAID["oom"] = True
            print(f"warning: nvJPEG ran out of {self.device} memory decoding {count} JPEG(s) ({str(e).splitlines()[0]}); "
                  "such batches are decoded by PIL on the CPU instead (slower): a smaller --batch-size "
                  "avoids it; later ones are not reported", file=sys.stderr, flush=True)


def upright_tensor(img, orientation):
    """A decoded C x H x W image turned as its EXIF orientation says, as utils/decoding.upright turns a PIL
    image: nvJPEG returns the stored pixels (torchvision's apply_exif_orientation is CPU-only), so both
    devices take this one way."""
    if orientation in (5, 6, 7, 8):  # sideways: transpose first, then the flips below as for 4, 1, 2, 3
        img, orientation = img.transpose(-2, -1), {5: 1, 6: 2, 7: 3, 8: 4}[orientation]
    flips = {2: (-1,), 3: (-2, -1), 4: (-2,)}.get(orientation)
    return img.flip(flips) if flips else img


def _out_of_memory(e):
    """An error of the decoder's that is the device's memory, not the file: torch's own, or nvJPEG's
    allocator status (torchvision passes it on as a RuntimeError)."""
    return isinstance(e, OUT_OF_MEMORY) or bool(re.search(r"out of memory|ALLOCATOR_FAILURE", str(e), re.I))


def _decode_jpegs(parts, device, mode=ImageReadMode.RGB):
    # decode_jpeg(list, device=...) (torchvision >= 0.19, so torch >= 2.4) is the batched nvjpeg call.
    # torchvision 0.29 marks its decoders deprecated in favour of TorchCodec; they still work.
    if device.type == "cuda":
        # nvJPEG's hardware engine can write its outputs before the work queued on the stream has run,
        # into blocks that queued kernels still read (pytorch/vision#9606): drain the stream first.
        torch.cuda.current_stream(device).synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(parts, mode=mode, device=device)
