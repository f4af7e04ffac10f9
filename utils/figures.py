"""The run's pictures, drawn with matplotlib: confusion matrix, image grids (samples, worst mistakes).

Each function returns an RGB uint8 array (H, W, 3); RunLogger hands it to TensorBoard
(add_image) and eval-only runs save it as a PNG (save_png). Only rank 0 calls these.

Matplotlib's object API (Figure + the Agg canvas), not pyplot: no global figure state,
no display needed, nothing to close.
"""
import warnings

import numpy as np
import torch


def _render(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a class name in a script the font lacks: drawn as boxes, no warning per glyph
        canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _figure(width, height, layout="constrained"):
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), dpi=100, layout=layout)


def confusion_matrix_image(confusion, classes):
    """Rows: true class (with its accuracy), columns: predicted; colour = share of the row, counts written in."""
    cm = np.asarray(confusion, dtype=np.float64)
    n = len(classes)
    share = cm / np.maximum(cm.sum(axis=1, keepdims=True), 1)
    side = min(3 + 0.45 * n, 16)
    fig = _figure(side + 1.2, side, layout=None)
    ax = fig.add_axes((0.3, 0.22, 0.66, 0.68))
    ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    acc = np.diag(share)
    ax.set_xticks(range(n), [str(c) for c in classes], rotation=45 if n > 3 else 0, ha="right" if n > 3 else "center")
    ax.set_yticks(range(n), [f"{c} ({a:.0%})" for c, a in zip(classes, acc)])
    ax.set_xlabel("predicted")
    ax.set_ylabel("true class (its accuracy)")
    total = cm.sum()
    ax.set_title(f"{int(total)} images, accuracy {np.trace(cm) / max(total, 1):.1%}", fontsize=10)
    if n <= 25:  # counts stay legible up to ~25 classes
        for i, j in zip(*np.nonzero(cm)):
            ax.text(j, i, int(cm[i, j]), ha="center", va="center", fontsize=8,
                    color="white" if share[i, j] > 0.5 else "black")
    return _render(fig)


def denormalize(images, mean=None, std=None):
    """(N, 3, H, W) normalized tensors -> the same in [0, 1]; per-image min-max without mean/std."""
    images = images.detach().float().cpu()
    if mean is not None and std is not None:
        images = images * torch.tensor(std).view(1, -1, 1, 1) + torch.tensor(mean).view(1, -1, 1, 1)
    else:
        low = images.amin(dim=(1, 2, 3), keepdim=True)
        images = (images - low) / (images.amax(dim=(1, 2, 3), keepdim=True) - low).clamp(min=1e-8)
    return images.clamp(0, 1)


def image_grid(images, titles, colours=None, title=None, cols=None, cell=112):
    """Images in [0, 1] (N, 3, H, W) with a caption each (red/green via `colours`).

    One mosaic in one Axes (captions as text), not an Axes per image: a grid of 16 costs
    about as much to draw as one picture.
    """
    n = len(images)
    if n == 0:  # e.g. no misclassified image this epoch: say so instead of leaving a gap in the series
        fig = _figure(4, 1)
        fig.text(0.5, 0.5, f"{title or ''}\nnone", ha="center", va="center", fontsize=10)
        return _render(fig)
    cols = cols or min(n, 8)
    rows = -(-n // cols)
    pad, caption = 8, 30  # pixels between cells, and above each cell for its caption
    cells = torch.nn.functional.interpolate(images.float(), size=(cell, cell), mode="nearest")
    mosaic = np.ones((rows * (cell + caption + pad), cols * (cell + pad), 3), dtype=np.float32)
    for i in range(n):
        y, x = (i // cols) * (cell + caption + pad) + caption, (i % cols) * (cell + pad)
        mosaic[y:y + cell, x:x + cell] = cells[i].permute(1, 2, 0).numpy()
    head = 0.35 if title else 0.0
    height, width = mosaic.shape[0] / 100, max(mosaic.shape[1] / 100, 4.8 if title else 0)
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height + head), dpi=100)
    ax = fig.add_axes((0, 0, 1, height / (height + head)))
    ax.imshow(mosaic, interpolation="nearest")
    ax.set_xlim(-0.5 - (width * 100 - mosaic.shape[1]) / 2, mosaic.shape[1] - 0.5 + (width * 100 - mosaic.shape[1]) / 2)
    ax.axis("off")
    for i in range(n):
        y, x = (i // cols) * (cell + caption + pad) + caption - 2, (i % cols) * (cell + pad) + cell / 2
        ax.text(x, y, titles[i], ha="center", va="bottom", fontsize=7, linespacing=1.1,
                color=(colours[i] if colours else "black"))
    if title:
        fig.text(0.5, 1 - head / (height + head) / 2, title, ha="center", va="center", fontsize=10)
    return _render(fig)


def grouped_bars(groups, series, values, colours, title, ylabel, size=(7.2, 4.2)):
    """Bars per group (x) and series (colour), each labelled with its value; values[(group, series)],
    a missing pair is left out. The picture is exactly size x 100 pixels."""
    fig = _figure(*size)
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
    return _render(fig)


def save_png(image, path):
    from matplotlib.image import imsave
    imsave(path, image, format="png")
