"""The parallel semantics, proven on CPU with the real launcher (torchrun, gloo).

    python -m pytest tests/test_parallel_semantics.py -q

One torchrun launch of 3 processes runs tests/_ddp_worker.py, which calls the
project's own init, split, samplers, DDP wrapping, fit and evaluate and reports
per rank, at world size 3 and again with ranks 0 and 1 joined as a group of 2; the same functions run here in one process for the
reference. The entry scripts themselves run for the DP script on the CPU (no wrapper there:
it must train exactly as train.py) and for a two-"node" torchrun launch on localhost. README section "How the parallelism
works" names these tests.
"""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FAST_ARGS, REPO, free_port, make_image_folder

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ddp_worker as worker  # noqa: E402

# Seven classes x 6 images: 7 val (1 per class) and 35 train, so neither split
# divides by 2 or 3 and the samplers have to pad or leave a remainder.
CLASSES = ("daisy", "dandelion", "roses", "sunflowers", "tulips", "c5", "c6")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def spawn(cmd, cwd=REPO, env=None):
    """Start a launcher in its own session, so a hang can be killed with all its workers."""
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env={**os.environ, **ENV, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_all(procs, timeout):
    """[(rc, stdout, stderr)]; a launch still running after `timeout` s (a collective that not
    every rank reached) is killed and fails the test."""
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun then stops its workers, which run in sessions of their own.
            for q in procs:
                q.terminate()
            for q in procs:
                try:
                    q.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(q.pid, signal.SIGKILL)
            pytest.fail(f"launch hung for {timeout}s (a collective not reached by every rank?)")
        results.append((p.returncode, out, err))
    return results


def load_main(script):
    spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def model_tensors(run_dir):
    return torch.load(Path(run_dir) / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["model"]


def evaluate_checkpoint(run_dir, image_root):
    """One process, one thread (as the workers): evaluate() of run_dir's last.pt, as train.py would."""
    from data import build_datasets, make_loader
    from utils.samplers import ShardSampler
    from model import build_model
    from utils.config import load_config
    from engine import evaluate
    cfg, cpu, threads = load_config(FAST_ARGS + ["--data-path", str(image_root)]), torch.device("cpu"), \
        torch.get_num_threads()
    _, val_set, classes = build_datasets(cfg.data)
    model = build_model(cfg.model, len(classes), cpu, verbose=False)
    model.load_state_dict(model_tensors(run_dir))
    loader = make_loader(val_set, cfg.train.batch_size, ShardSampler(val_set), cfg.data, cpu, train=False)
    torch.set_num_threads(1)
    try:
        return evaluate(model, loader, cpu, len(classes))
    finally:
        torch.set_num_threads(threads)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("flowers7"), per_class=6, classes=CLASSES)


@pytest.fixture(scope="module")
def single_eval(image_root):
    # One thread, as in the workers (OMP_NUM_THREADS=1): at batch 1 the CPU conv kernels split
    # their sums over threads, so another thread count rounds the logits differently.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return worker.eval_fixed(worker.DistInfo(), image_root)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def launches(image_root, tmp_path_factory):
    """One torchrun launch of the worker with 3 gloo processes; its ranks 0 and 1 then run every
    check again as a group of 2 (the worker's --also-world): per world size, the per-rank reports."""
    out = tmp_path_factory.mktemp("ddp_world3")
    [(rc, stdout, stderr)] = wait_all([spawn(TORCHRUN + [
        "--nproc_per_node=3", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        REPO / "tests" / "_ddp_worker.py", out, image_root, "--also-world", 2, free_port()])], timeout=400)
    assert rc == 0, f"worker launch failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return {world: {"world": world, "out": where,
                    "ranks": [json.loads((where / f"rank{r}.json").read_text()) for r in range(world)]}
            for world, where in ((3, out), (2, out / "world2"))}


@pytest.fixture(params=[2, 3], ids=lambda w: f"world{w}")
def launch(request, launches):
    """The reports of one world size, each rank's from the group it ran in."""
    reports = launches[request.param]
    assert all(r["world_size"] == request.param for r in reports["ranks"])
    return reports


