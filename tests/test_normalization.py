"""Input normalisation has one home (utils/normalization.py): the loop's device pass, a float
transform's NormalizeOnDevice and the pictures' inverse give torchvision's numbers."""
import torch
from torchvision import transforms

import data
from utils import normalization

CPU = torch.device("cpu")


def test_the_device_pass_and_a_float_transform_give_torchvision_normalize_exactly():
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8, generator=g)
    reference = transforms.Normalize(data.IMAGENET_MEAN, data.IMAGENET_STD)
    expected = torch.stack([reference(transforms.functional.convert_image_dtype(p, torch.float)) for p in pixels])
    _, val = data.build_transforms(8, 8)
    batch = normalization.model_input(pixels, CPU, normalization.normalization_of(val, CPU))
    assert batch.dtype == torch.float32 and torch.allclose(batch, expected, atol=1e-6)
    # A float image (an augmentation after ConvertImageDtype) is normalised in the transform, bitwise as torchvision.
    norm = data.NormalizeOnDevice(data.IMAGENET_MEAN, data.IMAGENET_STD)
    floats = pixels.float() / 255
    assert all(torch.equal(norm(f), reference(f)) for f in floats)
    assert torch.equal(norm(pixels[0]), pixels[0])  # uint8 passes on to the device pass
    assert normalization.mean_std(val) == (tuple(data.IMAGENET_MEAN), tuple(data.IMAGENET_STD))


def test_the_pictures_undo_the_normalisation():
    pixels = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    _, val = data.build_transforms(8, 8)
    batch = normalization.model_input(pixels, CPU, normalization.normalization_of(val, CPU))
    shown = normalization.denormalize(batch, *normalization.mean_std(val))
    assert torch.allclose(shown, pixels / 255, atol=1e-6)
