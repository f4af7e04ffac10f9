"""tools/ddp_check.py under the real launcher: 2 gloo processes on CPU, its verdict lines and exit code.

    python -m pytest tests/test_ddp_check.py -q

The CUDA check (gpu p2p) can only say "skipped (no CUDA)" here; tools/gpu_checks.sh is where GPUs are.
"""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import types

import pytest
import torch

from conftest import REPO, free_port, make_image_folder

TOOL = REPO / "tools" / "ddp_check.py"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
QUICK = ["--bandwidth-mb", "1,4", "--timeout-s", "60"]  # small all-reduces: the check, not a benchmark


def ddp_check(*args, nproc=2, timeout=120):
    """(rc, stdout, stderr) of `torchrun --nproc_per_node=nproc tools/ddp_check.py args`; a hang fails the test."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(TOOL), *QUICK, *map(str, args)]
    # Its own session, so a hang can be killed with torchrun's workers.
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"tools/ddp_check.py hung for {timeout} s")
    return proc.returncode, out, err


def verdicts(out):
    """{check name: (tag, text)} from the lines `TAG   name: text`."""
    found = {}
    for line in out.splitlines():
        m = re.match(r"(ok|FAIL|skip|info) +([a-z0-9 -]+): (.*)$", line)
        if m:
            found[m.group(2)] = (m.group(1), m.group(3))
    return found


def load_tool():
    spec = importlib.util.spec_from_file_location("ddp_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_check_passes_on_two_gloo_processes():
    rc, out, err = ddp_check("--config", "configs/demo.yaml", "data.num_workers=2", "train.batch_size=4")
    v = verdicts(out)
    assert rc == 0, out + err[-3000:]
    assert v["process group"][0] == "ok" and "gloo, world size 2" in v["process group"][1], out
    assert "ranks per node {" in v["process group"][1] and ": 2}" in v["process group"][1], out
    assert v["gpu p2p"] == ("skip", "skipped (no CUDA)"), out
    assert v["all-reduce"] == ("ok", "sum over 2 ranks = 3 (expected 3)"), out
    assert v["bandwidth"][0] == "ok" and re.search(r"1 MB [0-9.]+ GB/s, 4 MB [0-9.]+ GB/s", v["bandwidth"][1]), out
    # 2 processes x 2 workers x prefetch 4 x batch 4 x 3*64*64 bytes (demo's img_size 64, uint8): a few MB
    assert v["shm"][0] == "ok" and "2 process(es) x 2 workers x prefetch 4 x batch 4" in v["shm"][1], out
    assert v["env"][0] == "info" and "MASTER_PORT=" in v["env"][1], out
    assert v["summary"] == ("ok", "every check passed"), out
    assert len(out.splitlines()) == len([ln for ln in out.splitlines() if verdicts(ln)]), "only rank 0 prints verdicts"


@pytest.mark.slow
def test_too_small_shm_fails_with_the_fix_and_exit_1():
    """One process under torchrun: the count of processes per node is checked at 2 by the test above."""
    # 1 x 2 workers x 4 x 800,000 images x 12 KB (img_size 64, uint8) = 79 GB: more than any /dev/shm here.
    rc, out, err = ddp_check("--config", "configs/demo.yaml", "data.num_workers=2", "train.batch_size=800000",
                             nproc=1)
    v = verdicts(out)
    assert rc == 1, out + err[-3000:]
    tag, text = v["shm"]
    # 78.64 GB = 73.2 GiB, a quarter more for NCCL's own segments: 92 GiB
    assert tag == "FAIL" and "loaders need 78.64 GB" in text and "fix: Docker: docker run --shm-size=92g" in text, out
    assert v["all-reduce"][0] == "ok" and v["summary"][0] == "FAIL" and "shm" in v["summary"][1], out


def test_shm_need_counts_what_the_training_loader_holds(tmp_path):
    from data import build_datasets
    from utils.loader import PREFETCH_FACTOR
    from utils.config import load_config
    tool, cpu = load_tool(), torch.device("cpu")
    make_image_folder(tmp_path / "data", per_class=4, size=(90, 70))
    cfg = load_config(["--config", "configs/demo.yaml", "data.num_workers=3", "train.batch_size=8",
                       f"data.path={tmp_path / 'data'}"])
    sample = build_datasets(cfg.data)[0][0][0]  # one training sample, as a worker sends it
    need, how = tool.shm_need(cfg, cpu, procs_on_node=2)
    assert need == 2 * 3 * PREFETCH_FACTOR * 8 * sample.numel() * sample.element_size(), how
    assert sample.dtype == torch.uint8 and need == 2 * 3 * PREFETCH_FACTOR * 8 * 3 * 64 * 64, how
    # num_workers=-1 means what data.resolve_num_workers makes of it: no workers on the CPU.
    assert tool.shm_need(load_config([]), cpu, procs_on_node=2)[0] == 0


def test_shm_verdict_names_dockers_shm_size_above_its_default():
    tool = load_tool()
    small = tool.shm_verdict("h", 10 * 2**20, "how", free=2**30)  # 10 MiB: fits any container
    assert small == ("ok", "h: /dev/shm has 1.07 GB free, loaders need 0.01 GB (how)", None)
    tag, text, fix = tool.shm_verdict("h", 100 * 2**20, "how", free=2**34)  # 100 MiB: more than Docker's 64
    assert tag == "ok" and fix is None
    assert text.endswith("above Docker's default of 64 MiB: in a container, docker run --shm-size=1g"), text
    tag, text, fix = tool.shm_verdict("h", 10 * 2**30, "how", free=2**30)  # 10 GiB in 1 GiB
    assert tag == "FAIL" and fix.startswith("Docker: docker run --shm-size=13g (or more)"), (text, fix)


class FakeStream:
    """A CUDA-like device: each all-reduce is queued and takes `seconds` once the earlier work is done;
    the host's clock moves only when it waits (sync). The clock is virtual: nothing here sleeps."""

    def __init__(self, seconds):
        self.seconds, self.clock, self.busy_until = seconds, 0.0, 0.0

    def all_reduce(self, tensor, op=None, group=None):
        if op is None:  # the timed collective; the MAX over the ranks' times is host-side bookkeeping
            self.busy_until = max(self.clock, self.busy_until) + self.seconds

    def sync(self, device):
        self.clock = max(self.clock, self.busy_until)


