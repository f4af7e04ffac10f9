"""Offline, deterministic stand-in for the TensorFlow ``flower_photos`` data set.

Writes five classes of synthetic, photo-like flower JPEGs in the layout of the
real download, so every code path (folder scan, split, transforms, DDP) can be
exercised without network access:

    root/daisy/daisy_0000.jpg ...   root/dandelion/dandelion_0000.jpg ...
    root/roses/...   root/sunflowers/...   root/tulips/...
    root/.complete                  JSON of the parameters, written last

The classes differ in colour and in shape, so a ResNet trained from scratch
tells them apart within a few epochs even at 64 px: daisy = white petals
around a small yellow disc; dandelion = fluffy ball of thin yellow rays;
roses = crimson rings of petals with a spiral; sunflowers = yellow petals
around a big dark-brown centre; tulips = pink/purple/orange cups on green
stems. Background (grass, sky, soil, foliage), number of flowers, size,
position, tilt, hue, exposure and focus vary from image to image.

Image ``i`` of class ``c`` is drawn from its own
``numpy.random.default_rng([seed, c, i])``: the same arguments give
byte-identical files, no global RNG is touched, and a small set is an exact
prefix of a larger one made with the same seed and sizes.

Commands (from the repository root):

    python -m utils.demo_dataset data/flower_photos                          # 60 per class, 300 images
    python -m utils.demo_dataset data/flower_photos --images-per-class 200
    python -m utils.demo_dataset data/flower_photos --flower-photos-counts   # real class sizes, 3,670 images
    python -m utils.demo_dataset data/flower_photos --seed 1

From Python, ``ensure_demo_dataset(root)`` generates only when ``root`` is
absent or an empty folder, and is safe to call from every DDP rank at once.
"""
import argparse
import colorsys
import json
import math
import multiprocessing
import os
import secrets
import shutil
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageDraw, ImageFilter

from utils.errors import UserError

CLASS_NAMES = ("daisy", "dandelion", "roses", "sunflowers", "tulips")
# Image counts of the real flower_photos download, for a full-size stand-in.
FLOWER_PHOTOS_COUNTS = {"daisy": 633, "dandelion": 898, "roses": 641, "sunflowers": 699, "tulips": 799}

MARKER_NAME = ".complete"
# Recorded in the marker; bump it whenever the drawing changes, so a folder
# says which generator made it.
GENERATOR_VERSION = 1
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
# PIL draws polygons without anti-aliasing: flowers are drawn this many times
# larger and box-filtered down, so petal edges look photographed, not pixelated.
_SS = 2
# Below this many images, starting worker processes costs more than it saves.
_PARALLEL_FROM = 500


class DemoDatasetArgumentError(UserError, ValueError):
    """A bad argument: a ValueError to callers, a one-line `error:` to CLI users."""


class DemoDatasetPathError(UserError, FileExistsError):
    """The target path holds something that is not ours to overwrite."""


# --------------------------------------------------------------------------- public API

def generate_demo_dataset(root, images_per_class=60, seed=0, min_size=240, max_size=500, quality=90,
                          workers=None):
    """Write the demo set into ``root`` (created if needed) and return it as a Path.

    ``images_per_class`` is one int for every class or a dict class -> count
    (e.g. ``FLOWER_PHOTOS_COUNTS``). Width and height of each image are drawn
    independently from [min_size, max_size]. ``workers`` processes share the
    work (default: one below 500 images, else one per core); the files do not
    depend on it. The ``.complete`` marker is written last, so its presence
    means every image is on disk.
    """
    params = _params(images_per_class, seed, min_size, max_size, quality, workers)
    root = Path(root)
    for name in CLASS_NAMES:
        (root / name).mkdir(parents=True, exist_ok=True)
    jobs = [(c, i) for c, name in enumerate(CLASS_NAMES) for i in range(params["images_per_class"][name])]
    settings = (str(root), seed, min_size, max_size, quality)
    workers = min(_default_workers(len(jobs)) if workers is None else workers, len(jobs))
    if workers <= 1 or multiprocessing.current_process().daemon:  # a daemon may not have children
        _write_images(settings, jobs)
    else:
        # "spawn" rather than fork: the caller may be a training process with
        # threads and CUDA state that a forked child must not inherit.
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            # Interleaved slices even out the load; every image has its own RNG,
            # so how the jobs are split cannot change a single byte.
            list(pool.map(_write_images, [settings] * workers, [jobs[k::workers] for k in range(workers)]))
    (root / MARKER_NAME).write_text(json.dumps(params, indent=1, sort_keys=True) + "\n")
    return root


