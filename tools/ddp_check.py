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
    gpu links       CUDA only, information: per GPU pair, whether CUDA grants peer access and, where
                    `nvidia-smi topo -m` answers, the link between them (NV# NVLinks, PIX/PXB/PHB PCIe,
                    NODE/SYS across host bridges or CPU sockets)
    all-reduce      sum of rank+1 over the ranks is n(n+1)/2
    bandwidth       all-reduce bus bandwidth, busbw = algbw * 2(n-1)/n (nccl-tests' definition)
    shm             /dev/shm of each node holds what its loaders keep in flight:
                    processes x workers x prefetch x batch x one sample's bytes (the training
                    transform run on a test image: 3 x img_size^2 for its uint8 output); above
                    Docker's default of 64 MiB the line names the --shm-size a container needs
    env             which NCCL_* and network variables are set (information, never a failure)

Every rank runs every collective (the project's rule); the facts of one node (its GPU pairs,
its /dev/shm, its variables) are gathered over a gloo group, which needs no GPU peer-to-peer,
so a node whose GPUs cannot talk still reports why.
"""
import argparse
import json
import math
import os
import re
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
DOCKER_SHM = 64 * 2**20  # a container's /dev/shm unless `docker run --shm-size` says otherwise
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
    print(json.dumps({"peer": [[src != dst and torch.cuda.can_device_access_peer(src, dst) for dst in range(n)]
                               for src in range(n)]}), flush=True)
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
            print(json.dumps({"pair": [src, dst], "good": good, "seconds": seconds}), flush=True)


def gpu_pairs(timeout_s):
    """This node's pairs -> {"gpus": n, "bad": [...], "hung": pair or None, "slowest": s,
    "peer": n x n peer access or None, "links": {(i, j): link kind} or None}."""
    n = torch.cuda.device_count()
    if n < 2:
        return {"gpus": n, "bad": [], "hung": None, "slowest": 0.0, "peer": None, "links": None}
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
    uuids = [str(getattr(torch.cuda.get_device_properties(i), "uuid", "")) for i in range(n)]
    return {"gpus": n, "bad": bad, "hung": hung, "timed_out": timed_out,
            "slowest": max((r["seconds"] for r in done), default=0.0),
            "peer": next((r["peer"] for r in records if "peer" in r), None), "links": gpu_links(uuids)}


# -- gpu links: what connects each pair, from nvidia-smi, whose GPU numbers are its own (PCI order);
# CUDA's may differ (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER), so the two are matched by UUID --

def nvidia_smi(*args):
    """nvidia-smi's output, or None where it is absent, fails or hangs."""
    try:
        r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def parse_topology(text):
    """`nvidia-smi topo -m` -> {(i, j): kind} for i < j, nvidia-smi's GPU numbers."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in text.splitlines()]  # its header is underlined
    header = next((line.split() for line in lines if re.match(r"\s*GPU\d+\b", line)), [])
    links = {}
    for line in lines:
        cells = line.split()
        m = re.fullmatch(r"GPU(\d+)", cells[0]) if cells else None
        if m is None:
            continue
        for col, kind in zip(header, cells[1:]):  # GPU and NIC columns come before "CPU Affinity"
            other = re.fullmatch(r"GPU(\d+)", col)
            if other and int(m.group(1)) < int(other.group(1)):
                links[int(m.group(1)), int(other.group(1))] = kind
    return links


def gpu_links(uuids):
    """{(i, j): link kind} for CUDA's GPUs i < j, or None without `nvidia-smi topo -m` or UUIDs to match."""
    topo, ids = nvidia_smi("topo", "-m"), nvidia_smi("--query-gpu=uuid,index", "--format=csv,noheader")
    if topo is None or ids is None:
        return None
    smi_index = {}
    for line in ids.splitlines():
        uuid, _, index = line.rpartition(",")
        if index.strip().isdigit():
            smi_index[uuid.strip().lower().removeprefix("gpu-")] = int(index)
    index = [smi_index.get(u.lower().removeprefix("gpu-")) for u in uuids]
    if None in index:
        return None
    links = parse_topology(topo)
    found = {}
    for i in range(len(index)):
        for j in range(i + 1, len(index)):
            kind = links.get((min(index[i], index[j]), max(index[i], index[j])))
            if kind is not None:
                found[i, j] = kind
    return found or None


