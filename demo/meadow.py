"""Offline multi-label demo: meadows holding flowers of one to three of the five demo species, and their label file.

    root/images/meadow_0000.jpg ...
    root/labels.csv                path,label,split: "daisy;tulips" for a meadow of daisies and tulips
    root/.complete                 JSON of the parameters; there only once every file is written

Each species is in a meadow with probability 0.4 (at least one, at most three per meadow), drawn as 1-2 heads
in demo/flowers.py's style, so the species differ in colour and shape as in the single-label demo. Rows are
split 80/20 into train and val in the file itself (the split column), in image order. Meadow ``i`` comes from
its own ``numpy.random.default_rng([seed, 5, i])``: the same arguments give byte-identical files.

    python demo/meadow.py data/demo_meadow && python train.py --config configs/demo_multilabel.yaml
    python demo/meadow.py data/demo_meadow --images 1000 --seed 1
"""
import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from demo.flowers import CLASS_NAMES, MARKER, SS, background, camera, draw_heads, write_set  # noqa: E402

VAL_SHARE = 0.2


def render(index, seed=0, min_size=96, max_size=160):
    """Meadow ``index``: (PIL RGB image, sorted tuple of the species' indices in it)."""
    rng = np.random.default_rng([seed, len(CLASS_NAMES), index])
    present = np.flatnonzero(rng.uniform(size=len(CLASS_NAMES)) < 0.4)
    if len(present) == 0:
        present = rng.choice(len(CLASS_NAMES), 1)
    present = np.sort(rng.permutation(present)[:3])
    w, h = (int(v) for v in rng.integers(min_size, max_size + 1, 2))
    img = background(rng, w, h).resize((w * SS, h * SS), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    heads = [(rng.uniform(0.15, 0.85) * w, rng.uniform(0.15, 0.85) * h, min(w, h) * rng.uniform(0.16, 0.24), int(c))
             for c in present for _ in range(int(rng.integers(1, 3)))]
    for x, y, r, c in sorted(heads, key=lambda head: head[1]):  # lower in the frame = nearer = drawn on top
        draw_heads(rng, draw, c, [(x, y, r)], h)
    return camera(rng, img.reduce(SS), w, h), tuple(int(c) for c in present)


def generate(root, images=600, seed=0, min_size=96, max_size=160):
    """Write ``images`` meadows and labels.csv to ``root`` (absent or empty, else FileExistsError); returns it."""
    if type(images) is not int or images < 2:
        raise ValueError(f"images must be an int >= 2, got {images!r}")
    train = images - max(1, round(images * VAL_SHARE))

    def write(tmp):
        (tmp / "images").mkdir()
        with open(tmp / "labels.csv", "w", newline="", encoding="utf-8") as f:
            rows = csv.writer(f)
            rows.writerow(["path", "label", "split"])
            for i in range(images):
                img, present = render(i, seed, min_size, max_size)
                img.save(tmp / "images" / f"meadow_{i:04d}.jpg", quality=90)
                rows.writerow([f"images/meadow_{i:04d}.jpg", ";".join(CLASS_NAMES[c] for c in present),
                               "train" if i < train else "val"])

    return write_set(root, dict(images=images, seed=seed, min_size=min_size, max_size=max_size), write)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python demo/meadow.py", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to create, e.g. data/demo_meadow")
    parser.add_argument("--images", type=int, default=600, metavar="N", help="default: 600 (480 train / 120 val)")
    parser.add_argument("--seed", type=int, default=0, help="default: 0")
    args = parser.parse_args(argv)
    if args.images < 2 or args.seed < 0:
        parser.error("--images must be >= 2 and --seed >= 0")
    root, start = Path(args.out_dir), time.perf_counter()
    if (root / MARKER).is_file():
        print(f"{root}: a complete demo set is already there; nothing written")
        return
    try:
        generate(root, args.images, args.seed)
    except FileExistsError as e:
        parser.error(str(e))
    print(f"wrote {json.loads((root / MARKER).read_text())['images']} meadows and labels.csv (seed {args.seed}) "
          f"to {root} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