def ensure_demo_dataset(root, images_per_class=60, seed=0, **kw):
    """Return ``root`` as a Path, generating the demo set there first if it is absent or empty.

    Safe when several processes (DDP ranks) call it at once: each builds the set
    in a private temporary sibling folder and renames it into place; the rename
    is atomic, so one process wins and the others delete their copy. A folder
    without the marker is never modified: if it already holds a data set in a
    layout data.py reads (class sub-folders, or train/ and val/ of them) it is
    returned as is, otherwise this raises DemoDatasetPathError. ``kw`` goes to ``generate_demo_dataset``.
    """
    root = Path(root)
    params = _params(images_per_class, seed, **kw)
    if (root / MARKER_NAME).is_file():
        _warn_if_different(root, params)
        return root
    if root.exists() and not _is_empty_dir(root):
        if _looks_like_data_set(root):
            return root
        raise DemoDatasetPathError(
            f"'{root}' exists but is neither a generated demo set (no {MARKER_NAME} file) nor a folder "
            "of class sub-folders holding images; not writing into it. Point the data path at a new or "
            "empty folder, or remove this one.")

    root.parent.mkdir(parents=True, exist_ok=True)
    # A private sibling (same file system, so the rename is atomic). A dot-name
    # keeps a half-written copy from passing for a class folder should the
    # parent be scanned as a data set. Plain mkdir rather than mkdtemp: mkdtemp
    # makes the folder owner-only and the rename would publish that mode.
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        generate_demo_dataset(tmp, images_per_class, seed, **kw)
        _publish(tmp, root)
    finally:
        if tmp.exists():  # another process won the race, or generation failed
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def render_demo_image(class_name, index=0, seed=0, min_size=240, max_size=500):
    """The PIL image that ``generate_demo_dataset`` saves (as JPEG) for ``class_name`` and ``index``."""
    if class_name not in CLASS_NAMES:
        raise DemoDatasetArgumentError(f"unknown class {class_name!r}; expected one of {CLASS_NAMES}")
    if not _is_int(index) or index < 0:
        raise DemoDatasetArgumentError(f"index must be an integer >= 0, got {index!r}")
    _params(1, seed, min_size, max_size)
    return _render(CLASS_NAMES.index(class_name), seed, index, min_size, max_size)


# --------------------------------------------------------------------------- folders and processes

