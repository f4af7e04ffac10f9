"""Export a trained model to TorchScript or ONNX, checked against PyTorch, with a JSON sidecar.

    python export.py runs/demo --format onnx                   # -> runs/demo/checkpoints/best.onnx (+ .json)
    python export.py runs/demo/checkpoints/last.pt --format torchscript --out model.ts
    python -c "import onnxruntime"                             # the ONNX check runs the file in onnxruntime
    python export.py runs/demo --format onnx --int8            # + best.int8.onnx, if within 1 point of fp32

The batch dimension is dynamic. The sidecar (<out>.json) holds what a deployment
needs around the network: class names, input size (channels first: 1 for a grey
run, data.channels=1), resize, crop, mean and std, EXIF orientation, and how to read the outputs
("activation": softmax of logits / "temperature", the run's calibration, with "reject_threshold" for
predict_onnx.py --reject auto; or sigmoid with each label's threshold for a multi-label model). Before
the file is put in place its outputs are compared with PyTorch's on a batch of
another size than the one exported with; the max abs diff is printed, and over
1e-4 nothing is written.

Then on real images, the way a deployment runs it: the run's validation images (or --check-images DIR,
a class-per-folder tree or a plain folder; at most --check-limit of them) go through predict_onnx.py's
preprocessing (the sidecar's, without torch) into the exported file, and through predict.py's transform
into the PyTorch model. It prints the top-1 agreement, the largest probability difference and both
accuracies; over --check-tolerance (default 1e-3) of probability, nothing is written. Without
validation images at hand (the data is elsewhere) the step says so and is skipped.

Then its speed: the median latency of the exported file (in ONNX Runtime, or TorchScript) against the
eager model, on the same random inputs, batch 1 and batch 32, on the CPU the export runs on. The
two alternate call by call (eager, exported, eager, ...), so a load change on a shared machine
hits both alike: the ratio is what counts. --speed-repeats N calls each (default 10; 0 skips it).

--int8 (ONNX): ONNX Runtime's static quantization (QDQ, int8 weights per channel and activations),
calibrated on --calib-images N of the run's training images through predict_onnx.py's preprocessing.
Both files' accuracies on the real-image check's images and their latency ratio are printed; the int8
file (<out>.int8.onnx, with its sidecar) is written only when its accuracy is within --max-drop points
(default 1) of fp32's.
"""
import inspect
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import numpy as np
from omegaconf import OmegaConf

import predict_onnx
from data import build_transforms, split_dataset, trained_data_config
from model import load_trained
from utils.cli import ArgumentParser, cli_entry
from utils.decoding import MODES, BadImage, load_image
from utils.errors import RUNTIME_EXIT, UserError
from utils.normalization import FORMULA, mean_std, model_input, normalization_of

FORMATS = {"torchscript": ".torchscript.pt", "onnx": ".onnx"}
TOLERANCE = 1e-4
SPEED_BATCHES = (1, 32)
CHECK_TOLERANCE = 1e-3  # the largest probability difference on real images before nothing is written
CHECK_BATCH = 32


def images_to_check(check_dir, data_cfg, classes, limit):
    """([(path, class index or None)], where they came from), or ([], why not): --check-images DIR (an
    image's label is its folder's name where that is a class) or the run's validation split."""
    if check_dir:
        paths = predict_onnx.find_images([check_dir])[:limit]
        return [(p, classes.index(Path(p).parent.name) if Path(p).parent.name in classes else None)
                for p in paths], f"image(s) of {check_dir}"
    try:
        split = split_dataset(OmegaConf.create(data_cfg))
    except UserError as e:
        return [], f"no validation images at hand ({str(e).split(';')[0]}); --check-images DIR checks on yours"
    labels = [None if split.multilabel else label for _, label in split.val]
    return list(zip([p for p, _ in split.val], labels))[:limit], "validation image(s)"


