"""train_multi_gpu_fsdp.py and utils/fsdp.py: FSDP2 on 2 gloo processes on the CPU.

    python -m pytest tests/test_fsdp.py -q

One worker launch (tests/_fsdp_worker.py) compares sharded training with DDP, the shards'
sizes, the full state dict, activation checkpointing, bf16 with its BatchNorm groups, and a
channels_last model; the entry-script tests run the real scripts under torchrun: a run whose
rank is killed mid-epoch and restarted by torchrun ends with DDP's weights bit for bit, and
predict.py, export.py and --eval-only (train.py's and the FSDP script's) take its run directory.
The DDP reference run and the FSDP --eval-only run are made by the worker's ranks, through the
scripts' main(), before its own checks: a torch start-up per process costs more than the runs.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torchvision
from torch import nn

from _resume_utils import load, metrics, run_args, run_main
from conftest import REPO, free_port, make_image_folder, run_entry
from utils import fsdp
from utils.errors import UserError

# What needs FSDP2 to run on the CPU skips below torch 2.6; the block rules and the refusals run on any torch.
CPU_FSDP = fsdp.fully_shard is not None and fsdp.TORCH_VERSION >= fsdp.CPU_FSDP_TORCH
WHY = "FSDP2 on the CPU needs torch >= 2.6 (2.4 and 2.5 need CUDA streams)"
needs_cpu_fsdp = pytest.mark.skipif(not CPU_FSDP, reason=WHY)
FSDP, DDP = "train_multi_gpu_fsdp.py", "train_multi_gpu_ddp.py"
# BatchNorm everywhere, 20 blocks by the generic rule, and 1/30 of resnet18's weights to save at each step.
SMALL = "model.name=shufflenet_v2_x0_5"


@pytest.fixture(scope="module")
def worker(runs):
    return runs["worker"]


@pytest.mark.slow
def test_sharded_training_equals_ddp_bit_for_bit_batchnorm_resnet_and_vit(worker):
    for rank in worker:
        assert rank["resnet_tensors"] == 74 and rank["vit_tensors"] == 32
        assert rank["resnet_differ"] == [] and rank["vit_differ"] == []  # AdamW + accumulation; SGD
    assert 0 < worker[0]["vit_clipped_max_relative"] < 1e-5  # clipped: equal up to the norm's rounding


@pytest.mark.slow
def test_each_rank_holds_half_of_the_parameters_gradients_and_adamw_state(worker):
    total = worker[0]["resnet_full_params"]
    for rank in worker:
        assert rank["resnet_local_params"] * 2 == total
        assert rank["grad_local"] * 2 == total
        assert rank["optimizer_local"] == {"exp_avg": total // 2, "exp_avg_sq": total // 2}
        assert rank["resnet_chunks_ok"] and rank["vit_chunks_ok"]  # each tensor: its first dimension's chunk
    assert worker[0]["vit_local_params"] + worker[1]["vit_local_params"] == worker[0]["vit_full_params"]


@pytest.mark.slow
def test_evaluation_with_uneven_shards_pairs_the_sharded_forwards_and_equals_ddp(worker):
    assert all(rank["eval_equal"] for rank in worker)


@pytest.mark.slow
def test_full_state_loads_into_a_plain_model_with_the_same_eval_output(worker):
    assert worker[0]["plain_equal"] is True  # strict=True into torchvision's ResNet, bit-identical logits
    assert all(rank["reloaded_equal"] for rank in worker)  # and back into a sharded one


@pytest.mark.slow
def test_activation_checkpointing_keeps_the_weights_and_counts_batchnorm_once(worker):
    assert worker[0]["checkpointed_blocks"] == ["layer1", "layer2", "layer3", "layer4"]
    assert worker[0]["checkpointing_differ"] == []
    assert worker[0]["batches_tracked"] == 4  # 4 forwards; a second update per recompute would make 8


@pytest.mark.slow
def test_bf16_with_batchnorm_computes_and_keeps_batchnorm_fp32(worker):
    for rank in worker:
        assert rank["bf16_finite"] and (rank["bf16_logits"], rank["bf16_bn_dtype"]) == ("torch.float32",) * 2


@pytest.mark.slow
@pytest.mark.skipif(not fsdp.GROUP_LISTS, reason="one group of several modules (fully_shard of a list) needs "
                    "torch >= 2.5")
def test_bf16_puts_a_blocks_batchnorms_in_one_fp32_group_with_the_same_weights(worker):
    # 4 blocks and the root, each a bf16 group and an fp32 group of its BatchNorms (one per BatchNorm: 17, 41).
    assert (worker[0]["bf16_groups"], worker[0]["bf16_groups_resnet34"]) == (10, 10)
    assert worker[0]["bf16_grouping_differ"] == []  # bit for bit the weights of one group per BatchNorm


@pytest.mark.slow
def test_a_channels_last_model_is_sharded_and_trains_on_channels_last_batches_to_ddps_weights(worker):
    """build_model leaves the model channels_last on CUDA, where FSDP2 refused its weights."""
    for rank in worker:
        assert rank["channels_last_layouts"] == [["conv1", True], ["input", True]]
    assert worker[0]["channels_last_differ"] == []


# --------------------------------------------------------------------------- the entry script

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches. An FSDP run of one epoch whose rank 1 is SIGKILLed at its last step, after the mid-epoch
    save of step 2 of 3, and restarted by torchrun. Then the worker's launch, whose ranks first make the same
    run under train_multi_gpu_ddp.py and train_multi_gpu_fsdp.py --eval-only of the FSDP run's last.pt,
    each through the script's main() (one torch start-up, not three), then the worker's own checks."""
    if not CPU_FSDP:
        pytest.skip(WHY)
    root = tmp_path_factory.mktemp("fsdp_runs")
    data = make_image_folder(root / "flowers")  # 2 ranks x 3 steps per epoch
    # The recipe options that need nothing of FSDP (loss weights, MixUp/CutMix, the balanced sampler) ride along.
    extra = (SMALL, "train.log_every=1", "train.save_every_steps=2", "optim.class_weights=auto",
             "data.mixup_alpha=0.2", "data.cutmix_alpha=0.2", "data.sampler=balanced",
             "optim.head_lr_scale=5", "optim.layer_decay=0.9")  # an lr per group, by the blocks FSDP shards
    ddp, sharded, evaluated = root / "ddp", root / "fsdp", root / "fsdp_eval"
    # Two restarts allowed, one expected: an unasked-for second one (a rank that crashed) then still ends the
    # run, for the tests below, and the kill/restart test fails showing it, with PYTHONFAULTHANDLER's stacks.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", str(REPO / "tests" / "_faults.py"),
           "kill:1:2", FSDP, *run_args(data, sharded, *extra, epochs=1, flags=["--resume", "auto"])]
    killed = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    last = sharded / "checkpoints" / "last.pt"
    scripts = [(DDP, run_args(data, ddp, *extra, epochs=1)),
               (FSDP, run_args(data, evaluated, SMALL, flags=["--eval-only", "--resume", last]))]
    out = root / "worker"
    out.mkdir()
    (out / "scripts.json").write_text(json.dumps([(s, [str(a) for a in args]) for s, args in scripts]))
    r = run_entry("tests/_fsdp_worker.py", out, out / "scripts.json", nproc=2)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    worker = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    return {"data": data, "ddp": ddp, "fsdp": sharded, "killed": killed, "worker": worker, "worker_run": r,
            "fsdp_eval": evaluated}


