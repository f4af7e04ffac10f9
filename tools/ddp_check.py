"""Check the multi-GPU environment before a long run: one verdict line per check, exit 0 only if all pass.

Launch it exactly as the training, with the same config and overrides:

    python tools/ddp_check.py                                                  # a group of one
    torchrun --nproc_per_node=2 tools/ddp_check.py                             # one machine (gloo on CPU)
    torchrun --nproc_per_node=8 tools/ddp_check.py --config my.yaml train.batch_size=64
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST0:29400 \\
        tools/ddp_check.py --config my.yaml                                     # the same on every machine

Options of its own: --timeout-s (the process group's timeout, default 60 s, instead of the
training's 30 minutes: a hang becomes an error quickly), --p2p-timeout-s (default 30 s for all
GPU pairs of a node) and --bandwidth-mb (the all-reduce sizes, default 1,16,64). Everything else
is the training's command line (utils.config.load_config).

The checks, in the order they run (rank 0 prints every line, `ok`, `FAIL ... -> fix: ...`,
`skip` or `info`):
    process group   the group forms: backend, world size, ranks per node
    gpu p2p         CUDA only: every GPU pair of each node copies data correctly within the time
                    limit (3090/4090 with broken peer-to-peer hang or corrupt here; NCCL_P2P_DISABLE=1)
    all-reduce      sum of rank+1 over the ranks is n(n+1)/2
    bandwidth       all-reduce bus bandwidth, busbw = algbw * 2(n-1)/n (nccl-tests' definition)
    shm             /dev/shm of each node holds what its loaders keep in flight:
                    processes x workers x prefetch x batch x one sample's bytes (the training
                    transform run on a test image: 3 x img_size^2 for its uint8 output)
    env             which NCCL_* and network variables are set (information, never a failure)

Every rank runs every collective (the project's rule); the facts of one node (its GPU pairs,
its /dev/shm, its variables) are gathered over a gloo group, which needs no GPU peer-to-peer,
so a node whose GPUs cannot talk still reports why.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from PIL import Image  # noqa: E402

from utils.cli import cli_entry  # noqa: E402
from utils.distributed_utils import init_distributed_mode, read_launch_env  # noqa: E402
from utils.errors import UserError  # noqa: E402

SHM_PATH = "/dev/shm"  # where torch's DataLoader workers put their batches on Linux
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_DISTRIBUTED_")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "TP_SOCKET_IFNAME", "USE_LIBUV")
PG_FIX = ("every node must reach MASTER_ADDR:MASTER_PORT (firewall, a free port: torchrun --master_port=PORT); "
          "on a machine with several interfaces name the right one: NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0")
COLLECTIVE_FIX = "NCCL_P2P_DISABLE=1 (broken GPU peer-to-peer), NCCL_IB_DISABLE=1 (no working InfiniBand), " \
                 "NCCL_SOCKET_IFNAME=<interface between the nodes>; NCCL_DEBUG=INFO says which"


def parse_args(argv):
    """This tool's options; the rest of argv is the training's command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    p.add_argument("--timeout-s", type=float, default=60.0, help="process-group timeout (default 60)")
    p.add_argument("--p2p-timeout-s", type=float, default=30.0, help="time for all GPU pairs of a node (default 30)")
    p.add_argument("--bandwidth-mb", default="1,16,64", help="all-reduce sizes in MB, comma-separated")
    p.add_argument("--p2p-worker", action="store_true", help=argparse.SUPPRESS)  # the child of gpu_pairs()
    return p.parse_known_args(argv)


class Report:
    """The verdict lines. Every rank keeps the same list (each verdict is computed from values every rank
    holds), so every rank reaches the same exit code; only rank 0 prints."""

    def __init__(self, rank):
        self.rank, self.failed = rank, []

    def line(self, tag, name, text):
        if self.rank == 0:
            print(f"{tag:<5} {name}: {text}", flush=True)  # at once: if a later check hangs, these are out

    def ok(self, name, text):
        self.line("ok", name, text)

    def fail(self, name, text, fix):
        self.failed.append(name)
        self.line("FAIL", name, f"{text} -> fix: {fix}")


# -- gpu p2p: runs in a child process, because a broken peer-to-peer copy can hang in the driver for
# good, and a hung CUDA call cannot be interrupted from Python; the parent kills the child instead --

def p2p_worker():
    """Child: copy a known pattern between every ordered GPU pair; one JSON line per pair as it ends."""
    n = torch.cuda.device_count()
    numel = 16 * 2**20 // 4  # 16 MB: large enough to use the copy engines, short enough for 56 pairs
    for src in range(n):
        pattern = torch.arange(numel, dtype=torch.float32, device=f"cuda:{src}")
        for dst in range(n):
            if src == dst:
                continue
            print(json.dumps({"start": [src, dst]}), flush=True)  # names the pair if the next copy hangs
            t0 = time.perf_counter()
            copy = pattern.to(f"cuda:{dst}")
            torch.cuda.synchronize(dst)
            seconds = time.perf_counter() - t0
            good = bool(torch.equal(copy.cpu(), pattern.cpu()))
            print(json.dumps({"pair": [src, dst], "good": good, "seconds": seconds,
                              "peer": torch.cuda.can_device_access_peer(src, dst)}), flush=True)


