"""End to end against timm's train.py: wall time and img/s of the template's train.py on the same run.

    python benchmarks/vs_timm.py --timm-train PATH/pytorch-image-models/train.py   # timm importable
    python benchmarks/vs_timm.py --timm-train PATH --seeds 5 --epochs 15 --workers 2
    python benchmarks/vs_timm.py --quick          # the template side only, tiny run (no timm needed)

timm's train.py is not in the timm wheel: pass the file from a clone of
huggingface/pytorch-image-models (--timm-train), with timm itself installed or
on PYTHONPATH. timm is not a dependency of this project.

The run, matched on both sides (CPU, fp32, the same intra-op threads):
  data     a generated 10-class set of 32 px JPEGs in root/train/<class> and
           root/val/<class>, the layout both scripts read (data/vs_timm_32,
           git-ignored, kept);
  model    resnet18 from scratch, 10 classes (torchvision's / timm's: the same
           layers and FLOPs);
  train    RandomResizedCrop(32, scale 0.08-1, ratio 3/4-4/3, bilinear) +
           horizontal flip 0.5; timm's colour jitter off (the template has none);
  val      Resize(36) + CenterCrop(32) (timm: --crop-pct 0.875);
  optim    SGD with classical momentum 0.9 (timm's --opt momentum: its `sgd` is
           Nesterov's), the same lr and weight decay (timm leaves biases and
           norm weights out of it, and train.py has no flag to change that; at
           1e-4 over 225 steps that is a factor of 0.999), no label smoothing,
           batch --batch-size, the last partial batch dropped;
  schedule stepped per optimizer step: --warmup-epochs of linear warm-up, then
           a cosine down to lr * lrf at the last step. After the warm-up the
           two curves are equal step for step; in it they differ by at most
           lr / warm-up steps (printed: timm's warm-up is a line from
           --warmup-lr that reaches lr one step later than the template's);
  threads  --threads intra-op threads for both (OMP_NUM_THREADS; default 1: on
           a 2-core machine shared with other jobs, 2 OpenMP threads per
           process spin against each other, 11 vs 72 img/s in one test);
  workers  --workers DataLoader workers for both, each script's own loader;
           per epoch both evaluate and write a checkpoint; the template also
           its TensorBoard scalars, figures and per-class metrics (defaults).
Each seed runs the pair back to back, the order alternating (template first
for even seeds): a shared machine's load drifts, pairs see the same load.
Wall time is the process's, from start to exit (imports, data, every epoch,
the last checkpoint). img/s is each script's own training-loop rate over all
epochs (template: metrics.jsonl's train_seconds; timm: the mean update time of
each epoch's last log line). The ratios printed are medians of the per-seed
pairs' ratios (template / timm), from this one invocation.
Results: OUT/vs_timm.json and OUT/vs_timm.md; the table is printed last.
"""
import argparse
import csv
import json
import math
import os
import platform
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repository's modules: this file runs as a script
from utils import run_dir as run_files  # noqa: E402
IMG_SIZE, VAL_RESIZE, CROP_PCT = 32, 36, 0.875  # timm: floor(32 / 0.875) = 36
SHAPES = ("disc", "square", "triangle", "cross", "ring")
PALETTES = {"warm": ((200, 255), (20, 120), (0, 60)), "cool": ((0, 60), (60, 180), (180, 255))}  # RGB ranges


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timm-train", help="timm's train.py (from a clone of pytorch-image-models)")
    p.add_argument("--quick", action="store_true", help="tiny set, 1 epoch, 1 seed, the template side only")
    p.add_argument("--seeds", type=int, default=3, help="pairs (one seed each); default 3")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lrf", type=float, default=0.01, help="final lr = lr * lrf")
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=1, help="whole epochs (timm's flag is an int)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers, both sides; default 0")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (OMP_NUM_THREADS), both; default 1")
    p.add_argument("--per-class", default="100,25", help="train,val images per class; default 100,25")
    p.add_argument("--data", help="the set's root (default data/vs_timm_32, generated if absent)")
    p.add_argument("--out-dir", default="runs/vs_timm")
    p.add_argument("--template-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra config override for the template's train.py (e.g. train.figures=false)")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.per_class, args.warmup_epochs, args.timm_train = 1, 1, "8,4", 0, None
    elif not args.timm_train:
        p.error("--timm-train PATH is needed (timm's train.py); --quick runs the template side alone")
    if args.timm_train and not Path(args.timm_train).is_file():
        p.error(f"--timm-train: no file '{args.timm_train}'")
    args.train_per_class, args.val_per_class = (int(n) for n in args.per_class.split(","))
    if args.epochs <= args.warmup_epochs:
        p.error("--epochs must be more than --warmup-epochs")
    return args


