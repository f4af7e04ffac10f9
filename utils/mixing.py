"""MixUp and CutMix (data.mixup_alpha, data.cutmix_alpha): batch augmentations that mix images and labels.

They act on a whole batch on the device, after the loader, so they sit beside the data code rather
than in data.py's per-image transforms; the loss takes their soft targets (engine.Criterion).
Single-label batches use torchvision's; multi-label batches (multi-hot targets, which torchvision's
refuse) use MultiHotMix below, the same recipe with the targets mixed as they are.
"""
import math

import torch


def batch_mixer(mixup_alpha, cutmix_alpha, num_classes, multilabel=False):
    """data.mixup_alpha / data.cutmix_alpha -> torchvision's MixUp, CutMix or a random choice of the
    two per batch, called as mix(images, labels) -> (images, soft targets); None when both are 0.
    multilabel: MultiHotMix, mixing (B, C) multi-hot targets.

    Their random draws come from torch's global generator, which the loop seeds per epoch and a
    checkpoint saves: a resumed run mixes exactly as the uninterrupted one would."""
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return None
    if multilabel:
        return MultiHotMix(mixup_alpha, cutmix_alpha)
    from torchvision.transforms import v2  # here: 0.15 s of imports that a run without mixing does not pay
    mixers = ([v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []) + \
             ([v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else [])
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)


class MultiHotMix:
    """MixUp or CutMix (a fair coin per batch when both are on) of a batch with itself rolled by one,
    as torchvision's: images (B, C, H, W), targets (B, num_labels) in [0, 1]. The targets mix with the
    images' weight lam: lam * t + (1 - lam) * t_rolled (CutMix: lam = the kept area's share)."""

    def __init__(self, mixup_alpha, cutmix_alpha):
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha

    def __call__(self, images, targets):
        cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or torch.rand(()).item() < 0.5)
        alpha = self.cutmix_alpha if cutmix else self.mixup_alpha
        lam = torch.distributions.Beta(alpha, alpha).sample(()).item()
        rolled, targets = images.roll(1, 0), targets.float()
        if cutmix:
            h, w = images.shape[-2:]
            cy, cx = torch.randint(h, ()).item(), torch.randint(w, ()).item()
            r = 0.5 * math.sqrt(1.0 - lam)
            y0, y1 = max(cy - int(r * h), 0), min(cy + int(r * h), h)
            x0, x1 = max(cx - int(r * w), 0), min(cx + int(r * w), w)
            images = images.clone()
            images[..., y0:y1, x0:x1] = rolled[..., y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)
        else:
            images = images * lam + rolled * (1.0 - lam)
        return images, targets * lam + targets.roll(1, 0) * (1.0 - lam)
