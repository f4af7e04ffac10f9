"""Which model.zero_init_residual trains better: the template's train.py with it on and off, on real data.

    python benchmarks/init.py                 # the full table (3 seeds; ~15 min on 2 CPU cores)
    python benchmarks/init.py --seeds 5 --epochs 6
    python benchmarks/init.py --model resnet34        # the template's default model
    python benchmarks/init.py --quick         # tiny: 1 seed, 1 epoch, a few images (a smoke test)
    python benchmarks/init.py --tasks "digit pairs" --starts scratch --epochs 15
    python benchmarks/init.py --from-json runs/init/init.json     # the table of a finished run again
    python benchmarks/init.py --recipes --seeds 2 --out-dir runs/init_recipes   # the shipped demo recipes

Three data sets, each trained from scratch and from --weights:
  digits        scikit-learn's load_digits (1,797 real 8x8 scans of handwritten
                digits, shipped with sklearn: nothing is downloaded) as 32 px
                RGB PNGs in class folders, 10 classes; data.val_rate's split;
  digit pairs   multi-label: 32 px images whose two 16x32 halves hold two
                distinct digits, labelled "a;b" in a label file
                (docs/label-files.md); train images are made of the train
                scans only and val images of the held-out ones (a split column);
  demo          demo/flowers.py's five generated flower classes, at 32 px.
From --weights means from a checkpoint of another task that this tool trains
first, with the same setting as the run it starts: the demo's for both digit
sets, the digits' for the demo (every tensor but the head fits). Within the
fine-tune itself the setting changes nothing (only the head is initialised,
and zero_init_residual does not touch it), so these rows measure the setting
through the checkpoint's own training, as a user's earlier run would.

The recipe (the same for every row): --model (resnet18), --epochs epochs of batch 32,
SGD lr 0.05 momentum 0.9 with a cosine to lr * 0.01, half an epoch of warm-up,
no figures. The runs are interleaved, true then false for each seed, so a
shared machine's drifting load falls on both settings alike. Each run is a
process of its own (`python train.py ... model.zero_init_residual=true`), with
--threads OpenMP threads (default 1: on a 2-core machine shared with others,
2 threads per process spin against each other). The final metric is the last
epoch's val_acc (top-1; single-label) or val_map (mAP; multi-label) from
metrics.jsonl. Results: OUT/init.json and OUT/init.md; the table is printed last.

--recipes measures the runs the README makes first instead: the shipped demo
recipes exactly as a newcomer runs them (`train.py --config configs/demo.yaml`
and `--config configs/demo_multilabel.yaml`, the default model, their own
epochs, image size and lr, on demo/flowers.py's and demo/meadow.py's sets),
with only the setting and the seed changed; --epochs, --model and
--batch-size do not apply.
"""
import argparse
import csv
import json
import os
import platform
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
IMG_SIZE, VAL_RESIZE = 32, 36
SETTINGS = (True, False)
TASKS = ("digits", "digit pairs", "demo")
RECIPES = {"demo recipe": "configs/demo.yaml", "multi-label demo recipe": "configs/demo_multilabel.yaml"}
# The checkpoint each task starts from in its --weights rows: another task's, of the same architecture.
WEIGHTS_FROM = {"digits": "demo", "digit pairs": "demo", "demo": "digits"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 1 epoch, a few images: checks the tool runs")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--model", default="resnet18", help="a ResNet-family model.name; default resnet18")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each train.py; default 1")
    p.add_argument("--pairs", type=int, default=1500, help="digit-pair images (80%% train); default 1500")
    p.add_argument("--demo-per-class", type=int, default=100, help="demo images per class; default 100")
    p.add_argument("--digits-limit", type=int, default=0, help="use only this many digit scans (0: all 1,797)")
    p.add_argument("--data", default=str(REPO / "data" / "init_bench"), help="where the sets are written (kept)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of: {', '.join(TASKS)}; default all")
    p.add_argument("--starts", default="scratch,weights", help="comma list of: scratch, weights; default both")
    p.add_argument("--out-dir", default="runs/init")
    p.add_argument("--from-json", metavar="PATH", help="print the table of a saved init.json; no training")
    p.add_argument("--recipes", action="store_true", help="the shipped demo recipes as they are, from scratch")
    args = p.parse_args(argv)
    args.tasks, args.starts = args.tasks.split(","), args.starts.split(",")
    if not set(args.tasks) <= set(TASKS) or not set(args.starts) <= {"scratch", "weights"}:
        p.error(f"--tasks takes {', '.join(TASKS)}; --starts takes scratch, weights")
    if args.quick:
        args.seeds, args.epochs, args.batch_size = 1, 1, 8
        args.pairs, args.demo_per_class, args.digits_limit = 40, 6, 100
    if args.recipes:
        args.tasks, args.starts = list(RECIPES), ["scratch"]
    return args


