"""How much of the sample list does each DataLoader worker copy, once it has read every sample?

    python benchmarks/sample_memory.py                 # 1,000,000 samples, 4 workers
    python benchmarks/sample_memory.py --quick         # 50,000 samples, 2 workers (tests/test_benchmarks.py)
    python benchmarks/sample_memory.py --samples 200000 --workers 8 --json out.json

Forked workers share the parent's memory until they write to a page. Reading a Python object
writes its reference count, so a worker that reads every (path, label) tuple of a list ends up
with a private copy of the whole list (pytorch/pytorch#13246). data.ImageList keeps its samples
as a utils.sample_list.SampleList (three numpy arrays) instead. For each form, the old list of tuples (kept
here only as the comparison) and the SampleList, the script builds ImageNet-like samples, starts
a real DataLoader with N forked workers, and each worker reads every sample once and reports how
its Private_Dirty memory (/proc/self/smaps_rollup, Linux) grew meanwhile: that growth is what the
worker copied. Also reported: what building the samples added to the parent's memory.
"""
import argparse
import gc
import json
import platform
import statistics
import sys
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from utils.sample_list import SampleList  # noqa: E402


def private_dirty_mb():
    """This process's private dirty memory (pages it wrote, its own copies), in MiB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no Private_Dirty line in /proc/self/smaps_rollup")


def fake_samples(n, classes=1000):
    """ImageNet-like (path, label) pairs, path names 63 characters long."""
    for i in range(n):
        label = i % classes
        yield f"/data/imagenet/train/n{label:08d}/n{label:08d}_{i:09d}.JPEG", label


class ReadEverySample(Dataset):
    """Item k (one per worker): read every sample as ImageList does, -> the worker's memory growth."""

    def __init__(self, samples, workers):
        self.samples, self.workers = samples, workers

    def __len__(self):
        return self.workers

    def __getitem__(self, k):
        before = private_dirty_mb()
        total = 0
        for i in range(len(self.samples)):
            path, label = self.samples[i]
            total += len(path) + label
        return {"growth_mb": private_dirty_mb() - before, "checksum": total}


def measure(samples, workers):
    """Each of `workers` forked workers reads every sample once: -> [growth in MiB per worker], checksums."""
    # torch warns when the workers outnumber the cores; here they mostly wait for the page faults.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    loader = DataLoader(ReadEverySample(samples, workers), batch_size=None, num_workers=workers,
                        multiprocessing_context="fork")
    results = list(loader)
    return [r["growth_mb"] for r in results], {r["checksum"] for r in results}


def run(n, workers):
    rows = {}
    for form in ("list of tuples", "SampleList"):
        gc.collect()
        before = private_dirty_mb()
        samples = list(fake_samples(n)) if form == "list of tuples" else SampleList(fake_samples(n))
        parent_mb = private_dirty_mb() - before
        growth, checksums = measure(samples, workers)
        assert len(checksums) == 1, "the workers read different samples"
        rows[form] = {"parent_mb": round(parent_mb, 1), "worker_growth_mb": [round(g, 1) for g in growth],
                      "median_worker_growth_mb": round(statistics.median(growth), 1),
                      "all_workers_mb": round(sum(growth), 1), "checksum": checksums.pop()}
        del samples
    assert rows["list of tuples"]["checksum"] == rows["SampleList"]["checksum"], "the two forms hold other samples"
    return rows


def table(rows, n, workers):
    lines = [f"{n:,} samples, {workers} forked workers, each reading every sample once "
             f"(torch {torch.__version__}, Python {platform.python_version()})", "",
             "| samples kept as | parent, after building them | each worker's growth (median) | all workers |",
             "|---|---|---|---|"]
    for form, r in rows.items():
        lines.append(f"| {form} | {r['parent_mb']:.1f} MiB | {r['median_worker_growth_mb']:.1f} MiB | "
                     f"{r['all_workers_mb']:.1f} MiB |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="50,000 samples, 2 workers")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    n, workers = (50_000, 2) if args.quick else (args.samples, args.workers)
    if not Path("/proc/self/smaps_rollup").exists():
        sys.exit("error: this benchmark reads /proc/self/smaps_rollup (Linux 4.14 or later)")
    rows = run(n, workers)
    if args.json:
        args.json.write_text(json.dumps({"samples": n, "workers": workers, "rows": rows}, indent=2) + "\n")
    print(table(rows, n, workers))


if __name__ == "__main__":
    main()
