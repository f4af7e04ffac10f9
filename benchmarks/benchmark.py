"""How fast is the training loop, and how close does the input pipeline get to the model's own speed?

    python benchmarks/benchmark.py                      # this device, ResNet34, batch 128, 224 px, flower-sized folder
    python benchmarks/benchmark.py --quick              # CPU/CI: resnet18, 32 px, a tiny folder, seconds
    python benchmarks/benchmark.py --pipelines gpu,pil --compile --out-dir runs/bench

One run measures, on the current device and with the same model, batch,
precision and memory format throughout:
  (a) ceiling     the project's own train step (engine.train_one_epoch) on
                  device-resident synthetic batches: what the GPU can do;
  (b) end to end  train.py's real loop (train.main: loaders, fit, eval, checkpoints)
                  over a real JPEG folder, per data.pipeline; img/s of the
                  training pass, its ratio to (a), epoch seconds (train + eval),
                  peak device memory. The folder is the flower-sized generated set
                  (3,670 JPEGs, flower_photos' class counts, 240-500 px) unless --data;
  (c) DDP at world size 1 vs the bare module, same step, several DDP options
      (with and without the per-forward buffer broadcast, ddp.broadcast_buffers);
  (d) on CPU, the project's step vs a bare PyTorch loop doing the same work
      (catches per-step host syncs and logging all-reduces).
Timings are medians over interleaved repeats after warm-up ((d): of the repeats'
ratios, both loops stepping one model and optimizer); on CUDA every
timed region ends in a host sync (the loop's own .item()). Results go to
OUT/benchmark.json and OUT/benchmark.md, rewritten (atomically) before and
after every part, so a run stopped at any point leaves a valid table of what
it finished, and says which part was running and which had not started.
A part that fails is reported and the others still run (exit status 1).
The table is printed last. (b)'s folder is generated on first use, into
data/bench_flowers (git-ignored, kept; 50-57 s on one core of a 2-core VM);
--prepare-data makes only the folder.
"""
import argparse
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model import create_model  # noqa: E402
from engine import Step, train_one_epoch  # noqa: E402
from utils import run_dir as run_files  # noqa: E402
from utils.optim import build_optimizer, build_scaler, build_scheduler, resolve_amp  # noqa: E402

DDP_BOUND, BARE_BOUND, RATIO_TARGET, EPOCH_TARGET_S = 1.05, 1.05, 0.90, 0.6


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes for CPU/CI")
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--img-size", type=int, default=None)
    p.add_argument("--amp", default="auto", choices=("auto", "bf16", "fp16", "off"))
    p.add_argument("--channels-last", default="true", choices=("true", "false"))
    p.add_argument("--pipelines", default=None, help="comma list of data.pipeline values for (b)")
    p.add_argument("--epochs", type=int, default=None, help="(b): epochs per pipeline; the last one is reported")
    p.add_argument("--steps", type=int, default=None, help="(a), (c), (d): timed steps per repeat")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="also measure the ceiling with torch.compile")
    p.add_argument("--data", default=None, help="image folder for (b); default: generate the flower-sized set")
    p.add_argument("--skip", default="", help="comma list of parts to skip: ceiling,e2e,ddp,bare")
    p.add_argument("--out-dir", default="runs/benchmark")
    p.add_argument("--prepare-data", action="store_true",
                   help="only make (b)'s image folder and print its path: generate it ahead of a timed run")
    args = p.parse_args(argv)
    q = args.quick
    defaults = dict(model="resnet18" if q else "resnet34", batch_size=8 if q else 128, img_size=32 if q else 224,
                    pipelines="pil,gpu", epochs=1 if q else 3, steps=3 if q else 50, repeats=1 if q else 5)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak host RSS of this process


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class Batches:
    """A loader over a few fixed device-resident batches, cycled: no input cost at all."""

    def __init__(self, batches, steps):
        self.batches, self.steps = batches, steps

    def __len__(self):
        return self.steps

    def __iter__(self):
        return (self.batches[i % len(self.batches)] for i in range(self.steps))


