"""The run's pictures: confusion matrix and image grids (samples, worst mistakes), and one chart.
Multi-label runs get a per-label F1 bar picture instead of the confusion matrix, and a precision-recall
curve per label (TensorBoard's own PR curves).

The drawing functions return an RGB uint8 array (H, W, 3); RunLogger hands it to TensorBoard
(add_image) and eval-only runs save it as a PNG (save_png). Only rank 0 draws: sample_picture and
epoch_pictures, which the loop calls, do nothing on a disabled logger.

The per-epoch pictures are drawn with PIL, straight into pixels, in the DejaVu Sans font that
matplotlib ships: a few milliseconds each, where a matplotlib figure's text layout took about a
tenth of a second per picture (BENCHMARKS.md, against timm's train.py). The benchmarks' bar chart
(grouped_bars) is a matplotlib figure: its object API (Figure + the Agg canvas), not pyplot;
save_png (eval-only's two files) is matplotlib's imsave.
"""
import functools
import importlib.util
import os
import time
import warnings

import numpy as np
import torch

from utils.cam import overlay
from utils.normalization import denormalize, mean_std, model_input, normalization_of

# ColorBrewer's 9-class "Blues" (matplotlib's "Blues" colormap): light for 0, dark blue for 1.
_BLUES = np.array([[247, 251, 255], [222, 235, 247], [198, 219, 239], [158, 202, 225], [107, 174, 214],
                   [66, 146, 198], [33, 113, 181], [8, 81, 156], [8, 48, 107]], dtype=np.float64)
_COLOURS = {"black": (0, 0, 0), "white": (255, 255, 255), "firebrick": (178, 34, 34), "forestgreen": (34, 139, 34)}


@functools.lru_cache(maxsize=None)
def _font(size):
    """DejaVu Sans from matplotlib's own files (found, not imported); PIL's built-in font without it.
    A glyph the font lacks (e.g. a class name in Chinese) is drawn as a box."""
    from PIL import ImageFont
    spec = importlib.util.find_spec("matplotlib")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "mpl-data", "fonts", "ttf", "DejaVuSans.ttf")
        if os.path.isfile(path):
            return ImageFont.truetype(path, size)
    return ImageFont.load_default()


def _size(text, font):
    left, top, right, bottom = font.getbbox(text)
    return right - left, bottom - top


