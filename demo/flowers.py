"""Offline, deterministic stand-in for TensorFlow's ``flower_photos``: five classes of synthetic flower JPEGs.

    root/daisy/daisy_0000.jpg ...  root/dandelion/...  root/roses/...  root/sunflowers/...  root/tulips/...
    root/.complete                 JSON of the parameters; there only once every image is written

The classes differ in colour and in shape, so a small CNN from scratch tells them apart at 64 px: daisy = white
petals, small yellow disc; dandelion = fluffy ball of thin yellow rays; roses = crimson rings of round petals with
a dark spiral; sunflowers = golden pointed petals, big dark-brown centre; tulips = pink, purple, orange or magenta
cups on green stems. Background (grass, soil, foliage, sky), flower count, size, position, tilt, exposure and grain
vary. Image ``i`` of class ``c`` is drawn from its own ``numpy.random.default_rng([seed, c, i])``: the same
arguments give byte-identical files; no global random state is touched. Needs only numpy and PIL.

    python demo/flowers.py data/demo_flowers                            # 100 per class, 500 images
    python demo/flowers.py data/demo_flowers --images-per-class 200 --seed 1
    python demo/flowers.py data/flower_photos --flower-photos-counts    # the real class sizes, 3,670 images
    python demo/flowers.py data/demo_no_class --no-class 100            # images of none of the classes

Images of no class (--no-class N, for --eval-only --ood): the same backgrounds and camera, with stones,
fallen leaves or a butterfly instead of flowers, drawn from ``default_rng([seed, 99, i])``.

    from demo.flowers import ensure; ensure("data/demo_flowers")  # repo root on sys.path; only if absent or empty

The set is built in a hidden folder beside ``root`` and renamed into place: a killed run leaves nothing
half-made, and processes that call ``ensure`` at once (DDP ranks) all end up with the one complete set.
"""
import argparse
import colorsys
import json
import math
import os
import secrets
import shutil
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageDraw

CLASS_NAMES = ("daisy", "dandelion", "roses", "sunflowers", "tulips")
FLOWER_PHOTOS_COUNTS = {"daisy": 633, "dandelion": 898, "roses": 641, "sunflowers": 699, "tulips": 799}
MARKER = ".complete"
SS = 2  # PIL draws without anti-aliasing: flowers are drawn SS times larger and box-filtered down

# (hue, saturation, value) ranges at the top and at the bottom of the frame.
_GRASS = (((70, 120), (0.4, 0.75), (0.35, 0.6)), ((80, 130), (0.5, 0.85), (0.18, 0.42)))
_SOIL = (((20, 36), (0.25, 0.5), (0.45, 0.62)), ((18, 32), (0.3, 0.55), (0.32, 0.5)))
_FOLIAGE = (((95, 150), (0.45, 0.8), (0.15, 0.35)), ((60, 110), (0.4, 0.75), (0.25, 0.5)))
_SKY = (((198, 215), (0.35, 0.7), (0.7, 0.92)), ((190, 210), (0.2, 0.45), (0.85, 1.0)))
_TULIP_HSV = (((328, 348), (0.35, 0.6), (0.88, 1.0)), ((268, 300), (0.45, 0.8), (0.5, 0.85)),   # pink, purple
              ((8, 20), (0.85, 1.0), (0.92, 1.0)), ((300, 325), (0.5, 0.8), (0.7, 0.95)))       # orange, magenta


def _colour(rng, *hsv):
    """An RGB tuple from hue (degrees), saturation and value: each a number or a (low, high) range to draw from."""
    h, s, v = (rng.uniform(*x) if isinstance(x, tuple) else x for x in hsv)
    return tuple(round(c * 255) for c in colorsys.hsv_to_rgb(h / 360 % 1, min(max(s, 0), 1), min(max(v, 0), 1)))


def _shade(colour, factor):
    return tuple(min(255, max(0, round(c * factor))) for c in colour)


def _oval(turn, r0, r1, half_width, point=1.0, x=0.0, y=0.0):
    """Outline (xs, ys) from radius r0 to r1 along angle ``turn`` from (x, y): a petal, or if r0 = -r1 a disc."""
    u = np.linspace(0, 2 * np.pi, 20, endpoint=False)
    a = (r0 + r1) / 2 + (r1 - r0) / 2 * np.cos(u)
    b = half_width * np.sign(np.sin(u)) * np.abs(np.sin(u)) ** point  # point 2: sharp ends
    return x + a * np.cos(turn) - b * np.sin(turn), y + a * np.sin(turn) + b * np.cos(turn)