@pytest.mark.slow
def test_ddp_step_equals_one_big_batch(launch, tmp_path):
    """W ranks x batch b at lr L (scaled to W*L) == one process, batch W*b, lr W*L: same weights."""
    world, ranks = launch["world"], launch["ranks"]
    big = world * worker.PER_RANK_BATCH
    single = worker.fit_tiny(worker.DistInfo(), tmp_path / "single", big, world * worker.TRAIN_LR)

    # Same samples in the same steps: rank r's k-th batch is the r-th slice of the big k-th batch.
    b, steps = worker.PER_RANK_BATCH, single["steps_per_epoch"]
    assert all(r["fit"]["steps_per_epoch"] == steps for r in ranks)
    for step in range(2 * steps):  # two epochs
        ddp_batch = sorted(i for r in ranks for i in r["fit"]["seen"][step * b:(step + 1) * b])
        assert ddp_batch == sorted(single["seen"][step * big:(step + 1) * big]), f"step {step}"

    ddp_w, single_w = model_tensors(launch["out"] / "fit"), model_tensors(tmp_path / "single")
    torch.manual_seed(0)
    init = worker.TinyNet().state_dict()  # what fit_tiny starts from
    for name, w in single_w.items():
        assert rel_err(ddp_w[name], w) <= 1e-5, name
        assert rel_err(w, init[name]) > 1e-3, f"{name} barely moved: the comparison would be vacuous"
    # The comparison can fail: without the lr scaling rule the same run lands elsewhere.
    unscaled = worker.fit_tiny(worker.DistInfo(), tmp_path / "unscaled", big, worker.TRAIN_LR)
    assert max(rel_err(ddp_w[n], w) for n, w in model_tensors(tmp_path / "unscaled").items()) > 1e-3
    # The reduced epoch loss is the big batch's loss (same weights at each step, up to fp32 rounding).
    for r in ranks:
        assert r["fit"]["last"]["train_loss"] == pytest.approx(single["last"]["train_loss"], rel=1e-5)
    assert unscaled["last"]["train_loss"] != pytest.approx(single["last"]["train_loss"], rel=1e-5)


@pytest.mark.slow
def test_ddp_accumulation_equals_one_big_batch_also_across_a_mid_epoch_resume(launch, tmp_path):
    """W ranks x batch b x train.accum_steps=2 == one process with batch 2Wb: the same samples in each
    optimizer step, the same weights (DDP all-reduces on each step's last micro-batch only), and a
    run stopped between two micro-batches of epoch 2 and resumed ends bit for bit the same."""
    world, ranks = launch["world"], launch["ranks"]
    b, big = worker.PER_RANK_BATCH, 2 * world * worker.PER_RANK_BATCH
    single = worker.fit_tiny(worker.DistInfo(), tmp_path / "single", big, world * worker.TRAIN_LR)
    steps = single["steps_per_epoch"]
    assert all(r["accum"]["steps_per_epoch"] == steps for r in ranks)
    for step in range(2 * steps):  # two epochs: rank r's micro-batches 2k and 2k+1 are its part of step k
        ddp_batch = sorted(i for r in ranks for i in r["accum"]["seen"][2 * step * b:2 * (step + 1) * b])
        assert ddp_batch == sorted(single["seen"][step * big:(step + 1) * big]), f"step {step}"
    # no_sync: one all-reduce of the gradient buckets per optimizer step, none for the first micro-batch.
    for r in ranks:
        seen = r["accum"]["allreduced_buckets"]
        assert seen and len(seen) == 2 * steps * len(set(seen)), (len(seen), steps)
    accum = model_tensors(launch["out"] / "accum")
    for name, w in model_tensors(tmp_path / "single").items():
        assert rel_err(accum[name], w) <= 1e-5, name
    for r in ranks:
        assert r["accum"]["last"]["train_loss"] == pytest.approx(single["last"]["train_loss"], rel=1e-5)
        assert r["accum"]["last"]["step"] == 2 * steps  # global steps count optimizer steps
    # The stop came before micro-batch 2 of epoch 2: the checkpoint lands on the step boundary after it.
    assert ranks[0]["accum"]["stopped_at"] == [1, 2, steps + 1]
    resumed = model_tensors(launch["out"] / "accum_resumed")
    for name, w in accum.items():
        # Bit for bit at 2 ranks. At 3, a restarted DDP's first step all-reduces with its initial
        # bucket layout, not the one it rebuilt after step 1, so the 3-term sums round in another order.
        assert torch.equal(resumed[name], w) if world == 2 else rel_err(resumed[name], w) <= 1e-6, name
    # Without no_sync's deferred all-reduce being right, or with the loss not divided by the
    # micro-batches, the weights would differ: a run at accum_steps=1 (batch Wb) lands elsewhere.
    assert max(rel_err(accum[n], w) for n, w in model_tensors(launch["out"] / "fit").items()) > 1e-3


