"""More than one machine, on localhost: two torchrun "nodes" (one agent each), gloo on CPU.

    python -m pytest tests/test_multinode.py -q

- elastic: --nnodes=1:2 with c10d rendezvous and --max-restarts; one node is lost
  mid-epoch (its agent and worker SIGKILLed), the survivor restarts at world size 1
  and finishes from the last checkpoint, every epoch once in metrics.jsonl;
- no shared filesystem: the nodes run in different working directories with a
  relative --output-dir, so only node 0 sees the checkpoint; rank 0 reads it and
  broadcasts it, and both ranks resume the same state;
- a node without the data is named in one line;
- the console in a file: one plain line per log window, rank 0 only, no carriage returns;
- ddp.backend (gloo on CPU; nccl refused in one line) and the one-scan dataset split.
"""
import inspect
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import data as data_module
from _resume_utils import load, run_args, run_main
from conftest import REPO, free_port, make_image_folder, workers_of
from utils.config import load_config
from utils.distributed_utils import cleanup, ddp_kwargs, init_distributed_mode, resolve_backend
from utils.errors import UserError
from utils.stop import StopRequest

DDP = str(REPO / "train_multi_gpu_ddp.py")
LINE = re.compile(r"^epoch (\d+)/(\d+)  step (\d+)/(\d+)  loss \d+\.\d{4}  \d+ img/s  lr \S+  ETA \d+:\d\d:\d\d$")


@pytest.fixture(scope="module")
def flowers(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("multinode") / "flowers")  # 25 train images


class Node:
    """One torchrun agent ("node") in the background, its output in a file."""

    def __init__(self, cwd, launcher, args, log):
        self.log = Path(log)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", *launcher, DDP, *map(str, args)]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)

    def wait(self, timeout=240):
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def text(self):
        return self.log.read_text()

    def worker(self):
        return next(iter(workers_of(self.proc.pid).values()), None)


def static_pair(tmp_path, args, cwds):
    """Two nodes with a fixed node rank: node 0 (rank 0) in cwds[0], node 1 in cwds[1]."""
    port = free_port()
    nodes = [Node(cwd, ["--nnodes=2", f"--node_rank={i}", "--master_addr=127.0.0.1", f"--master_port={port}"],
                  args, tmp_path / f"node{i}.log") for i, cwd in enumerate(cwds)]
    return [n.wait() for n in nodes], nodes


def test_elastic_losing_a_node_mid_epoch_the_survivor_finishes_at_world_size_1(flowers, tmp_path):
    out = tmp_path / "run"
    args = run_args(flowers, out, "train.log_every=1", "train.save_every_steps=1", epochs=3, flags=["--resume", "auto"])
    port, job = free_port(), f"elastic-{os.getpid()}"
    # A short last call, so the smaller round closes in seconds; a keep-alive of 10 s (2 s x 5), so a
    # loaded machine's late heartbeat does not count a live node as lost (the kill is noticed at once
    # anyway: the survivor's next all-reduce fails).
    conf = "last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=5"
    launcher = ["--nnodes=1:2", "--max-restarts=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id={job}"]
    survivor = Node(REPO, [*launcher, f"--rdzv_conf=is_host=1,{conf}"], args, tmp_path / "a.log")  # holds the store
    time.sleep(1)
    lost = Node(REPO, [*launcher, f"--rdzv_conf=is_host=0,{conf}"], args, tmp_path / "b.log")
    deadline = time.time() + 180
    # Lose node b in epoch 2 between global steps 4 and 6 (3 steps per epoch at world size 2): rank 0
    # (on either node) prints epoch 2's step-2 line after step 4's checkpoint (train.save_every_steps=1)
    # is saved, and the kill lands well before the epoch's last step and its evaluation are done.
    in_epoch_2 = re.compile(r"^epoch 2/3  step 2/3  ", re.MULTILINE)
    while not any(in_epoch_2.search(node.text()) for node in (survivor, lost)):
        assert time.time() < deadline and survivor.proc.poll() is None and lost.proc.poll() is None, \
            survivor.text()[-3000:] + lost.text()[-3000:]
        time.sleep(0.02)
    worker = lost.worker()
    os.kill(lost.proc.pid, signal.SIGKILL)  # the whole node: its agent, then its worker
    if worker:
        os.kill(worker, signal.SIGKILL)
    lost.wait()
    assert survivor.wait(240) == 0, survivor.text()[-4000:]
    log = survivor.text()
    assert len(re.findall(r"resumed from .*last\.pt at epoch 2", log)) == 1, log[-4000:]
    # The epoch goes on at the first image of its order that no process trained (utils.samplers.ShuffleSampler).
    notes = [x for x in log.splitlines() if x.startswith("note: the checkpoint was written")]
    assert len(notes) == 1 and "world_size 2 -> 1" in notes[0] and "epoch 2 goes on from image" in notes[0], notes
    assert "1 process(es) on cpu" in log
    epochs = [m["epoch"] for m in map(eval_json, (out / "metrics.jsonl").read_text().splitlines())]
    assert epochs == [1, 2, 3]  # every epoch once
    state = load(out / "checkpoints" / "last.pt")
    # Counted in this run's steps from epoch 2 on: 3 epochs x 6 steps of one process (re-placed schedule).
    assert state["epoch"] == 3 and state["data"]["world_size"] == 1 and state["global_step"] == 3 * 6