@pytest.mark.slow
def test_a_killed_rank_restarts_from_the_sharded_checkpoint_and_ends_with_ddps_weights(runs):
    killed, out = runs["killed"], runs["fsdp"]
    assert killed.returncode == 0, killed.stdout[-2000:] + killed.stderr[-4000:]
    assert [rank["script_codes"][0] for rank in runs["worker"]] == [0, 0], runs["worker_run"].stderr[-3000:]  # DDP's
    resumed = [x for x in killed.stdout.splitlines() if "resumed from" in x]
    fatal = killed.stderr.find("Fatal Python error")  # a crashed rank's stacks (faulthandler), else the log's end
    why = killed.stderr[fatal:fatal + 3000] if fatal >= 0 else killed.stderr[-3000:]
    assert len(resumed) == 1, f"torchrun resumed the FSDP run {len(resumed)} times, the fault asked for 1: {why}"
    assert "at epoch 1 after its step 2" in resumed[0], killed.stdout[-3000:]
    a, b = load(runs["ddp"] / "checkpoints" / "last.pt"), load(out / "checkpoints" / "last.pt")
    assert a["model"].keys() == b["model"].keys()
    assert [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])] == []
    assert (a["scheduler"], a["global_step"], a["best_acc"]) == (b["scheduler"], b["global_step"], b["best_acc"])
    assert metrics(runs["ddp"]) == metrics(out)
    groups = [json.loads((run / "param_groups.json").read_text()) for run in (runs["ddp"], out)]
    assert groups[0] == groups[1] and len({g["lr_scale"] for g in groups[1].values()}) > 2
    shards = sorted(p.name for p in (out / "checkpoints").glob("sharded-*"))
    assert shards == [b["sharded"]] and not list((out / "checkpoints").glob(".*.tmp"))