@pytest.mark.slow
def test_distributed_eval_equals_single_process(launch, single_eval):
    """7 val images over 2 or 3 ranks: every image counted once; every rank gets the global numbers.
    Also 1 image ("one"): ranks without a validation batch still join every collective."""
    for batch, ref in single_eval.items():
        assert ref["val_count"] == ref["val_size"] == (1 if batch == "one" else len(CLASSES))
        for r in launch["ranks"]:
            ev = r["eval"][batch]
            assert ev["val_count"] == ref["val_count"]
            assert ev["val_acc"] == ref["val_acc"]
            assert ev["val_per_class_acc"] == ref["val_per_class_acc"]
            # Batch 1: the same float64 terms summed in another order, so equal to float64 rounding.
            # Batch 4: a rank batches other images together than one process does, and fp32 conv
            # kernels round a sample's logits differently by batch (measured ~4e-8 relative here).
            tol = 1e-6 if batch == "4" else 1e-12
            assert ev["val_loss"] == pytest.approx(ref["val_loss"], rel=tol, abs=0), f"batch {batch}"
            # Calibration (utils/calibration.py): the NLL and bin sums all-reduced, the confidences gathered.
            # The temperature's grid may settle one point (2e-4 of T) apart where two NLL sums tie to rounding.
            assert ev["val_temperature"] == pytest.approx(ref["val_temperature"], rel=1e-3), f"batch {batch}"
            for key in ("val_ece", "val_ece_calibrated", "val_reject_threshold"):
                assert ev[key] == pytest.approx(ref[key], rel=1e-3, abs=1e-6), f"{key}, batch {batch}"


@pytest.mark.slow
def test_split_same_on_every_rank_and_shards_disjoint(launch):
    world, ranks = launch["world"], launch["ranks"]
    split0 = ranks[0]["split"]
    for r in ranks[1:]:
        for key in ("classes", "train", "val"):
            assert r["split"][key] == split0[key], f"rank {r['rank']} sees another {key}"
    n = split0["n_train"]
    pad = -n % world  # DistributedSampler repeats the first `pad` indices so all shards are equally long
    assert n % world != 0, "the data must exercise the padding"
    for epoch in (0, 1):
        shards = [r["split"]["shards"][epoch] for r in ranks]
        assert len({len(s) for s in shards}) == 1
        flat = [i for s in shards for i in s]
        assert sorted(set(flat)) == list(range(n)), f"epoch {epoch}: shards do not cover the training set"
        assert len(flat) - len(set(flat)) == pad, f"epoch {epoch}: shards overlap beyond the padding"
    for r in ranks:
        first, second, first_again = r["split"]["shards"]
        assert first != second, "the order must change every epoch (set_epoch)"
        assert first == first_again, "the order must be reproducible from the seed"
    # What fit() actually fed each rank, epoch by epoch: disjoint and covering (24 divides by 2 and 3).
    per_epoch = ranks[0]["fit"]["steps_per_epoch"] * worker.PER_RANK_BATCH
    epochs = [[i for r in ranks for i in r["fit"]["seen"][e * per_epoch:(e + 1) * per_epoch]] for e in (0, 1)]
    for seen in epochs:
        assert sorted(seen) == list(range(worker.TINY_TRAIN))
    assert epochs[0] != epochs[1]


