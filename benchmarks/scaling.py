"""The seed's scaling table on your own hardware: single / DataParallel / DDP on 1, 2, 4 ... N devices.

    python benchmarks/scaling.py                               # every visible GPU, flower-sized folder
    python benchmarks/scaling.py --gpus 1,2,4,8 --modes single,dp,ddp --data data/flower_photos
    python benchmarks/scaling.py --quick                       # CPU/CI: single, DDP over 2 gloo processes

Each row is a real run of an entry script (train.py, train_multi_gpu_dp.py,
torchrun train_multi_gpu_ddp.py) in its own process, read back from its
metrics.jsonl: seconds per epoch (train + eval, last epoch, so start-up and
cuDNN autotuning are left out), training images/s, speedup over `single`,
scaling efficiency (speedup / devices), and peak memory per device: on CUDA
the most `nvidia-smi` reported for each GPU during the run (DataParallel's
extra memory on its first GPU shows here), on CPU the peak resident memory of
the largest process. --batch-size is per device: DataParallel gets it times
the number of GPUs as its global batch, so every row does the same work per
device. Writes OUT/scaling.json, OUT/scaling.md and OUT/scaling.png (drawn
with matplotlib, utils/figures.py), rewritten (atomically) before and after
every row: a run stopped at any point leaves a valid table of the rows it
finished, with the row that was running and those not started marked as such.
--timeout bounds each row (the run and its child processes are killed), so one
hung row still leaves time for the next.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repository's modules: this file runs as a script
from utils import run_dir as run_files  # noqa: E402
SCRIPTS = {"single": "train.py", "dp": "train_multi_gpu_dp.py", "ddp": "train_multi_gpu_ddp.py"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU/CI sizes: resnet18, 32 px, a tiny folder")
    p.add_argument("--gpus", default=None, help="device counts, e.g. 1,2,4,8 (default: powers of 2 up to N, and N)")
    p.add_argument("--modes", default="single,dp,ddp")
    p.add_argument("--data", default=None, help="image folder (default: the generated flower-sized set)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="per device")
    p.add_argument("--model", default=None)
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("--pipeline", default=None, help="data.pipeline for every run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out-dir", default="runs/scaling")
    p.add_argument("extra", nargs="*", help="config overrides passed to every run, key=value")
    args = p.parse_args(argv)
    q = args.quick
    for k, v in dict(epochs=1 if q else 2, batch_size=8 if q else 16, model="resnet18" if q else "resnet34",
                     img_size=32 if q else 224, pipeline="pil").items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def device_counts(n, requested):
    if requested:
        return [int(x) for x in requested.split(",")]
    counts, k = [], 1
    while k < n:
        counts.append(k)
        k *= 2
    return counts + [n]


def process_tree(root_pid):
    """root_pid and all its descendants (from /proc), root first."""
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    todo, tree = [root_pid], []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def kill_tree(root_pid):
    """SIGKILL a run and everything it started (torchrun's workers, DataLoader workers): killing
    torchrun alone would leave its workers holding the GPUs. They stay in this process group, so a
    time limit on this script (timeout(1) signals the group) still reaches them too."""
    for pid in process_tree(root_pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class PeakMemory(threading.Thread):
    """Samples memory while a run lasts: per GPU via nvidia-smi, or the child processes' RSS on CPU."""

    def __init__(self, root_pid, cuda, every=0.2):
        super().__init__(daemon=True)
        self.root_pid, self.cuda, self.every = root_pid, cuda, every
        self.peak, self.stop = {}, threading.Event()
        self.baseline = self._gpu_used() if cuda else {}

    def _gpu_used(self):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        return {int(i): float(m) for i, m in (line.split(",") for line in out.strip().splitlines() if line)}

    def _tree_rss(self):
        rss = {}
        for pid in process_tree(self.root_pid):
            try:
                rss[pid] = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                continue
        return {"largest process": max(rss.values(), default=0) / 2 ** 20}

    def run(self):
        while not self.stop.is_set():
            sample = self._gpu_used() if self.cuda else self._tree_rss()
            for k, v in sample.items():
                v -= self.baseline.get(k, 0.0)  # what was in use before the run is not the run's
                self.peak[k] = max(self.peak.get(k, 0.0), v)
            self.stop.wait(self.every)


def run_one(args, mode, k, data_root, out_dir, cuda):
    run_dir = out_dir / "runs" / f"{mode}{k}"
    if run_dir.exists():
        import shutil
        shutil.rmtree(run_dir)
    batch = args.batch_size * k if mode == "dp" else args.batch_size
    overrides = [f"model.name={args.model}", f"data.img_size={args.img_size}",
                 f"data.val_resize={round(args.img_size * 256 / 224)}", f"data.pipeline={args.pipeline}",
                 *args.extra]
    if args.quick:
        overrides.append("data.num_workers=0")
    script = str(REPO / SCRIPTS[mode])
    flags = ["--data-path", str(data_root), "--epochs", str(args.epochs), "--batch-size", str(batch),
             "--output-dir", str(run_dir), "--device", "cuda" if cuda else "cpu"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if mode == "ddp":
        from benchmarks.benchmark import free_port
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={k}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", script]
    else:
        cmd = [sys.executable, script]
    if cuda:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(k))
    else:
        # k CPU "devices" share the cores: each process gets its share of threads (one in --quick,
        # where CI machines are shared and oversubscribed threads only measure the contention).
        env["OMP_NUM_THREADS"] = "1" if args.quick else str(max(1, (os.cpu_count() or 1) // k))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd + flags + overrides, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    mem = PeakMemory(proc.pid, cuda)
    mem.start()
    timed_out = False
    try:
        log, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tree(proc.pid)
        log, _ = proc.communicate()
    mem.stop.set()
    mem.join()
    wall = time.perf_counter() - start
    (out_dir / f"{mode}{k}.log").write_text(log)
    metrics = run_dir / run_files.METRICS
    if timed_out or proc.returncode != 0 or not metrics.exists():
        tail = "\n".join(log.strip().splitlines()[-5:])
        why = f"timed out after {args.timeout:g} s (--timeout)" if timed_out else f"exit {proc.returncode}"
        return {"mode": mode, "devices": k, "error": f"{why}: {tail}" if tail else why,
                "wall_seconds": wall}
    last = run_files.read_metrics(run_dir)[-1]
    return {"mode": mode, "devices": k, "global_batch": batch * (k if mode == "ddp" else 1),
            "s_per_epoch": last["train_seconds"] + last["val_seconds"], "img_per_s": last["img_per_s"],
            "val_acc": last["val_acc"], "val_count": last["val_count"], "wall_seconds": wall,
            "peak_mem_mb": {str(d): round(v) for d, v in sorted(mem.peak.items())}}


def add_speedups(rows):
    base = next((r for r in rows if r["mode"] == "single" and "error" not in r), None)
    base = base or next((r for r in rows if r["devices"] == 1 and "error" not in r), None)
    for r in rows:
        if base and "error" not in r:
            r["speedup"] = base["s_per_epoch"] / r["s_per_epoch"]
            r["efficiency"] = r["speedup"] / r["devices"]


def markdown(rows, unit, running=None, not_started=()):
    """The table: measured rows, then the row running (if any) and those not started, so a file
    left by a stopped run says what it lacks."""
    lines = ["| mode | devices | global batch | s/epoch | img/s | speedup | efficiency | " + unit + " |",
             "|---|---|---|---|---|---|---|---|"]
    pending = [(m, k, "started, no result yet (if the run has ended, it was stopped during this row)")
               for m, k in ([running] if running else [])]
    pending += [(m, k, "not started") for m, k in not_started]
    for r in rows + [{"mode": m, "devices": k, "pending": why} for m, k, why in pending]:
        if "pending" in r:
            lines.append(f"| {r['mode']} | {r['devices']} | | {r['pending']} | | | | |")
            continue
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['devices']} | | failed: {r['error'].splitlines()[0][:60]} | | | | |")
            continue
        mem = ", ".join(f"{v:,}" for v in r["peak_mem_mb"].values()) or "n/a"
        lines.append(f"| {r['mode']} | {r['devices']} | {r['global_batch']} | {r['s_per_epoch']:.2f} | "
                     f"{r['img_per_s']:,.0f} | {r.get('speedup', 0):.2f} | {r.get('efficiency', 0):.2f} | {mem} |")
    return "\n".join(lines)


def chart(rows, path, title):
    """Grouped bars: images/s per device count, one colour per mode, value on each bar (matplotlib)."""
    from utils.figures import grouped_bars, save_png
    ok = [r for r in rows if "error" not in r]
    counts = sorted({r["devices"] for r in ok})
    modes = [m for m in SCRIPTS if any(r["mode"] == m for r in ok)]
    image = grouped_bars([f"{k} device{'s' if k > 1 else ''}" for k in counts], modes,
                         {(f"{r['devices']} device{'s' if r['devices'] > 1 else ''}", r["mode"]): r["img_per_s"]
                          for r in ok}, {"single": "dimgray", "dp": "darkorange", "ddp": "tab:blue"},
                         title, "img/s")
    tmp = path.with_name(f".{path.name}.tmp")
    save_png(image, tmp)
    os.replace(tmp, path)


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    cuda = torch.cuda.is_available() and not args.quick
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    from benchmarks.benchmark import flower_folder, write_atomic
    data_root = Path(flower_folder(argparse.Namespace(data=args.data, quick=args.quick), out_dir)).resolve()
    n = torch.cuda.device_count() if cuda else 2
    counts = device_counts(n, args.gpus if cuda else (args.gpus or "1,2"))
    modes = args.modes.split(",")
    plan = []
    for k in counts:
        for m in modes:
            if m != "ddp" and not cuda and k > 1:
                continue  # single and DP are one process: on CPU there is no second device
            if m == "single" and k > 1:
                continue
            if m == "dp" and not cuda:
                continue  # DataParallel without GPUs runs exactly like single
            if m == "ddp" and k == 1 and args.quick:
                continue  # the CPU rehearsal: a 1-process DDP launch shows nothing the 2-process row does not
            plan.append((m, k))
    unit = "peak MiB per GPU (nvidia-smi)" if cuda else "peak RSS MiB (largest process)"
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "cpu_count": os.cpu_count(),
            "load_avg_at_start": os.getloadavg(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "model": args.model, "img_size": args.img_size, "batch_per_device": args.batch_size,
            "epochs": args.epochs, "pipeline": args.pipeline, "data": str(data_root)}
    header = (f"{meta['date']}, {meta['device']} x{max(counts)}, {meta['cpu_count']} CPU cores (load "
              f"{meta['load_avg_at_start'][0]:.1f}), torch {meta['torch']}; {args.model} {args.img_size} px, "
              f"batch {args.batch_size} per device, data.pipeline={args.pipeline}, last of {args.epochs} epoch(s)"
              f"\n`{meta['command']}`\n\n")
    rows = []

    def save(running=None):  # before and after every row: a stopped run leaves a valid partial table
        add_speedups(rows)
        not_started = plan[len(rows) + (running is not None):]
        md = markdown(rows, unit, running, not_started)
        write_atomic(out_dir / "scaling.json", json.dumps(
            {"meta": meta, "rows": rows, "running": running, "not_started": not_started}, indent=2) + "\n")
        write_atomic(out_dir / "scaling.md", header + md + "\n")
        chart(rows, out_dir / "scaling.png", f"{args.model} {args.img_size}px, batch {args.batch_size}/device, "
                                              f"{meta['device']}")
        return md

    for m, k in plan:
        save(running=(m, k))
        print(f"{m} on {k} {'GPU' if cuda else 'CPU process'}(s) ...", flush=True)
        rows.append(run_one(args, m, k, data_root, out_dir, cuda))
        save()
    print("\n" + header + save(), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(1 if any("error" in r for r in main()) else 0)  # a failed row: a table, and a failed exit
