"""Fine-tuning recipes on real images that ship offline: which start wins with 20 labelled images per class.

    python benchmarks/finetune.py                  # the table (2 seeds)
    python benchmarks/finetune.py --seeds 5 --epochs 30 --val-per-class 100
    python benchmarks/finetune.py --quick          # tiny: 1 seed, 1 epoch, a few images (a smoke test)
    python benchmarks/finetune.py --arms "full fine-tune,head lr x10"   # some rows only

The images are scikit-learn's load_digits (1,797 real 8x8 scans of handwritten digits, shipped with
sklearn: nothing is downloaded), as 32 px RGB PNGs. A resnet18 is first trained from scratch on digits 0-4
(--pretrain-epochs, data.val_rate 0.2); its weights without the head are the "pretrained" start. The task
is digits 5-9 with --per-class labelled train images per class (the same ones for every arm and seed) and
--val-per-class others per class for validation (a train/ val/ root). Every arm is the same command,
train.py with AdamW lr 1e-3, weight decay 0.05, one epoch of warm-up and a cosine, batch 20, --epochs,
one OpenMP thread, except what its row names:

  scratch             no weights
  full fine-tune      --weights PRETRAINED
  head lr x10         ... optim.head_lr_scale=10
  layer decay 0.75    ... optim.head_lr_scale=10 optim.layer_decay=0.75
  unfreeze at 1/4     ... optim.head_lr_scale=10 train.unfreeze_at=E/4 train.unfreeze_warmup=E/4
  frozen body         ... model.freeze_layers=true (only the head trains)
  linear probe        ... train.linear_probe=true, five heads (lr 1e-3 to 1e-1) for 100 epochs on the cached
                      features, no weight decay, no warm-up; its val_acc is the kept head's (best.pt: the best
                      (lr, epoch) on val, as DINOv2's linear evaluation reports)
  student alone       timm/resnet10t from scratch (4.9M parameters)
  student + teacher   the same, train.teacher= the full fine-tune of that seed (resnet18), kd_alpha 0.9, T 4

The metric is the last epoch's val_acc from metrics.jsonl, as mean [min, max] over the seeds. Results:
OUT/finetune.json and OUT/finetune.md; the table is printed last. A run of the same name that finished all its
epochs in OUT is kept (an interrupted measurement continues where it stopped).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repository's modules: this file runs as a script
import torch  # noqa: E402

from benchmarks.init import IMG_SIZE, VAL_RESIZE, _build, _digits, _scan  # noqa: E402
from utils import run_dir as run_files  # noqa: E402

ARMS = ("scratch", "full fine-tune", "head lr x10", "layer decay 0.75", "unfreeze at 1/4", "frozen body",
        "linear probe", "student alone", "student + teacher")
PROBE_EPOCHS = 100  # over cached features: seconds
PROBE = ["train.linear_probe=true", "optim.lr=[0.001,0.003,0.01,0.03,0.1]", "optim.weight_decay=0",
         "optim.warmup_epochs=0", f"train.epochs={PROBE_EPOCHS}"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--pretrain-epochs", type=int, default=6)
    p.add_argument("--per-class", type=int, default=20, help="labelled train images per class of digits 5-9")
    p.add_argument("--val-per-class", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data", type=Path, default=REPO / "runs" / "finetune_data")
    p.add_argument("--out-dir", type=Path, default=REPO / "runs" / "finetune")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated rows to run (student + teacher needs "
                   "full fine-tune)")
    p.add_argument("--quick", action="store_true", help="1 seed, 1 epoch, 4 images per class: a smoke test")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",")]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or ("student + teacher" in args.arms and "full fine-tune" not in args.arms):
        p.error(f"--arms: {', '.join(unknown) or 'student + teacher needs full fine-tune'}; rows: {', '.join(ARMS)}")
    if args.quick:
        args.seeds, args.epochs, args.pretrain_epochs, args.per_class, args.val_per_class = 1, 1, 1, 4, 4
    return args


def make_sets(args):
    """(pretraining root of digits 0-4, task root of digits 5-9 with train/ and val/)."""
    images, labels = _digits(0)
    limit = None if not args.quick else 40

    def pretrain(tmp):
        for i, (img, y) in enumerate(list(zip(images, labels))[:limit and limit * 5]):
            if y < 5:
                (tmp / str(y)).mkdir(exist_ok=True)
                _scan(img, (IMG_SIZE, IMG_SIZE)).save(tmp / str(y) / f"{i:04d}.png")

    def task(tmp):
        taken = {}
        for i, (img, y) in enumerate(zip(images, labels)):  # load_digits' own order: the same split every time
            if y < 5:
                continue
            n = taken[y] = taken.get(y, 0) + 1
            split = "train" if n <= args.per_class else "val" if n <= args.per_class + args.val_per_class else None
            if split:
                (tmp / split / str(y)).mkdir(parents=True, exist_ok=True)
                _scan(img, (IMG_SIZE, IMG_SIZE)).save(tmp / split / str(y) / f"{i:04d}.png")
    return (_build(args.data / "digits0-4", {"limit": limit, "size": IMG_SIZE}, pretrain),
            _build(args.data / "digits5-9", {"per_class": args.per_class, "val": args.val_per_class,
                                             "size": IMG_SIZE}, task))


def command(root, out, seed, epochs, extra=()):
    return [sys.executable, str(REPO / "train.py"), "--data-path", str(root), "--device", "cpu", "--epochs",
            str(epochs), "--batch-size", "20", "--output-dir", str(out), "model.name=resnet18",
            f"data.img_size={IMG_SIZE}", f"data.val_resize={VAL_RESIZE}", "data.min_crop_scale=0.35",
            "data.num_workers=0", "optim.name=adamw", "optim.lr=0.001", "optim.weight_decay=0.05",
            "optim.warmup_epochs=1", f"train.seed={seed}", "train.figures=false", *extra]


def score(out):
    """A run's number: its last epoch's val_acc; a linear probe's, its kept head's (best.pt)."""
    if yaml.safe_load((out / run_files.CONFIG).read_text())["train"].get("linear_probe"):
        return torch.load(run_files.best(out), map_location="cpu", weights_only=False)["best_score"]
    return run_files.read_metrics(out, epochs_only=True)[-1]["val_acc"]


def train(cmd, log, threads):
    """One train.py process -> (its score, wall seconds); its output goes to `log`."""
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)})
    if done.returncode:
        raise SystemExit(f"error: train.py exited {done.returncode}; see {log}")
    out = Path(cmd[cmd.index("--output-dir") + 1])
    return score(out), time.perf_counter() - start


# The student: timm's resnet10t (4.9M parameters, resnet18 11.2M). mobilenet_v3_small at 32 px evaluates to one
# constant output here (its last feature maps are 1x1; val_loss stays ln 5 while its train loss falls).
STUDENT = ["model.name=timm/resnet10t"]


def arm_args(arm, pretrained, epochs, teacher):
    quarter = max(1, epochs // 4)
    tuned = ["--weights", str(pretrained)]
    return {"scratch": [],
            "full fine-tune": tuned,
            "head lr x10": tuned + ["optim.head_lr_scale=10"],
            "layer decay 0.75": tuned + ["optim.head_lr_scale=10", "optim.layer_decay=0.75"],
            "unfreeze at 1/4": tuned + ["optim.head_lr_scale=10", f"train.unfreeze_at={quarter}",
                                        f"train.unfreeze_warmup={quarter}"] if epochs > 1 else tuned,
            "frozen body": tuned + ["model.freeze_layers=true"],
            "linear probe": tuned + PROBE,
            "student alone": STUDENT,
            "student + teacher": STUDENT + [f"train.teacher={teacher}", "train.kd_alpha=0.9",
                                            "train.kd_temperature=4"]}[arm]


def measure(args, pre_root, task_root):
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    pre = out_dir / "pretrain"
    if len(run_files.read_metrics(pre, epochs_only=True)) != args.pretrain_epochs:  # not (all) trained yet
        train(command(pre_root, pre, 0, args.pretrain_epochs, ["optim.lr=0.002"] + (["resume=auto"] if
                      run_files.last(pre).is_file() else [])), out_dir / "pretrain.log", args.threads)
    pretrained = out_dir / "pretrained_body.pth"  # the head left out: the task's is new
    weights = torch.load(run_files.best(pre), map_location="cpu", weights_only=True)["model"]
    torch.save({k: v for k, v in weights.items() if not k.startswith("fc.")}, pretrained)
    res = {"epochs": args.epochs, "pretrain_epochs": args.pretrain_epochs, "per_class": args.per_class,
           "val_per_class": args.val_per_class, "seeds": args.seeds, "runs": []}
    for seed in range(args.seeds):
        for arm in (a for a in ARMS if a in args.arms):
            name = f"{arm.replace(' ', '_').replace('/', '-').replace('+', 'and')}-seed{seed}"
            teacher = out_dir / f"full_fine-tune-seed{seed}"
            cmd = command(task_root, out_dir / name, seed, args.epochs, arm_args(arm, pretrained, args.epochs, teacher))
            done = run_files.read_metrics(out_dir / name, epochs_only=True)
            epochs = PROBE_EPOCHS if arm == "linear probe" else args.epochs
            if len(done) == epochs and run_files.best(out_dir / name).is_file():  # a finished run: kept
                acc, seconds = score(out_dir / name), sum(row["epoch_seconds"] for row in done)
            else:
                shutil.rmtree(out_dir / name, ignore_errors=True)
                acc, seconds = train(cmd, out_dir / f"{name}.log", args.threads)
            res["runs"].append({"arm": arm, "seed": seed, "val_acc": acc, "seconds": round(seconds, 1)})
            print(f"{arm:18s} seed {seed}: val_acc {acc:.3f} ({seconds:.0f} s)", flush=True)
            (out_dir / "finetune.json").write_text(json.dumps(res, indent=1))
    return res


def table(res):
    lines = ["| start | val_acc | vs full fine-tune |", "|---|---|---|"]
    by_arm = {arm: [r["val_acc"] for r in res["runs"] if r["arm"] == arm] for arm in ARMS}
    by_arm = {arm: accs for arm, accs in by_arm.items() if accs}
    full = statistics.mean(by_arm.get("full fine-tune") or [0.0])
    for arm, accs in by_arm.items():
        mean = statistics.mean(accs)
        lines.append(f"| {arm} | {mean:.3f} [{min(accs):.3f}, {max(accs):.3f}] | {mean - full:+.3f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    pre_root, task_root = make_sets(args)
    res = measure(args, pre_root, task_root)
    md = table(res)
    (args.out_dir / "finetune.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
