"""Bad configs and command lines fed to the real entry scripts (README: "What happens when...").

    python -m pytest tests/test_bad_config.py -q

Every failing case points --output-dir at a finished run and checks the
contract: its exit code (2 usage/config, 1 runtime), exactly one `error:` line
naming the culprit, no traceback, and the earlier run's files untouched.
Most cases call the scripts' main() in this process (fast); a few run the
real CLI and torchrun in a subprocess.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import train
import train_multi_gpu_ddp
import train_multi_gpu_dp
from bad_files import call_main, error_line, tree_hash
from conftest import FAST_ARGS, REPO, free_port, make_image_folder, run_entry

# FAST_ARGS with epochs and batch size as classic flags: a dotted override would win over
# the --epochs / --batch-size a case passes after them.
ARGS = [a for a in FAST_ARGS if not a.startswith(("train.epochs=", "train.batch_size="))] + [
    "--epochs", "1", "--batch-size", "4"]


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A finished one-epoch resnet18 run on 5 classes: what no later mistake may damage."""
    base = tmp_path_factory.mktemp("earlier")
    root = make_image_folder(base / "flowers")
    run = base / "run"
    code, out, err = call_main(train.main, ARGS + ["--data-path", root, "--output-dir", run])
    assert code == 0, (out + err)[-3000:]
    return {"root": root, "run": run, "base": base}


def _yaml(base, text):
    path = base / "bad.yaml"
    path.write_text(text)
    return path


def _foreign_weights(base):
    path = base / "foreign.pth"
    torch.save(torch.nn.Linear(3, 4).state_dict(), path)
    return path


def _four_classes(base):
    return make_image_folder(base / "four", classes=("daisy", "roses", "sunflowers", "tulips"))


def _file_in_the_way(base):
    (base / "a_file").write_text("not a folder")
    return base / "a_file" / "run"


