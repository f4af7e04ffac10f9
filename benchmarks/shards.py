"""Images per second of the training loader from shards (data.shards) against the same images in class folders,
and the time to the first batch as the number of images grows.

    python benchmarks/shards.py                      # 2,000 JPEGs for img/s; first batch at 1,000, 10,000, 30,000
    python benchmarks/shards.py --quick              # tiny sets, seconds
    python benchmarks/shards.py --images 5000 --sizes 1000 100000 --repeats 5 --out-dir runs/shards

Both loaders are train.py's own (data.build_datasets + data.make_loader, data.val_rate=0 so both read every
image, the same decode and crop, 2 workers that live across epochs): one from class folders of synthetic JPEGs
(160x120, grain, 10 classes), one from their shards (tools/make_shards.py, 1,000 per shard) on the local disk,
and one from the same shards served by a plain HTTP server on localhost (python's http.server in a thread;
each epoch starts with an empty shard cache, so every shard is fetched). A run is one whole epoch, timed from
iter() to its last batch, after one untimed epoch of each; runs alternate folders, local shards, HTTP shards,
--repeats times, and the ratios printed are the medians of the pairs.

The first batch: a fresh process's share of the work (the split, the datasets, the loader and its workers, one
batch), in this process, folders and shards alternated, at each --sizes number of images (generated once into
--out-dir, kept).
"""
import argparse
import functools
import http.server
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import data  # noqa: E402
from utils.config import load_config  # noqa: E402
from utils.samplers import epoch_sampler  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2000, help="images of the img/s set")
    p.add_argument("--sizes", type=int, nargs="*", default=[1000, 10000, 30000], help="images, first-batch sets")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out-dir", default="data/bench_shards", help="where the sets are made (kept)")
    p.add_argument("--quick", action="store_true", help="tiny sets, one repeat: seconds")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.sizes, args.repeats, args.batch = 200, [200, 400], 1, 16
    return args


def image_set(out_dir, n):
    """n synthetic JPEGs in 10 class folders, and their shards: (folder, shard folder), made once."""
    root, shards = Path(out_dir) / f"folders_{n}", Path(out_dir) / f"shards_{n}"
    if not (shards / "index.json").exists():
        rng = np.random.default_rng(0)
        base = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)
        for i in range(n):
            folder = root / f"class_{i % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            grain = rng.integers(-20, 20, base.shape)
            Image.fromarray(np.clip(base.astype(int) + grain + 10 * (i % 10), 0, 255).astype(np.uint8)).save(
                folder / f"{i:07d}.jpg", quality=90)
        subprocess.run([sys.executable, str(REPO / "tools/make_shards.py"), str(root), "--out", str(shards),
                        "--per-shard", "1000"], check=True, stdout=subprocess.DEVNULL)
    return root, shards


def loader(source, args, cache):
    """train.py's training loader over `source` (["--data-path", X] or ["data.shards=X"])."""
    cfg = load_config([*source, "--batch-size", str(args.batch), "data.val_rate=0", f"data.num_workers={args.workers}",
                       "data.img_size=64", "data.val_resize=73", f"data.shard_cache={cache}"])
    train_set, _, _ = data.build_datasets(cfg.data)
    out = data.make_loader(train_set, args.batch, epoch_sampler(train_set, 0), cfg.data, torch.device("cpu"),
                           train=True, procs_per_node=1)
    out.generator.manual_seed(0)
    return out


def epoch(loader_, n_epoch):
    loader_.sampler.set_epoch(n_epoch)
    start, images = time.perf_counter(), 0
    for x, _ in loader_:
        images += x.shape[0]
    return images / (time.perf_counter() - start)


def first_batch(source, args, cache):
    start = time.perf_counter()
    loader_ = loader(source, args, cache)
    next(iter(loader_))
    seconds = time.perf_counter() - start
    del loader_
    return seconds


def serve(root):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out_dir)
    folders, shards = image_set(out, args.images)
    httpd, url = serve(shards.parent)
    cache = Path(tempfile.mkdtemp(prefix="shard_cache_"))
    try:
        sources = {"folders": ["--data-path", str(folders)], "local shards": [f"data.shards={shards}"],
                   "HTTP shards": [f"data.shards={url}/{shards.name}"]}
        loaders = {name: loader(src, args, cache / name) for name, src in sources.items()}
        for name, ld in loaders.items():
            epoch(ld, 0)  # untimed: workers started, files in the page cache
        rates = {name: [] for name in loaders}
        for r in range(args.repeats):
            for name, ld in loaders.items():
                if name == "HTTP shards":
                    shutil.rmtree(cache / name, ignore_errors=True)  # every shard fetched again
                    loaders[name] = ld = loader(sources[name], args, cache / name)
                rates[name].append(epoch(ld, r + 1))
        del loaders
        firsts = []
        for n in args.sizes:
            f_root, s_root = image_set(out, n)
            times = {"folders": [], "shards": []}
            for _ in range(2):
                times["folders"].append(first_batch(["--data-path", str(f_root)], args, cache / "f"))
                times["shards"].append(first_batch([f"data.shards={s_root}"], args, cache / "f"))
            firsts.append((n, min(times["folders"]), min(times["shards"])))
    finally:
        httpd.shutdown()
        shutil.rmtree(cache, ignore_errors=True)
    base = rates["folders"]
    print(f"{args.images} JPEGs 160x120, batch {args.batch}, {args.workers} workers, crop 64, {args.repeats} repeats")
    print("| source | img/s (median) | ratio to folders (median of pairs) |")
    print("|---|---|---|")
    for name, got in rates.items():
        ratio = statistics.median(g / b for g, b in zip(got, base))
        print(f"| {name} | {statistics.median(got):.1f} | {ratio:.2f} |")
    print("\n| images | first batch, folders (s) | first batch, shards (s) |")
    print("|---|---|---|")
    for n, f, s in firsts:
        print(f"| {n:,} | {f:.2f} | {s:.2f} |")
    print(json.dumps({"img_per_s": rates, "first_batch": firsts}))


if __name__ == "__main__":
    main()