def _ring(rng, n):
    return (rng.uniform(0, 2 * math.pi) + 2 * math.pi * np.arange(n) / n + rng.normal(0, 0.05, n)).tolist()


def _daisy(rng, poly, line, r):
    n, disc = int(rng.integers(14, 27)), r * rng.uniform(0.17, 0.25)
    white = _colour(rng, (0, 360), (0, 0.05), (0.9, 1))
    for a in _ring(rng, n):
        poly(_oval(a, disc * 0.5, r * rng.uniform(0.82, 1), r * math.pi / n * rng.uniform(0.8, 1.15), 0.8),
             _shade(white, rng.uniform(0.9, 1)), _shade(white, 0.78))
    yellow = _colour(rng, (42, 54), (0.8, 1), (0.85, 1))
    poly(_oval(0, -disc, disc, disc), yellow, _shade(yellow, 0.75))


def _dandelion(rng, poly, line, r):
    hue, n = rng.uniform(54, 60), int(rng.integers(110, 170))  # lemon yellow, greener than sunflower gold
    poly(_oval(0, -0.7 * r, 0.7 * r, 0.7 * r), _colour(rng, hue - 2, 0.9, 0.9))
    outer = np.sort(r * rng.uniform(0.55, 1, n))[::-1]  # long rays first, the short ones pile up on top
    for a, r0, r1 in zip(rng.uniform(0, 2 * math.pi, n), r * rng.uniform(0, 0.35, n), outer):
        line([r0 * math.cos(a), r1 * math.cos(a)], [r0 * math.sin(a), r1 * math.sin(a)],
             _colour(rng, hue, 0.85, (0.8, 1)), r * 0.05)
    poly(_oval(0, -0.16 * r, 0.16 * r, 0.16 * r), _colour(rng, hue - 4, 1, 0.85))


def _rose(rng, poly, line, r):
    red = _colour(rng, (-12, 6), (0.8, 1), (0.6, 0.85))
    for k in range(4):  # rings of round petals, smaller and darker towards the tight centre
        for a in _ring(rng, 6 - k):
            poly(_oval(a, 0, r * (1 - 0.2 * k), r * (0.5 - 0.1 * k)), _shade(red, rng.uniform(0.95, 1.05) - 0.08 * k),
                 _shade(red, 0.55))
    theta = np.linspace(0, rng.uniform(2.5, 3.5) * 2 * math.pi, 60)
    turn, rad = rng.choice([-1, 1]) * theta + rng.uniform(0, 2 * math.pi), r * 0.55 * theta / theta[-1]
    line(rad * np.cos(turn), rad * np.sin(turn), _shade(red, 0.55), r * 0.05)


def _sunflower(rng, poly, line, r):
    n, centre = int(rng.integers(18, 31)), r * rng.uniform(0.45, 0.55)
    gold, angles = _colour(rng, (36, 44), (0.9, 1), (0.9, 1)), _ring(rng, n)
    for offset, shade, reach in ((math.pi / n, 0.8, 0.97), (0, 1, 1)):  # the darker back ring fills the gaps
        for a in angles:
            poly(_oval(a + offset, centre * 0.8, r * reach * rng.uniform(0.85, 1), centre * math.pi / n * 1.25, 2),
                 _shade(gold, shade * rng.uniform(0.92, 1)))
    brown = _colour(rng, (15, 30), (0.6, 0.85), (0.14, 0.26))
    poly(_oval(0, -centre, centre, centre), brown)
    poly(_oval(0, -0.72 * centre, 0.72 * centre, 0.72 * centre), _shade(brown, 0.8), _shade(brown, 1.6))


