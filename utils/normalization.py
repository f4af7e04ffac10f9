"""Input normalisation, in one place: pixels 0..255 -> (x / 255 - mean) / std, and back for pictures.

data.py's transforms end in NormalizeOnDevice, which passes uint8 images on: the loop, the gpu
pipeline and predict.py normalise whole batches on the device here (a quarter of the bytes through
the workers), with the mean and std that step holds. A float image (after ConvertImageDtype) is
normalised by NormalizeOnDevice itself, with the same formula. It lives in utils/ because the gpu
pipeline (utils/) uses it and utils/ does not import data.py. The mean and std themselves are here too
(imagenet_stats): ImageNet's per channel for RGB, one pair for grey images (data.channels=1).
"""
import torch

FORMULA = "/255, (x - mean) / std"  # what normalize computes, in words (export.py's sidecar)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Grey images: the averages of the three above. A grey image replicated into R, G and B and normalised
# with one (mean, std) in every channel is what a first convolution with its RGB kernels summed sees
# exactly (model.adapt_first_conv); these are within 0.043 (mean) and 0.003 (std) of each channel's own.
GREY_MEAN = (0.449,)
GREY_STD = (0.226,)


def imagenet_stats(channels=3):
    """(mean, std) the transforms normalise with, one value per channel: data.channels 3 or 1."""
    return {3: (IMAGENET_MEAN, IMAGENET_STD), 1: (GREY_MEAN, GREY_STD)}[channels]


def normalize(pixels, mean, std, channels_last=False, scale=255):
    """NCHW pixels in 0..scale (uint8, or float) -> normalised floats (float32 for uint8): the same ops as ToTensor +
    Normalize, so the same numbers; mean and std broadcast over the pixels (normalization_of).
    channels_last: the first op writes that layout, which saves the separate full-batch copy a
    conversion afterwards would make. scale=1: values already in 0..1 (torchvision's Normalize)."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    dtype = pixels.dtype if pixels.is_floating_point() else torch.float32
    out = torch.empty(pixels.shape, dtype=dtype, device=pixels.device, memory_format=layout)
    return torch.div(pixels, scale, out=out).sub_(mean).div_(std)


def mean_std(source):
    """(mean, std) of a Normalize step (NormalizeOnDevice too): `source` itself, or the first one in
    `source.transforms` or `source.transform.transforms` (a dataset); (None, None) without one."""
    if hasattr(source, "mean") and hasattr(source, "std"):
        return tuple(source.mean), tuple(source.std)
    for t in getattr(getattr(source, "transform", source), "transforms", []):
        if hasattr(t, "mean") and hasattr(t, "std"):
            return tuple(t.mean), tuple(t.std)
    return None, None


def normalization_of(source, device):
    """(mean, std) of `source` (mean_std) as (1, C, 1, 1) float32 on `device`, for normalize; (0, 1)
    without a Normalize step, ToTensor's /255 alone. Made once a pass, not per batch."""
    mean, std = mean_std(source)
    return tuple(torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1).to(device, non_blocking=True)
                 for v in (mean or (0.0,), std or (1.0,)))


def model_input(images, device, norm, channels_last=False):
    """A loader's images -> the model's input on `device`. uint8 images (data.py's transforms) become
    float, normalised with `norm` (normalization_of) and channels_last there, in one pass, with no
    host sync; float images were normalised by their transform and are moved as they are."""
    # non_blocking pairs with pin_memory: the copy overlaps with queued GPU work.
    images = images.to(device, non_blocking=True)
    if images.dtype == torch.uint8:
        return normalize(images, *norm, channels_last=channels_last)
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


def denormalize(images, mean=None, std=None):
    """(N, C, H, W) normalised tensors -> the same in [0, 1] (normalize undone); per-image min-max
    without mean/std. uint8 images (before the loop normalises them) are pixels: /255."""
    if images.dtype == torch.uint8:
        return images.detach().cpu().float() / 255
    images = images.detach().float().cpu()
    if mean is not None and std is not None:
        images = images * torch.tensor(std).view(1, -1, 1, 1) + torch.tensor(mean).view(1, -1, 1, 1)
    else:
        low = images.amin(dim=(1, 2, 3), keepdim=True)
        images = (images - low) / (images.amax(dim=(1, 2, 3), keepdim=True) - low).clamp(min=1e-8)
    return images.clamp(0, 1)
