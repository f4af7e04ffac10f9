"""Classify images with a trained model: top-k classes and probabilities per image (multi-label: the labels
at or above their thresholds, and each label's probability).

    python predict.py runs/demo data/demo_flowers/daisy                    # a run directory = its best.pt
    python predict.py runs/demo/checkpoints/last.pt photo.jpg 'more/**/*.png' --topk 3
    python predict.py runs/demo folder/ --out preds.json --batch-size 128 --device cuda
    python predict.py runs/demo data/demo_flowers/daisy --cam runs/demo/cam             # + Grad-CAM overlays
    python predict.py runs/demo photo.jpg --cam cam/ --cam-class tulips                # the map of one class
    python predict.py runs/demo photos/ --reject auto        # "unknown" under the threshold keeping 95% of val
    python predict.py runs/demo photos/ --tta flip           # each image's logits averaged with its mirror's

PATH is an image, a folder (searched recursively) or a glob. The model, the
validation transform, the class names and the channels (a grey run's images are
read as grey) come from the checkpoint itself; EMA
weights are used when it holds them. The probabilities are calibrated: softmax(logits / T), the
temperature T fitted on validation by the run (utils/calibration.py); --reject auto|P answers "unknown"
where the top one is under P (auto: the run's threshold, which keeps 95% of validation images). A table
shows the first images; all go to
--out (.csv or .json; default: predictions.csv in the run directory). A multi-label
checkpoint gives each image the labels whose sigmoid probability reaches the label's
threshold (from the checkpoint: eval.threshold, or those tuned on validation), and
--out holds every label's probability. An
unreadable file is warned about, listed and skipped; the exit is non-zero only
when no image can be read.

--cam DIR writes, for each image, DIR/<its path>_cam_<class>.png: the image as the model sees it and
its Grad-CAM map (utils/cam.py) for the top class, or for --cam-class NAME; a multi-label model gets one
per predicted label. The target layer is the family's (utils/cam.py) or the run's model.cam_layer.
"""
import os
import sys
import time
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from data import build_transforms, trained_data_config
from engine import TTA_VIEWS, tta_forward
from model import load_trained
# The table and the --out file are predict_onnx.py's, so that the two predictors never differ in them.
import predict_onnx
from predict_onnx import print_table, write_predictions
from utils import run_dir as run_files
from utils.cam import find_target, maps_for, overlay
from utils.cli import ArgumentParser, cli_entry
from utils.decoding import MODES, BadImage, load_image
from utils.distributed_utils import resolve_device
from utils.errors import OUT_OF_MEMORY, RUNTIME_EXIT, UserError, allocation
from utils.figures import image_grid, save_png
from utils.normalization import denormalize, mean_std, model_input, normalization_of

class ImageFiles(Dataset):
    """path -> (tensor, index, error text); an unreadable file gives a blank image and its error."""

    def __init__(self, paths, transform, size, max_pixels=0, mode="RGB"):
        self.paths, self.transform, self.size, self.max_pixels, self.mode = paths, transform, size, max_pixels, mode

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        try:
            return load_image(self.paths[i], self.transform, self.max_pixels, self.mode), i, ""
        except BadImage as e:  # a black image through the same transform: its batch's dtype and size
            return self.transform(Image.new(self.mode, (self.size, self.size))), i, str(e)