def _params(images_per_class, seed, min_size=240, max_size=500, quality=90, workers=None):
    """Validate the arguments; the result (less ``workers``) is what the marker records."""
    if isinstance(images_per_class, dict):
        unknown = sorted(set(images_per_class) - set(CLASS_NAMES))
        missing = [c for c in CLASS_NAMES if c not in images_per_class]
        if unknown or missing:
            raise DemoDatasetArgumentError(f"images_per_class must name exactly the classes {CLASS_NAMES}; "
                                           f"unknown: {unknown}, missing: {missing}")
        counts = {c: images_per_class[c] for c in CLASS_NAMES}
    else:
        counts = {c: images_per_class for c in CLASS_NAMES}
    # An empty class folder would break the folder scan downstream, hence >= 1.
    for name, n in counts.items():
        if not _is_int(n) or n < 1:
            raise DemoDatasetArgumentError(f"images per class must be an integer >= 1, got {n!r} for '{name}'")
    for label, value in (("seed", seed), ("min_size", min_size), ("max_size", max_size), ("quality", quality)):
        if not _is_int(value):
            raise DemoDatasetArgumentError(f"{label} must be an integer, got {value!r}")
    if seed < 0:
        raise DemoDatasetArgumentError(f"seed must be >= 0, got {seed}")
    if not 32 <= min_size <= max_size:
        raise DemoDatasetArgumentError(f"need 32 <= min_size <= max_size, got {min_size} and {max_size}")
    if not 1 <= quality <= 100:
        raise DemoDatasetArgumentError(f"quality must be in [1, 100], got {quality}")
    if workers is not None and (not _is_int(workers) or workers < 1):
        raise DemoDatasetArgumentError(f"workers must be None or an integer >= 1, got {workers!r}")
    return {"generator_version": GENERATOR_VERSION, "images_per_class": {c: int(n) for c, n in counts.items()},
            "seed": int(seed), "min_size": int(min_size), "max_size": int(max_size), "quality": int(quality)}


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _default_workers(n_images):
    if n_images < _PARALLEL_FROM:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # Under torchrun every local rank generates at the same time; share the cores.
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, min(8, cores // ranks))


def _write_images(settings, jobs):
    root, seed, min_size, max_size, quality = settings
    for class_index, index in jobs:
        name = CLASS_NAMES[class_index]
        img = _render(class_index, seed, index, min_size, max_size)
        img.save(os.path.join(root, name, f"{name}_{index:04d}.jpg"), "JPEG", quality=quality)


def _publish(tmp, root):
    """Move the finished ``tmp`` to ``root``, unless another process got there first."""
    for attempt in range(2):
        try:
            # Atomic within one file system; on POSIX it also replaces an empty folder.
            os.rename(tmp, root)
            return
        except OSError:
            if (root / MARKER_NAME).is_file():
                return  # another rank won; the caller deletes our copy
            # Windows will not rename onto an existing empty folder: remove it, retry once.
            if attempt == 0 and _is_empty_dir(root):
                try:
                    os.rmdir(root)
                except OSError:
                    pass
                continue
            raise


def _warn_if_different(root, params):
    try:
        found = json.loads((root / MARKER_NAME).read_text())
    except (OSError, ValueError):
        found = None
    if found != params:
        warnings.warn(f"the demo set at '{root}' was made with {found}, not the requested {params}; "
                      "using it as is (delete the folder to regenerate)", stacklevel=3)


def _is_empty_dir(path):
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except (NotADirectoryError, FileNotFoundError):
        return False


def _looks_like_data_set(root):
    """A layout data.py can read: class sub-folders holding images, or train/ and val/ of those."""
    return _looks_like_class_folders(root) or all(_looks_like_class_folders(root / s) for s in ("train", "val"))


def _looks_like_class_folders(root):
    if not root.is_dir():
        return False
    with os.scandir(root) as entries:
        classes = [e.path for e in entries if e.is_dir() and not e.name.startswith(".")]
    return len(classes) >= 2 and all(_holds_an_image(c) for c in classes)


def _holds_an_image(folder):
    with os.scandir(folder) as entries:
        return any(e.is_file() and e.name.lower().endswith(_IMAGE_SUFFIXES) for e in entries)


# --------------------------------------------------------------------------- colours and shapes

def _rgb(h, s, v):
    """HSV with the hue in degrees (wrapped) -> an RGB tuple for PIL."""
    r, g, b = colorsys.hsv_to_rgb((h / 360.0) % 1.0, min(max(s, 0.0), 1.0), min(max(v, 0.0), 1.0))
    return round(r * 255), round(g * 255), round(b * 255)


def _rgb_many(h, s, v):
    """Vectorised ``_rgb`` for the hundreds of grass blades and dandelion rays in an image."""
    h, s, v = np.broadcast_arrays((np.asarray(h, float) / 60.0) % 6.0,
                                  np.clip(np.asarray(s, float), 0, 1), np.clip(np.asarray(v, float), 0, 1))
    sector = np.floor(h).astype(int) % 6
    f = h - np.floor(h)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    rgb = np.stack([np.choose(sector, [v, q, p, p, t, v]),
                    np.choose(sector, [t, v, v, q, p, p]),
                    np.choose(sector, [p, p, t, v, v, q])], axis=-1)
    return [tuple(c) for c in np.rint(rgb * 255).astype(int).tolist()]


def _shade(color, factor):
    return tuple(min(255, max(0, round(c * factor))) for c in color)


def _shades(color, factors):
    return [_shade(color, f) for f in np.ravel(factors).tolist()]


def _petals(angles, r0, r1, half_width, bluntness=0.5, x=0.0, y=0.0, n=9):
    """Outlines of lens-shaped petals, one row per angle, from radius r0 to r1 around (x, y).

    ``bluntness`` < 1 gives the rounded tips of daisy petals, 1 the pointed
    ones of sunflowers. Radii and widths are scalars or one value per petal;
    a whole ring is built at once because per-petal numpy calls dominated.
    """
    angles = np.atleast_1d(np.asarray(angles, float))[:, None]
    r0, r1, half_width = (np.broadcast_to(np.asarray(v, float), angles.shape[:1])[:, None]
                          for v in (r0, r1, half_width))
    t = np.linspace(0.0, 1.0, n)[None, :]
    along = r0 + (r1 - r0) * np.concatenate([t, t[:, ::-1]], axis=1)
    across = half_width * np.sin(np.pi * t) ** bluntness
    across = np.concatenate([across, -across[:, ::-1]], axis=1)
    ca, sa = np.cos(angles), np.sin(angles)
    return x + along * ca - across * sa, y + along * sa + across * ca


def _circles(x, y, r, n=24):
    """Circle outlines, one row per circle, as polygons so that a _Pen can foreshorten them."""
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)[None, :]
    x, y, r = (np.atleast_1d(np.asarray(v, float))[:, None] for v in (x, y, r))
    return x + r * np.cos(t), y + r * np.sin(t)