# --------------------------------------------------------------------------- the data

def _draw(rng, shape, palette):
    """One 32 px image: a shape in the palette's colours on a noisy background of the other's."""
    import numpy as np
    from PIL import Image, ImageDraw
    big = 4 * IMG_SIZE  # drawn large and box-filtered down, for smooth edges
    other = PALETTES["cool" if palette == "warm" else "warm"]
    background = np.array([rng.integers(lo, hi) for lo, hi in other]) * 0.45 + 60
    img = Image.fromarray(np.clip(background + rng.normal(0, 18, (big, big, 3)), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    colour = tuple(int(rng.integers(lo, hi)) for lo, hi in PALETTES[palette])
    r = rng.uniform(0.22, 0.4) * big
    cx, cy = rng.uniform(r, big - r, size=2)
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "disc":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    elif shape == "cross":
        w = r / 3
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour)
    else:
        draw.ellipse(box, outline=colour, width=int(r / 3))
    return img.rotate(rng.uniform(-30, 30), resample=Image.BILINEAR).resize((IMG_SIZE, IMG_SIZE), Image.BOX)


def make_set(root, train_per_class, val_per_class, seed=0):
    """root/{train,val}/<shape>_<palette>/*.jpg: 10 classes; built beside root and renamed into place."""
    import numpy as np
    root = Path(root)
    marker = {"train": train_per_class, "val": val_per_class, "size": IMG_SIZE, "seed": seed}
    if (root / ".complete").is_file() and json.loads((root / ".complete").read_text()) == marker:
        return root
    tmp = root.parent / f".{root.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    classes = [(s, p) for p in PALETTES for s in SHAPES]
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for c, (shape, palette) in enumerate(classes):
            folder = tmp / split / f"{shape}_{palette}"
            folder.mkdir(parents=True)
            for i in range(n):
                rng = np.random.default_rng([seed, c, i, split == "val"])
                _draw(rng, shape, palette).save(folder / f"{i:04d}.jpg", quality=90)
    (tmp / ".complete").write_text(json.dumps(marker))
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


# --------------------------------------------------------------------------- the two commands

def steps_per_epoch(args):
    return args.train_per_class * 10 // args.batch_size


def template_command(args, root, seed, out):
    return [sys.executable, str(REPO / "train.py"), "--data-path", str(root), "--device", "cpu",
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
            "--lrf", str(args.lrf), "--output-dir", str(out), "model.name=resnet18", f"data.img_size={IMG_SIZE}",
            f"data.val_resize={VAL_RESIZE}", "data.min_crop_scale=0.08", f"data.num_workers={args.workers}",
            "optim.name=sgd", "optim.momentum=0.9", f"optim.weight_decay={args.weight_decay}",
            f"optim.warmup_epochs={args.warmup_epochs}", "optim.label_smoothing=0", f"train.seed={seed}",
            *args.template_arg]


def timm_command(args, root, seed, out):
    steps = steps_per_epoch(args)
    warmup_steps = args.warmup_epochs * steps
    # --warmup-prefix: the cosine spans the epochs after the warm-up, as the template's does.
    return [sys.executable, str(Path(__file__).resolve()), "--run-timm", str(Path(args.timm_train).resolve()),
            "--data-dir", str(root), "--train-split", "train", "--val-split", "val", "--model", "resnet18",
            "--num-classes", "10", "--img-size", str(IMG_SIZE), "--crop-pct", str(CROP_PCT),
            "--interpolation", "bilinear", "--train-interpolation", "bilinear", "--scale", "0.08", "1.0",
            "--hflip", "0.5", "--color-jitter", "0", "--smoothing", "0", "-b", str(args.batch_size),
            "--opt", "momentum", "--momentum", "0.9", "--weight-decay", str(args.weight_decay), "--lr", str(args.lr),
            "--sched", "cosine", "--sched-on-updates", "--epochs", str(args.epochs - args.warmup_epochs),
            "--warmup-epochs", str(args.warmup_epochs), "--warmup-prefix",
            "--warmup-lr", str(args.lr / max(warmup_steps, 1)), "--min-lr", str(args.lr * args.lrf),
            "-j", str(args.workers), "--seed", str(seed), "--output", str(out.parent), "--experiment", out.name,
            "--log-interval", str(max(steps - 1, 1))]  # every epoch's last update is logged: its mean update time


def run_timm(path, argv):
    """timm's train.py, unmodified, on a machine without CUDA: at this commit it asks for a CUDA device
    (init_distributed_device's default) and validate() syncs CUDA for its default device argument; here
    the device is the CPU and that sync, of a device that does not exist, does nothing."""
    import torch
    import timm.utils
    if not torch.cuda.is_available():
        pick = timm.utils.init_distributed_device

        def on_cpu(a):
            a.device = "cpu"
            return pick(a)
        timm.utils.init_distributed_device = on_cpu
        torch.cuda.synchronize = lambda *a, **k: None
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


# --------------------------------------------------------------------------- one run, and what it reports

def timed(cmd, log, threads):
    """Wall seconds of one process, start to exit; its output goes to `log`."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)})
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"error: {' '.join(map(str, cmd[:3]))} ... exited {done.returncode}; see {log}")
    return {"wall_s": seconds, "load_1min_before": load}


def template_result(out):
    epochs = run_files.read_metrics(out)
    seconds = sum(e["train_seconds"] for e in epochs)
    images = sum(e["img_per_s"] * e["train_seconds"] for e in epochs)
    return {"img_per_s": images / seconds, "val_acc": epochs[-1]["val_acc"],
            "epoch_start_lrs": [e["lr"] for e in epochs], "figure_s": sum(e.get("figure_seconds", 0) for e in epochs)}


_TIMM_LINE = re.compile(r"Train: (\d+) \[\s*(\d+)/(\d+).*?\(([\d.]+)s,\s+([\d.]+)/s\)")


def timm_result(out, log, batch_size):
    last = {}  # epoch -> (update index, mean update s) of its last logged update
    for m in _TIMM_LINE.finditer(Path(log).read_text()):
        last[int(m.group(1))] = (int(m.group(2)), batch_size / float(m.group(5)))
    updates = {e: i + 1 for e, (i, _) in last.items()}
    seconds = sum(updates[e] * s for e, (_, s) in last.items())
    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    return {"img_per_s": sum(updates.values()) * batch_size / seconds, "val_acc": float(rows[-1]["eval_top1"]) / 100,
            "epoch_end_lrs": [float(r["lr"]) for r in rows]}


def lr_curves(args):
    """Both schedules, step by step, from the code each script runs: (max |difference| / lr, in the warm-up
    and after it). Needs timm; the template's from utils/optim.py."""
    sys.path.insert(0, str(REPO))
    import torch
    from timm.scheduler import create_scheduler_v2, scheduler_kwargs
    from utils.config import load_config
    from utils.optim import build_scheduler
    steps = steps_per_epoch(args)
    cfg = load_config(["--lr", str(args.lr), "--lrf", str(args.lrf), f"optim.warmup_epochs={args.warmup_epochs}"])
    timm_args = argparse.Namespace(sched="cosine", epochs=args.epochs - args.warmup_epochs,
                                   warmup_epochs=args.warmup_epochs, warmup_prefix=True,
                                   warmup_lr=args.lr / max(args.warmup_epochs * steps, 1),
                                   min_lr=args.lr * args.lrf, sched_on_updates=True, cooldown_epochs=0)
    curves = {}
    for side in ("template", "timm"):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.lr)
        if side == "template":
            sched = build_scheduler(opt, cfg.optim, args.epochs, steps)
            step = lambda n: sched.step()  # noqa: E731
        else:
            sched, _ = create_scheduler_v2(opt, **scheduler_kwargs(timm_args), updates_per_epoch=steps)
            step = lambda n: sched.step_update(num_updates=n)  # noqa: E731
        lrs = []
        for n in range(1, args.epochs * steps + 1):
            lrs.append(opt.param_groups[0]["lr"])  # the lr this step trains with
            opt.step()
            step(n)
        curves[side] = lrs
    diff = [abs(a - b) / args.lr for a, b in zip(curves["template"], curves["timm"])]
    w = args.warmup_epochs * steps
    return {"steps": len(diff), "warmup_steps": w, "max_diff_in_warmup": max(diff[:w], default=0.0),
            "max_diff_after_warmup": max(diff[w:])}