@pytest.mark.slow
def test_every_rank_gets_the_reduced_metrics(launch):
    """Every rank joins every reduction: a rank-0 guard around one would hang (timeout) or leave
    the other ranks with their local numbers, which differ here (different shards)."""
    last = [r["fit"]["last"] for r in launch["ranks"]]
    for key in ("train_loss", "val_loss", "val_acc", "val_count", "best_acc", "val_per_class_acc"):
        assert len({json.dumps(m[key]) for m in last}) == 1, f"ranks disagree on {key}"
    assert last[0]["val_count"] == worker.TINY_VAL


@pytest.mark.slow
def test_ddp_without_the_per_forward_buffer_broadcast_keeps_rank0s_state_bit_for_bit(launch):
    """ddp.broadcast_buffers=false (the default): DDP broadcasts no buffers in training, and rank 0's
    weights and BatchNorm statistics after six steps are exactly those of a run that broadcasts
    them at every forward. The other ranks keep statistics of their own batches, which evaluation
    replaces with rank 0's (test_distributed_eval_equals_single_process)."""
    ranks = [r["buffers"] for r in launch["ranks"]]
    assert all(r["configured"]["broadcasts"] == 0 for r in ranks)
    assert all(r["broadcast"]["broadcasts"] == 6 for r in ranks)  # the count sees them when they happen
    assert ranks[0]["configured"]["state"] == ranks[0]["broadcast"]["state"]
    mean = "1.running_mean"
    assert ranks[1]["configured"]["state"][mean] != ranks[0]["configured"]["state"][mean]
    # Weights stay identical on every rank: gradients are all-reduced whatever happens to buffers.
    assert all(r["configured"]["state"]["5.weight"] == ranks[0]["configured"]["state"]["5.weight"] for r in ranks)