def _tulip(rng, poly, line, r):
    """A closed cup on a stem with one leaf; the origin is the middle of the cup."""
    colour, foot = _colour(rng, *_TULIP_HSV[rng.integers(4)]), r * rng.uniform(2.35, 3.35)
    green, side = _colour(rng, (90, 125), (0.55, 0.85), (0.35, 0.6)), rng.choice([-1, 1])
    line([0, rng.uniform(-0.15, 0.15) * r], [0.45 * r, foot], green, r * 0.1)
    poly(_oval(-math.pi / 2 + side * 0.35, 0, 1.6 * r, 0.14 * r, 2, 0, foot), green)
    a, rim = r * rng.uniform(0.62, 0.78), r * rng.uniform(0.25, 0.4)  # rounded bottom, three tips along the rim
    t = np.linspace(0, math.pi, 16)
    xs = np.concatenate([a * np.cos(t), a * np.array([-1.02, -0.55, -0.35, 0, 0.35, 0.55, 1.02])])
    ys = np.concatenate([0.75 * r * np.sin(t), -0.9 * r + rim * np.array([0.6, 0.25, 1, 0, 1, 0.25, 0.6])])
    poly((xs, ys), colour, _shade(colour, 0.7))
    poly(_oval(-math.pi / 2, -0.7 * r, 0.9 * r, 0.55 * a, 1.3), _shade(colour, 1.12), _shade(colour, 0.75))


