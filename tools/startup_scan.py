"""Start-up cost of reading a large image folder: the scan and split of data.build_datasets, per rank.

    python tools/startup_scan.py /tmp/scan200k --files 200000                       # one process
    torchrun --nproc_per_node=2 tools/startup_scan.py /tmp/scan200k --files 200000  # two (gloo on CPU)
    python tools/startup_scan.py /tmp/scan1m --files 1000000 --classes 1000 --label-file   # data.labels

Makes ROOT (empty .jpg files in --classes class folders, once) if it is missing; the scan
never decodes, so empty files measure it exactly. Prints one line per rank: the
seconds from the first call to the datasets being ready, and how many
directory walks this rank made (global rank 0 scans, the others receive its list).
--label-file reads ROOT/labels.csv instead (path,label, every file once, written once):
the label file's read, its existence check and split, in place of the walk.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data import build_datasets  # noqa: E402
from utils.config import load_config  # noqa: E402
from utils.distributed_utils import cleanup, gather_objects, init_distributed_mode  # noqa: E402


def make(root, files, classes=10):
    done = root / ".complete"
    if done.exists():
        return
    with open(root.parent / f".{root.name}.csv", "w") as csv:
        csv.write("path,label\n")
        for c in range(classes):
            folder = root / f"class_{c:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(files // classes):
                (folder / f"img_{i:07d}.jpg").touch()
                csv.write(f"class_{c:03d}/img_{i:07d}.jpg,class_{c:03d}\n")
    # Beside the class folders it would be an ignored file of the folder scan; moved in last.
    os.replace(root.parent / f".{root.name}.csv", root / ".labels.csv")
    done.touch()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path)
    p.add_argument("--files", type=int, default=200_000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--label-file", action="store_true", help="read ROOT/.labels.csv (data.labels), not the folders")
    args = p.parse_args()
    info = init_distributed_mode("cpu")
    if info.rank == 0:
        args.root.mkdir(parents=True, exist_ok=True)
        make(args.root, args.files, args.classes)
    gather_objects(None)  # every rank waits for the folder
    walks = []
    real_walk = os.walk
    os.walk = lambda top, **k: walks.append(top) or real_walk(top, **k)
    labels = [f"data.labels={args.root / '.labels.csv'}"] if args.label_file else []
    cfg = load_config(["--data-path", str(args.root), "--device", "cpu", *labels])
    start = time.perf_counter()
    train, val, classes = build_datasets(cfg.data)
    seconds = time.perf_counter() - start
    for rank, (s, w, n) in enumerate(gather_objects((seconds, len(walks), len(train) + len(val)))):
        if info.rank == 0:
            print(f"rank {rank}: {s:.2f} s, {w} directory walks, {n} images, world size {info.world_size}")
    cleanup()


if __name__ == "__main__":
    main()