def eval_json(line):
    import json
    return json.loads(line)


def test_no_shared_filesystem_rank_0_reads_the_checkpoint_and_every_rank_resumes_it(flowers, tmp_path, monkeypatch):
    import train_multi_gpu_ddp
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    # A relative --output-dir: each node has its own "run/", and only node 0's holds a checkpoint
    # (epoch 1, written by one process, the script's main() in this one: the cheapest way to get one there).
    assert run_main(train_multi_gpu_ddp, run_args(flowers, cwds[0] / "run", epochs=1), monkeypatch) == 0

    codes, nodes = static_pair(tmp_path, run_args(flowers, "run", "ddp.backend=gloo", epochs=2,
                                                  flags=["--resume", "auto"]), cwds)
    log = nodes[0].text()
    assert codes == [0, 0], log[-3000:] + nodes[1].text()[-3000:]
    assert re.search(r"resumed from run/checkpoints/last\.pt at epoch 2", log), log[-3000:]
    assert not (cwds[1] / "run").exists()  # node 1 read nothing and wrote nothing
    state = load(cwds[0] / "run" / "checkpoints" / "last.pt")
    assert (state["epoch"], state["global_step"]) == (2, 6)  # both ranks ran epoch 2 only, 3 steps each
    # The console in a file: one plain line per log window, from rank 0 alone, no carriage returns.
    assert "\r" not in log and "\r" not in nodes[1].text()
    steps = [LINE.match(x).groups() for x in log.splitlines() if LINE.match(x)]
    assert steps == [("2", "2", "2", "3"), ("2", "2", "3", "3")], log[-3000:]  # train.log_every=2
    assert not any(LINE.match(x) for x in nodes[1].text().splitlines())


def test_a_node_without_the_data_is_named_in_one_line(flowers, tmp_path):
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    (cwds[0] / "flowers").symlink_to(flowers)  # relative --data-path: there on node 0 only
    codes, nodes = static_pair(tmp_path, run_args("flowers", tmp_path / "run"), cwds)
    assert codes[0] != 0 and codes[1] != 0
    errors = [x for x in nodes[0].text().splitlines() + nodes[1].text().splitlines() if x.startswith("error:")]
    assert len(errors) == 1, errors
    assert re.fullmatch(r"error: data path 'flowers' is missing on \S+ \(node rank 1\): every node needs .*",
                        errors[0]), errors


def test_plain_progress_lines_in_a_file_and_the_bar_on_a_terminal(tmp_path):
    from utils.run_logger import RunLogger
    from tqdm import tqdm
    for name, tty in (("a", True), ("b", False)):
        logger = RunLogger(tmp_path / name, enabled=True, tty=tty)
        try:
            assert isinstance(logger.progress_bar([1], 1, "x"), tqdm) == tty
        finally:
            logger.close()  # its TensorBoard writer thread must not outlive tmp_path (conftest deletes it)


def test_ddp_backend_gloo_auto_and_nccl_refused_on_cpu(monkeypatch):
    assert resolve_backend("auto", want_cuda=False) == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert resolve_backend("auto", want_cuda=True) == "gloo"  # CUDA without NCCL (Windows)
    with pytest.raises(UserError, match="ddp.backend=nccl needs CUDA"):
        resolve_backend("nccl", want_cuda=False)
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    init_distributed_mode("cpu", backend="gloo")
    try:
        assert dist.get_backend() == "gloo"
    finally:
        cleanup()
    kwargs = ddp_kwargs({"backend": "gloo", "bucket_cap_mb": 25, "static_graph": False, "broadcast_buffers": False})
    # What DistributedDataParallel accepts; torch 2.13 renamed broadcast_buffers (the old name warns).
    renamed = "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    assert kwargs == {"bucket_cap_mb": 25, "static_graph": False,
                      "forward_sync_buffers" if renamed else "broadcast_buffers": False}


def test_usr1_is_a_stop_request_like_sigterm():
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert stop.requested() and stop.name == "SIGUSR1"
    finally:
        stop.uninstall()


def test_one_scan_by_rank_0_each_class_folder_walked_once(flowers, monkeypatch):
    walks = []
    real_walk = os.walk
    monkeypatch.setattr(data_module.os, "walk", lambda top, **k: walks.append(str(top)) or real_walk(top, **k))
    data_cfg = load_config([f"data.path={flowers}"]).data
    split = data_module.shared_split(data_cfg)
    assert sorted(walks) == sorted(str(flowers / c) for c in split.classes)  # once per class folder
    # Any other rank takes rank 0's split from the broadcast and scans nothing.
    walks.clear()
    monkeypatch.setattr(data_module, "get_rank", lambda: 1)
    monkeypatch.setattr(data_module, "broadcast_object", lambda obj: ("ok", split))
    assert data_module.shared_split(data_cfg) is split and walks == []