def links_text(n, peer, links):
    """One node's pairs grouped by what they have: '<link>, peer access <how>: 0-1 0-2 (2 pairs); ...'."""
    groups = {}
    for i in range(n):
        for j in range(i + 1, n):
            ways = (peer[i][j], peer[j][i]) if peer else None
            access = ("peer access unknown" if ways is None else "peer access" if all(ways) else
                      "no peer access" if not any(ways) else f"peer access {i}->{j} only" if ways[0]
                      else f"peer access {j}->{i} only")
            kind = (links or {}).get((i, j), "link unknown")
            groups.setdefault(f"{kind}, {access}", []).append(f"{i}-{j}")
    pairs = n * (n - 1) // 2
    if len(groups) == 1:
        text = f"all {pairs} pair(s) of cuda:0-{n - 1}: {next(iter(groups))}"
    else:
        text = "; ".join(f"{what}: {' '.join(p)} ({len(p)} pair(s))" for what, p in groups.items())
    return text + ("" if links else " (no `nvidia-smi topo -m` to name the links)")


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


def sync(device):
    """Wait for the work queued on the device: CUDA kernels and NCCL collectives return before they run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bus_bandwidth(sizes_mb, device, world, group, iters=5):
    """[(MB, busbw in GB/s)]: all-reduces of each size, timed on the slowest rank, as the step waits for it."""
    found = []
    for mb in sizes_mb:
        buf = torch.ones(max(1, int(mb * 2**20 / 4)), device=device)
        dist.all_reduce(buf)  # warm-up: connections and buffers are set up on first use
        sync(device)  # else the fill and the warm-up, still queued, are timed with the loop
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync(device)
        elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        algbw = buf.numel() * 4 / elapsed.item() / 1e9
        found.append((mb, algbw * 2 * (world - 1) / world))  # nccl-tests' bus bandwidth
    return found


def shm_verdict(host, need, how, free):
    """(tag, text, fix or None) of one node's /dev/shm."""
    size = f"--shm-size={max(1, math.ceil(need * 1.25 / 2**30))}g"  # a quarter more: NCCL's own segments too
    docker = f"; above Docker's default of 64 MiB: in a container, docker run {size}" if need > DOCKER_SHM else ""
    if need == 0:
        return "ok", f"{host}: no loader workers ({how}): batches do not pass through {SHM_PATH}", None
    if free is None:
        return "skip", f"{host}: no {SHM_PATH} on this system; needs {gb(need)} ({how})", None
    text = f"{host}: {SHM_PATH} has {gb(free)} free, loaders need {gb(need)} ({how})"
    if need <= free:
        return "ok", text + docker, None
    return "FAIL", text, (f"Docker: docker run {size} (or more); else fewer data.num_workers or a smaller "
                          "train.batch_size")


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
            if found["gpus"] >= 2:
                report.line("info", "gpu links", f"{host}: {links_text(found['gpus'], found['peer'], found['links'])}")

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
        sizes = [float(s) for s in args.bandwidth_mb.split(",")]
        parts = [f"{mb:g} MB {busbw:.2f} GB/s" if world > 1 else f"{mb:g} MB n/a"
                 for mb, busbw in bus_bandwidth(sizes, device, world, facts_group)]
        note = "" if world > 1 else " (one rank: nothing crosses a link)"
        report.ok("bandwidth", f"all-reduce busbw {', '.join(parts)}{note}")
    else:
        report.line("skip", "bandwidth", "skipped (the all-reduce failed)")

    # -- shm: each node's loaders share its /dev/shm --
    procs_on_node = per_node[hosts[rank][0]]
    mine = (shm_need(cfg, device, procs_on_node), shm_free()) if first_on_node else None
    for host, found in ((h, f) for (h, _), f in zip(hosts, gather(mine)) if f is not None):
        (need, how), free = found
        tag, text, fix = shm_verdict(host, need, how, free)
        if tag == "FAIL":
            report.fail("shm", text, fix)
        else:
            report.line(tag, "shm", text)

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