def gpu_pairs(timeout_s):
    """This node's pairs -> {"gpus": n, "bad": [...], "hung": pair or None, "slowest": s}."""
    n = torch.cuda.device_count()
    if n < 2:
        return {"gpus": n, "bad": [], "hung": None, "slowest": 0.0}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, __file__, "--p2p-worker"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        timed_out = True
    records = [json.loads(s) for s in out.splitlines() if s.startswith("{")]
    done = [r for r in records if "pair" in r]
    started = [r["start"] for r in records if "start" in r]
    hung = started[-1] if timed_out and len(started) > len(done) else None
    bad = [r["pair"] for r in done if not r["good"]]
    if proc.returncode and not timed_out:  # the child crashed: its last line says why
        bad.append(out.strip().splitlines()[-1] if out.strip() else f"exit code {proc.returncode}")
    return {"gpus": n, "bad": bad, "hung": hung, "timed_out": timed_out,
            "slowest": max((r["seconds"] for r in done), default=0.0)}


# -- /dev/shm: the loader's workers hand every batch to the main process through shared memory --

def sample_bytes(data_cfg):
    """Bytes of one training sample as the loader workers send it: the training transform run on a
    test JPEG (uint8 by default; float32 where an added transform converts it)."""
    from data import build_transforms
    from utils.decoding import load_image
    train, _ = build_transforms(data_cfg.img_size, data_cfg.val_resize, data_cfg.min_crop_scale)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.jpg")
        Image.new("RGB", (2 * data_cfg.img_size,) * 2).save(path)
        sample = load_image(path, train)
    return sample.numel() * sample.element_size()


def shm_need(cfg, device, procs_on_node):
    """Bytes this node's loaders may hold in /dev/shm at once, and how that was counted."""
    from data import resolve_num_workers  # num_workers=-1: what the training resolves
    from utils.loader import PREFETCH_FACTOR
    workers = resolve_num_workers(cfg.data.num_workers, device, procs_on_node)
    image = sample_bytes(cfg.data)
    per_proc = workers * PREFETCH_FACTOR * cfg.train.batch_size * image
    how = (f"{procs_on_node} process(es) x {workers} workers x prefetch {PREFETCH_FACTOR} x batch "
           f"{cfg.train.batch_size} x {image / 2**20:.2f} MB")
    return per_proc * procs_on_node, how


def shm_free(path=SHM_PATH):
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):  # no /dev/shm (macOS, Windows): torch shares memory another way
        return None
    return st.f_bavail * st.f_frsize


def network_env():
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def gb(nbytes):
    return f"{nbytes / 1e9:.2f} GB"