# --------------------------------------------------------------------------- the comparison

def describe(args, root):
    import torch
    import torchvision
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
            "torch": torch.__version__, "torchvision": torchvision.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": args.threads, "data": str(root),
            "train_images": args.train_per_class * 10, "val_images": args.val_per_class * 10,
            "steps_per_epoch": steps_per_epoch(args), "command": " ".join([Path(sys.executable).name, *sys.argv])}
    for k in ("epochs", "batch_size", "lr", "lrf", "weight_decay", "warmup_epochs", "workers", "seeds",
              "template_arg", "timm_train"):
        meta[k] = getattr(args, k)
    if args.timm_train:
        import timm
        meta["timm"] = timm.__version__
    return meta


def compare(args, root, out_dir):
    res = {"meta": describe(args, root), "runs": []}
    sides = ["template"] + (["timm"] if args.timm_train else [])
    for seed in range(args.seeds):
        order = sides if seed % 2 == 0 else sides[::-1]
        pair = {"seed": seed}
        for side in order:
            out = out_dir / f"{side}-seed{seed}"
            shutil.rmtree(out, ignore_errors=True)
            log = out_dir / f"{side}-seed{seed}.log"
            if side == "template":
                pair[side] = timed(template_command(args, root, seed, out), log, args.threads)
                pair[side].update(template_result(out))
            else:
                pair[side] = timed(timm_command(args, root, seed, out), log, args.threads)
                pair[side].update(timm_result(out, log, args.batch_size))
            r = pair[side]
            print(f"seed {seed} {side}: {r['wall_s']:.1f} s wall, {r['img_per_s']:.0f} img/s, "
                  f"val_acc {r['val_acc']:.3f} (load {r['load_1min_before']:.2f})", flush=True)
        if args.timm_train:
            pair["wall_ratio"] = pair["template"]["wall_s"] / pair["timm"]["wall_s"]
            pair["img_per_s_ratio"] = pair["template"]["img_per_s"] / pair["timm"]["img_per_s"]
        res["runs"].append(pair)
        write(res, out_dir)
    if args.timm_train:
        res["lr"] = lr_curves(args)
        res["wall_ratio"] = statistics.median(p["wall_ratio"] for p in res["runs"])
        res["img_per_s_ratio"] = statistics.median(p["img_per_s_ratio"] for p in res["runs"])
    res["meta"]["load_avg_at_end"] = os.getloadavg()
    write(res, out_dir)
    return res


