"""Images per second of the training loader from shards (data.shards) against the same images in class folders,
and the time to the first batch and the loader workers' memory as the number of images grows.

    python benchmarks/shards.py                      # 2,000 JPEGs for img/s; first batch at 1,000, 10,000, 30,000
    python benchmarks/shards.py --quick              # tiny sets, seconds
    python benchmarks/shards.py --only-scale --sizes 10000 100000 1000000 --out-dir /tmp/bench_shards

Both loaders are train.py's own (data.build_datasets + data.make_loader, data.val_rate=0 so both read every
image, the same decode and crop, 2 workers that live across epochs): one from class folders of synthetic JPEGs
(160x120, grain, 10 classes), one from their shards (tools/make_shards.py, 1,000 per shard) on the local disk,
and one from the same shards served by a plain HTTP server on localhost (python's http.server in a thread;
each epoch starts with an empty shard cache, so every shard is fetched). A run is one whole epoch, timed from
iter() to its last batch, after one untimed epoch of each; runs alternate folders, local shards, HTTP shards,
--repeats times, and the ratios printed are the medians of the pairs.

The first batch: a fresh process's share of the work (the split, the datasets, the loader and its workers, one
batch), in this process, folders, shards and the same shards read through wids's own index (their samples.jsonl
without the images' places: how shards were read before) alternated, the fastest of 2, at each --sizes number of
images; then each loader worker's memory (RSS, and USS: the pages it alone holds, from /proc/PID/smaps_rollup). Those sets are small
synthetic JPEGs (64x48, 100 distinct ones hard-linked under 10 class folders, so that 10^6 of them are made in
a minute) packed by make_shards.py on every core, made once into --out-dir and kept: delete it after.
"""
import argparse
import functools
import http.server
import json
import os
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
    p.add_argument("--only-scale", action="store_true", help="the first batch and memory rows only, no img/s")
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


def scale_set(out_dir, n):
    """n small synthetic JPEGs in 10 class folders (hard links to 100 distinct ones), and their shards."""
    root, shards = Path(out_dir) / f"scale_folders_{n}", Path(out_dir) / f"scale_shards_{n}"
    if not (shards / "index.json").exists():
        rng = np.random.default_rng(0)
        pool = Path(out_dir) / "scale_pool"
        pool.mkdir(parents=True, exist_ok=True)
        for k in range(100):
            Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(pool / f"{k}.jpg", quality=90)
        for c in range(10):
            (root / f"class_{c}").mkdir(parents=True, exist_ok=True)
        for i in range(n):
            target = root / f"class_{i % 10}" / f"{i:07d}.jpg"
            if not target.exists():
                os.link(pool / f"{i % 100}.jpg", target)
        subprocess.run([sys.executable, str(REPO / "tools/make_shards.py"), str(root), "--out", str(shards),
                        "--per-shard", "1000"], check=True, stdout=subprocess.DEVNULL)
    return root, shards


def without_places(shards):
    """A folder of the same shards (linked) whose samples.jsonl lacks the images' offsets and sizes: read
    through wids's ShardListDataset, which indexes a shard by parsing its tar headers when it opens it."""
    out = shards.parent / (shards.name + "_wids")
    if not (out / "index.json").exists():
        out.mkdir(exist_ok=True)
        for f in shards.glob("*.tar"):
            if not (out / f.name).exists():
                os.symlink(f.resolve(), out / f.name)
        rows = [json.loads(line) for line in (shards / "samples.jsonl").read_text().splitlines()]
        (out / "samples.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k not in ("offset", "size")})
                                                   + "\n" for r in rows))
        shutil.copy(shards / "index.json", out / "index.json")
    return out


def memory(pid):
    """(RSS, USS) of process `pid` in MiB, from /proc/PID/smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) / 1024
    return fields["Rss"], fields["Private_Clean"] + fields["Private_Dirty"]


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
    """(seconds to the first batch, [(RSS, USS) of each loader worker] after it)."""
    start = time.perf_counter()
    loader_ = loader(source, args, cache)
    batches = iter(loader_)
    next(batches)
    seconds = time.perf_counter() - start
    workers = [memory(w.pid) for w in getattr(batches, "_workers", [])]
    del batches, loader_
    return seconds, workers


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
    rates, firsts = {}, []
    if not args.only_scale:
        rates = throughput(args, out)
    cache = Path(tempfile.mkdtemp(prefix="shard_cache_"))
    try:
        for n in args.sizes:
            f_root, s_root = scale_set(out, n)
            sources = {"folders": ["--data-path", str(f_root)], "shards": [f"data.shards={s_root}"],
                       "wids": [f"data.shards={without_places(s_root)}"]}
            times = {k: [] for k in sources}
            for _ in range(2):
                for k, source in sources.items():
                    times[k].append(first_batch(source, args, cache / k))
            best = {k: min(times[k], key=lambda t: t[0]) for k in sources}
            firsts.append((n, *(best[k][0] for k in sources), *(max(best[k][1], default=(0, 0)) for k in sources)))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if rates:
        print_rates(args, rates)
    print("\n| images | first batch (s): folders | shards | shards read by wids's index | worker RSS / USS (MiB): "
          "folders | shards | shards by wids |")
    print("|---|---|---|---|---|---|---|")
    for n, f, s_, w, *mem in firsts:
        print(f"| {n:,} | {f:.2f} | {s_:.2f} | {w:.2f} | " + " | ".join(f"{r:.0f} / {u:.0f}" for r, u in mem) + " |")
    print(json.dumps({"img_per_s": rates, "first_batch": firsts}))


def throughput(args, out):
    """{source: [img/s of each repeat]}: folders, local shards and shards over HTTP, interleaved."""
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
    finally:
        httpd.shutdown()
        shutil.rmtree(cache, ignore_errors=True)
    return rates


def print_rates(args, rates):
    base = rates["folders"]
    print(f"{args.images} JPEGs 160x120, batch {args.batch}, {args.workers} workers, crop 64, {args.repeats} repeats")
    print("| source | img/s (median) | ratio to folders (median of pairs) |")
    print("|---|---|---|")
    for name, got in rates.items():
        ratio = statistics.median(g / b for g, b in zip(got, base))
        print(f"| {name} | {statistics.median(got):.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
