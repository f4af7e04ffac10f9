"""Image files -> 8-bit RGB (or grey), a JPEG decoded only as large as the transform needs (draft decoding).

A 4000x3000 photo cropped to 224 px needs a fraction of its pixels: PIL's draft mode decodes a JPEG
at 1/2, 1/4 or 1/8 of each side (DCT scaling), several times faster. load_image hands a JPEG to
DraftRandomResizedCrop or DraftResize undecoded, and they decode it at the smallest scale that still
leaves their output's pixels. Any other file, or another first transform, is decoded whole.

Grey (mode "L", data.channels=1): a colour JPEG is decoded straight to its luma plane (libjpeg's grey
output, no chroma decoded), the pixels torchvision's decode_jpeg and nvJPEG give in their GRAY mode;
any other file is converted by PIL's luma formula, which is how that plane was made when it was encoded.

EXIF orientation: a phone stores a photo's pixels as the sensor read them and a tag saying how to turn
them upright. Every image is turned upright here (PIL's ImageOps.exif_transpose table), a JPEG decoded
small after its decode, with its crop box or resize drawn in the upright image's pixels.
"""
import contextlib
import io
import os

import numpy as np
import torch
from PIL import Image
from torchvision import transforms
from torchvision.transforms import functional as TF

# PIL's own decompression-bomb check warns or fails without naming the file;
# load_rgb applies data.max_image_pixels itself, with the path in the message.
Image.MAX_IMAGE_PIXELS = None


class BadImage(Exception):
    """A file that cannot be decoded into an image; the message names it and says why."""


MODES = {3: "RGB", 1: "L"}  # data.channels -> the PIL mode images are decoded to

# EXIF orientation (2-8) -> the transpose that turns the stored pixels upright: ImageOps.exif_transpose's
# table (that function decodes the whole image first, before a JPEG could be decoded small).
UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
           5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}
SIDEWAYS = (5, 6, 7, 8)  # the orientations that swap width and height


def exif_orientation(img):
    """An opened image's EXIF orientation (1-8; a JPEG's is in the header read), 1 where it has none or
    the tag is unreadable (a broken tag does not make the pixels unusable)."""
    try:
        orientation = img.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - see the docstring
        return 1
    return orientation if orientation in UPRIGHT else 1


def upright(img, orientation):
    """A decoded PIL image turned as its EXIF orientation says (itself for 1)."""
    return img.transpose(UPRIGHT[orientation]) if orientation in UPRIGHT else img


def upright_size(img):
    """(width, height) of an opened image once turned upright, before it is decoded."""
    w, h = img.size
    return (h, w) if getattr(img, "orientation", 1) in SIDEWAYS else (w, h)


def to_8bit(img, mode="RGB"):
    """Any PIL mode (CMYK, RGBA, L, P, 16-bit grey, ...) -> 8-bit `mode`: RGB, or L (grey)."""
    if img.mode.startswith("I"):
        # 16-bit grey: convert("RGB") would clip every value over 255 to white; scale instead.
        arr = np.asarray(img).astype(np.int64).clip(0, 65535)
        if img.mode != "I" or arr.max() > 255:
            arr = arr >> 8
        img = Image.fromarray(arr.astype(np.uint8), "L")
    elif img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # PIL warns on P + transparency -> RGB; this way is silent
    return img.convert(mode)


def _decode_error(path, e):
    why = (str(e).splitlines() or [type(e).__name__])[0].replace(f" '{path}'", "")
    return BadImage(f"cannot decode '{path}': {why}")


def load_rgb(path, max_pixels=0, undecoded=False, mode="RGB", data=None):
    """Decode `path` to RGB (mode="L": grey); raise BadImage naming the file if it cannot be decoded.
    undecoded: a JPEG comes back with only its header read (and the mode wanted, as `wanted_mode`), for
    `decode` to decode at the size needed. data: the file's bytes (read from a shard); `path` then names it."""
    try:
        if (os.path.getsize(path) if data is None else len(data)) == 0:
            raise BadImage(f"'{path}' is empty (0 bytes)")
        img = Image.open(path if data is None else io.BytesIO(data))  # reads the header only
        w, h = img.size
        if max_pixels and w * h > max_pixels:
            img.close()
            raise BadImage(f"'{path}' is {w}x{h} = {w * h} pixels, over data.max_image_pixels="
                           f"{max_pixels} (a decompression-bomb guard); raise it if you trust the file")
        if undecoded and img.format == "JPEG":
            img.wanted_mode, img.orientation = mode, exif_orientation(img)
            return img
        with img:
            if mode == "L" and img.format == "JPEG":
                img.draft("L", None)  # a colour JPEG decodes to its luma plane (module docstring)
            orientation = exif_orientation(img)  # read before to_8bit, whose copy may drop the tag
            return upright(to_8bit(img, mode), orientation)
    except BadImage:
        raise
    except Exception as e:  # noqa: BLE001 - whatever PIL raises on a broken file is the file's fault
        raise _decode_error(path, e) from None