def check_on_images(model, run, items, spec, transform, mode, max_pixels):
    """Each image through predict_onnx.py's preprocessing into `run` (the exported file) and through
    predict.py's transform into `model` -> (images, top-1 agreements, largest probability difference,
    PyTorch's correct, the export's correct, labelled images)."""
    norm = normalization_of(transform, torch.device("cpu"))
    seen = agree = right_torch = right_export = labelled = 0
    largest = 0.0
    for start in range(0, len(items), CHECK_BATCH):
        ours, theirs, labels = [], [], []
        for path, label in items[start:start + CHECK_BATCH]:
            try:
                theirs.append(load_image(path, transform, max_pixels, mode))
                ours.append(predict_onnx.preprocess(path, spec))
                labels.append(label)
            except (BadImage, predict_onnx.BadImage):
                del theirs[len(ours):]
        if not ours:
            continue
        with torch.inference_mode():
            p_torch = predict_onnx.probabilities(model(model_input(torch.stack(theirs), torch.device("cpu"), norm))
                                                 .float().numpy(), spec)
            p_export = predict_onnx.probabilities(run(torch.from_numpy(np.stack(ours))).float().numpy(), spec)
        top_torch, top_export = p_torch.argmax(1), p_export.argmax(1)
        seen += len(ours)
        agree += int((top_torch == top_export).sum())
        largest = max(largest, float(np.abs(p_torch - p_export).max()))
        for label, a, b in zip(labels, top_torch, top_export):
            if label is not None:
                labelled += 1
                right_torch += int(a == label)
                right_export += int(b == label)
    return seen, agree, largest, right_torch, right_export, labelled


def export_torchscript(model, example, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notices on newer torch
        # check_trace=False: its re-trace on the same input costs more than the trace; the file itself
        # is checked against PyTorch below, on a batch of another size.
        torch.jit.trace(model, example, check_trace=False).save(str(path))
        loaded = torch.jit.load(str(path))
    return lambda x: loaded(x)


def export_onnx(model, example, path):
    try:
        import onnxruntime
    except ImportError:
        raise UserError("--format onnx checks the file with onnxruntime: pip install onnxruntime") from None
    kwargs = dict(input_names=["images"], output_names=["logits"], opset_version=17,
                  dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
    # The TorchScript-based exporter: it needs only the onnx package on torch 2.4 to 2.14; the
    # newer dynamo exporter (default since 2.9) would also need onnxscript.
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        kwargs["dynamo"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), str(path), **kwargs)
    # As many threads as torch's, so that the speed table compares the two on the same cores.
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"images": x.numpy()})[0])


def speed(model, run, shape, repeats):
    """[(batch, eager ms, exported ms)]: the median of `repeats` calls each, interleaved, after two
    warm-up calls each (TorchScript's profiling executor optimises on its second call)."""
    rows, gen = [], torch.Generator().manual_seed(1)
    for batch in SPEED_BATCHES:
        x = torch.randn(batch, *shape, generator=gen)
        times = ([], [])
        with torch.inference_mode():
            for _ in range(2):
                model(x)
                run(x)
            for _ in range(repeats):
                for f, kept in zip((model, run), times):
                    start = time.perf_counter()
                    f(x)
                    kept.append((time.perf_counter() - start) * 1e3)
        rows.append((batch, statistics.median(times[0]), statistics.median(times[1])))
    return rows