# case -> (extra args given the earlier run, expected exit code, text the error line must hold)
CASES = {
    "unknown_key": (lambda e: ["optim.lrr=0.1"], 2, "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
    "wrong_type": (lambda e: ["--epochs", "abc"], 2, "'train.epochs'"),
    "malformed_yaml": (lambda e: ["--config", _yaml(e["base"], "train:\n  epochs: 3\n   batch_size: [4\n")],
                       2, "line 3"),
    "config_missing": (lambda e: ["--config", e["base"] / "nope.yaml"], 2, "nope.yaml' does not exist"),
    "batch_size_zero": (lambda e: ["--batch-size", "0"], 2, "'train.batch_size': 0"),
    "batch_size_negative": (lambda e: ["--batch-size", "-3"], 2, "'train.batch_size': -3"),
    "epochs_zero": (lambda e: ["--epochs", "0"], 2, "'train.epochs': 0"),
    "bad_image_not_a_choice": (lambda e: ["data.bad_image=ignore"], 2, "choose one of warn, error"),
    "not_key_value": (lambda e: ["optim.lr"], 2, "not a key=value override"),
    "weights_missing": (lambda e: ["--weights", e["base"] / "nope.pth"], 2, "nope.pth' does not exist"),
    "weights_nothing_fits": (lambda e: ["--weights", _foreign_weights(e["base"])], 2, "has no tensor that fits"),
    "run_dir_exists_without_resume": (lambda e: [], 2, "already holds a run"),
    "resume_another_model": (lambda e: ["--resume", "auto", "model.name=resnet34"], 2,
                             "checkpoint is a resnet18, this run builds a resnet34 (model.name); "
                             "resume with model.name=resnet18"),
    "resume_another_class_count": (lambda e: ["--resume", "auto", "--data-path", _four_classes(e["base"])],
                                   2, "checkpoint has 5 classes ['daisy', 'dandelion', 'roses', 'sunflowers', "
                                   "'tulips'], the data has 4 ['daisy', 'roses', 'sunflowers', 'tulips']; "
                                   "resume needs the same class folders"),
    "output_dir_not_writable": (lambda e: ["--output-dir", _file_in_the_way(e["base"])], 2, "is not writable"),
    # Refused by the loop before it writes anything: the fresh --output-dir is not even created.
    "accum_steps_over_an_epoch": (lambda e: ["--output-dir", e["base"] / "unborn", "train.accum_steps=7"], 2,
                                  "train.accum_steps=7 is more than the 6 batches of an epoch per process"),
    "compile_with_activation_checkpointing": (
        lambda e: ["--output-dir", e["base"] / "unborn", "train.compile=true", "model.activation_checkpointing=true"],
        2, "train.compile=true cannot compile model.activation_checkpointing=true's blocks"),
    # train.linear_probe: a key without meaning for it is named, before the run directory is touched.
    "probe_with_mixup": (lambda e: ["train.linear_probe=true", "data.mixup_alpha=0.2"], 2,
                         "data.mixup_alpha=0.2 does not apply to train.linear_probe=true"),
    "probe_with_teacher": (lambda e: ["train.linear_probe=true", f"train.teacher={e['run']}"], 2,
                           "train.teacher="),
    "lr_list_without_probe": (lambda e: ["optim.lr=[0.01,0.1]"], 2, "a list trains one head per lr with "
                              "train.linear_probe=true"),
    "probe_best_metric": (lambda e: ["--output-dir", e["base"] / "unborn", "train.linear_probe=true",
                                     "train.best_metric=val_macro_f1"], 2,
                          "train.best_metric=val_macro_f1 is not a metric of this run; choose one of val_acc, val_loss"),
    "class_weights_count": (lambda e: ["--output-dir", e["base"] / "unborn", "optim.class_weights=[1,2,3]"], 2,
                            "optim.class_weights has 3 weights, the data has 5 classes"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_is_one_line_and_damages_nothing(earlier, case):
    extra, code_expected, needle = CASES[case]
    before = tree_hash(earlier["run"])
    args = ARGS + ["--data-path", earlier["root"], "--output-dir", earlier["run"], *extra(earlier)]
    code, out, err = call_main(train.main, args)
    line = error_line(code, out, err, code_expected)
    assert needle in line, line
    assert tree_hash(earlier["run"]) == before
    assert not (earlier["base"] / "unborn").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(earlier):
    before = tree_hash(earlier["run"])
    code, out, err = call_main(train.main, ARGS + ["--data-path", earlier["root"], "--device", "cuda"])
    assert "--device cuda asked for CUDA" in error_line(code, out, err, 2)
    assert tree_hash(earlier["run"]) == before


def test_dp_global_batch_smaller_than_gpus(earlier, monkeypatch):
    """4 GPUs simulated on CPU: the check runs before any CUDA call."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    args = ARGS + ["--device", "auto", "--batch-size", "2", "--data-path", earlier["root"]]
    code, out, err = call_main(train_multi_gpu_dp.main, args)
    assert "--batch-size 2 is smaller than the 4 GPUs" in error_line(code, out, err, 2)


def test_out_of_memory_in_a_step_is_one_line_and_keeps_the_finished_epoch(earlier, tmp_path, monkeypatch):
    """CUDA's out-of-memory error, raised from the model's forward in epoch 2's third step, ended in
    torch's traceback. It is one line naming the batch, the process and what to try, exit 1, and
    epoch 1's checkpoint and metrics line stay as they were written."""
    import torchvision
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # torch 2.4: only the latter
    forward, calls = torchvision.models.ResNet._forward_impl, [0]

    def run_out_of_memory(self, x):
        if torch.is_grad_enabled() and self.training:
            calls[0] += 1
            if calls[0] == 6 + 3:  # 25 training images in batches of 4: 6 steps an epoch
                raise oom("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                          "79.19 GiB of which 1.06 GiB is free. Of the allocated memory 75.2 GiB is allocated by "
                          "PyTorch, and 1.1 GiB is reserved by PyTorch but unallocated.")
        return forward(self, x)

    monkeypatch.setattr(torchvision.models.ResNet, "_forward_impl", run_out_of_memory)
    run = tmp_path / "run"
    code, out, err = call_main(train.main, ARGS + ["--data-path", earlier["root"], "--output-dir", run,
                                                   "--epochs", "2"])
    assert error_line(code, out, err, 1) == (
        "error: out of memory on cpu (the only process) at --batch-size 4; tried to allocate 2.00 GiB with "
        "1.06 GiB free: try --batch-size 2 with train.accum_steps=2 (the global batch stays 4), or "
        "model.activation_checkpointing=true, or train_multi_gpu_fsdp.py, which shards the model over the GPUs")
    assert calls[0] == 9
    assert torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["epoch"] == 1
    assert [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def test_out_of_memory_names_the_rank_and_leaves_out_what_is_already_on():
    """Under DDP the line names the rank and the per-process batch; advice already taken is not given."""
    from types import SimpleNamespace
    from utils.errors import out_of_memory
    from utils.distributed_utils import DistInfo
    cfg = SimpleNamespace(train=SimpleNamespace(batch_size=5, accum_steps=2, global_batch=0, compile=False),
                          model=SimpleNamespace(activation_checkpointing=True))
    info = DistInfo(rank=3, world_size=8, device=torch.device("cuda", 3))
    e = out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory."), cfg, info, "fsdp")
    assert str(e) == ("out of memory on cuda:3 (rank 3 of 8) at --batch-size 5 per process: try a smaller "
                      "--batch-size with a larger train.accum_steps (the global batch stays 80)")
    assert e.exit_code == 1
    # With train.global_batch the accumulation follows from the batch: halving it is the whole advice.
    cfg.train.global_batch, cfg.train.batch_size, cfg.train.accum_steps = 64, 8, 1
    e = out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory."), cfg, info, "fsdp")
    assert str(e).endswith("try --batch-size 4 (train.global_batch=64 stays: the accumulation grows)"), str(e)


def test_weights_of_another_architecture_load_what_fits_and_report(earlier, tmp_path):
    """resnet18 weights into a resnet34: the shared tensors load, the report says what did not."""
    code, out, err = call_main(train.main, ARGS + [
        "--data-path", earlier["root"], "--output-dir", tmp_path / "run", "model.name=resnet34",
        "--weights", earlier["run"] / "checkpoints" / "last.pt"])
    assert code == 0, (out + err)[-3000:]
    assert "loaded " in out and "kept initial values" in out, out


def test_train_debug_shows_the_traceback(earlier, monkeypatch):
    monkeypatch.setenv("TRAIN_DEBUG", "1")
    code, out, err = call_main(train.main, ARGS + ["optim.lrr=0.1"])
    assert code == 2 and "Traceback" in err and "error: unknown config key 'optim.lrr'" in err


@pytest.fixture
def held_port():
    """A port some other program is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        yield s.getsockname()[1]


def test_ddp_busy_master_port_without_torchrun_is_one_line(earlier, held_port, monkeypatch):
    """srun-style launch (SLURM variables, no torchrun): our own process-group setup meets the busy port."""
    for k, v in {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(held_port)}.items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    code, out, err = call_main(train_multi_gpu_ddp.main, ARGS + ["--data-path", earlier["root"]])
    line = error_line(code, out, err, 1)
    assert f"127.0.0.1:{held_port}" in line and "in use" in line


@pytest.mark.slow
def test_torchrun_busy_master_port_fails_fast(tmp_path, held_port):
    """torchrun itself binds --master_port before our script starts: it must fail in seconds, not hang."""
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        "--master_addr=127.0.0.1", f"--master_port={held_port}",
                        str(REPO / "train_multi_gpu_ddp.py"), *FAST_ARGS, "--output-dir", tmp_path / "run"],
                       capture_output=True, text=True, timeout=240, cwd=REPO)
    assert r.returncode != 0
    assert "address already in use" in (r.stdout + r.stderr)
    assert time.monotonic() - start < 120
    assert not (tmp_path / "run").exists()


LATE_RANK_0 = """
import os, sys, time
sys.path.insert(0, {repo!r})
from utils import cli
from utils.errors import UserError
cli.SHARED_ERROR_WAIT_S = {wait}

@cli.cli_entry
def main():
    raise UserError("the same on every rank", every_rank=True)
{real}
if os.environ["RANK"] == "0":
    time.sleep({delay})  # rank 0 reaches the error its ranks share last (a loaded node)
main()
"""

# The "late" case runs the real DDP script's main() on a bad --epochs: a config error, which every
# rank parses alike, printed once under torchrun (as `torchrun train_multi_gpu_ddp.py --epochs abc`).
REAL_DDP = """
import train_multi_gpu_ddp
main = lambda: train_multi_gpu_ddp.main(["--device", "cpu", "--epochs", "abc"])
"""
EPOCHS_ABC = ("error: bad value for 'train.epochs' (set by --epochs abc): Value 'abc' of type 'str' "
              "could not be converted to Integer")


@pytest.mark.slow
def test_a_shared_error_is_printed_once_however_late_rank_0_is(tmp_path):
    """torchrun stops the group as soon as one worker exits: rank 1 must not exit before rank 0 has
    printed the line they share. Rank 0 7 s late ("late": train_multi_gpu_ddp.py's own config error),
    and never there within rank 1's wait ("hung": rank 1 then prints it). Both under torchrun, side by
    side."""
    cases = {"late": (7, 60, REAL_DDP, EPOCHS_ABC), "hung": (600, 1, "", "error: the same on every rank")}
    procs = {}
    for name, (delay, wait, real, _) in cases.items():
        script = tmp_path / f"{name}.py"
        script.write_text(LATE_RANK_0.format(repo=str(REPO), delay=delay, wait=wait, real=real))
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
             f"--master_port={free_port()}", str(script)], cwd=tmp_path, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and errors == [cases[name][3]], (name, out + err)


OOM_DETAIL = "; tried to allocate 1.50 GiB with 1.02 GiB free"
ADVICE = (": try --batch-size 2 with train.accum_steps=2 (the global batch stays 4), or "
          "model.activation_checkpointing=true, or train_multi_gpu_fsdp.py, which shards the model over the GPUs")


@pytest.mark.parametrize("fault, extra, line", [
    ("oom:forward:1", [], "error: out of memory on cpu in the start-up forward of model.name=resnet18 (one image "
     f"of 32 px, no gradients){OOM_DETAIL}: a smaller model or data.img_size, or train_multi_gpu_fsdp.py, which "
     "shards the model over the GPUs"),
    ("oom:ema:1", ["train.ema_decay=0.9"], f"error: out of memory on cpu (the only process) at --batch-size 4"
     f"{OOM_DETAIL}{ADVICE}"),
    ("oom:restore:1", ["--resume", "{run}/checkpoints/last.pt"], f"error: out of memory on cpu (the only "
     f"process) at --batch-size 4{OOM_DETAIL}{ADVICE}"),
    ("oom:forward:2", ["--eval-only", "--resume", "{run}/checkpoints/best.pt"], f"error: out of memory on cpu "
     f"(the only process) at --batch-size 4{OOM_DETAIL}{ADVICE}"),
])
def test_out_of_memory_anywhere_in_a_run_is_the_one_line(earlier, tmp_path, fault, extra, line):
    """torch's out-of-memory error (tests/_faults.py) in the start-up probe, the EMA copy, the restore of a
    checkpoint or --eval-only's evaluation: one error line, exit 1, in a process of its own; the earlier
    run's files stay as they were."""
    before = tree_hash(earlier["run"])
    extra = [a.replace("{run}", str(earlier["run"])) for a in extra]
    proc = run_entry("tests/_faults.py", fault, "train.py", *ARGS, "--data-path", earlier["root"],
                     "--output-dir", tmp_path / "run", *extra)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [line], proc.stderr[-3000:]
    assert tree_hash(earlier["run"]) == before


def test_out_of_memory_in_predict_is_one_line_naming_the_batch(earlier, tmp_path):
    proc = run_entry("tests/_faults.py", "oom:forward:1", "predict.py", earlier["run"], earlier["root"] / "daisy",
                     "--device", "cpu", "--batch-size", "8", "--out", tmp_path / "p.json")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: out of memory on cpu at --batch-size 8{OOM_DETAIL}: try --batch-size 4"], proc.stderr[-3000:]
    assert not (tmp_path / "p.json").exists()