# --------------------------------------------------------------------------- the data

def _done(root, marker):
    return (root / ".complete").is_file() and json.loads((root / ".complete").read_text()) == marker


def _build(root, marker, write):
    """write(tmp) into a folder beside root, renamed into place once complete (a killed run leaves nothing)."""
    root = Path(root)
    if _done(root, marker):
        return root
    tmp = root.parent / f".{root.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    (tmp / ".complete").write_text(json.dumps(marker))
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def _digits(limit):
    """(images as uint8 8x8 arrays, labels), scikit-learn's scans scaled from 0-16 to 0-255."""
    import numpy as np
    from sklearn.datasets import load_digits
    d = load_digits()
    images, labels = (d.images * (255 / 16)).round().astype(np.uint8), d.target
    return (images[:limit], labels[:limit]) if limit else (images, labels)


def _scan(array, size):
    """One 8x8 scan as an RGB image of `size` (w, h), bilinear: the grey digit in R, G and B."""
    from PIL import Image
    return Image.fromarray(array).resize(size, Image.BILINEAR).convert("RGB")


def make_digits(root, limit):
    images, labels = _digits(limit)

    def write(tmp):
        for i, (img, y) in enumerate(zip(images, labels)):
            (tmp / str(y)).mkdir(exist_ok=True)
            _scan(img, (IMG_SIZE, IMG_SIZE)).save(tmp / str(y) / f"{i:04d}.png")
    return _build(root, {"limit": limit, "size": IMG_SIZE}, write)


