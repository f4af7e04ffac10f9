"""MixUp and CutMix (data.mixup_alpha, data.cutmix_alpha): batch augmentations that mix images and labels.

They act on a whole batch on the device, after the loader, so they sit beside the data code rather
than in data.py's per-image transforms; the loss takes their soft targets (engine.Criterion).
"""
from torchvision.transforms import v2


def batch_mixer(mixup_alpha, cutmix_alpha, num_classes):
    """data.mixup_alpha / data.cutmix_alpha -> torchvision's MixUp, CutMix or a random choice of the
    two per batch, called as mix(images, labels) -> (images, soft targets); None when both are 0.

    Their random draws come from torch's global generator, which the loop seeds per epoch and a
    checkpoint saves: a resumed run mixes exactly as the uninterrupted one would."""
    mixers = ([v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []) + \
             ([v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else [])
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)