def _ring_angles(rng, n, jitter):
    return rng.uniform(0, 2 * math.pi) + 2 * math.pi * np.arange(n) / n + rng.normal(0, jitter, n)


class _Pen:
    """Draws one flower straight onto the image, through an affine map.

    A flower is described in its own frame: output pixels, origin at the head,
    y down. Foreshortening (``squash``) and tilt (``angle``, degrees) are
    applied to the coordinates rather than by resampling a drawn layer, which
    is several times faster and keeps edges crisp. Drawing happens on an
    _SS-times nearest-neighbour enlargement of the patch under the flower; box-
    filtering it back down anti-aliases the new edges and restores every
    untouched background pixel exactly.
    """

    def __init__(self, canvas, x, y, squash, angle, box, round_shape=False):
        """``box``: extent of everything drawn, in the flower's frame; ``round_shape``:
        the drawing fits the ellipse inside the box, so the patch can be smaller."""
        x0, y0, x1, y1 = box
        c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
        self._m = np.array([[c, -s * squash], [s, c * squash]])
        centre = self._m @ np.array([(x0 + x1) / 2, (y0 + y1) / 2])
        half = np.array([(x1 - x0) / 2, (y1 - y0) / 2])
        extent = np.sqrt(self._m ** 2 @ half ** 2) if round_shape else np.abs(self._m) @ half
        lo = np.floor(centre - extent).astype(int) - 1
        hi = np.ceil(centre + extent).astype(int) + 1
        self._canvas = canvas
        self._corner = (round(x) + int(lo[0]), round(y) + int(lo[1]))
        w, h = (int(v) for v in hi - lo)
        # Parts outside the image come back from crop() black and are clipped again by paste().
        patch = canvas.crop((*self._corner, self._corner[0] + w, self._corner[1] + h))
        self._img = patch.resize((w * _SS, h * _SS), Image.NEAREST)
        self._draw = ImageDraw.Draw(self._img)
        self._offset = -lo[:, None] * _SS

    def _xy(self, xs, ys):
        p = self._m @ np.vstack([np.ravel(xs), np.ravel(ys)]).astype(float) * _SS + self._offset
        return list(zip(p[0].tolist(), p[1].tolist()))

    def polygons(self, xs, ys, fills, outline=None):
        """One polygon per row of ``xs``/``ys``; ``fills`` is one colour or a list, one per row."""
        xs, ys = np.atleast_2d(xs), np.atleast_2d(ys)
        points = self._xy(xs, ys)
        n = xs.shape[1]
        for i, fill in enumerate(fills if isinstance(fills, list) else [fills] * len(xs)):
            self._draw.polygon(points[i * n:(i + 1) * n], fill=fill, outline=outline)

    def line(self, xs, ys, fill, width):
        self._draw.line(self._xy(xs, ys), fill=fill, width=max(1, round(width * _SS)), joint="curve")

    def segments(self, x0, y0, x1, y1, fills, width):
        width = max(1, round(width * _SS))
        for a, b, fill in zip(self._xy(x0, y0), self._xy(x1, y1), fills):
            self._draw.line([a, b], fill=fill, width=width)

    def dots(self, xs, ys, radius, fills):
        rr = radius * _SS
        for (x, y), fill in zip(self._xy(xs, ys), fills):
            self._draw.ellipse([x - rr, y - rr, x + rr, y + rr], fill=fill)

    def finish(self):
        self._canvas.paste(self._img.reduce(_SS), self._corner)


def _leaf(pen, rng, x, y, angle, length, width):
    green = _rgb(rng.uniform(85, 130), rng.uniform(0.5, 0.8), rng.uniform(0.3, 0.55))
    pen.polygons(*_petals(angle, 0, length, width, 0.8, x, y), fills=green)
    # The midrib is what makes it read as a leaf rather than a green blob.
    pen.line([x, x + 0.8 * length * math.cos(angle)], [y, y + 0.8 * length * math.sin(angle)],
             fill=_shade(green, 0.7), width=max(0.5, width * 0.12))


# --------------------------------------------------------------------------- the five flowers
# Each draws one head of radius ``r`` (output pixels) centred at (x, y) on
# ``canvas``, foreshortened by ``squash`` and turned by ``angle`` degrees.