def _text(draw, xy, text, size, fill="black", anchor="mm"):
    """Text at xy (anchor: PIL's two letters, e.g. "mm" centred, "rm" right-middle); lines stack."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a glyph the font lacks: drawn as a box, no warning per glyph
        draw.multiline_text(xy, text, fill=_COLOURS.get(fill, fill), font=_font(size), anchor=anchor,
                            align="center", spacing=1)


def _blues(share):
    """Shares in [0, 1] -> RGB, interpolated along the Blues scale."""
    x = np.clip(np.asarray(share, dtype=np.float64), 0, 1) * (len(_BLUES) - 1)
    low = np.minimum(x.astype(int), len(_BLUES) - 2)
    t = (x - low)[..., None]
    return np.rint(_BLUES[low] * (1 - t) + _BLUES[low + 1] * t).astype(np.uint8)


def _rotated_label(text, size, angle):
    """A text label as an RGBA image turned by `angle` degrees (counter-clockwise), to paste."""
    from PIL import Image, ImageDraw
    w, h = _size(text, _font(size))
    label = Image.new("RGBA", (w + 4, h + 6), (255, 255, 255, 0))
    _text(ImageDraw.Draw(label), (2, (h + 6) // 2), text, size, anchor="lm")
    return label.rotate(angle, expand=True, resample=Image.BICUBIC)


def confusion_matrix_image(confusion, classes):
    """Rows: true class (with its accuracy), columns: predicted; colour = share of the row, counts written in."""
    from PIL import Image, ImageDraw
    cm = np.asarray(confusion, dtype=np.float64)
    n = len(classes)
    share = cm / np.maximum(cm.sum(axis=1, keepdims=True), 1)
    acc = np.diag(share)
    cell = int(np.clip(600 // max(n, 1), 12, 56))
    rows = [f"{c} ({a:.0%})" for c, a in zip(classes, acc)]
    cols = [_rotated_label(str(c), 11, 45 if n > 3 else 0) for c in classes]
    left = max(_size(r, _font(11))[0] for r in rows) + 40  # row labels, and the axis label beside them
    top, bottom = 36, max(c.height for c in cols) + 30
    width, height = max(left + n * cell + 20, 360), top + n * cell + bottom
    img = Image.new("RGB", (width, height), "white")
    grid = _blues(share).repeat(cell, axis=0).repeat(cell, axis=1)
    img.paste(Image.fromarray(grid), (left, top))
    draw = ImageDraw.Draw(img)
    draw.rectangle((left - 1, top - 1, left + n * cell, top + n * cell), outline=(0, 0, 0))
    total = cm.sum()
    _text(draw, (left + n * cell // 2, top // 2), f"{int(total)} images, accuracy {np.trace(cm) / max(total, 1):.1%}",
          12)
    for i, (row, col) in enumerate(zip(rows, cols)):
        _text(draw, (left - 6, top + i * cell + cell // 2), row, 11, anchor="rm")
        x = left + i * cell + cell // 2  # the label ends under its column's centre
        img.paste(col, (x - col.width if n > 3 else x - col.width // 2, top + n * cell + 4), col)
    if n <= 25:  # counts stay legible up to ~25 classes
        for i, j in zip(*np.nonzero(cm)):
            _text(draw, (left + j * cell + cell // 2, top + i * cell + cell // 2), str(int(cm[i, j])),
                  max(8, min(11, cell // 3)), fill="white" if share[i, j] > 0.5 else "black")
    _text(draw, (left + n * cell // 2, height - 12), "predicted", 11)
    ylabel = _rotated_label("true class (its accuracy)", 11, 90)
    img.paste(ylabel, (4, top + max(0, (n * cell - ylabel.height) // 2)), ylabel)
    return np.asarray(img).copy()


def f1_bars_image(f1, classes, title="per-label F1 at the thresholds"):
    """One horizontal bar per label, its length the label's F1 in [0, 1], the value written beside it."""
    from PIL import Image, ImageDraw
    n = len(classes)
    row, bar = 18, 300
    left = max([_size(str(c), _font(11))[0] for c in classes] + [40]) + 12
    top = 30
    img = Image.new("RGB", (left + bar + 60, top + n * row + 10), "white")
    draw = ImageDraw.Draw(img)
    _text(draw, (img.width // 2, top // 2), title + (f", macro {float(np.mean(f1)):.3f}" if n else ""), 12)
    for i, (name, value) in enumerate(zip(classes, f1)):
        y = top + i * row
        colour = tuple(int(c) for c in _blues(0.35 + 0.65 * value))
        draw.rectangle((left, y + 2, left + max(1, round(bar * value)), y + row - 3), fill=colour)
        _text(draw, (left - 6, y + row // 2), str(name), 11, anchor="rm")
        _text(draw, (left + round(bar * value) + 6, y + row // 2), f"{value:.2f}", 10, anchor="lm")
    return np.asarray(img).copy()


def reliability_image(table, temperature, size=260):
    """The reliability diagram, before and after the temperature (utils/calibration.reliability's bins): per
    confidence bin a bar to its accuracy, the gap to the bin's mean confidence in red, the diagonal dashed
    (perfect calibration), each panel titled with its ECE."""
    from PIL import Image, ImageDraw
    from utils.calibration import ece_of
    bins, pad, top = table["bins"], 40, 34
    img = Image.new("RGB", (2 * (size + pad) + pad, size + top + 50), "white")
    draw = ImageDraw.Draw(img)
    for k, (name, rows) in enumerate((("before (T = 1)", table["before"]), (f"after (T = {temperature:.3g})", table["after"]))):
        x0, y1 = pad + k * (size + pad), top + size
        count, conf, right = (np.asarray(r, dtype=np.float64) for r in rows)
        w = size / bins
        for b in np.nonzero(count)[0]:
            acc, mean = right[b] / count[b], conf[b] / count[b]
            left, right_x = x0 + b * w + 1, x0 + (b + 1) * w - 1
            draw.rectangle((left, y1 - acc * size, right_x, y1), fill=tuple(int(c) for c in _blues(0.75)))
            lo, hi = sorted((acc, mean))
            draw.rectangle((left, y1 - hi * size, right_x, y1 - lo * size), outline=_COLOURS["firebrick"])
        for t in np.linspace(0, 1, 40, endpoint=False):  # the diagonal, dashed
            draw.line((x0 + t * size, y1 - t * size, x0 + (t + 0.0125) * size, y1 - (t + 0.0125) * size), fill=(90, 90, 90))
        draw.rectangle((x0, top, x0 + size, y1), outline=(0, 0, 0))
        _text(draw, (x0 + size // 2, top // 2), f"{name}: ECE {ece_of(rows):.4f}", 12)
        _text(draw, (x0 + size // 2, y1 + 24), "confidence (top probability)", 11)
        for v in (0, 0.5, 1):
            _text(draw, (x0 + v * size, y1 + 4), f"{v:g}", 9, anchor="mt")
            _text(draw, (x0 - 4, y1 - v * size), f"{v:g}", 9, anchor="rm")
    _text(draw, (img.width // 2, img.height - 10), "bars: accuracy per bin; red: its gap to the mean confidence", 10)
    return np.asarray(img).copy()


def image_grid(images, titles, colours=None, title=None, cols=None, cell=112):
    """Images in [0, 1] (N, 3, H, W) with a caption each (red/green via `colours`), in one mosaic."""
    from PIL import Image, ImageDraw
    n = len(images)
    head = 28 if title else 0
    if n == 0:  # e.g. no misclassified image this epoch: say so instead of leaving a gap in the series
        img = Image.new("RGB", (400, 100), "white")
        _text(ImageDraw.Draw(img), (200, 50), f"{title or ''}\nnone", 12)
        return np.asarray(img).copy()
    cols = cols or min(n, 8)
    rows = -(-n // cols)
    pad, caption = 8, 30  # pixels between cells, and above each cell for its caption
    cells = torch.nn.functional.interpolate(images.float(), size=(cell, cell), mode="nearest")
    pixels = (cells.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    width = max(cols * (cell + pad), 480 if title else 0)
    margin = (width - cols * (cell + pad)) // 2 + pad // 2  # the mosaic centred under a wider title
    mosaic = np.full((head + rows * (cell + caption + pad), width, 3), 255, dtype=np.uint8)
    for i in range(n):
        y, x = head + (i // cols) * (cell + caption + pad) + caption, margin + (i % cols) * (cell + pad)
        mosaic[y:y + cell, x:x + cell] = pixels[i]
    img = Image.fromarray(mosaic)
    draw = ImageDraw.Draw(img)
    for i in range(n):
        y, x = head + (i // cols) * (cell + caption + pad) + caption - 2, margin + (i % cols) * (cell + pad) + cell // 2
        _text(draw, (x, y), titles[i], 9, fill=colours[i] if colours else "black", anchor="md")
    if title:
        _text(draw, (width // 2, head // 2 + 2), title, 12)
    return np.asarray(img).copy()


def grouped_bars(groups, series, values, colours, title, ylabel, size=(7.2, 4.2)):
    """Bars per group (x) and series (colour), each labelled with its value; values[(group, series)],
    a missing pair is left out. The picture is exactly size x 100 pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=size, dpi=100, layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(len(series), 1)
    for si, name in enumerate(series):
        xs = [gi + si * width for gi, g in enumerate(groups) if (g, name) in values]
        ys = [values[(g, name)] for g in groups if (g, name) in values]
        bars = ax.bar(xs, ys, width * 0.95, label=name, color=colours.get(name))
        ax.bar_label(bars, labels=[f"{y:,.0f}" for y in ys], fontsize=8)
    ax.set_xticks([gi + width * (len(series) - 1) / 2 for gi in range(len(groups))], [str(g) for g in groups])
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.margins(y=0.15)
    if series:
        ax.legend(fontsize=8)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def save_png(image, path):
    from matplotlib.image import imsave
    imsave(path, image, format="png")


# --------------------------------------------------------------------------- the loop's pictures

def sample_picture(logger, images, labels, classes, dataset, global_step):
    """The first training batch as the model sees it (normalisation undone), rank 0 only."""
    if not logger.enabled:
        return
    n = min(16, len(images))
    shown = denormalize(images[:n], *mean_std(dataset))
    if labels.ndim == 2:  # multi-hot: the image's label set
        names = [";".join(classes[c] for c in row.nonzero().flatten().tolist()) for row in labels[:n]]
    else:
        names = [classes[i] for i in labels[:n].tolist()]
    logger.image("train/augmented_samples", image_grid(shown, names, title="augmented training samples", cols=8),
                 global_step)


def worst_picture(worst, classes, dataset, cam=None):
    """The worst mistakes as an image grid: each with true class, predicted class and probability;
    multi-label: the true label set over the predicted one, and the image's loss. With `cam`
    (utils.cam.Explainer) each image is followed by its Grad-CAM maps for the predicted and the true
    class (multi-label: a wrongly predicted label and a missed one, where there is one)."""
    mean, std = mean_std(dataset)
    pixels = torch.stack([dataset[w["index"]][0] for w in worst]) if worst else None
    shown = denormalize(pixels, mean, std) if worst else []
    if worst and cam is not None:
        return _worst_with_maps(worst, classes, dataset, cam, pixels, shown)
    if worst and "labels" in worst[0]:
        def names(ids):
            return ";".join(classes[c] for c in ids) or "(none)"
        titles = [f"{names(w['labels'])}\n-> {names(w['preds'])}  {w['loss']:.2f}" for w in worst]
        title = "worst mistakes (true labels -> predicted labels, loss)"
    else:
        titles = [f"{classes[w['label']]} -> {classes[w['pred']]}\n{w['prob']:.0%}" for w in worst]
        title = "worst mistakes (true -> predicted, probability)"
    return image_grid(shown, titles, colours=["firebrick"] * len(worst), title=title,
                      cols=min(8, max(len(worst), 1)))


def _worst_with_maps(worst, classes, dataset, cam, pixels, shown):
    """worst_picture's grid with three cells per mistake: the image, the map of the predicted class and
    the map of the true class, three mistakes a row."""
    pairs, titles, cells = [], [], []
    for i, w in enumerate(worst):
        if "labels" in w:  # multi-label: one false positive and one missed label, the first of each
            pred = next((c for c in w["preds"] if c not in w["labels"]), None)
            true = next((c for c in w["labels"] if c not in w["preds"]), None)
            titles.append(f"loss {w['loss']:.2f}")
        else:
            pred, true = w["pred"], w["label"]
            titles.append(f"{classes[true]} -> {classes[pred]}\n{w['prob']:.0%}")
        for what, c in (("predicted", pred), ("true", true)):
            titles.append(f"{what}: {classes[c]}" if c is not None else f"{what}: (none)")
            if c is not None:
                pairs.append((i, c))
        cells.append((pred, true))
    maps = iter(cam.maps(model_input(pixels, cam.device, normalization_of(dataset, cam.device)), pairs))
    panels = []
    for i, (pred, true) in enumerate(cells):
        panels.append(shown[i].expand(3, -1, -1))
        for c in (pred, true):
            panels.append(overlay(shown[i:i + 1], next(maps)[None])[0] if c is not None else torch.ones_like(panels[-1]))
    return image_grid(torch.stack(panels), titles, colours=["firebrick", "black", "black"] * len(worst),
                      title="worst mistakes (true -> predicted), Grad-CAM of the predicted and the true class",
                      cols=3 * min(3, len(worst)))


def epoch_pictures(logger, val, worst, classes, dataset, global_step, pr=None, cam=None):
    """Rank 0 draws the epoch's confusion matrix and worst mistakes; returns the seconds it took.
    Multi-label (`pr`: every image's probabilities and 0/1 targets): the per-label F1 bars and a
    precision-recall curve per label instead of the confusion matrix. `cam` (utils.cam.Explainer or None):
    the worst mistakes with their Grad-CAM maps."""
    if not logger.enabled:
        return 0.0
    start = time.perf_counter()
    if pr is not None:
        logger.image("val/per_label_f1", f1_bars_image(val["val_f1"], classes), global_step)
        probs, targets = pr
        for c, name in enumerate(classes):
            logger.pr_curve(f"val_pr/{name}", targets[:, c], probs[:, c], global_step)
    else:
        logger.image("val/confusion_matrix", confusion_matrix_image(val["val_confusion"], classes), global_step)
    if worst is not None:  # train.worst_images > 0; also when there was no mistake
        logger.image("val/worst_mistakes", worst_picture(worst, classes, dataset, cam), global_step)
    return round(time.perf_counter() - start, 4)
