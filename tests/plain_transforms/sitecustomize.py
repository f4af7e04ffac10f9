"""Python imports this file at start-up when its folder is on PYTHONPATH (tests/test_benchmarks.py,
tests/test_edits.py): data.build_transforms becomes the transforms the template ships, in this
process and in every process it starts (torchrun workers too). Tools that run train.py then test
what they measure, whatever augmentation a user has added to data.py. Not a product file.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import data  # noqa: E402
from torchvision import transforms as T  # noqa: E402
from utils.decoding import DraftRandomResizedCrop, DraftResize  # noqa: E402


def plain_transforms(img_size, val_resize, min_crop_scale=0.08, channels=3):
    """(train, val) as data.build_transforms ships them: exactly the steps the gpu pipeline reproduces."""
    norm = data.NormalizeOnDevice(*data.imagenet_stats(channels))
    train = T.Compose([DraftRandomResizedCrop(img_size, scale=(min_crop_scale, 1.0)), T.RandomHorizontalFlip(),
                       norm])
    return train, T.Compose([DraftResize(val_resize), T.CenterCrop(img_size), T.PILToTensor(), norm])


if __name__ == "sitecustomize":  # at start-up; an import by a test only borrows the function
    data.build_transforms = plain_transforms
