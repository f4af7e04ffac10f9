"""Classify images with an exported ONNX model, without PyTorch: the file to copy to a server.

    python export.py runs/demo --format onnx                                    # -> best.onnx + best.onnx.json
    python predict_onnx.py runs/demo/checkpoints/best.onnx data/demo_flowers/daisy
    python predict_onnx.py model.onnx photo.jpg 'more/**/*.png' --topk 3 --out preds.json
    python predict_onnx.py model.onnx photos/ --reject auto    # "unknown" under the sidecar's threshold

It needs onnxruntime, numpy and Pillow only (pip install onnxruntime numpy pillow), and reads the model's
sidecar (<model>.onnx.json, written by export.py) for everything around the network: the classes, the
preprocessing (EXIF orientation, grey or RGB, the resize of the shorter side with a JPEG decoded only as
large as needed, the centre crop, mean and std), the activation (softmax, or sigmoid with each label's
threshold), and the temperature that calibrates the probabilities (--reject auto|P answers "unknown"
where the top one is under the sidecar's reject_threshold, or P). Its pixels, table and --out file
(.csv or .json, default predictions_onnx.csv beside the model) are predict.py's, column for column:
predict.py writes them through this file's functions. An unreadable file is warned about, listed and
skipped; the exit is non-zero only when no image can be read. A mistake on the command line is one
`error:` line and exit 2, before the model is loaded.
"""
import argparse
import csv
import glob
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

Image.MAX_IMAGE_PIXELS = None  # sidecar's max_image_pixels is applied below, with the path in the message

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")  # data.py's
SHOWN = 10  # images in the printed table; the rest go to the file only
UNKNOWN = "unknown"  # the answer under the rejection threshold (predict.py --reject)
# EXIF orientation (2-8) -> the transpose that turns the stored pixels upright (ImageOps.exif_transpose's
# table), and those that swap width and height.
UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
           5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}
SIDEWAYS = (5, 6, 7, 8)


class UserError(Exception):
    """A mistake the user can fix: one `error:` line and exit_code."""

    def __init__(self, message, exit_code=2):
        super().__init__(message)
        self.exit_code = exit_code


class BadImage(Exception):
    """A file that cannot be decoded; the message names it and says why."""


# --------------------------------------------------------------------------- the sidecar

def read_sidecar(model_path):
    """<model>.json beside the model -> its dict, with the preprocessing keys an older sidecar lacks
    derived from what it has."""
    path = Path(str(model_path) + ".json")
    if not path.is_file():
        raise UserError(f"no sidecar '{path}' beside the model; export.py writes it with the .onnx")
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"sidecar '{path}' is not JSON ({e})") from None
    missing = [k for k in ("classes", "input_size", "resize", "mean", "std", "activation") if k not in spec]
    if missing:
        raise UserError(f"sidecar '{path}' lacks {', '.join(missing)}; export the model again with export.py")
    channels, crop = spec["input_size"][0], spec["input_size"][1]
    return {"channels": channels, "crop": crop, "exif_orientation": True, "max_image_pixels": 0,
            "temperature": 1.0, "input": "images", **spec}


# --------------------------------------------------------------------------- decoding (utils/decoding.py's)

def exif_orientation(img):
    try:
        orientation = img.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - a broken tag does not make the pixels unusable
        return 1
    return orientation if orientation in UPRIGHT else 1


def to_8bit(img, mode="RGB"):
    """Any PIL mode (CMYK, RGBA, L, P, 16-bit grey, ...) -> 8-bit `mode`: RGB, or L (grey)."""
    if img.mode.startswith("I"):
        arr = np.asarray(img).astype(np.int64).clip(0, 65535)  # 16-bit grey: scaled, not clipped to white
        if img.mode != "I" or arr.max() > 255:
            arr = arr >> 8
        img = Image.fromarray(arr.astype(np.uint8), "L")
    elif img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    return img.convert(mode)


def resized_size(w, h, size):
    """torchvision's Resize(size) output (width, height) for a w x h image: the shorter side becomes size."""
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(size * long / short)
    return (size, new_long) if w <= h else (new_long, size)