def predict(model, paths, transform, size, device, topk, batch_size, workers, max_pixels=0, mode="RGB",
            thresholds=None, temperature=1.0, reject=0.0, tta="none"):
    """-> (rows of (path, [(class index, prob), ...]), [(path, why), ...] unreadable). mode: RGB or L (grey).
    tta="flip": each image's logits averaged with its mirror image's (engine.tta_forward, as --eval-only's
    eval.tta). Probabilities are softmax(logits / temperature); a top probability under `reject` makes the row
    [(-1, prob)]: "unknown". thresholds (multi-label, one per label): each row is (path, [(label index, prob)
    of the labels at or above their threshold, most probable first], every label's prob)."""
    files = ImageFiles(paths, transform, size, max_pixels, mode)
    loader = DataLoader(files, batch_size=batch_size, num_workers=workers, pin_memory=device.type == "cuda")
    norm = normalization_of(files, device)  # uint8 batches are normalised on the device, as in training
    rows, bad = [], []
    with torch.inference_mode():
        for images, index, errors in loader:
            logits = tta_forward(model, model_input(images, device, norm), tta).float()
            # float64 softmax, as predict_onnx.py's: a small temperature leaves float32 little room under 1.
            probs = logits.sigmoid() if thresholds is not None else (logits.double() / temperature).softmax(dim=1)
            top = probs.topk(topk if thresholds is None else probs.shape[1], dim=1)
            for i, err, p, c, every in zip(index.tolist(), errors, top.values.tolist(), top.indices.tolist(),
                                           probs.tolist()):
                if err:
                    print(f"warning: skipping unreadable image: {err}", file=sys.stderr, flush=True)
                    bad.append((paths[i], err))
                elif thresholds is not None:
                    rows.append((paths[i], [(k, pk) for k, pk in zip(c, p) if pk >= thresholds[k]], every))
                elif p[0] < reject:
                    rows.append((paths[i], [(-1, p[0])]))  # "unknown": under the rejection threshold
                else:
                    rows.append((paths[i], list(zip(c, p))))
    return rows, bad


def write_cams(model, target, rows, classes, cam_dir, cam_class, transform, size, device, batch_size,
               max_pixels=0, mode="RGB"):
    """One PNG per (image, class) under cam_dir: the input beside its Grad-CAM overlay. The class:
    cam_class, else the image's top class, or (multi-label) each label predicted. -> the files written."""
    paths = [row[0] for row in rows]
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    files = ImageFiles(paths, transform, size, max_pixels, mode)
    norm, (mean, std) = normalization_of(files, device), mean_std(files)
    written = []
    for start in range(0, len(rows), batch_size):
        part = range(start, min(start + batch_size, len(rows)))
        images = torch.stack([files[i][0] for i in part])
        pairs = [(j, c) for j, i in enumerate(part)
                 for c in ([cam_class] if cam_class is not None else [k for k, _ in rows[i][1]][:1]
                           if len(rows[i]) == 2 else [k for k, _ in rows[i][1]])
                 if c >= 0]  # an "unknown" answer (--reject) has no class to explain
        cams = maps_for(model, model_input(images, device, norm), pairs, *target)
        shown = denormalize(images, mean, std)
        for (j, c), cam in zip(pairs, cams):
            i = part[j]
            prob = dict(rows[i][1]).get(c) if len(rows[i]) == 2 else rows[i][2][c]
            name = os.path.splitext(os.path.relpath(os.path.abspath(paths[i]), root))[0].replace(os.sep, "_")
            out = cam_dir / f"{name}_cam_{classes[c]}.png".replace(os.sep, "_")
            caption = f"{classes[c]}" + (f" {prob:.0%}" if prob is not None else "")
            save_png(image_grid(torch.stack([shown[j], overlay(shown[j:j + 1], cam[None])[0]]).expand(-1, 3, -1, -1),
                                ["input", caption], cell=max(size, 160)), out)
            written.append(out)
    return written