def _daisy(rng, canvas, x, y, r, squash, angle):
    pen = _Pen(canvas, x, y, squash, angle, (-r, -r, r, r), round_shape=True)
    n = int(rng.integers(14, 27))
    disc = r * rng.uniform(0.17, 0.25)
    # White with a faint tint, as real petals pick up the light around them.
    white = _rgb(rng.uniform(0, 360), rng.uniform(0.0, 0.05), rng.uniform(0.9, 1.0))
    petals = _petals(_ring_angles(rng, n, 0.05), disc * 0.5, r * rng.uniform(0.82, 1.0, n),
                     r * math.pi / n * rng.uniform(0.8, 1.15, n), 0.45)
    pen.polygons(*petals, fills=_shades(white, rng.uniform(0.9, 1.0, n)), outline=_shade(white, 0.78))
    yellow = _rgb(rng.uniform(42, 54), rng.uniform(0.8, 1.0), rng.uniform(0.85, 1.0))
    pen.polygons(*_circles(0, 0, disc), fills=yellow, outline=_shade(yellow, 0.75))
    pen.polygons(*_circles(0, 0, disc * 0.55), fills=_shade(yellow, 0.88))
    pen.finish()


def _dandelion(rng, canvas, x, y, r, squash, angle):
    pen = _Pen(canvas, x, y, squash, angle, (-r, -r, r, r), round_shape=True)
    hue = rng.uniform(50, 58)  # lemon yellow, a shade greener than sunflower gold
    pen.polygons(*_circles(0, 0, r * rng.uniform(0.45, 0.6)), fills=_rgb(hue - 6, 0.95, 0.85))
    n = int(rng.integers(110, 170))
    a = rng.uniform(0, 2 * math.pi, n)
    # Long rays first, so the short ones pile up on top into a dense centre.
    outer = np.sort(r * rng.uniform(0.55, 1.0, n))[::-1]
    inner = r * rng.uniform(0.0, 0.35, n)
    fills = _rgb_many(hue + rng.normal(0, 3, n), 0.9, rng.uniform(0.75, 1.0, n))
    pen.segments(inner * np.cos(a), inner * np.sin(a), outer * np.cos(a), outer * np.sin(a), fills,
                 width=max(0.5, r * 0.035))
    pen.polygons(*_circles(0, 0, r * rng.uniform(0.12, 0.2)), fills=_rgb(hue - 8, 1.0, 0.8))
    pen.finish()


def _rose(rng, canvas, x, y, r, squash, angle):
    pen = _Pen(canvas, x, y, squash, angle, (-1.45 * r, -1.45 * r, 1.45 * r, 1.45 * r), round_shape=True)
    for _ in range(int(rng.integers(0, 4))):
        _leaf(pen, rng, 0, 0, rng.uniform(0, 2 * math.pi), r * rng.uniform(1.15, 1.4), r * rng.uniform(0.25, 0.35))
    red = _rgb(rng.uniform(-12, 6), rng.uniform(0.8, 1.0), rng.uniform(0.6, 0.85))
    dark = _shade(red, 0.55)
    # Rings of overlapping round petals, each smaller and a little darker
    # towards the tight centre, like a bloom seen from above.
    for k in range(4):
        ring, m = r * (1.0 - 0.2 * k), 6 - k
        a = _ring_angles(rng, m, 0.0)
        petals = _circles(0.5 * ring * np.cos(a), 0.5 * ring * np.sin(a), np.full(m, 0.5 * ring))
        pen.polygons(*petals, fills=_shades(red, 1.0 - 0.08 * k + rng.uniform(-0.05, 0.05, m)), outline=dark)
    # The spiral is what still says "rose" at 64 px.
    theta = np.linspace(0, rng.uniform(2.5, 3.5) * 2 * math.pi, 80)
    rad = r * 0.55 * theta / theta[-1]
    turn = rng.choice([-1.0, 1.0]) * theta + rng.uniform(0, 2 * math.pi)
    pen.line(rad * np.cos(turn), rad * np.sin(turn), fill=dark, width=max(0.5, r * 0.05))
    pen.finish()