def main(argv=None):
    args, train_argv = parse_args(sys.argv[1:] if argv is None else argv)
    if args.p2p_worker:
        return p2p_worker()
    from utils.config import load_config  # the training's parser: same files, flags and overrides
    cfg = load_config(train_argv, description="tools/ddp_check.py")
    launch = read_launch_env()
    report = Report(launch[0] if launch else 0)

    # -- process group: the project's own init, with a short timeout --
    t0 = time.perf_counter()
    try:
        info = init_distributed_mode(cfg.train.device, timeout_minutes=args.timeout_s / 60, backend=cfg.ddp.backend)
    except UserError as e:
        report.fail("process group", f"did not form within {args.timeout_s:g} s ({e})", PG_FIX)
        if report.rank != 0:  # rank 0 may be the one that is missing: say which rank this is
            print(f"rank {report.rank}: {e}", file=sys.stderr, flush=True)
        return 1
    rank, world, device = info.rank, info.world_size, info.device
    backend = dist.get_backend()
    # Node facts travel over gloo (TCP), never over the GPUs' own links, which may be what is broken.
    facts_group = dist.new_group(backend="gloo") if backend != "gloo" else None

    def gather(obj):
        out = [None] * world
        dist.all_gather_object(out, obj, group=facts_group)
        return out

    hosts = gather((socket.gethostname(), info.local_rank))
    per_node = {}
    for host, _ in hosts:
        per_node[host] = per_node.get(host, 0) + 1
    nodes = ", ".join(f"{h}: {c}" for h, c in per_node.items())
    report.ok("process group", f"{backend}, world size {world}, {len(per_node)} node(s), ranks per node "
                               f"{{{nodes}}}, formed in {time.perf_counter() - t0:.1f} s on {device.type}")
    # Each node is checked once, by its first local rank; the others gather what it found.
    first_on_node = info.local_rank == 0

    # -- gpu p2p: before any NCCL collective, which would hang on a pair that is broken --
    p2p_ok = True
    if device.type != "cuda":
        report.line("skip", "gpu p2p", "skipped (no CUDA)")
    else:
        mine = gpu_pairs(args.p2p_timeout_s) if first_on_node else None
        for host, found in ((h, f) for (h, _), f in zip(hosts, gather(mine)) if f is not None):
            if found["hung"] is not None:
                p2p_ok = False
                src, dst = found["hung"]
                report.fail("gpu p2p", f"{host}: copy cuda:{src} -> cuda:{dst} did not finish within "
                            f"{args.p2p_timeout_s:g} s", "NCCL_P2P_DISABLE=1 (and check the driver / IOMMU)")
            elif found["bad"] or found.get("timed_out"):
                p2p_ok = False
                report.fail("gpu p2p", f"{host}: wrong data after copies {found['bad']}",
                            "NCCL_P2P_DISABLE=1 (and check the driver / IOMMU)")
            elif found["gpus"] < 2:
                report.line("skip", "gpu p2p", f"{host}: {found['gpus']} GPU visible to local rank 0, no pairs")
            else:
                n = found["gpus"]
                report.ok("gpu p2p", f"{host}: {n * (n - 1)} pairs of {n} GPUs copy 16 MB correctly, "
                                     f"slowest {found['slowest'] * 1000:.1f} ms")

    # -- all-reduce: the gradients' collective, on the training's backend and device --
    collective_ok = p2p_ok or backend != "nccl"
    if not collective_ok:  # every rank knows p2p failed (gathered), so every rank skips alike
        report.fail("all-reduce", "not run: a GPU pair failed above and NCCL would hang on it",
                    "rerun with NCCL_P2P_DISABLE=1")
    else:
        value = torch.tensor([float(rank + 1)], device=device)
        try:
            dist.all_reduce(value)
            got, expected = value.item(), world * (world + 1) / 2
            if got == expected:
                report.ok("all-reduce", f"sum over {world} ranks = {got:g} (expected {expected:g})")
            else:
                collective_ok = False
                report.fail("all-reduce", f"sum over {world} ranks = {got:g}, expected {expected:g}", COLLECTIVE_FIX)
        except RuntimeError as e:  # gloo's timeout; NCCL's watchdog ends the process itself
            collective_ok = False
            report.fail("all-reduce", f"{str(e).splitlines()[0]}", COLLECTIVE_FIX)

    # -- bandwidth: a few sizes, timed by the slowest rank, as the step waits for it --
    if collective_ok:
        parts = []
        for mb in (float(s) for s in args.bandwidth_mb.split(",")):
            buf = torch.ones(max(1, int(mb * 2**20 / 4)), device=device)
            dist.all_reduce(buf)  # warm-up: connections and buffers are set up on first use
            iters = 5
            dist.barrier(group=facts_group)
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=facts_group)
            algbw = buf.numel() * 4 / elapsed.item() / 1e9
            busbw = algbw * 2 * (world - 1) / world
            parts.append(f"{mb:g} MB {busbw:.2f} GB/s" if world > 1 else f"{mb:g} MB n/a")
        note = "" if world > 1 else " (one rank: nothing crosses a link)"
        report.ok("bandwidth", f"all-reduce busbw {', '.join(parts)}{note}")
    else:
        report.line("skip", "bandwidth", "skipped (the all-reduce failed)")

    # -- shm: each node's loaders share its /dev/shm --
    procs_on_node = per_node[hosts[rank][0]]
    mine = (shm_need(cfg, device, procs_on_node), shm_free()) if first_on_node else None
    for host, found in ((h, f) for (h, _), f in zip(hosts, gather(mine)) if f is not None):
        (need, how), free = found
        if need == 0:
            report.ok("shm", f"{host}: no loader workers ({how}): batches do not pass through {SHM_PATH}")
        elif free is None:
            report.line("skip", "shm", f"{host}: no {SHM_PATH} on this system; needs {gb(need)} ({how})")
        elif need <= free:
            report.ok("shm", f"{host}: {SHM_PATH} has {gb(free)} free, loaders need {gb(need)} ({how})")
        else:
            report.fail("shm", f"{host}: {SHM_PATH} has {gb(free)} free, loaders need {gb(need)} ({how})",
                        "Docker: docker run --shm-size=8g (or more); else fewer data.num_workers or a smaller "
                        "train.batch_size")

    # -- env: what the user set, per node (nodes that differ are worth seeing) --
    mine = network_env() if first_on_node else None
    for host, found in ((h, f) for (h, _), f in zip(hosts, gather(mine)) if f is not None):
        shown = " ".join(f"{k}={v}" for k, v in found.items()) or "none of NCCL_*, GLOO_*, MASTER_* set"
        report.line("info", "env", f"{host}: {shown}")

    if report.failed:
        report.line("FAIL", "summary", f"{len(report.failed)} check(s) failed: {', '.join(report.failed)}")
    else:
        report.line("ok", "summary", "every check passed")
    return 1 if report.failed else 0  # cli_entry leaves no process group behind


if __name__ == "__main__":
    sys.exit(cli_entry(main)())  # a bad config or flag: the training's one `error:` line, printed once