def synthetic(device, batch, img, channels_last, n=4, classes=5):
    gen = torch.Generator().manual_seed(0)  # random, never zeros: zeros can run faster than real data
    out = []
    for _ in range(n):
        x = torch.randn(batch, 3, img, img, generator=gen).to(device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out.append((x, torch.randint(0, classes, (batch,), generator=gen).to(device)))
    return out


class Trainer:
    """One model + optimizer + schedule, stepped by the project's train_one_epoch or by a bare loop."""

    def __init__(self, name, device, amp_dtype, channels_last, wrap=None, seed=0):
        torch.manual_seed(seed)
        model = create_model(name, num_classes=5).to(device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.bare = model
        self.model = wrap(model) if wrap else model
        optim_cfg = argparse.Namespace(name="sgd", lr=0.01, lrf=0.01, momentum=0.9, weight_decay=1e-4,
                                       warmup_epochs=0.0, scale_lr=False)
        self.opt = build_optimizer(model, optim_cfg)
        self.sched = build_scheduler(self.opt, optim_cfg, 1000, 1000)
        self.scaler = build_scaler(amp_dtype, device)
        self.device, self.amp_dtype, self.channels_last = device, amp_dtype, channels_last

    def project(self, loader):
        """Seconds for one train_one_epoch over `loader` (it ends with a host sync)."""
        sync(self.device)
        t = time.perf_counter()
        train_one_epoch(Step(self.model, self.opt, self.sched, self.scaler, self.device, amp_dtype=self.amp_dtype,
                             channels_last=self.channels_last), loader, 0)
        return time.perf_counter() - t

    def bare_loop(self, loader):
        """The same work written as the shortest correct PyTorch loop, one sync at the end."""
        self.model.train()
        sync(self.device)
        t = time.perf_counter()
        for x, y in loader:
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                loss = F.cross_entropy(self.model(x), y)
            self.opt.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.sched.step()
        loss.item()
        return time.perf_counter() - t


def interleaved(runs, loader, repeats, per_repeat=False):
    """{name: median seconds per step}; variants alternate, in reversed order every other repeat,
    so machine load and drift hit them alike. per_repeat: {name: [seconds per step, per repeat]}."""
    for fn in runs.values():
        fn(loader)  # warm-up: cuDNN autotuning, DDP's first-step bucket rebuild, compilation
    times = {k: [] for k in runs}
    for r in range(repeats):
        for k, fn in list(runs.items())[::-1 if r % 2 else 1]:
            times[k].append(fn(loader) / len(loader))
    return times if per_repeat else {k: statistics.median(v) for k, v in times.items()}


def measure_ceiling(args, device, amp_dtype, channels_last, compiled=False):
    loader = Batches(synthetic(device, args.batch_size, args.img_size, channels_last), args.steps)
    out = {}
    variants = {"compiled": torch.compile} if compiled else {"eager": None}
    for name, wrap in variants.items():
        reset_peak(device)
        try:
            step = Trainer(args.model, device, amp_dtype, channels_last, wrap=wrap)
            warm = Batches(loader.batches, max(args.steps, 30) if name == "compiled" else args.steps)
            step.project(warm)  # compile and autotune with enough steps before timing
            s = interleaved({name: step.project}, loader, args.repeats)[name]
        except Exception as e:  # noqa: BLE001 - a compiler failure is a result to report, not a crash
            if not compiled:
                raise
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        out[name] = {"step_ms": s * 1e3, "img_per_s": args.batch_size / s, "peak_mem_mb": peak_mb(device)}
        del step
    return {**out.get("eager", {}), "variants": out}


def flower_folder(args, out_dir):
    from demo.flowers import FLOWER_PHOTOS_COUNTS, ensure
    if args.data:
        return Path(args.data)
    if args.quick:
        return ensure(out_dir / "data" / "tiny_flowers", images_per_class=10, min_size=40, max_size=64)
    root = REPO / "data" / "bench_flowers"  # kept between runs; data/ is git-ignored
    t = time.perf_counter()
    ensure(root, images_per_class=FLOWER_PHOTOS_COUNTS)
    print(f"flower-sized folder ready at {root} ({time.perf_counter() - t:.0f}s)", flush=True)
    return root


def measure_end_to_end(args, device, pipeline, data_root, out_dir):
    """train.py's main() on the folder: the real loaders, loop, eval and checkpoints."""
    import train
    run_dir = out_dir / "runs" / pipeline
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = ["--device", str(device), "--data-path", str(data_root), "--batch-size", str(args.batch_size),
            "--epochs", str(args.epochs), "--output-dir", str(run_dir),
            f"model.name={args.model}", f"data.img_size={args.img_size}",
            f"data.val_resize={round(args.img_size * 256 / 224)}", f"train.amp={args.amp}",
            f"model.channels_last={args.channels_last}", f"data.pipeline={pipeline}"]
    if args.quick:
        argv.append("data.num_workers=0")
    reset_peak(device)
    t = time.perf_counter()
    train.main(argv)
    wall = time.perf_counter() - t
    rows = run_files.read_metrics(run_dir)
    last = rows[-1]
    return {"img_per_s": last["img_per_s"], "train_seconds": last["train_seconds"],
            "val_seconds": last["val_seconds"], "epoch_seconds": last["train_seconds"] + last["val_seconds"],
            "epoch_seconds_with_checkpoint": last["epoch_seconds"], "val_acc": last["val_acc"],
            "epochs": len(rows), "wall_seconds": wall,
            "setup_seconds": wall - sum(r["epoch_seconds"] for r in rows), "peak_mem_mb": peak_mb(device)}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_ddp(args, device, amp_dtype, channels_last):
    """DDP at world size 1 vs the bare module (train.py's case), same step, interleaved."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from utils.config import load_config
    from utils.distributed_utils import ddp_kwargs
    configured = ddp_kwargs(load_config([]).ddp)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        ids = [device.index] if device.type == "cuda" else None
        options = {"ddp_pytorch_defaults": {}, "ddp_configured": configured,
                   "ddp_configured_static": {**configured, "static_graph": True},
                   "ddp_configured_bucket100": {**configured, "bucket_cap_mb": 100},
                   # ddp.broadcast_buffers=true: rank 0's buffers broadcast at every forward (torch's default)
                   "ddp_configured_broadcast_buffers": ddp_kwargs(load_config(["ddp.broadcast_buffers=true"]).ddp)}
        steps = {"bare": Trainer(args.model, device, amp_dtype, channels_last)}
        for name, kw in options.items():
            steps[name] = Trainer(args.model, device, amp_dtype, channels_last,
                               wrap=lambda m, kw=kw: DDP(m, device_ids=ids, **kw))
        loader = Batches(synthetic(device, args.batch_size, args.img_size, channels_last), args.steps)
        med = interleaved({k: s.project for k, s in steps.items()}, loader, args.repeats)
    finally:
        dist.destroy_process_group()
    variants = {k: {"step_ms": v * 1e3, "ratio": v / med["bare"]} for k, v in med.items()}
    ratio = variants["ddp_configured"]["ratio"]
    return {"configured_options": configured, "variants": variants, "ratio": ratio,
            "best": min((k for k in variants if k != "bare"), key=lambda k: variants[k]["ratio"]),
            "bound": DDP_BOUND, "ok": ratio <= DDP_BOUND}


def measure_bare(args):
    """(d) on CPU: a small model, the project's step vs the bare loop, same batches, same run."""
    cpu = torch.device("cpu")
    img, batch, steps = (16, 4, 2) if args.quick else (32, 16, 20)  # quick: the plumbing, not a measurement
    loader = Batches(synthetic(cpu, batch, img, False), steps)
    # One model and optimizer for both loops: two copies of the same model in different memory differ
    # by up to ~15% in one process, even when both run the bare loop; that, not the loop, dominated.
    trainer = Trainer("resnet18", cpu, None, False)
    times = interleaved({"project": trainer.project, "bare": trainer.bare_loop}, loader,
                        max(args.repeats, 3 if args.quick else 9), per_repeat=True)
    # The median of each repeat's ratio: a pair runs back to back, so a slow spell of the machine
    # hits both halves of it alike.
    pairs = [p / b for p, b in zip(times["project"], times["bare"])]
    ratio, med = statistics.median(pairs), {k: statistics.median(v) for k, v in times.items()}
    return {"model": f"resnet18 {img}px batch {batch} fp32", "device": "cpu", "threads": torch.get_num_threads(),
            "project_step_ms": med["project"] * 1e3, "bare_step_ms": med["bare"] * 1e3, "ratio": ratio,
            "pair_ratios": [round(r, 3) for r in pairs], "bound": BARE_BOUND, "ok": ratio <= BARE_BOUND}


def describe(device):
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "load_avg_at_start": os.getloadavg(), "device": str(device),
            "command": " ".join([Path(sys.executable).name, *sys.argv])}
    import torchvision
    meta["torchvision"] = torchvision.__version__
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
    else:
        meta["cpu"] = platform.processor() or platform.machine()
    return meta


def table(res):
    rows = [("metric", "value", "target", "met")]
    fmt = lambda v, d=0: f"{v:,.{d}f}"  # noqa: E731
    if "ceiling" in res:
        for name, r in res["ceiling"]["variants"].items():
            rows.append((f"ceiling img/s ({name})", r["error"][:60] if "error" in r else fmt(r["img_per_s"]), "", ""))
        rows.append((f"ceiling {res['settings']['memory']}", fmt(res["ceiling"]["peak_mem_mb"]), "", ""))
    for pipe, r in res.get("end_to_end", {}).items():
        ratio = r.get("ratio_to_ceiling")
        gpu = res["meta"]["device"].startswith("cuda")
        rows.append((f"e2e img/s ({pipe})", fmt(r["img_per_s"]), "", ""))
        if ratio is not None:
            rows.append((f"e2e / ceiling ({pipe})", fmt(ratio, 3), f">= {RATIO_TARGET}" if gpu else "(GPU only)",
                         ("yes" if ratio >= RATIO_TARGET else "NO") if gpu else ""))
        rows.append((f"epoch s, train+eval ({pipe})", fmt(r["epoch_seconds"], 2),
                     f"<= {EPOCH_TARGET_S}" if gpu else "(GPU only)",
                     ("yes" if r["epoch_seconds"] <= EPOCH_TARGET_S else "NO") if gpu else ""))
        rows.append((f"val_acc after {r['epochs']} epochs ({pipe})", fmt(r["val_acc"], 3), "", ""))
        rows.append((f"{res['settings']['memory']} ({pipe})", fmt(r["peak_mem_mb"]), "", ""))
    if "ddp_ws1" in res:
        d = res["ddp_ws1"]
        for k, v in d["variants"].items():
            if k != "bare":
                rows.append((f"DDP ws1 / bare step ({k})", fmt(v["ratio"], 3), "", ""))
        rows.append(("DDP ws1 / bare step (configured)", fmt(d["ratio"], 3), f"<= {d['bound']}",
                     "yes" if d["ok"] else "NO"))
    if "bare_loop" in res:
        b = res["bare_loop"]
        rows.append(("CPU project / bare loop step", fmt(b["ratio"], 3), f"<= {b['bound']}",
                     "yes" if b["ok"] else "NO"))
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "---|" * 4)
    return "\n".join(lines)