def _sunflower(rng, canvas, x, y, r, squash, angle):
    pen = _Pen(canvas, x, y, squash, angle, (-r, -r, r, r), round_shape=True)
    n = int(rng.integers(18, 30))
    centre = r * rng.uniform(0.45, 0.55)
    gold = _rgb(rng.uniform(32, 44), rng.uniform(0.9, 1.0), rng.uniform(0.9, 1.0))
    a = _ring_angles(rng, n, 0.04)
    # Two offset rings of pointed petals; the darker back ring fills the gaps.
    for offset, shade, reach in ((math.pi / n, 0.8, 0.97), (0.0, 1.0, 1.0)):
        petals = _petals(a + offset, centre * 0.8, r * reach * rng.uniform(0.85, 1.0, n),
                         centre * math.pi / n * rng.uniform(1.1, 1.4, n), 1.0)
        pen.polygons(*petals, fills=_shades(gold, shade * rng.uniform(0.92, 1.0, n)))
    brown = _rgb(rng.uniform(15, 30), rng.uniform(0.6, 0.85), rng.uniform(0.14, 0.26))
    pen.polygons(*_circles(0, 0, centre), fills=brown)
    pen.polygons(*_circles(0, 0, centre * 0.72), fills=brown, outline=_shade(brown, 1.6))
    # Speckled seeds give the centre texture instead of a flat disc.
    k = 40
    a = rng.uniform(0, 2 * math.pi, k)
    d = centre * 0.9 * np.sqrt(rng.uniform(0, 1, k))
    pen.dots(d * np.cos(a), d * np.sin(a), max(0.5, r * 0.015), _shades(brown, rng.uniform(0.5, 1.8, k)))
    pen.finish()


_TULIP_COLOURS = (  # (hue, saturation, value) ranges; no pure red, which belongs to roses
    ((328, 348), (0.35, 0.6), (0.88, 1.0)),   # pink
    ((268, 300), (0.45, 0.8), (0.5, 0.85)),   # purple
    ((14, 28), (0.8, 1.0), (0.9, 1.0)),       # orange
    ((300, 325), (0.5, 0.8), (0.7, 0.95)),    # magenta
)


def _tulip(rng, canvas, x, y, r, squash, angle):
    """A closed cup on a stem with one leaf; (x, y) is the middle of the cup."""
    stem = r * rng.uniform(1.6, 2.6)
    top, base = -0.9 * r, 0.75 * r       # petal tips, bottom of the cup
    foot = base + stem
    half_w = max(1.15 * r, 0.5 * stem + 0.3 * r)
    pen = _Pen(canvas, x, y, squash, angle, (-half_w, -r, half_w, foot + 1))
    hue, sat, val = (rng.uniform(*span) for span in _TULIP_COLOURS[rng.integers(len(_TULIP_COLOURS))])
    colour = _rgb(hue, sat, val)
    green = _rgb(rng.uniform(90, 125), rng.uniform(0.55, 0.85), rng.uniform(0.35, 0.6))
    pen.line([0, rng.uniform(-0.15, 0.15) * r], [base - 0.3 * r, foot], fill=green, width=r * 0.1)
    _leaf(pen, rng, 0, foot - 0.1 * stem, -math.pi / 2 + rng.choice([-1.0, 1.0]) * rng.uniform(0.25, 0.5),
          stem * rng.uniform(0.6, 0.9), r * 0.28)
    # Rounded bottom, near-straight sides and three petal tips along the rim.
    a = r * rng.uniform(0.62, 0.78)
    rim = r * rng.uniform(0.25, 0.4)
    t = np.linspace(0, math.pi, 16)
    xs = np.concatenate([a * np.cos(t), a * np.array([-1.02, -0.55, -0.35, 0, 0.35, 0.55, 1.02])])
    ys = np.concatenate([0.75 * r * np.sin(t), top + rim * np.array([0.6, 0.25, 1, 0, 1, 0.25, 0.6])])
    pen.polygons(xs, ys, fills=colour, outline=_shade(colour, 0.7))
    # A lighter front petal gives the cup its depth.
    pen.polygons(*_petals(-math.pi / 2, 0, base - top, a * 0.55, 0.7, 0, base - 0.05 * r),
                 fills=_shade(colour, 1.12), outline=_shade(colour, 0.75))
    pen.finish()


_FLOWERS = (_daisy, _dandelion, _rose, _sunflower, _tulip)
_STEM_PROBABILITY = (0.5, 0.6, 0.25, 0.4, 0.0)  # tulips draw their own stem
_TULIPS = CLASS_NAMES.index("tulips")


# --------------------------------------------------------------------------- backgrounds