def test_bandwidth_times_the_loop_alone_not_the_queued_warm_up(monkeypatch):
    """On CUDA the fill and the warm-up all-reduce are still queued when the host reaches the timed loop;
    without a sync before it, their time is counted in the loop's (5 all-reduces timed as 6: a sixth low)."""
    tool, stream = load_tool(), FakeStream(seconds=0.01)
    fake_dist = types.SimpleNamespace(all_reduce=stream.all_reduce, barrier=lambda group=None: None,
                                      ReduceOp=types.SimpleNamespace(MAX="max"))
    monkeypatch.setattr(tool, "dist", fake_dist)
    monkeypatch.setattr(tool, "sync", stream.sync)
    monkeypatch.setattr(tool, "time", types.SimpleNamespace(perf_counter=lambda: stream.clock))
    found = tool.bus_bandwidth([4.0], torch.device("cpu"), world=2, group=None)
    # busbw = algbw * 2(n-1)/n = algbw for 2 ranks: 4 MiB per 10 ms
    assert found == [(4.0, pytest.approx(4 * 2**20 / 0.01 / 1e9))], found


TOPO = """\
\t\x1b[4mGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tSYS\tPIX\t0-47\t0\t\tN/A
GPU1\tNV18\t X \tSYS\tSYS\t0-47\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tSYS\t48-95\t1\t\tN/A
NIC0\tPIX\tSYS\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def fake_nvidia_smi(folder, topo, uuids):
    """An `nvidia-smi` on PATH that answers `topo -m` and `--query-gpu=uuid,index` as the real one does."""
    folder.mkdir()
    (folder / "topo.txt").write_text(topo)
    (folder / "ids.txt").write_text("".join(f"{u}, {i}\n" for i, u in enumerate(uuids)))
    script = folder / "nvidia-smi"
    script.write_text(f'#!/bin/sh\ncase "$1" in topo) cat "{folder}/topo.txt" ;; '
                      f'--query-gpu=uuid,index) cat "{folder}/ids.txt" ;; *) exit 9 ;; esac\n')
    script.chmod(0o755)


def test_gpu_links_name_each_pairs_link_from_nvidia_smi_in_cudas_numbering(tmp_path, monkeypatch):
    tool = load_tool()
    assert tool.parse_topology(TOPO) == {(0, 1): "NV18", (0, 2): "SYS", (1, 2): "SYS"}
    smi = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]  # nvidia-smi's GPU0, 1, 2
    fake_nvidia_smi(tmp_path / "bin", TOPO, smi)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    # CUDA numbers them otherwise (CUDA_VISIBLE_DEVICES=2,0,1); torch's UUIDs lack the "GPU-".
    links = tool.gpu_links(["cccc", "aaaa", "bbbb"])
    assert links == {(0, 1): "SYS", (0, 2): "SYS", (1, 2): "NV18"}, links
    peer = [[False, False, False], [False, False, True], [False, True, False]]
    assert tool.links_text(3, peer, links) == ("SYS, no peer access: 0-1 0-2 (2 pair(s)); "
                                               "NV18, peer access: 1-2 (1 pair(s))")
    everywhere = [[i != j for j in range(2)] for i in range(2)]
    assert tool.links_text(2, everywhere, {(0, 1): "NV18"}) == "all 1 pair(s) of cuda:0-1: NV18, peer access"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi: peer access alone
    assert tool.gpu_links(["aaaa", "bbbb"]) is None
    assert tool.links_text(2, [[False, True], [False, False]], None) == (
        "all 1 pair(s) of cuda:0-1: link unknown, peer access 0->1 only (no `nvidia-smi topo -m` to name the links)")