@pytest.mark.slow
def test_predict_export_and_eval_only_take_the_fsdp_run(runs, tmp_path, monkeypatch):
    """Its last.pt is an ordinary full-weights checkpoint (in this process: no second torch start-up)."""
    import export
    import predict
    import train
    out = runs["fsdp"]
    rows = predict.main([str(out), str(runs["data"] / "daisy"), "--out", str(tmp_path / "p.csv"), "--device", "cpu"])
    assert len(rows) == 6
    assert export.main([str(out), "--format", "torchscript", "--out", str(tmp_path / "m.pt")]) <= 1e-4
    last = out / "checkpoints" / "last.pt"
    args = run_args(runs["data"], tmp_path / "e", SMALL, flags=["--eval-only", "--resume", last])
    assert run_main(train, args, monkeypatch) == 0
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["val_acc"] == metrics(out)[-1]["val_acc"]


@pytest.mark.slow
def test_fsdp_eval_only_loads_the_run_into_the_sharded_model_and_reports_its_numbers(runs):
    """train_multi_gpu_fsdp.py --eval-only under torchrun (its main() in the worker's launch): last.pt's full
    weights go into the sharded model (load_weights)."""
    r = runs["worker_run"]
    assert [rank["script_codes"][1] for rank in runs["worker"]] == [0, 0], r.stderr[-3000:]
    got, final = json.loads((runs["fsdp_eval"] / "eval.json").read_text()), metrics(runs["fsdp"])[-1]
    keys = ("val_loss", "val_acc", "val_macro_f1", "val_count", "val_confusion")
    assert {k: got[k] for k in keys} == {k: final[k] for k in keys}
    shown = [x for x in r.stdout.splitlines() if x.startswith("eval-only:")]
    assert len(shown) == 1 and f"accuracy {final['val_acc']:.4f}" in shown[0], r.stdout[-2000:]


# --------------------------------------------------------------------------- refusals and block rules

@needs_cpu_fsdp
def test_what_fsdp_cannot_do_is_one_error_line_before_any_data(tmp_path, monkeypatch, capsys):
    """The script's main() in this process (no second torch start-up): the exit code and the error line."""
    import train_multi_gpu_fsdp
    code = run_main(train_multi_gpu_fsdp, [*map(str, run_args(tmp_path / "absent", tmp_path / "run")),
                                           "train.ema_decay=0.9"], monkeypatch)
    stderr = capsys.readouterr().err
    errors = [x for x in stderr.splitlines() if x.startswith("error:")]
    assert code != 0 and len(errors) == 1 and "train.ema_decay" in errors[0], stderr[-2000:]
    from utils.config import load_config
    for override, key in (("train.compile=true", "train.compile"), ("train.amp=fp16", "train.amp=fp16")):
        with pytest.raises(UserError, match=key):
            fsdp.check_config(load_config([override]), torch.device("cpu"))