# (hue, saturation, value) ranges at the top and at the bottom of the frame.
_GRASS = (((70, 120), (0.4, 0.75), (0.35, 0.6)), ((80, 130), (0.5, 0.85), (0.18, 0.42)))
_SOIL = (((18, 36), (0.3, 0.6), (0.3, 0.5)), ((15, 32), (0.4, 0.7), (0.18, 0.38)))
_FOLIAGE = (((95, 150), (0.45, 0.8), (0.15, 0.35)), ((60, 110), (0.4, 0.75), (0.25, 0.5)))
_SKY = (((198, 215), (0.35, 0.7), (0.7, 0.92)), ((190, 210), (0.2, 0.45), (0.85, 1.0)))


def _colour_field(rng, w, h, palette, clouds=0.0):
    """Vertical gradient between two palette colours with soft blotches and mottling, as an image.

    Everything is computed on a 1/16-scale grid and upsampled once: large,
    smooth variation for the price of one resize.
    """
    sw, sh = max(2, w // 16), max(2, h // 16)
    gw, gh = int(rng.integers(3, 7)), int(rng.integers(3, 7))
    (top_h, top_s, top_v), (bot_h, bot_s, bot_v) = palette
    top = np.array(_rgb(rng.uniform(*top_h), rng.uniform(*top_s), rng.uniform(*top_v)), float)
    bottom = np.array(_rgb(rng.uniform(*bot_h), rng.uniform(*bot_s), rng.uniform(*bot_v)), float)
    t = np.linspace(0, 1, gh)[:, None, None]
    # Variation mostly in brightness: per-channel noise of this size turns dark soil purple.
    grid = top * (1 - t) + bottom * t + rng.normal(0, 10, (gh, gw, 1)) + rng.normal(0, 4, (gh, gw, 3))
    if clouds:  # lift random cells towards a bluish white, hazy rather than daisy-white
        lift = (rng.uniform(0, 1, (gh, gw, 1)) < clouds) * rng.uniform(0.25, 0.6, (gh, gw, 1))
        grid += (np.array([215.0, 225.0, 245.0]) - grid) * lift
    grid = Image.fromarray(np.clip(grid, 0, 255).astype(np.uint8)).resize((sw, sh), Image.BICUBIC)
    # Mostly brightness, a little colour: dappled light on leaves and earth; a sky stays smoother.
    strength = rng.uniform(2, 6) if palette is _SKY else rng.uniform(6, 16)
    mottle = rng.normal(0, strength, (sh, sw, 1)) + rng.normal(0, strength / 4, (sh, sw, 3))
    small = np.clip(np.asarray(grid, float) + mottle, 0, 255).astype(np.uint8)
    return Image.fromarray(small).resize((w, h), Image.BILINEAR)


def _background(rng, w, h):
    kind = int(rng.integers(5))
    if kind == 4:  # sky over a meadow, with a wavy horizon
        sky = _colour_field(rng, w, h, _SKY, clouds=0.25)
        img = _colour_field(rng, w, h, _GRASS)
        level, waves, phase = rng.uniform(0.25, 0.6), rng.uniform(2, 8), rng.uniform(0, 6)
        horizon = h * level + h * 0.03 * np.sin(np.arange(w) / w * waves + phase)
        above = np.arange(h)[:, None] < horizon[None, :]
        img = Image.composite(sky, img, Image.fromarray(above.astype(np.uint8) * 255))
        _grass_blades(rng, ImageDraw.Draw(img), w, h, top=int(horizon.max()))
    else:
        palette = (_GRASS, _SOIL, _FOLIAGE, _SKY)[kind]
        img = _colour_field(rng, w, h, palette, clouds=0.3 if palette is _SKY else 0.0)
        if palette is _SOIL:
            _pebbles(rng, ImageDraw.Draw(img), w, h)
        elif palette is not _SKY:
            _grass_blades(rng, ImageDraw.Draw(img), w, h, top=0)
    return img


def _grass_blades(rng, draw, w, h, top):
    n = int(w * (h - top) / 500 * rng.uniform(0.5, 1.5))
    x = rng.uniform(0, w, n)
    y = rng.uniform(top, h, n)
    length = rng.uniform(6, 28, n) * (0.5 + y / h)   # lower in the frame = nearer = longer
    angle = -math.pi / 2 + rng.normal(0, 0.35, n)
    # Mostly darker than the ground, so they read as texture, not as streaks of rain.
    fills = _rgb_many(rng.uniform(70, 130, n), rng.uniform(0.5, 0.8, n), rng.uniform(0.12, 0.55, n))
    x1, y1 = x + length * np.cos(angle), y + length * np.sin(angle)
    for x0_, y0_, x1_, y1_, fill, thick in zip(x.tolist(), y.tolist(), x1.tolist(), y1.tolist(), fills,
                                               (length > 20).tolist()):
        draw.line((x0_, y0_, x1_, y1_), fill=fill, width=1 + thick)


def _pebbles(rng, draw, w, h):
    n = int(rng.integers(15, 60))
    x, y = rng.uniform(0, w, n), rng.uniform(0, h, n)
    rx, ry = rng.uniform(2, 9, n), rng.uniform(2, 7, n)
    fills = _rgb_many(rng.uniform(20, 40, n), rng.uniform(0.05, 0.35, n), rng.uniform(0.25, 0.7, n))
    for box, fill in zip(np.stack([x - rx, y - ry, x + rx, y + ry], axis=1).tolist(), fills):
        draw.ellipse(box, fill=fill)


# --------------------------------------------------------------------------- one image

def _render(class_index, seed, index, min_size, max_size):
    rng = np.random.default_rng([seed, class_index, index])
    w, h = (int(v) for v in rng.integers(min_size, max_size + 1, size=2))
    img = _background(rng, w, h)
    draw = ImageDraw.Draw(img)

    count = int(rng.choice([1, 2, 3, 4, 5], p=[0.45, 0.25, 0.15, 0.1, 0.05]))
    heads = [(rng.uniform(0.12, 0.88) * w, rng.uniform(0.12, 0.88) * h,
              min(w, h) * rng.uniform(0.28, 0.46) * count ** -0.4) for _ in range(count)]
    heads.sort(key=lambda head: head[1])  # lower in the frame = nearer = drawn on top
    for x, y, r in heads:
        if rng.uniform() < _STEM_PROBABILITY[class_index]:
            green = _rgb(rng.uniform(85, 125), rng.uniform(0.5, 0.8), rng.uniform(0.35, 0.6))
            draw.line([(x, y), (x + rng.uniform(-0.4, 0.4) * r, h)], fill=green, width=max(2, round(r * 0.1)))
        if class_index == _TULIPS:
            squash, angle = 1.0, rng.uniform(-25, 25)   # stems grow roughly upwards
        else:
            # A head seen at an angle is an ellipse, and the ellipse may point any way.
            squash, angle = rng.uniform(0.6, 1.0), rng.uniform(0, 360)
        _FLOWERS[class_index](rng, img, x, y, r, squash, angle)

    # The "camera": exposure and white balance, sometimes a little defocus, then sensor grain.
    gain = rng.uniform(0.85, 1.15) * (1 + rng.normal(0, 0.04, 3))
    lut = np.clip(np.rint(np.arange(256)[None, :] * gain[:, None] + rng.uniform(-10, 10)), 0, 255)
    img = img.point(lut.astype(np.uint8).ravel().tolist())
    if rng.uniform() < 0.25:
        img = img.filter(ImageFilter.BoxBlur(rng.uniform(0.4, 1.0)))
    amplitude = int(rng.integers(8, 25))
    grain = Image.fromarray(rng.integers(0, amplitude, (h, w), dtype=np.uint8))
    return ImageChops.add(img, Image.merge("RGB", (grain, grain, grain)), 1.0, -(amplitude // 2))


# --------------------------------------------------------------------------- CLI

def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m utils.demo_dataset",
                                     description="Write the offline demo flower set (flower_photos layout).")
    parser.add_argument("out_dir", help="folder to create, e.g. data/flower_photos")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--images-per-class", type=int, default=60, metavar="N",
                       help="images in every class (default: 60)")
    sizes.add_argument("--flower-photos-counts", action="store_true",
                       help="the class sizes of the real flower_photos, 3,670 images in all")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes to use (default: 1 below 500 images, else one per core)")
    args = parser.parse_args(argv)

    root = Path(args.out_dir)
    per_class = dict(FLOWER_PHOTOS_COUNTS) if args.flower_photos_counts else args.images_per_class
    had_marker = (root / MARKER_NAME).is_file()
    start = time.perf_counter()
    try:
        ensure_demo_dataset(root, per_class, args.seed, workers=args.workers)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if had_marker:
        print(f"{root}: a complete demo set is already there; nothing written")
    elif not (root / MARKER_NAME).is_file():
        print(f"{root}: already holds class folders with images; nothing written")
    else:
        counts = json.loads((root / MARKER_NAME).read_text())["images_per_class"]
        print(f"wrote {sum(counts.values())} images ({', '.join(f'{n} {c}' for c, n in counts.items())}; "
              f"seed {args.seed}) to {root} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