def table(res):
    med = lambda side, key: statistics.median(p[side][key] for p in res["runs"])  # noqa: E731
    m = res["meta"]
    sides = [s for s in ("template", "timm") if s in res["runs"][0]]
    lines = ["| | " + " | ".join(sides) + (" | template / timm (median of pairs) |" if len(sides) > 1 else " |"),
             "|---|" + "---|" * (len(sides) + (len(sides) > 1))]
    for key, name, fmt in (("wall_s", "wall time, s (median)", "{:.1f}"), ("img_per_s", "img/s (median)", "{:.0f}"),
                           ("val_acc", "final val accuracy (median)", "{:.3f}")):
        row = f"| {name} | " + " | ".join(fmt.format(med(s, key)) for s in sides)
        ratio = {"wall_s": "wall_ratio", "img_per_s": "img_per_s_ratio"}.get(key)
        if len(sides) > 1:
            row += f" | {statistics.median(p[ratio] for p in res['runs']):.3f}" if ratio else " | "
        lines.append(row + " |")
    for p in res["runs"]:
        lines.append(f"| seed {p['seed']} | " + " | ".join(f"{p[s]['wall_s']:.1f} s, {p[s]['img_per_s']:.0f} img/s, "
                                                           f"acc {p[s]['val_acc']:.3f}" for s in sides)
                     + (f" | {p['wall_ratio']:.3f} wall, {p['img_per_s_ratio']:.3f} img/s |" if len(sides) > 1
                        else " |"))
    if "lr" in res:
        lr = res["lr"]
        lines.append(f"\nlr curves over {lr['steps']} steps: equal within {lr['max_diff_after_warmup']:.1e} x lr after "
                     f"the warm-up; within {lr['max_diff_in_warmup']:.3f} x lr in its {lr['warmup_steps']} steps.")
    lines.append(f"\nresnet18, {m['train_images']} train / {m['val_images']} val images of {IMG_SIZE} px, "
                 f"{m['epochs']} epochs x {m['steps_per_epoch']} steps of {m['batch_size']}, {m['workers']} workers, "
                 f"CPU ({m['cpu_count']} cores, {m['torch_threads']} torch threads), torch {m['torch']}"
                 + (f", timm {m['timm']}" if "timm" in m else "") + f"; load average at the end "
                 f"{', '.join(f'{x:.2f}' for x in m.get('load_avg_at_end', ()))}; `{m['command']}`")
    return "\n".join(lines) + "\n"


def write(res, out_dir, stem="vs_timm", render=None):
    """OUT/<stem>.json and OUT/<stem>.md (render(res), default this tool's table), each whole or not at all."""
    for name, text in ((f"{stem}.json", json.dumps(res, indent=2)), (f"{stem}.md", (render or table)(res))):
        tmp = out_dir / f"{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / name)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-timm"]:
        return run_timm(argv[1], argv[2:])
    args = parse_args(argv)
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    default = (out_dir / "data" / "tiny_32") if args.quick else REPO / "data" / "vs_timm_32"
    root = make_set(Path(args.data) if args.data else default, args.train_per_class, args.val_per_class)
    res = compare(args, root, out_dir)
    print(table(res), end="")
    return 0 if not math.isnan(res.get("wall_ratio", 0.0)) else 1


if __name__ == "__main__":
    sys.exit(main())