def training_images(data_cfg, n):
    """The first n of the run's training images, spread over the classes (the split's order)."""
    try:
        split = split_dataset(OmegaConf.create(data_cfg))
    except UserError as e:
        raise UserError(f"--int8 calibrates on the run's training images: {e}") from None
    paths = [p for p, _ in split.train]
    step = max(1, len(paths) // n)
    return paths[::step][:n]


class _Calibration:
    """onnxruntime.quantization's CalibrationDataReader: the images, one batch of 8 at a time."""

    def __init__(self, paths, spec):
        self.batches = iter([np.stack([predict_onnx.preprocess(p, spec) for p in paths[i:i + 8]])
                             for i in range(0, len(paths), 8)])
        self.name = spec["input"]

    def get_next(self):
        batch = next(self.batches, None)
        return None if batch is None else {self.name: batch}


def quantize(out, spec, model, items, calib, transform, mode, max_pixels, max_drop, repeats):
    """<out>.int8.onnx and its sidecar, beside the fp32 file, when its accuracy on `items` is within
    max_drop points of fp32's; both accuracies and the latency ratio are printed either way."""
    import onnxruntime
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process
    CalibrationDataReader.register(_Calibration)
    final = out.with_name(out.name.removesuffix(".onnx") + ".int8.onnx")
    tmp, prepared = final.with_name(f".{final.name}.tmp"), final.with_name(f".{final.name}.pre.tmp")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quant_pre_process(str(out), str(prepared))  # shape inference and graph optimisation, as ORT advises
            quantize_static(str(prepared), str(tmp), _Calibration(calib, spec), quant_format=QuantFormat.QDQ,
                            per_channel=True, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
        sessions = []
        for path in (out, tmp):
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            sessions.append(lambda x, s=session: torch.from_numpy(s.run(None, {"images": x.numpy()})[0]))
        seen, agree, _, right_fp32, right_int8, labelled = check_on_images(
            model, sessions[1], items, spec, transform, mode, max_pixels)
        fp32_acc, int8_acc = right_fp32 / labelled, right_int8 / labelled
        line = (f"int8: calibrated on {len(calib)} training image(s); accuracy on {labelled}: {fp32_acc:.4f} "
                f"(fp32) and {int8_acc:.4f} (int8), top-1 agreement {agree}/{seen}")
        if repeats:
            rows = speed(sessions[0], sessions[1], tuple(spec["input_size"]), repeats)
            line += "; latency int8 / fp32: " + ", ".join(f"{i8 / fp:.2f} at batch {b}" for b, fp, i8 in rows)
        print(line, flush=True)
        drop = 100 * (fp32_acc - int8_acc)
        if drop > max_drop:
            print(f"int8: not written: it loses {drop:.2f} points of accuracy (> --max-drop {max_drop:g})", flush=True)
            return None
        tmp.replace(final)
    finally:
        tmp.unlink(missing_ok=True)
        prepared.unlink(missing_ok=True)
    sidecar = final.with_name(final.name + ".json")
    sidecar.write_text(json.dumps({**spec, "format": "onnx int8 (static, QDQ)"}, indent=2, ensure_ascii=False) + "\n",
                       encoding="utf-8")
    print(f"int8: {final} (+ {sidecar.name})", flush=True)
    return final


@cli_entry
def main(argv=None):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="run directory (its checkpoints/best.pt) or checkpoint file")
    ap.add_argument("--format", required=True, help="torchscript or onnx")
    ap.add_argument("--out", help="output file (default: beside the checkpoint, .torchscript.pt or .onnx)")
    ap.add_argument("--speed-repeats", type=int, default=10, metavar="N",
                    help="latency vs eager: N interleaved calls each at batch 1 and 32 (default 10; 0: skip)")
    ap.add_argument("--check-images", metavar="DIR",
                    help="the real images to check the file on (default: the run's validation images)")
    ap.add_argument("--check-limit", type=int, default=512, metavar="N",
                    help="check on at most N real images (default 512; 0: skip the real-image check)")
    ap.add_argument("--int8", action="store_true", help="also an int8 file (ONNX Runtime static quantization)")
    ap.add_argument("--calib-images", type=int, default=100, metavar="N",
                    help="--int8: training images to calibrate on (default 100)")
    ap.add_argument("--max-drop", type=float, default=1.0, metavar="POINTS",
                    help="--int8: the accuracy it may lose, in points of percent (default 1)")
    ap.add_argument("--check-tolerance", type=float, default=CHECK_TOLERANCE, metavar="P",
                    help=f"largest probability difference on real images before nothing is written "
                         f"(default {CHECK_TOLERANCE:g})")
    args = ap.parse_args(argv)
    if args.format not in FORMATS:
        raise UserError(f"unknown --format '{args.format}'; choose torchscript or onnx")
    if args.speed_repeats < 0:
        raise UserError(f"--speed-repeats {args.speed_repeats}: give a count of calls, or 0 to skip the timing")
    if args.check_limit < 0 or not args.check_tolerance >= 0:
        raise UserError("--check-limit and --check-tolerance take a number of 0 or more")
    if args.int8 and args.format != "onnx":
        raise UserError("--int8 quantizes an ONNX file: add --format onnx")
    if args.int8 and (args.calib_images < 1 or not args.max_drop >= 0):
        raise UserError("--calib-images takes a count of 1 or more and --max-drop points of 0 or more")
    if args.check_images and not Path(args.check_images).is_dir():
        raise UserError(f"--check-images '{args.check_images}' is not a folder")
    model, classes, config, ckpt_path = load_trained(args.source)
    out = Path(args.out) if args.out else ckpt_path.with_suffix(FORMATS[args.format])
    if not out.parent.is_dir():
        raise UserError(f"--out '{out}': folder '{out.parent}' does not exist")
    data_cfg = trained_data_config(config)
    size, resize, channels = int(data_cfg["img_size"]), int(data_cfg["val_resize"]), int(data_cfg["channels"])
    # What predict.py and evaluation normalise with.
    transform = build_transforms(size, resize, channels=channels)[1]
    mean, std = mean_std(transform)
    multilabel = getattr(model, "multilabel", False)
    spec = {
        "format": args.format, "checkpoint": str(ckpt_path), "model": config.get("model", {}).get("name"),
        "classes": classes, "input": "images",
        **({"output": "logits (sigmoid gives each label's probability; a label is predicted at or above its threshold)",
            "activation": "sigmoid", "multilabel": True,
            "thresholds": model.thresholds}
           if multilabel else
           {"output": "logits (softmax of logits / temperature gives calibrated probabilities)", "activation": "softmax",
            "multilabel": False, "temperature": model.temperature,
            # the calibrated top probability under which predict_onnx.py --reject auto answers "unknown"
            "reject_threshold": model.reject_threshold}),
        "input_size": [channels, size, size], "resize": resize,
        "mean": list(mean), "std": list(std),
        # What predict_onnx.py's preprocessing follows (predict.py's, step for step).
        "channels": channels, "crop": size, "interpolation": "bilinear", "exif_orientation": True,
        "max_image_pixels": int(data_cfg["max_image_pixels"]),
        "preprocess": f"{'grey (L)' if channels == 1 else 'RGB'}, EXIF orientation applied, resize shorter side "
                      f"to `resize` (bilinear, antialiased; a JPEG decoded at 1/2, 1/4 or 1/8 where that still "
                      f"leaves the resized size), center-crop `crop`, {FORMULA}",
    }
    items, source = (images_to_check(args.check_images, data_cfg, classes, args.check_limit)
                     if args.check_limit else ([], "--check-limit 0"))
    calib = []
    if args.int8:  # refused before the export when there is nothing to calibrate or to judge it on
        calib = training_images(data_cfg, args.calib_images)
        if not any(label is not None for _, label in items):
            raise UserError(f"--int8 is judged by its accuracy on labelled images, and there are none ({source}); "
                            "give --check-images DIR of class folders")

    gen = torch.Generator().manual_seed(0)
    example = torch.randn(2, channels, size, size, generator=gen)
    check = torch.randn(3, channels, size, size, generator=gen)  # another batch size: the dynamic axis works
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        run = (export_torchscript if args.format == "torchscript" else export_onnx)(model, example, tmp)
        with torch.inference_mode():
            diff = (run(check).float() - model(check)).abs().max().item()
        if not diff <= TOLERANCE:
            raise UserError(f"the exported model differs from PyTorch by {diff:.3g} (> {TOLERANCE}); "
                            "nothing written", exit_code=RUNTIME_EXIT)
        print(f"{args.format}: max abs diff vs PyTorch on a batch of 3 random inputs: {diff:.2e}", flush=True)
        if items:
            seen, agree, largest, right_torch, right_export, labelled = check_on_images(
                model, run, items, spec, transform, MODES[channels], int(data_cfg["max_image_pixels"]))
            accuracy = (f"; accuracy {right_torch / labelled:.4f} (PyTorch) and {right_export / labelled:.4f} "
                        f"(exported) on {labelled}" if labelled else "; no labels, no accuracy")
            print(f"real images: {seen} {source} through predict_onnx.py's preprocessing and the exported file, "
                  f"and through predict.py's and PyTorch: top-1 agreement {agree}/{seen}, largest probability "
                  f"difference {largest:.2e}{accuracy}", flush=True)
            if not largest <= args.check_tolerance:
                raise UserError(f"on real images the exported model's probabilities differ from PyTorch's by "
                                f"{largest:.3g} (> --check-tolerance {args.check_tolerance:g}); nothing written",
                                exit_code=RUNTIME_EXIT)
        else:
            print(f"real images: not checked: {source}", flush=True)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    sidecar = out.with_name(out.name + ".json")
    sidecar.write_text(json.dumps(spec, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{args.format}: {out} (+ {sidecar.name})")
    if args.int8:
        quantize(out, spec, model, items, calib, transform, MODES[channels], int(data_cfg["max_image_pixels"]),
                 args.max_drop, args.speed_repeats)
    if args.speed_repeats:
        engine = "ONNX Runtime" if args.format == "onnx" else "TorchScript"
        threads = torch.get_num_threads()
        print(f"speed on the CPU ({threads} thread{'s' if threads > 1 else ''} each), median ms per call of "
              f"{args.speed_repeats} interleaved calls each; {engine} vs eager PyTorch:")
        print(f"{'batch':>7} {'eager ms':>10} {args.format + ' ms':>14} {'ratio':>7}")
        for batch, eager, exported in speed(model, run, (channels, size, size), args.speed_repeats):
            print(f"{batch:>7} {eager:>10.2f} {exported:>14.2f} {exported / eager:>7.2f}")
        print("ratio: exported / eager time (below 1: the exported model is faster)")
    return diff


if __name__ == "__main__":
    main(sys.argv[1:])