def write_atomic(path, data):
    """Write `data` (str or bytes) through a temporary sibling and a rename: whoever reads the file,
    and whatever stops this process, sees the previous version or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def progress_lines(status):
    """What is not (yet) in the table: a run stopped by a time limit leaves these as its last word."""
    lines = [f"- failed: {k}: {v}" for k, v in status.get("failed", {}).items()]
    if status.get("running"):
        lines.append(f"- started, no result yet: {status['running']} (at +{status['running_since_s']:.0f} s; "
                     "if the run has ended, it was stopped during this)")
    if status.get("not_started"):
        lines.append(f"- not started: {', '.join(status['not_started'])}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.prepare_data:
        print(flower_folder(args, Path(args.out_dir)), flush=True)
        return None
    from utils.distributed_utils import resolve_device, use_device
    device = resolve_device(args.device)
    use_device(device)  # as the entry scripts do: current CUDA device, cudnn.benchmark
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    amp_dtype = resolve_amp(args.amp, device)
    channels_last = args.channels_last == "true" and device.type == "cuda"
    skip = set(filter(None, args.skip.split(",")))
    res = {"meta": describe(device), "settings": {
        "model": args.model, "batch_size": args.batch_size, "img_size": args.img_size,
        "amp": str(amp_dtype).replace("torch.", "") if amp_dtype else "off", "channels_last": channels_last,
        "steps": args.steps, "repeats": args.repeats, "epochs": args.epochs,
        "memory": "peak MiB allocated (CUDA)" if device.type == "cuda" else "peak host RSS MiB (process so far)"}}
    start = time.perf_counter()

    def save():  # before and after every part: a run stopped at any time leaves a valid partial table
        md = table(res)
        meta = res["meta"]
        header = (f"{meta['date']} on {meta.get('gpu', meta.get('cpu'))} ({meta['cpu_count']} CPU cores, load "
                  f"{meta['load_avg_at_start'][0]:.1f}), torch {meta['torch']}, torchvision {meta['torchvision']}; "
                  f"{args.model}, batch {args.batch_size}, {args.img_size} px, amp {res['settings']['amp']}, "
                  f"channels_last {channels_last}\n`{meta['command']}`\n\n")
        progress = progress_lines(res["parts"])
        text = header + md + ("\n\n" + progress if progress else "")
        write_atomic(out_dir / "benchmark.json", json.dumps(res, indent=2) + "\n")
        write_atomic(out_dir / "benchmark.md", text + "\n")
        return text

    def ceiling():
        res["ceiling"] = measure_ceiling(args, device, amp_dtype, channels_last, compiled=False)

    def end_to_end(pipe):
        if "data_root" not in res["settings"]:
            res["settings"]["data_root"] = str(flower_folder(args, out_dir))
        data_root = res["settings"]["data_root"]
        print(f"(b) end to end: train.py on {data_root}, data.pipeline={pipe}", flush=True)
        r = measure_end_to_end(args, device, pipe, data_root, out_dir)
        if "img_per_s" in res.get("ceiling", {}):
            r["ratio_to_ceiling"] = r["img_per_s"] / res["ceiling"]["img_per_s"]
        res.setdefault("end_to_end", {})[pipe] = r

    def ddp():
        res["ddp_ws1"] = measure_ddp(args, device, amp_dtype, channels_last)

    def bare():
        res["bare_loop"] = measure_bare(args)

    def compiled():
        if "img_per_s" not in res.get("ceiling", {}):
            raise RuntimeError("needs the eager ceiling, which has no result")
        res["ceiling"]["variants"].update(measure_ceiling(args, device, amp_dtype, channels_last,
                                                          compiled=True)["variants"])

    plan = []  # (name, what to print, work), in order; the longest and least sure part last
    if "ceiling" not in skip:
        plan.append(("ceiling", "(a) ceiling: train step on device-resident synthetic batches", ceiling))
    if "e2e" not in skip:
        plan += [(f"e2e {pipe}", None, lambda pipe=pipe: end_to_end(pipe)) for pipe in args.pipelines.split(",")]
    if "ddp" not in skip:
        plan.append(("ddp", "(c) DDP world size 1 vs bare module", ddp))
    if "bare" not in skip:
        plan.append(("bare", "(d) CPU: project train step vs a bare PyTorch loop", bare))
    if args.compile and "ceiling" not in skip:
        plan.append(("compiled", "(a') ceiling with torch.compile", compiled))
    status = res["parts"] = {"done": [], "failed": {}, "running": None, "not_started": [p[0] for p in plan]}
    for name, message, work in plan:
        status["not_started"].remove(name)
        status["running"], status["running_since_s"] = name, time.perf_counter() - start
        save()
        if message:
            print(message, flush=True)
        try:
            work()
            status["done"].append(name)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a failed part is a result; the others still run
            traceback.print_exc()  # (train.main exits on a config error: SystemExit)
            status["failed"][name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        status["running"] = None
        status.pop("running_since_s")
        save()
    res["meta"]["seconds"] = time.perf_counter() - start
    print("\n" + save(), flush=True)
    if status["failed"]:
        raise SystemExit(1)
    return res


if __name__ == "__main__":
    main()