def draft_scale(width, height, out_width, out_height):
    """The largest of 1, 2, 4, 8 that still leaves a JPEG decoded that much smaller at least the output."""
    s = min(width // max(out_width, 1), height // max(out_height, 1), 8)
    return 1 << (max(s, 1).bit_length() - 1)


def load_resized(path, spec):
    """`path` -> a PIL image, upright, in the sidecar's mode, its shorter side resized to spec["resize"]
    (bilinear, antialiased); a JPEG is decoded only as large as that needs. BadImage if it cannot be."""
    mode = "L" if spec["channels"] == 1 else "RGB"
    try:
        if os.path.getsize(path) == 0:
            raise BadImage(f"'{path}' is empty (0 bytes)")
        img = Image.open(path)  # the header only
        w, h = img.size
        limit = spec["max_image_pixels"]
        if limit and w * h > limit:
            img.close()
            raise BadImage(f"'{path}' is {w}x{h} = {w * h} pixels, over data.max_image_pixels={limit} "
                           "(a decompression-bomb guard)")
        orientation = exif_orientation(img) if spec["exif_orientation"] else 1
        up_w, up_h = (h, w) if orientation in SIDEWAYS else (w, h)
        out_w, out_h = resized_size(up_w, up_h, spec["resize"])
        scale = 1
        if img.format == "JPEG":
            s = draft_scale(up_w, up_h, out_w, out_h)
            # draft() decodes at 1/s of each side (and a colour JPEG to its luma plane for grey).
            drafted = img.draft(mode if img.mode == "RGB" else img.mode, (w // s, h // s)) if s > 1 or mode == "L" else None
            scale = round(w / drafted[1][2]) if drafted else 1
        if img.mode == mode:
            img.load()
        else:
            img = to_8bit(img, mode)
        img = img.transpose(UPRIGHT[orientation]) if orientation in UPRIGHT else img
        if scale == 1:
            return img if img.size == (out_w, out_h) else img.resize((out_w, out_h), Image.BILINEAR)
        return img.resize((out_w, out_h), Image.BILINEAR, box=(0, 0, up_w / scale, up_h / scale))
    except BadImage:
        raise
    except Exception as e:  # noqa: BLE001 - whatever PIL raises on a broken file is the file's fault
        why = (str(e).splitlines() or [type(e).__name__])[0].replace(f" '{path}'", "")
        raise BadImage(f"cannot decode '{path}': {why}") from None


def center_crop(img, size):
    """torchvision's CenterCrop(size) on a PIL image (padded with black where the image is smaller)."""
    w, h = img.size
    if w < size or h < size:
        padded = Image.new(img.mode, (max(w, size), max(h, size)))
        padded.paste(img, ((size - w) // 2 if size > w else 0, (size - h) // 2 if size > h else 0))
        img, (w, h) = padded, padded.size
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return img.crop((left, top, left + size, top + size))


def preprocess(path, spec):
    """`path` -> the model's input for one image: float32 (C, crop, crop), (x / 255 - mean) / std."""
    img = center_crop(load_resized(path, spec), spec["crop"])
    pixels = np.asarray(img, dtype=np.uint8).reshape(img.height, img.width, -1).transpose(2, 0, 1)
    mean = np.asarray(spec["mean"], dtype=np.float32).reshape(-1, 1, 1)
    std = np.asarray(spec["std"], dtype=np.float32).reshape(-1, 1, 1)
    return (pixels.astype(np.float32) / np.float32(255) - mean) / std


# --------------------------------------------------------------------------- the model

def probabilities(logits, spec):
    """Logits -> probabilities as the sidecar says: softmax of logits / temperature, or each label's sigmoid."""
    logits = np.asarray(logits, dtype=np.float64)
    if spec["activation"] == "sigmoid":
        return 1 / (1 + np.exp(-logits))
    z = logits / float(spec["temperature"])
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def rows_of(paths, probs, spec, topk, reject=0.0):
    """predict.py's rows: (path, [(class index, prob), ...] top-k) or, multi-label, (path, [(label, prob) at or
    above its threshold], every label's prob). reject: a single-label top probability under it gives
    [(-1, prob)], the "unknown" answer."""
    rows = []
    for path, p in zip(paths, np.asarray(probs, dtype=np.float64)):
        order = np.argsort(-p, kind="stable")
        if spec["activation"] == "sigmoid":
            on = [(int(k), float(p[k])) for k in order if p[k] >= spec["thresholds"][k]]
            rows.append((path, on, [float(x) for x in p]))
        elif p[order[0]] < reject:
            rows.append((path, [(-1, float(p[order[0]]))]))
        else:
            rows.append((path, [(int(k), float(p[k])) for k in order[:topk]]))
    return rows


def class_name(classes, c):
    return UNKNOWN if c < 0 else classes[c]


def run_model(model_path, spec, threads=0):
    """An onnxruntime session on the CPU -> a function from an N x C x H x W float32 batch to logits."""
    try:
        import onnxruntime
    except ImportError:
        raise UserError("predict_onnx.py runs the model in onnxruntime: pip install onnxruntime") from None
    options = onnxruntime.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    return lambda batch: session.run(None, {spec["input"]: batch})[0]


def predict(model_path, paths, spec, topk, batch_size, reject=0.0, run=None):
    """-> (rows as rows_of gives them, [(path, why), ...] unreadable). run: a run_model already made (serve.py
    keeps one session for all its requests), else one is made here."""
    run = run or run_model(model_path, spec)
    rows, bad = [], []
    for start in range(0, len(paths), batch_size):
        inputs, good = [], []
        for path in paths[start:start + batch_size]:
            try:
                inputs.append(preprocess(path, spec))
                good.append(path)
            except BadImage as e:
                print(f"warning: skipping unreadable image: {e}", file=sys.stderr, flush=True)
                bad.append((path, str(e)))
        if inputs:
            rows += rows_of(good, probabilities(run(np.stack(inputs)), spec), spec, topk, reject)
    return rows, bad


# --------------------------------------------------------------------------- what the user sees

def find_images(specs):
    """Image paths for each PATH argument (an image, a folder searched recursively, or a glob), in order,
    each once; a PATH that yields none is an error."""
    found, seen = [], set()
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            hits = [str(Path(d) / f) for d, dirs, files in sorted(os.walk(path, followlinks=True))
                    for f in sorted(files) if is_image_file(f)]
            if not hits:
                raise UserError(f"folder '{spec}' holds no images (.jpg/.jpeg/.png/...)")
        elif path.is_file():
            hits = [str(path)]  # named explicitly: decoding decides
        else:
            hits = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p) and is_image_file(p))
            if not hits:
                raise UserError(f"'{spec}' is no file or folder, and as a glob it matches no image")
        for p in hits:
            if p not in seen:
                seen.add(p)
                found.append(p)
    return found


def is_image_file(path):
    name = os.path.basename(path)
    return not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS)


def print_table(rows, classes):
    """The first SHOWN rows: each path and its classes with their probabilities (multi-label: its labels)."""
    width = min(max(len(row[0]) for row in rows[:SHOWN]), 60)
    for p, top, *_ in rows[:SHOWN]:
        shown = p if len(p) <= width else "..." + p[-(width - 3):]
        print(f"{shown:<{width}}  " + ("  ".join(f"{class_name(classes, c)} {pr:.3f}" for c, pr in top)
                                       or "(no label)"))
    if len(rows) > SHOWN:
        print(f"... and {len(rows) - SHOWN} more")


def write_predictions(rows, classes, out, topk):
    """CSV or JSON by suffix, via a temporary file: an existing file is replaced only when complete."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    if out.suffix == ".json":
        tmp.write_text(json.dumps(records(rows, classes), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.replace(out)
        return
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if rows and len(rows[0]) == 3:  # multi-label: the predicted labels, then every label's probability
            w.writerow(["path", "labels", *classes])
            for p, on, every in rows:
                w.writerow([p, ";".join(classes[c] for c, _ in on), *(f"{pr:.6f}" for pr in every)])
        else:
            w.writerow(["path"] + [x for k in range(1, topk + 1) for x in (f"class{k}", f"prob{k}")])
            for p, top in rows:
                w.writerow([p] + [x for c, pr in top for x in (class_name(classes, c), f"{pr:.6f}")])
    tmp.replace(out)


def records(rows, classes):
    """The rows as --out FILE.json holds them (and serve.py answers): {"path", "top": [{"class", "prob"}, ...]},
    or multi-label {"path", "labels": [...] at their thresholds, "probs": every label's}; 6 decimals."""
    if rows and len(rows[0]) == 3:
        return [{"path": p, "labels": [{"class": classes[c], "prob": round(pr, 6)} for c, pr in on],
                 "probs": {name: round(pr, 6) for name, pr in zip(classes, every)}} for p, on, every in rows]
    return [{"path": p, "top": [{"class": class_name(classes, c), "prob": round(pr, 6)} for c, pr in top]}
            for p, top in rows]


def parse_reject(value):
    """--reject: None, "auto", or a probability in (0, 1]; anything else is the user's error."""
    if value is None or value == "auto":
        return value
    try:
        p = float(value)
    except ValueError:
        p = -1.0
    if not 0 < p <= 1:
        raise UserError(f"--reject '{value}': give auto or a probability above 0 and at most 1")
    return p


def resolve_reject(reject, multilabel, stored, where):
    """parse_reject's value for this model: None (off), P, or for "auto" the threshold `stored` with it (`where`
    names the file). A multi-label model answers no label under its thresholds instead: --reject is refused."""
    if reject is not None and multilabel:
        raise UserError("--reject is for a single-label model; a multi-label one answers no label under its thresholds")
    if reject != "auto":
        return reject
    if stored is None:
        raise UserError(f"--reject auto: {where} holds no rejection threshold (written before runs fitted one); "
                        "give --reject P, a probability")
    return stored


def check_out(out):
    if Path(out).suffix.lower() not in (".csv", ".json"):
        raise UserError(f"--out '{out}' must end in .csv or .json")
    if not Path(out).parent.is_dir():
        raise UserError(f"--out '{out}': folder '{Path(out).parent}' does not exist")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="an .onnx file from export.py (its sidecar <model>.json beside it)")
    ap.add_argument("paths", nargs="+", metavar="PATH", help="image, folder (recursive) or glob")
    ap.add_argument("--topk", type=int, default=5, help="classes per image (default 5)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--out", help="FILE.csv or FILE.json (default: predictions_onnx.csv beside the model)")
    ap.add_argument("--reject", metavar="auto|P", help='answer "unknown" when the calibrated top probability is '
                    "under P; auto: the sidecar's threshold, which keeps 95%% of validation images")
    args = ap.parse_args(argv)
    try:
        if args.topk < 1 or args.batch_size < 1:
            raise UserError("--topk and --batch-size must be at least 1")
        reject = parse_reject(args.reject)
        if not Path(args.model).is_file():
            raise UserError(f"model '{args.model}' does not exist")
        out = Path(args.out) if args.out else Path(args.model).with_name("predictions_onnx.csv")
        check_out(out)
        spec = read_sidecar(args.model)
        reject = resolve_reject(reject, spec["activation"] == "sigmoid", spec.get("reject_threshold"),
                                f"the sidecar of '{args.model}'")
        classes = spec["classes"]
        paths = find_images(args.paths)
        topk = min(args.topk, len(classes))
        start = time.perf_counter()
        rows, bad = predict(args.model, paths, spec, topk, args.batch_size, reject or 0.0)
        seconds = time.perf_counter() - start
        if not rows:
            raise UserError(f"none of the {len(paths)} image(s) could be read (see the warnings above)", 1)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    print_table(rows, classes)
    write_predictions(rows, classes, out, topk)
    multilabel = spec["activation"] == "sigmoid"
    print(f"{len(rows)} image(s) in {seconds:.1f}s ({len(paths) / max(seconds, 1e-9):.0f} img/s, onnxruntime on the CPU)"
          + (f", {len(bad)} unreadable skipped: " + ", ".join(p for p, _ in bad) if bad else "")
          + (f"; labels at their thresholds and every label's probability written to {out}" if multilabel
             else f"; top-{topk} written to {out}"))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