def make_pairs(root, n, limit, seed=0):
    """n images of two distinct digits side by side, 80% train (from 80% of the scans), 20% val (the rest)."""
    import numpy as np
    from PIL import Image
    images, labels = _digits(limit)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    cut = int(0.8 * len(order))
    pools = {"train": order[:cut], "val": order[cut:]}

    def write(tmp):
        rows = []
        for i in range(n):
            split = "train" if i < int(0.8 * n) else "val"
            left = rng.choice(pools[split])
            right = rng.choice([j for j in pools[split] if labels[j] != labels[left]])
            img = Image.new("RGB", (IMG_SIZE, IMG_SIZE))
            img.paste(_scan(images[left], (IMG_SIZE // 2, IMG_SIZE)), (0, 0))
            img.paste(_scan(images[right], (IMG_SIZE // 2, IMG_SIZE)), (IMG_SIZE // 2, 0))
            img.save(tmp / f"{i:04d}.png")
            rows.append((f"{i:04d}.png", f"{labels[left]};{labels[right]}", split))
        with open(tmp / "labels.csv", "w", newline="") as f:
            csv.writer(f).writerows([("path", "label", "split"), *rows])
    return _build(root, {"n": n, "limit": limit, "size": IMG_SIZE, "seed": seed}, write)


def make_demo(root, per_class):
    sys.path.insert(0, str(REPO))
    from demo.flowers import ensure
    # Small sides: the runs train at 32 px, and decoding 500 px JPEGs would dominate a CPU epoch.
    return ensure(root, images_per_class=per_class, min_size=48, max_size=64)


def make_sets(args):
    base = Path(args.data) / ("quick" if args.quick else "full")
    if args.recipes:  # the README's own sets, as demo/flowers.py and demo/meadow.py write them
        from demo import flowers, meadow
        pictures = base / "recipe_meadow"
        if not (pictures / "labels.csv").is_file():
            meadow.generate(pictures, images=30 if args.quick else 600)
        return {"demo recipe": flowers.ensure(base / "recipe_flowers", 6 if args.quick else 100),
                "multi-label demo recipe": pictures}
    return {"digits": make_digits(base / "digits", args.digits_limit),
            "digit pairs": make_pairs(base / "digit_pairs", args.pairs, args.digits_limit),
            "demo": make_demo(base / f"demo_{args.demo_per_class}", args.demo_per_class)}


# --------------------------------------------------------------------------- one run

def command(args, task, root, seed, zero_init, out, weights=None):
    if task in RECIPES:  # the recipe as shipped: only the setting, the seed and where things go differ
        cmd = [sys.executable, str(REPO / "train.py"), "--config", RECIPES[task], "--device", "cpu",
               "--output-dir", str(out), f"data.path={root}", f"model.zero_init_residual={str(zero_init).lower()}",
               f"train.seed={seed}", "train.figures=false", "data.num_workers=0"]
        if task == "multi-label demo recipe":
            cmd.append(f"data.labels={root / 'labels.csv'}")
        return cmd + (["--epochs", "1"] if args.quick else [])
    cmd = [sys.executable, str(REPO / "train.py"), "--data-path", str(root), "--device", "cpu",
           "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", "0.05", "--lrf", "0.01",
           "--output-dir", str(out), f"model.name={args.model}", f"model.zero_init_residual={str(zero_init).lower()}",
           f"data.img_size={IMG_SIZE}", f"data.val_resize={VAL_RESIZE}", "data.min_crop_scale=0.35",
           "data.num_workers=0", "optim.warmup_epochs=0.5", f"train.seed={seed}", "train.figures=false"]
    if task == "digit pairs":
        cmd.append(f"data.labels={root / 'labels.csv'}")
    if weights:
        cmd += ["--weights", str(weights)]
    return cmd


def train(cmd, log, threads):
    """One train.py process -> (its final val metric, wall seconds); its output goes to `log`."""
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)})
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"error: train.py exited {done.returncode}; see {log}")
    out = Path(cmd[cmd.index("--output-dir") + 1])
    last = run_files.read_metrics(out)[-1]
    return last["val_map"] if "val_map" in last else last["val_acc"], seconds


# --------------------------------------------------------------------------- the measurement

def rows(meta):
    return [(task, start) for task in meta.get("tasks", TASKS) for start in meta.get("starts", ("scratch", "weights"))]


def measure(args, sets, out_dir):
    res = {"meta": describe(args), "checkpoints": {}, "runs": []}
    # The --weights rows' checkpoints: one per (task, setting), seed 0, trained like every other run.
    for task in sorted({WEIGHTS_FROM[t] for t in args.tasks} if "weights" in args.starts else ()):
        for z in SETTINGS:
            out = out_dir / f"pretrain-{task.replace(' ', '_')}-{str(z).lower()}"
            shutil.rmtree(out, ignore_errors=True)
            metric, seconds = train(command(args, task, sets[task], 0, z, out), out.with_suffix(".log"), args.threads)
            res["checkpoints"][f"{task}/{z}"] = {"path": str(run_files.best(out)), "metric": metric}
            print(f"checkpoint {task} zero_init_residual={z}: metric {metric:.3f} ({seconds:.0f} s)", flush=True)
    for task, start in rows(res["meta"]):
        for seed in range(args.seeds):
            for z in SETTINGS:  # interleaved: true, false, true, false ...
                name = f"{task.replace(' ', '_')}-{start}-seed{seed}-{str(z).lower()}"
                out = out_dir / name
                shutil.rmtree(out, ignore_errors=True)
                weights = res["checkpoints"][f"{WEIGHTS_FROM[task]}/{z}"]["path"] if start == "weights" else None
                metric, seconds = train(command(args, task, sets[task], seed, z, out, weights),
                                        out_dir / f"{name}.log", args.threads)
                res["runs"].append({"task": task, "start": start, "seed": seed, "zero_init_residual": z,
                                    "metric": metric, "wall_s": seconds, "load_1min": os.getloadavg()[0]})
                print(f"{task}, {start}, seed {seed}, zero_init_residual={z}: {metric:.3f} ({seconds:.0f} s)",
                      flush=True)
                write(res, out_dir)
    res["meta"]["load_avg_at_end"] = os.getloadavg()
    res["meta"]["minutes"] = (time.time() - res["meta"]["start"]) / 60
    write(res, out_dir)
    return res


def describe(args):
    import torch
    import torchvision
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "start": time.time(),
            "python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "cpu_count": os.cpu_count(), "threads": args.threads, "epochs": args.epochs, "model": args.model,
            "batch_size": args.batch_size, "seeds": args.seeds, "tasks": args.tasks, "starts": args.starts,
            "recipes": args.recipes, "command": " ".join([Path(sys.executable).name, *sys.argv])}


METRIC = {"digits": "top-1", "digit pairs": "mAP", "demo": "top-1", "demo recipe": "top-1",
          "multi-label demo recipe": "mAP"}


def table(res):
    """Per row: mean [min, max] over seeds of each setting, and the difference of the means (true - false);
    then which setting is better or equal in most rows."""
    lines = ["| data set (metric) | start | zero_init_residual=true | false | true - false |",
             "|---|---|---|---|---|"]
    wins = {True: 0, False: 0}
    for task, start in rows(res["meta"]):
        got = {z: [r["metric"] for r in res["runs"] if (r["task"], r["start"], r["zero_init_residual"])
                   == (task, start, z)] for z in SETTINGS}
        if not all(got.values()):
            continue  # not measured yet
        mean = {z: statistics.mean(v) for z, v in got.items()}
        diff = round(mean[True] - mean[False], 3)  # as printed: +0.000 is a tie
        wins[True] += diff >= 0
        wins[False] += diff <= 0
        cells = [f"{mean[z]:.3f} [{min(got[z]):.3f}, {max(got[z]):.3f}]" for z in SETTINGS]
        where = "scratch" if start == "scratch" else f"--weights ({WEIGHTS_FROM[task]})"
        lines.append(f"| {task} ({METRIC[task]}) | {where} | {cells[0]} | {cells[1]} | {diff:+.3f} |")
    m = res["meta"]
    if m.get("recipes"):
        lines.append(f"\nbetter or equal in {wins[True]} rows with true, {wins[False]} with false. Mean [min, max] "
                     f"over {m['seeds']} seeds of the last epoch's val metric; the recipes as shipped (the default "
                     f"model, their epochs), CPU ({m['cpu_count']} cores, {m['threads']} thread per run), torch "
                     f"{m['torch']}, torchvision {m['torchvision']}"
                     + (f"; {m['minutes']:.1f} min" if "minutes" in m else "") + f"; `{m['command']}`")
        return "\n".join(lines) + "\n"
    # The rule: the setting better or equal in more rows; a tie is torchvision's own default, false.
    lines.append(f"\nbetter or equal in {wins[True]} rows with true, {wins[False]} with false: by the rule, "
                 f"model.zero_init_residual={str(wins[True] > wins[False]).lower()}. Mean [min, max] over "
                 f"{m['seeds']} seeds of the last epoch's val metric; {m.get('model', 'resnet18')}, {m['epochs']} epochs of batch "
                 f"{m['batch_size']}, {IMG_SIZE} px, CPU ({m['cpu_count']} cores, {m['threads']} thread per run), "
                 f"torch {m['torch']}, torchvision {m['torchvision']}"
                 + (f"; {m['minutes']:.1f} min; load average at the end "
                    f"{', '.join(f'{x:.2f}' for x in m['load_avg_at_end'])}" if "minutes" in m else "")
                 + f"; `{m['command']}`")
    return "\n".join(lines) + "\n"


def write(res, out_dir):
    for name, text in (("init.json", json.dumps(res, indent=2)), ("init.md", table(res))):
        tmp = out_dir / f"{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / name)


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        print(table(json.loads(Path(args.from_json).read_text())), end="")
        return 0
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    res = measure(args, make_sets(args), out_dir)
    print(table(res), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