def fake_gpu(monkeypatch, capability, name):
    """torch.cuda answering as a GPU of this compute capability: bf16 in hardware from 8.0 on, and
    is_bf16_supported() counting emulation by default, as torch >= 2.3 does."""
    native = capability >= (8, 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.skipif(fsdp.fully_shard is None, reason="FSDP2 needs torch >= 2.4")
def test_amp_auto_on_a_gpu_without_native_bf16_is_refused_not_trained_in_fp16(monkeypatch):
    from utils.config import load_config
    from utils.optim import resolve_amp
    gpu = torch.device("cuda", 0)
    fake_gpu(monkeypatch, (7, 0), "Tesla V100-SXM2-16GB")
    assert resolve_amp("auto", gpu) is torch.float16  # what the loop would train
    with pytest.raises(UserError) as refused:
        fsdp.check_config(load_config([]), gpu)
    assert str(refused.value) == (
        "train_multi_gpu_fsdp.py: train.amp=auto means fp16 on this GPU (Tesla V100-SXM2-16GB, compute capability "
        "7.0: no native bf16), and fp16 needs a loss scaler for sharded gradients; set train.amp=off (fp32)")
    assert "emulated" not in str(refused.value)
    for asked in ("off", "bf16"):  # what the line says to set passes
        fsdp.check_config(load_config([f"train.amp={asked}"]), gpu)
    fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    fsdp.check_config(load_config([]), gpu)
    assert resolve_amp("auto", gpu) is torch.bfloat16


def test_block_rule_per_family_and_named_blocks():
    resnet = torchvision.models.resnet18()
    assert [n for n, _ in fsdp.find_blocks(resnet)] == ["layer1", "layer2", "layer3", "layer4"]
    vit = torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=3, num_heads=2,
                                               hidden_dim=8, mlp_dim=8)
    assert [n for n, _ in fsdp.find_blocks(vit)] == [f"encoder.layers.encoder_layer_{i}" for i in range(3)]
    mobile = torchvision.models.mobilenet_v3_small()
    assert [n for n, _ in fsdp.find_blocks(mobile)] == [f"features.{i}" for i in range(13)] + ["classifier.0",
                                                                                              "classifier.3"]
    own = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    assert [n for n, _ in fsdp.find_blocks(own)] == ["0", "2", "4"]  # a MODELS entry: the parts with weights
    assert [n for n, _ in fsdp.find_blocks(resnet, ["BasicBlock", "layer1"])] == \
        ["layer1"] + [f"layer{i}.{j}" for i in (2, 3, 4) for j in (0, 1)]
    with pytest.raises(UserError, match="model.blocks: Nope"):
        fsdp.find_blocks(resnet, ["Nope"])


def test_an_fsdp_checkpoint_resumed_by_another_script_is_one_error_line(tmp_path):
    """Its optimizer state is in the shards: train.py or DDP would otherwise load an empty one."""
    from utils import checkpoint as ckpt
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = ckpt.make_state(model.state_dict(), opt, sched, torch.amp.GradScaler("cpu", enabled=False),
                            ckpt.RunState(1, 3, 0.5), {}, ["a", "b"], sharded="sharded-e001-s00000003-1")
    assert state["optimizer"] == {} and torch.equal(state["model"]["weight"], model.weight)
    with pytest.raises(UserError, match="optimizer state is sharded .train_multi_gpu_fsdp.py"):
        ckpt.restore(state, model, opt, sched, None, ["a", "b"])


@pytest.mark.slow
@needs_cpu_fsdp
def test_every_family_with_a_bare_batchnorm_block_shards_and_steps_at_fp32_and_bf16(tmp_path):
    """RegNet's stem, VGG's and DenseNet's features.N, ...: a BatchNorm that is a block by itself is sharded
    once, in its fp32 group (twice was FSDP2's "applied to a module once" AssertionError). One launch."""
    r = run_entry("tests/_fsdp_families_worker.py", tmp_path, nproc=2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(found) >= 10, found  # 5 torchvision families x 2 dtypes, and timm's 2 when installed
        assert {k: v for k, v in found.items() if v != "ok"} == {}, found
