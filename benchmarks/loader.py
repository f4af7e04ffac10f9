"""Images per second of the template's training loader against torchvision's reference pipeline, same JPEGs.

    python benchmarks/loader.py                  # flower-sized JPEGs and 4000x3000 photos, this machine's workers
    python benchmarks/loader.py --quick          # tiny sets, seconds (tests/test_benchmarks.py)
    python benchmarks/loader.py --workers 8 --repeats 5 --sets photos --out-dir runs/loader

Both loaders are the real thing, with worker processes, collation, the IPC
back to the main process and (on CUDA) pinned memory and the copy to the
device:
  template   data.build_datasets + data.make_loader from configs/default.yaml,
             as train.py builds its training loader (data.val_rate=0, so both
             read every file; data.num_workers, train.batch_size and
             data.img_size set here);
  reference  torchvision's references: ImageFolder (PIL) + RandomResizedCrop +
             RandomHorizontalFlip + ToTensor + Normalize, DataLoader(shuffle,
             drop_last, pin_memory on CUDA).
The template is timed twice per repeat: "delivered", its batches moved to the
device as they come (uint8), which is what the loader hands a GPU and what the
goals are judged on; and "model input", each batch through the training loop's
own utils.normalization.model_input, which normalises the uint8 batch to float on the device
(on a CPU-only run that pass is in the main process, on the cores the workers
decode on, and counted). The reference's batches always go through
utils.normalization.model_input (they are float already: moved, and channels_last on CUDA).
The same worker count for both: min(8, CPU cores), the template's own rule on
CUDA, unless --workers. A run is one whole epoch, timed from iter() until its
last batch is the model's input (on CUDA: synced), after one untimed epoch of
each: as in a training run's later epochs, the reference pays its worker start
every epoch and the template's persistent workers do not. Whole epochs, so that
no run leaves prefetched work behind to compete with the next. Runs alternate
template, template (model input), reference, template... --repeats times; each
template run and the reference run of its repeat give a ratio, and the printed
ratios are the medians of this one invocation's (a shared machine's load
drifts; runs taken seconds apart see the same load).

Sets (generated on first use into data/, git-ignored, kept):
  flowers  demo/flowers.py at flower_photos' class sizes: 3,670 JPEGs, 240-500 px
           (data/bench_flowers, the folder benchmarks/benchmark.py uses);
  photos   --photos 4000x3000 JPEGs (a phone camera's size, quality 90, with
           sensor-like grain so they decode like photos, not flat colour):
           the demo's flowers enlarged (data/bench_photos).
Results: OUT/loader.json and OUT/loader.md; the table is printed last.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import data  # noqa: E402
from demo.flowers import CLASS_NAMES, FLOWER_PHOTOS_COUNTS, ensure  # noqa: E402
from utils import normalization  # noqa: E402
from utils.config import load_config  # noqa: E402
from model import use_channels_last  # noqa: E402
from utils.distributed_utils import resolve_device  # noqa: E402
from utils.samplers import epoch_sampler  # noqa: E402

GOALS = {"flowers": 1.5, "photos": 3.0}  # template / reference, issue 20
PHOTO_SIZE = (4000, 3000)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sets and sizes, for CPU/CI")
    p.add_argument("--sets", default="flowers,photos", help="comma list: flowers,photos")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers for both; default min(8, cores)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved template/reference pairs per set")
    p.add_argument("--img-size", type=int, default=None, help="output crop, px")
    p.add_argument("--photos", type=int, default=60, help="how many 4000x3000 photos to generate")
    p.add_argument("--device", default="auto", help="where batches go: auto (cuda if there is one), cpu, cuda")
    p.add_argument("--out-dir", default="runs/loader")
    p.add_argument("--set-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the template's loader (e.g. data.pipeline=gpu); repeatable")
    args = p.parse_args(argv)
    q = args.quick
    for k, v in dict(repeats=1 if q else 3, img_size=32 if q else 224).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.workers is None:
        args.workers = max(1, min(8, os.cpu_count() or 1))
    # Batch size per set. A photo takes ~60 ms to decode on one core: small batches.
    args.batch = {"flowers": 8 if q else 128, "photos": 4 if q else 16}
    args.sets = [s for s in args.sets.split(",") if s]
    unknown = set(args.sets) - set(GOALS)
    if unknown:
        p.error(f"--sets: unknown {sorted(unknown)}; known: flowers, photos")
    return args


def flower_folder(args, out_dir):
    if args.quick:
        return ensure(out_dir / "data" / "tiny_flowers", images_per_class=4, min_size=40, max_size=64)
    return ensure(REPO / "data" / "bench_flowers", images_per_class=FLOWER_PHOTOS_COUNTS)


def photo_folder(args, out_dir):
    """Flower images enlarged to 4000x3000 with grain, a class folder each; written once, then kept."""
    n, size = (10, (400, 300)) if args.quick else (args.photos, PHOTO_SIZE)
    root = (out_dir / "data" / "tiny_photos") if args.quick else REPO / "data" / f"bench_photos_{n}"
    marker = root / ".complete"
    if marker.is_file():
        return root
    per_class = -(-n // len(CLASS_NAMES))
    small = ensure(root.parent / f".{root.name}-sources", images_per_class=per_class,
                   **(dict(min_size=40, max_size=64) if args.quick else {}))
    rng = np.random.default_rng(0)
    for i in range(n):
        name = CLASS_NAMES[i % len(CLASS_NAMES)]
        (root / name).mkdir(parents=True, exist_ok=True)
        with Image.open(small / name / f"{name}_{i // len(CLASS_NAMES):04d}.jpg") as img:
            big = np.asarray(img.convert("RGB").resize(size, Image.BICUBIC), dtype=np.int16)
        grain = rng.integers(-6, 7, big.shape[:2] + (1,), dtype=np.int16)  # luminance noise, as a sensor's
        Image.fromarray(np.clip(big + grain, 0, 255).astype(np.uint8)).save(root / name / f"{name}_{i:04d}.jpg",
                                                                           quality=90)
    marker.write_text(json.dumps({"images": n, "size": size}))
    return root


def template_loader(root, args, batch, device):
    """The training loader as train.py builds it (data.build_datasets + data.make_loader)."""
    cfg = load_config(["--data-path", str(root), "--batch-size", str(batch), "data.val_rate=0",
                       f"data.num_workers={args.workers}", f"data.img_size={args.img_size}",
                       f"data.val_resize={round(args.img_size * 256 / 224)}", *args.set_arg])
    train_set, _, _ = data.build_datasets(cfg.data)
    loader = data.make_loader(train_set, batch, epoch_sampler(train_set, 0), cfg.data, device, train=True,
                              procs_per_node=1, channels_last=cfg.model.channels_last)
    loader.generator.manual_seed(0)
    return loader


def reference_loader(root, args, batch, device):
    """torchvision's references/classification: ImageFolder, PIL, the usual train transform."""
    from torchvision import datasets, transforms as T
    tf = T.Compose([T.RandomResizedCrop(args.img_size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(data.IMAGENET_MEAN, data.IMAGENET_STD)])
    return torch.utils.data.DataLoader(datasets.ImageFolder(str(root), tf), batch_size=batch, shuffle=True,
                                       num_workers=args.workers, pin_memory=device.type == "cuda", drop_last=True,
                                       generator=torch.Generator().manual_seed(0))


def timed_run(loader, device, to_model=True):
    """Seconds from iter() until the epoch's batches are on `device`: as the model's input (the loop's
    own utils.normalization.model_input), or with to_model=False as the loader delivers them; the images counted,
    one batch's look."""
    norm = normalization.normalization_of(loader.dataset, device)
    channels_last = use_channels_last(True, device)  # model.channels_last's default, for both
    start, images, look = time.perf_counter(), 0, None
    it = iter(loader)
    for _ in range(len(loader)):
        x, _ = next(it)
        x = normalization.model_input(x, device, norm, channels_last) if to_model else x.to(device, non_blocking=True)
        images += x.shape[0]
        look = look or {"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del it  # the reference's workers end here, outside the timed region
    return seconds, images, look


def measure_set(name, root, args, device):
    batch = args.batch[name]
    loaders = {"template": template_loader(root, args, batch, device),
               "reference": reference_loader(root, args, batch, device)}
    assert len(loaders["template"]) == len(loaders["reference"]), "the same files, the same epoch"
    for loader in loaders.values():
        timed_run(loader, device)  # warm-up: file cache, persistent workers started
    runs = {"template": (loaders["template"], False), "template_model_input": (loaders["template"], True),
            "reference": (loaders["reference"], True)}
    rates = {k: [] for k in runs}
    looks = {}
    for r in range(args.repeats):
        for kind, (loader, to_model) in runs.items():
            seconds, images, looks[kind] = timed_run(loader, device, to_model)
            rates[kind].append(images / seconds)
            print(f"{name} repeat {r + 1}/{args.repeats} {kind}: {images} images in {seconds:.2f}s = "
                  f"{images / seconds:.1f} img/s", flush=True)
    pairs = {k: [t / ref for t, ref in zip(rates[k], rates["reference"])] for k in ("template", "template_model_input")}
    ratio = statistics.median(pairs["template"])
    return {"root": str(root), "files": len(loaders["reference"].dataset), "batch_size": batch,
            "batches_per_run": len(loaders["template"]),
            **{k: {"img_per_s": statistics.median(v), "runs": v, **looks[k]} for k, v in rates.items()},
            "pair_ratios": pairs["template"], "ratio": ratio,
            "model_input_pair_ratios": pairs["template_model_input"],
            "model_input_ratio": statistics.median(pairs["template_model_input"]),
            "goal": GOALS[name], "goal_met": ratio >= GOALS[name]}


def describe(args, device):
    import torchvision
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
            "torch": torch.__version__, "torchvision": torchvision.__version__, "cpu_count": os.cpu_count(),
            "load_avg_at_start": os.getloadavg(), "device": str(device), "workers": args.workers,
            "img_size": args.img_size, "repeats": args.repeats, "template_overrides": args.set_arg,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "command": " ".join([Path(sys.executable).name, *sys.argv])}


def table(res):
    lines = ["| set | files | batch | template img/s, delivered | reference img/s | ratio (median of pairs) | goal "
             "| template img/s, as the model's input | its ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in res["sets"].items():
        lines.append(f"| {name} | {s['files']} | {s['batch_size']} | {s['template']['img_per_s']:.1f} | "
                     f"{s['reference']['img_per_s']:.1f} | {s['ratio']:.2f} | >= {s['goal']} "
                     f"({'met' if s['goal_met'] else 'not met'}) | {s['template_model_input']['img_per_s']:.1f} | "
                     f"{s['model_input_ratio']:.2f} |")
    m = res["meta"]
    lines.append(f"\n{m['workers']} workers, {m['img_size']} px crops, {m['repeats']} interleaved pairs per set, "
                 f"device {m['device']}, torch {m['torch']}, {m['cpu_count']} CPU cores; `{m['command']}`")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    res = {"meta": describe(args, device), "sets": {}}
    folders = {"flowers": flower_folder, "photos": photo_folder}
    for name in args.sets:
        t = time.perf_counter()
        root = folders[name](args, out_dir)
        print(f"{name}: {root} ready ({time.perf_counter() - t:.0f}s)", flush=True)
        res["sets"][name] = measure_set(name, root, args, device)
    (out_dir / "loader.json").write_text(json.dumps(res, indent=2))
    (out_dir / "loader.md").write_text(table(res))
    print(table(res), end="")


if __name__ == "__main__":
    main()