def decode(img, scale=1):
    """An image from load_rgb -> (8-bit RGB or grey, as load_rgb was asked, upright, and how many times
    smaller it was decoded). A JPEG not decoded yet is decoded at 1/scale of each side (rounded up); any
    other image is as it is."""
    w, mode, orientation = img.width, getattr(img, "wanted_mode", None), getattr(img, "orientation", 1)
    if mode is None:  # decoded already: load_rgb gave it the mode wanted
        mode = img.mode if img.mode in MODES.values() else "RGB"
    try:
        # draft() also turns a colour JPEG's decoder to its luma plane when grey is wanted.
        drafted = (img.draft(mode if img.mode == "RGB" else img.mode, (w // scale, img.height // scale))
                   if scale > 1 or mode == "L" else None)
        if img.mode == mode:
            img.load()  # in place: a JPEG already in the mode wanted, the usual case, is not copied
        else:
            img = to_8bit(img, mode)
    except Exception as e:  # noqa: BLE001 - as in load_rgb
        raise _decode_error(getattr(img, "filename", "the image"), e) from None
    # draft() answers (mode, the original's extent in the new pixels); None where it did nothing.
    return upright(img, orientation), (round(w / drafted[1][2]) if drafted else 1)


def load_image(path, transform=None, max_pixels=0, mode="RGB", data=None):
    """`path` (or its bytes, `data`) decoded to `mode` (RGB or L), through `transform`; BadImage if it cannot be
    decoded. When the transform begins with a DraftRandomResizedCrop or DraftResize, a JPEG reaches it
    undecoded, to be decoded only as large as needed."""
    first = getattr(transform, "transforms", [transform])[0] if transform is not None else None
    img = load_rgb(path, max_pixels, undecoded=isinstance(first, (DraftRandomResizedCrop, DraftResize)), mode=mode,
                   data=data)
    return img if transform is None else transform(img)


def draft_scale(width, height, out_width, out_height):
    """How much smaller a JPEG can be decoded when its width x height pixels become out_width x
    out_height: the largest of 1, 2, 4 and 8 (DCT scaling, PIL's draft) that still leaves that many."""
    s = min(width // max(out_width, 1), height // max(out_height, 1), 8)
    return 1 << (max(s, 1).bit_length() - 1)


class DraftRandomResizedCrop(transforms.RandomResizedCrop):
    """torchvision's RandomResizedCrop with the same random draws and boxes, giving a uint8 tensor.
    The box is drawn in the original's pixels first; a JPEG from load_image is then decoded at the
    smallest scale that leaves the box at least the output size (a 4000x3000 photo: mostly 1/4 or
    1/8, several times faster). The box is resized on uint8 by torch's antialiased bilinear, within
    one level of PIL's and about 3x faster."""

    def forward(self, img):
        if not isinstance(img, Image.Image):
            return super().forward(img)
        # The box is drawn in the upright image's pixels: get_params reads only the extent of a tensor.
        width, height = upright_size(img)
        extent = torch.empty(1, 1, 1, dtype=torch.uint8).expand(1, height, width)
        top, left, h, w = self.get_params(extent, self.scale, self.ratio)
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


class DraftResize(transforms.Resize):
    """torchvision's Resize. A JPEG not decoded yet (load_image) is decoded at the smallest scale that
    leaves it at least the output size (DraftRandomResizedCrop's rule); that size is torchvision's,
    computed from the original's."""

    def forward(self, img):
        if not isinstance(img, Image.Image):
            return super().forward(img)
        w, h = upright_size(img)
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