def test_dp_script_on_cpu_trains_exactly_like_train_py(image_root, tmp_path):
    """train_multi_gpu_dp.py with global batch B computes what train.py with batch B computes.

    On CPU (as here) the DP script trains without the DataParallel wrapper (it would grab the
    GPUs), so this compares train.py's code path with itself: it proves the DP script's own
    setup (device choice, loaders, sampler, unprefixed checkpoint keys) matches train.py,
    not that DataParallel computes the same. It is no proof for several GPUs: that needs a
    machine with them (tests/test_cuda_scripts.py runs the DP script on a GPU and checks the
    replicas' autocast dtype, but compares nothing with train.py).
    """
    common = FAST_ARGS + ["--data-path", image_root, "train.batch_size=8"]  # after FAST_ARGS' batch: wins
    single = load_main("train.py")([str(a) for a in common + ["--output-dir", tmp_path / "single"]])
    dp = load_main("train_multi_gpu_dp.py")([str(a) for a in common + ["--output-dir", tmp_path / "dp"]])
    a, b = model_tensors(tmp_path / "single"), model_tensors(tmp_path / "dp")
    assert a.keys() == b.keys() and not any(k.startswith("module.") for k in b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for key in ("train_loss", "val_loss", "val_acc", "val_count", "val_per_class_acc"):
        assert single["last"][key] == dp["last"][key], key


def test_dp_refuses_batch_smaller_than_gpu_count(monkeypatch, capsys, image_root):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(SystemExit) as exc:
        load_main("train_multi_gpu_dp.py")(FAST_ARGS + ["--device", "cuda", "train.batch_size=2",
                                                        "--data-path", str(image_root)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --batch-size 2 is smaller than the 4 GPUs"), err


def test_dp_with_device_cpu_on_a_machine_with_gpus_trains_on_the_cpu(monkeypatch, capsys, image_root, tmp_path):
    """Two GPUs are faked (only is_available and device_count; this machine has none). With --device cpu
    the script must not wrap the model: DataParallel(device_ids=None) takes every visible GPU and moves
    the replicas there, while the batches stay on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    try:
        load_main("train_multi_gpu_dp.py")(FAST_ARGS + ["--data-path", str(image_root),
                                                        "--output-dir", str(tmp_path / "run")])
    except SystemExit as e:
        pytest.fail(f"exit {e.code}: {capsys.readouterr().err[-2000:]}")
    out = capsys.readouterr().out
    assert "no GPU: one cpu process without DataParallel" in out and "on cpu" in out
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


def test_dp_with_device_cuda_n_puts_that_gpu_first(monkeypatch, image_root):
    """--device cuda:2 on four GPUs (faked): DataParallel gathers on cuda:2 and still uses all four.
    It used to take [0, 1, 2, 3] whatever --device said, with the outputs on cuda:0."""
    spec = importlib.util.spec_from_file_location("dp_script", REPO / "train_multi_gpu_dp.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(script, "use_device", lambda device, deterministic=False: None)
    monkeypatch.setattr(script, "build_model", lambda *a, **k: torch.nn.Linear(2, 2))  # stays on the CPU
    wrapped = {}

    class Captured(Exception):
        pass

    def data_parallel(module, device_ids):
        wrapped["device_ids"] = device_ids
        raise Captured

    monkeypatch.setattr(script.nn, "DataParallel", data_parallel)
    with pytest.raises(Captured):
        script.main(FAST_ARGS + ["--device", "cuda:2", "train.amp=off", "--data-path", str(image_root)])
    assert wrapped["device_ids"] == [2, 0, 1, 3]


@pytest.mark.slow
def test_ddp_script_without_torchrun_trains_as_one_process(image_root, tmp_path):
    """`python train_multi_gpu_ddp.py` (no launcher) once ended in DDP's 'process group has not been
    initialized' traceback; it now forms a group of one and says how to launch more."""
    from conftest import run_entry
    r = run_entry("train_multi_gpu_ddp.py", *FAST_ARGS, "--data-path", image_root, "--output-dir", tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert ("note: no torchrun or srun environment: training as one process on cpu; for N GPUs launch with: "
            "torchrun --nproc_per_node=N train_multi_gpu_ddp.py ...") in r.stdout
    assert "1 process(es) on cpu" in r.stdout and (tmp_path / "run" / "metrics.jsonl").is_file()


# Loaded into every worker through PYTHONPATH: logs each file the process opens for writing,
# creates, renames or removes, and prints the list with its rank when it exits.
AUDIT_HOOK = r'''
import atexit, json, os, sys
if "RANK" in os.environ:
    _writes = []
    _PATH_EVENTS = {"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.copyfile",
                    "os.symlink", "os.link", "os.truncate"}

    def _hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else \
                bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        elif event in _PATH_EVENTS:
            path, writing = args[0], True
        else:
            return
        if writing and isinstance(path, (str, bytes, os.PathLike)):
            path = os.fsdecode(path)
            if not path.startswith(("/dev/", "/proc/")):
                _writes.append(event + " " + path)

    sys.addaudithook(_hook)
    atexit.register(lambda: sys.stderr.write("AUDIT " + json.dumps(
        {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
         "writes": sorted(set(_writes))}) + "\n"))
'''


@pytest.mark.slow
def test_multi_node_launch_rank0_only_writes(image_root, tmp_path):
    """Two torchrun "nodes" on localhost (c10d rendezvous, one process each) train one epoch of
    train_multi_gpu_ddp.py --syncBN True together. Each node runs in its own directory and the
    run directory is the default (relative) one, so a file written by rank 1 would show."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(AUDIT_HOOK)
    port = free_port()
    procs = []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        procs.append(spawn(TORCHRUN + [
            "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=semantics", REPO / "train_multi_gpu_ddp.py",
            *FAST_ARGS, "--data-path", image_root, "--syncBN", "True"],
            cwd=tmp_path / f"node{node}", env={"PYTHONPATH": str(hook)}))
    results = wait_all(procs, timeout=240)
    for rc, out, err in results:
        assert rc == 0, f"{out[-2000:]}\n{err[-3000:]}"
    audits = []
    for _, out, err in results:
        lines = [line for line in err.splitlines() if line.startswith("AUDIT ")]
        assert len(lines) == 1, err[-3000:]
        audits.append(json.loads(lines[0][len("AUDIT "):]))
    assert sorted(a["rank"] for a in audits) == [0, 1] and {a["world"] for a in audits} == {2}
    # c10d rendezvous assigns ranks itself (--node_rank is a hint): find the node that got rank 0.
    main = next(i for i, a in enumerate(audits) if a["rank"] == 0)
    other = 1 - main
    out0, err0 = results[main][1], results[main][2]
    out1, err1 = results[other][1], results[other][2]

    # Rank 1 wrote nothing, anywhere, except torch's own compile-cache folder (torch makes it, not
    # the template); rank 0 did write (so the hook does see writes).
    assert [w for w in audits[other]["writes"] if "/torchinductor_" not in w] == []
    assert any("metrics.jsonl" in w for w in audits[main]["writes"])
    assert not list((tmp_path / f"node{other}").iterdir())
    [run_dir] = list((tmp_path / f"node{main}" / "runs").iterdir())  # one run directory

    # Rank 0 saw a world of 2 (lr scaled to 2 x 0.01) and logged once; rank 1 printed nothing.
    assert "2 process(es) on cpu" in out0 and "lr 0.02" in out0
    # Captured, so no terminal: rank 0 prints plain progress lines (a tqdm bar only on a TTY).
    assert re.search(r"^epoch 1/\d+  step \d+/\d+  loss ", out0, re.M), "rank 0 shows the progress"
    for text in (out1, err1):
        assert "epoch 1" not in text and "run directory" not in text and "warning:" not in text
    # --syncBN True on CPU: one warning for the whole job, and the run went on.
    assert (out0 + err0 + out1 + err1).count("SyncBatchNorm needs CUDA") == 1

    # Files written once, by one writer: one metrics line per epoch, one event file, checkpoints.
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    metrics = json.loads(lines[0])
    assert metrics["val_count"] == len(CLASSES), "distributed eval counts each val image exactly once"
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    # The logged validation numbers are those of the saved weights, as one process evaluates them
    # (DDP's first eval forward gives every rank rank 0's BatchNorm buffers, those in the checkpoint).
    ref = evaluate_checkpoint(run_dir, image_root)
    for key in ("val_count", "val_acc", "val_per_class_acc"):
        assert metrics[key] == ref[key], key
    assert metrics["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
    assert len(json.loads((run_dir / "class_indices.json").read_text())) == len(CLASSES)
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} == {"last.pt", "best.pt"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's SyncBatchNorm runs on CUDA only")
def test_syncbn_equals_global_batch_bn(tmp_path):
    """The seed's example: 2 processes x batch 2 with SyncBN == one BatchNorm over the 4 samples.
    Both processes share GPU 0 over gloo (NCCL refuses two ranks on one GPU)."""
    [(rc, out, err)] = wait_all([spawn(TORCHRUN + [
        "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        REPO / "tests" / "_ddp_worker.py", tmp_path, tmp_path, "--syncbn-gpu"])], timeout=300)
    assert rc == 0, f"{out[-2000:]}\n{err[-3000:]}"
    torch.manual_seed(0)
    x = (torch.randn(4, 3, 5, 5, device="cuda") * 2 + 1).cpu().requires_grad_()
    bn = torch.nn.BatchNorm2d(3)
    y = bn(x)
    y.square().sum().backward()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        part = slice(2 * rank, 2 * rank + 2)
        torch.testing.assert_close(torch.tensor(got["out"]), y[part].detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got["grad_in"]), x.grad[part], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got["running_mean"]), bn.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(got["running_var"]), bn.running_var, rtol=1e-5, atol=1e-6)
        assert got["resnet34_sync_bn"] == 36 and got["resnet34_plain_bn"] == 0