@cli_entry
def main(argv=None):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="run directory (its checkpoints/best.pt) or checkpoint file")
    ap.add_argument("paths", nargs="+", metavar="PATH", help="image, folder (recursive) or glob")
    ap.add_argument("--topk", type=int, default=5, help="classes per image (default 5)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--workers", type=int, default=-1, help="decoding processes; -1 = min(4, CPU cores)")
    ap.add_argument("--out", help="FILE.csv or FILE.json (default: predictions.csv in the run directory)")
    ap.add_argument("--cam", metavar="DIR", help="also write a Grad-CAM overlay PNG per image into DIR")
    ap.add_argument("--cam-class", metavar="NAME", help="--cam's class (default: each image's top class)")
    ap.add_argument("--reject", metavar="auto|P", help='answer "unknown" when the calibrated top probability is '
                    "under P; auto: the checkpoint's threshold, which keeps 95%% of validation images")
    ap.add_argument("--tta", default="none", help="test-time augmentation: none, or flip (the mean of the "
                    "image's and its mirror image's logits)")
    args = ap.parse_args(argv)
    # Everything a user can get wrong is checked before the model is loaded or an image decoded.
    if args.out and Path(args.out).suffix.lower() not in (".csv", ".json"):
        raise UserError(f"--out '{args.out}' must end in .csv or .json")
    if args.topk < 1 or args.batch_size < 1:
        raise UserError("--topk and --batch-size must be at least 1")
    if args.tta not in TTA_VIEWS:
        raise UserError(f"--tta '{args.tta}': choose {' or '.join(TTA_VIEWS)}")
    if args.cam_class and not args.cam:
        raise UserError("--cam-class needs --cam DIR (where the overlays go)")
    try:  # checked before the model is loaded
        reject = predict_onnx.parse_reject(args.reject)
    except predict_onnx.UserError as e:
        raise UserError(str(e)) from None
    device = resolve_device(args.device)
    model, classes, config, ckpt_path = load_trained(args.source)
    try:
        reject = predict_onnx.resolve_reject(reject, getattr(model, "multilabel", False), model.reject_threshold,
                                             f"checkpoint '{ckpt_path}'")
    except predict_onnx.UserError as e:
        raise UserError(str(e)) from None
    cam_class, target = None, None
    if args.cam:
        if args.cam_class is not None and args.cam_class not in classes:
            raise UserError(f"--cam-class '{args.cam_class}' is no class of this model; its classes: {', '.join(classes)}")
        cam_class = classes.index(args.cam_class) if args.cam_class is not None else None
        target = find_target(model, (config.get("model") or {}).get("cam_layer"))
        if Path(args.cam).exists() and not Path(args.cam).is_dir():
            raise UserError(f"--cam '{args.cam}' is a file, not a folder")
    try:
        paths = predict_onnx.find_images(args.paths)  # predict_onnx.py's rule, so both read the same files
    except predict_onnx.UserError as e:
        raise UserError(str(e)) from None
    out = Path(args.out) if args.out else run_files.run_of(ckpt_path) / run_files.PREDICTIONS
    if not out.parent.is_dir():
        raise UserError(f"--out '{out}': folder '{out.parent}' does not exist")
    data_cfg = trained_data_config(config)
    size, resize, channels = int(data_cfg["img_size"]), int(data_cfg["val_resize"]), int(data_cfg["channels"])
    transform = build_transforms(size, resize, channels=channels)[1]
    topk = min(args.topk, len(classes))
    workers = min(4, os.cpu_count() or 1) if args.workers < 0 else args.workers
    workers = min(workers, max(0, (len(paths) - 1) // args.batch_size))  # one batch: no worker start-up

    start = time.perf_counter()
    thresholds = model.thresholds if getattr(model, "multilabel", False) else None  # the checkpoint's own
    try:
        rows, bad = predict(model.to(device), paths, transform, size, device, topk, args.batch_size, workers,
                            int(data_cfg["max_image_pixels"]), mode=MODES[channels], thresholds=thresholds,
                            temperature=getattr(model, "temperature", 1.0), reject=reject or 0.0, tta=args.tta)
    except OUT_OF_MEMORY as e:
        raise UserError(f"out of memory on {device} at --batch-size {args.batch_size}{allocation(e)}: try "
                        f"--batch-size {max(1, args.batch_size // 2)}", RUNTIME_EXIT) from e
    seconds = time.perf_counter() - start
    if not rows:
        raise UserError(f"none of the {len(paths)} image(s) could be read (see the warnings above)", RUNTIME_EXIT)

    print_table(rows, classes)
    write_predictions(rows, classes, out, topk)
    if args.cam:
        Path(args.cam).mkdir(parents=True, exist_ok=True)
        cams = write_cams(model, target, rows, classes, Path(args.cam), cam_class, transform, size, device,
                          args.batch_size, int(data_cfg["max_image_pixels"]), mode=MODES[channels])
        print(f"{len(cams)} Grad-CAM overlay(s) (layer {target[0]}) written to {args.cam}")
    print(f"{len(rows)} image(s) in {seconds:.1f}s ({len(paths) / max(seconds, 1e-9):.0f} img/s on {device})"
          + (f", {len(bad)} unreadable skipped: " + ", ".join(p for p, _ in bad) if bad else "")
          + (f"; labels at their thresholds and every label's probability written to {out}" if thresholds
             else f"; top-{topk} written to {out}"))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