def _field(rng, w, h, palette):
    """A vertical gradient between two palette colours with soft blotches, computed coarse and upsampled."""
    top, bottom = (np.array(_colour(rng, *end), float) for end in palette)
    gw, gh = (int(v) for v in rng.integers(3, 7, 2))
    t = np.linspace(0, 1, gh)[:, None, None]
    grid = top * (1 - t) + bottom * t + rng.normal(0, 10, (gh, gw, 1)) + rng.normal(0, 4, (gh, gw, 3))
    grid = Image.fromarray(np.uint8(np.clip(grid, 0, 255))).resize((w // 16 + 2, h // 16 + 2), Image.BICUBIC)
    mottled = np.asarray(grid) + rng.normal(0, 3 if palette is _SKY else 10, (h // 16 + 2, w // 16 + 2, 1))
    return Image.fromarray(np.uint8(np.clip(mottled, 0, 255))).resize((w, h), Image.BILINEAR)


def background(rng, w, h):
    """Grass, soil, foliage, sky, or sky over a meadow; grass blades on all but open sky."""
    kind = int(rng.integers(5))
    img = _field(rng, w, h, (_GRASS, _SOIL, _FOLIAGE, _SKY, _GRASS)[kind])
    horizon = int(h * rng.uniform(0.25, 0.6)) if kind == 4 else 0
    if horizon:
        img.paste(_field(rng, w, horizon, _SKY))
    n, draw = 0 if kind == 3 else int(w * (h - horizon) / 500 * rng.uniform(0.5, 1.5)), ImageDraw.Draw(img)
    x, y, a = rng.uniform(0, w, n), rng.uniform(horizon, h, n), rng.normal(0, 0.35, n)
    # Lower in the frame = nearer = longer; darker than the ground, so they read as texture.
    for x, y, a, length in zip(x, y, a, rng.uniform(6, 28, n) * (0.5 + y / h)):
        draw.line((x, y, x + length * math.sin(a), y - length * math.cos(a)), width=1 + (length > 20),
                  fill=_colour(rng, (70, 130), (0.5, 0.8), (0.12, 0.55)))
    return img


def _render(class_index, index, seed, min_size, max_size):
    """Image ``index`` of class ``class_index``, as a PIL RGB image."""
    rng = np.random.default_rng([seed, class_index, index])
    w, h = (int(v) for v in rng.integers(min_size, max_size + 1, 2))
    img = background(rng, w, h).resize((w * SS, h * SS), Image.NEAREST)
    draw, count = ImageDraw.Draw(img), int(rng.choice(5, p=[0.45, 0.25, 0.15, 0.1, 0.05])) + 1
    heads = [(rng.uniform(0.12, 0.88) * w, rng.uniform(0.12, 0.88) * h,
              min(w, h) * rng.uniform(0.28, 0.46) * count ** -0.4) for _ in range(count)]
    draw_heads(rng, draw, class_index, sorted(heads, key=lambda head: head[1]), h)
    return camera(rng, img.reduce(SS), w, h)


def draw_heads(rng, draw, class_index, heads, h):
    """Flowers of class ``class_index`` at heads (x, y, radius), in that order, on a supersampled canvas."""
    flower = (_daisy, _dandelion, _rose, _sunflower, _tulip)[class_index]
    for x, y, r in heads:  # lower in the frame = nearer = drawn on top
        if class_index != 4 and rng.uniform() < 0.5:  # tulips draw their own stem
            draw.line([(x * SS, y * SS), ((x + rng.uniform(-0.4, 0.4) * r) * SS, h * SS)], width=round(r * 0.1 * SS),
                      fill=_colour(rng, (85, 125), (0.5, 0.8), (0.35, 0.6)))
        # A head seen at an angle is an ellipse pointing any way; tulips grow roughly upwards.
        squash, turn = (1, rng.uniform(-0.4, 0.4)) if class_index == 4 else (rng.uniform(0.6, 1), rng.uniform(0, 6.3))
        c, s = math.cos(turn) * SS, math.sin(turn) * SS

        def canvas(xs, ys):  # the flower's own frame (origin at the head) -> supersampled canvas points
            xs, ys = np.ravel(xs), np.ravel(ys) * squash
            return list(zip((x * SS + c * xs - s * ys).tolist(), (y * SS + s * xs + c * ys).tolist()))

        flower(rng, lambda xy, fill, outline=None: draw.polygon(canvas(*xy), fill, outline),
               lambda xs, ys, fill, width: draw.line(canvas(xs, ys), fill, round(width * SS) or 1), r)


def camera(rng, img, w, h):
    """The "camera" over a drawn scene: exposure and white balance, then sensor grain."""
    gain = rng.uniform(0.85, 1.15) * (1 + rng.normal(0, 0.04, 3))
    img = img.point(np.clip(np.arange(256) * gain[:, None] + rng.uniform(-10, 10), 0, 255).astype(int).ravel())
    amp = int(rng.integers(8, 25))
    grain = Image.fromarray(rng.integers(0, amp, (h, w), dtype=np.uint8))
    return ImageChops.add(img, Image.merge("RGB", (grain,) * 3), 1.0, -(amp // 2))


def _no_class(index, seed, min_size, max_size):
    """Image ``index`` of no class: a background with stones, fallen leaves or a butterfly, no flower."""
    rng = np.random.default_rng([seed, 99, index])
    w, h = (int(v) for v in rng.integers(min_size, max_size + 1, 2))
    img = background(rng, w, h).resize((w * SS, h * SS), Image.NEAREST)
    draw, kind = ImageDraw.Draw(img), int(rng.integers(3))
    for _ in range(int(rng.integers(1, 6))):
        x, y, r = rng.uniform(0.1, 0.9) * w * SS, rng.uniform(0.2, 0.9) * h * SS, min(w, h) * SS * rng.uniform(0.05, 0.2)
        if kind == 0:  # a stone: a grey-brown ellipse with a lighter top
            grey = _colour(rng, (20, 50), (0.05, 0.25), (0.35, 0.7))
            draw.ellipse((x - r, y - r * 0.6, x + r, y + r * 0.6), fill=grey)
            draw.ellipse((x - r * 0.6, y - r * 0.5, x + r * 0.4, y), fill=_shade(grey, 1.2))
        elif kind == 1:  # a fallen leaf: an orange-brown pointed oval and its midrib
            turn = rng.uniform(0, 6.3)
            xs, ys = _oval(0, -r, r, r * 0.45)
            c, s = math.cos(turn), math.sin(turn)
            draw.polygon(list(zip(x + c * xs - s * ys, y + s * xs + c * ys)), fill=_colour(rng, (15, 40), (0.6, 0.9), (0.4, 0.8)))
            draw.line((x - c * r, y - s * r, x + c * r, y + s * r), fill=(70, 45, 20), width=max(1, round(r / 12)))
        else:  # a butterfly: two pairs of blue wings and a dark body
            wing = _colour(rng, (200, 240), (0.6, 0.95), (0.6, 0.95))
            for side in (-1, 1):
                draw.ellipse((x + side * r * 0.9 - r * 0.5, y - r * 0.7, x + side * r * 0.9 + r * 0.5, y), fill=wing)
                draw.ellipse((x + side * r * 0.6 - r * 0.35, y, x + side * r * 0.6 + r * 0.35, y + r * 0.6),
                             fill=_shade(wing, 0.8))
            draw.line((x, y - r * 0.7, x, y + r * 0.6), fill=(30, 25, 20), width=max(1, round(r / 6)))
    return camera(rng, img.reduce(SS), w, h)


def generate_no_class(root, images=100, seed=0, min_size=240, max_size=500):
    """Write ``images`` pictures of none of the classes to ``root`` (absent or empty), for --eval-only --ood."""
    if not (type(images) is int and images >= 1):
        raise ValueError(f"images must be an int >= 1, got {images!r}")

    def write(tmp):
        for i in range(images):
            _no_class(i, seed, min_size, max_size).save(tmp / f"no_class_{i:04d}.jpg", quality=90)

    return write_set(root, dict(no_class=images, seed=seed, min_size=min_size, max_size=max_size), write)


def generate(root, images_per_class=100, seed=0, min_size=240, max_size=500):
    """Write the set to ``root``, absent or an empty folder (else FileExistsError), and return it as a Path.
    ``images_per_class``: an int or a dict class -> int (FLOWER_PHOTOS_COUNTS); sides in [min_size, max_size]."""
    counts = images_per_class if isinstance(images_per_class, dict) else dict.fromkeys(CLASS_NAMES, images_per_class)
    if set(counts) != set(CLASS_NAMES) or not all(type(n) is int and n >= 1 for n in counts.values()):
        raise ValueError(f"images_per_class must be an int >= 1 or a dict of one per class, got {images_per_class!r}")
    if not 16 <= min_size <= max_size:
        raise ValueError(f"need 16 <= min_size <= max_size, got {min_size} and {max_size}")
    def write(tmp):
        for c, name in enumerate(CLASS_NAMES):
            (tmp / name).mkdir(parents=True)
            for i in range(counts[name]):
                _render(c, i, seed, min_size, max_size).save(tmp / name / f"{name}_{i:04d}.jpg", quality=90)

    return write_set(root, dict(images_per_class=counts, seed=seed, min_size=min_size, max_size=max_size), write)


def write_set(root, params, write):
    """``write(folder)`` fills a hidden folder beside ``root``, which then gets the marker (``params`` as JSON)
    and is renamed to ``root`` (absent or an empty folder, else FileExistsError); returns ``root`` as a Path."""
    root = Path(root)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"'{root}' is not empty and holds no {MARKER}: not a demo set, not writing into it")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"  # same file system: atomic rename
    try:
        tmp.mkdir()
        write(tmp)
        (tmp / MARKER).write_text(json.dumps(params))
        try:
            os.rename(tmp, root)  # on POSIX this also replaces an empty folder
        except OSError:
            if not (root / MARKER).is_file():  # else another process got there first with the same set
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def ensure(root, images_per_class=100, seed=0, **kw):
    """``root`` as a Path; generated first (``generate``'s arguments) if absent or empty, as is if complete."""
    root = Path(root)
    if not (root / MARKER).is_file():
        try:
            generate(root, images_per_class, seed, **kw)
        except FileExistsError:
            if not (root / MARKER).is_file():  # else another process finished it meanwhile
                raise
    return root


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python demo/flowers.py", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to create, e.g. data/demo_flowers")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--images-per-class", type=int, default=100, metavar="N", help="default: 100")
    sizes.add_argument("--flower-photos-counts", action="store_true", help="the real class sizes, 3,670 images")
    sizes.add_argument("--no-class", type=int, metavar="N", help="N images of none of the classes instead (--ood)")
    parser.add_argument("--seed", type=int, default=0, help="default: 0")
    args = parser.parse_args(argv)
    if args.images_per_class < 1 or args.seed < 0 or (args.no_class is not None and args.no_class < 1):
        parser.error("--images-per-class and --no-class must be >= 1 and --seed >= 0")
    root, start = Path(args.out_dir), time.perf_counter()
    if (root / MARKER).is_file():
        print(f"{root}: a complete demo set is already there; nothing written")
        return
    if args.no_class is not None:
        try:
            generate_no_class(root, args.no_class, args.seed)
        except FileExistsError as e:
            parser.error(str(e))
        print(f"wrote {args.no_class} images of no class (seed {args.seed}) to {root} in "
              f"{time.perf_counter() - start:.1f}s")
        return
    try:
        ensure(root, FLOWER_PHOTOS_COUNTS if args.flower_photos_counts else args.images_per_class, args.seed)
    except FileExistsError as e:
        parser.error(str(e))
    n = sum(json.loads((root / MARKER).read_text())["images_per_class"].values())
    print(f"wrote {n} images (seed {args.seed}) to {root} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
