"""Fine-tuning's per-group learning rates (utils/param_groups.py): optim.head_lr_scale, optim.layer_decay,
train.unfreeze_at and train.unfreeze_warmup, through the real scripts.

    python -m pytest tests/test_param_groups.py -q

timm's param_groups_layer_decay is the reference of each parameter's lr scale for a timm ViT and a timm
ResNet; a torchvision ResNet follows utils/fsdp.py's blocks. A run stopped mid-ramp resumes bit for bit,
and under torchrun (2 gloo processes) the body stays as loaded, BatchNorm statistics included, until
train.unfreeze_at, then trains. The FSDP run of tests/test_fsdp.py carries the lr scales too.
"""
import json
import signal

import pytest
import torch
from torch import nn

import train
from _resume_utils import assert_same_run, load, metrics, one_thread, run_args, run_main  # noqa: F401
from bad_files import call_main
from conftest import FAST_ARGS, make_image_folder, run_entry
from model import create_model
from test_resume import _resume_from_message, signal_on_training_batch
from utils import run_dir as run_files

timm = pytest.importorskip("timm")  # requirements.txt installs it


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("groups") / "flowers")  # 25 train: 6 steps of 4


def flat(num_classes):
    """A model with no block structure (no timm group_matcher, no container of blocks): registered in
    model.MODELS by tests/_with_model.py."""
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, num_classes)

        def forward(self, x):
            return self.fc(self.conv(x).mean((2, 3)))
    return Flat()


def timm_groups(name, layer_decay, **kwargs):
    """{parameter name: (lr_scale, weight_decay)} of timm.optim.param_groups_layer_decay on the same
    architecture (its no-decay rule, 1-d tensors, is AdamW's here: norms and biases are 1-d in both models)."""
    from timm.optim import param_groups_layer_decay
    net = timm.create_model(name, pretrained=False, num_classes=5, **kwargs)
    names = {id(p): n for n, p in net.named_parameters()}
    return {names[id(p)]: (g["lr_scale"], g["weight_decay"])
            for g in param_groups_layer_decay(net, weight_decay=0.05, layer_decay=layer_decay) for p in g["params"]}


@pytest.mark.parametrize("name, head, extra", [("vit_tiny_patch16_224", "head", {"img_size": 32}),
                                               ("test_resnet", "fc", {})])
def test_layer_decay_equals_timms_param_groups_and_the_head_gets_its_scale(data, tmp_path, name, head, extra,
                                                                           one_thread):
    """train.py writes param_groups.json; each lr scale is timm's (x head_lr_scale on the head); the
    optimizer's groups start at lr x scale; the epoch line shows the head's lr and the lowest group's."""
    out = tmp_path / "run"
    code, stdout, stderr = call_main(train.main, [
        *FAST_ARGS, f"model.name=timm/{name}", "--data-path", data, "--output-dir", out, "optim.name=adamw",
        "optim.lr=0.001", "optim.weight_decay=0.05", "optim.layer_decay=0.65", "optim.head_lr_scale=10"])
    assert code == 0, stderr[-3000:]
    table = json.loads((out / run_files.PARAM_GROUPS).read_text())
    reference = timm_groups(name, 0.65, **extra)
    assert table.keys() == reference.keys()
    for param, (scale, decay) in reference.items():
        expected = scale * (10 if param.startswith(head + ".") else 1)
        assert table[param] == {"lr_scale": pytest.approx(expected, rel=1e-12), "weight_decay": decay}, param
    state = load(out / "checkpoints" / "last.pt")
    assert all(g["initial_lr"] == pytest.approx(0.001 * g["lr_scale"], rel=1e-12)
               for g in state["optimizer"]["param_groups"])
    lowest = min(scale for scale, _ in reference.values())
    row = metrics(out)[-1]
    assert row["lr"] == pytest.approx(0.01) and row["lr_lowest"] == pytest.approx(0.001 * lowest)
    assert f"lr 0.01 (lowest group {0.001 * lowest:.3g})" in stdout


def test_layer_decay_on_a_model_without_blocks_is_one_error_line(data, tmp_path):
    proc = run_entry("tests/_with_model.py", "flat", "test_param_groups:flat", "train.py", *FAST_ARGS,
                     "model.name=flat", "--data-path", data, "--output-dir", tmp_path / "run", "optim.layer_decay=0.7")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "model.name=flat has no block structure" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()


# A torchvision ResNet by utils/fsdp.py's blocks (stem 0, layer1..layer4 1..4, fc 5), the head at 10x, the body
# held at lr 0 for epoch 1 and ramped up over epoch 2, with the EMA and 2 batches per step.
RAMP = ["optim.layer_decay=0.5", "optim.head_lr_scale=10", "train.unfreeze_at=1", "train.unfreeze_warmup=1",
        "train.ema_decay=0.9", "train.ema_warmup=true", "train.accum_steps=2"]


@pytest.mark.slow
def test_torchvision_depths_and_a_stop_mid_ramp_resume_bit_for_bit(data, tmp_path, monkeypatch, capsys, request,
                                                                   one_thread):
    straight, out = tmp_path / "straight", tmp_path / "run"
    assert run_main(train, run_args(data, straight, *RAMP, epochs=2), monkeypatch) == 0
    table = json.loads((straight / run_files.PARAM_GROUPS).read_text())
    depth = {"conv1": 0, "bn1": 0, "layer1": 1, "layer2": 2, "layer3": 3, "layer4": 4}
    for param, row in table.items():
        part = param.split(".")[0]
        assert row["lr_scale"] == (10.0 if part == "fc" else 0.5 ** (5 - depth[part])), param
    rows = metrics(straight)
    # Epoch 1: the body at 0; epoch 2 opens its ramp: 1 of 3 steps, of the cosine's value there.
    assert rows[0]["lr_lowest"] == 0.0 and 0 < rows[1]["lr_lowest"] < rows[1]["lr"] * 0.5 ** 5 / 10 / 3 * 1.0001
    signal_on_training_batch(request, 6 + 3, signal.SIGINT)  # epoch 2's second step, mid-ramp
    code = run_main(train, run_args(data, out, *RAMP, epochs=2), monkeypatch)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    assert load(out / "checkpoints" / "last.pt")["global_step"] == 5
    monkeypatch.undo()
    assert run_main(train, _resume_from_message(err), monkeypatch) == 0
    assert_same_run(straight, out)
    a, b = load(straight / "checkpoints" / "last.pt"), load(out / "checkpoints" / "last.pt")
    assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])


@pytest.mark.slow
def test_unfreezing_under_torchrun_keeps_the_body_as_loaded_until_epoch_k_then_trains_it(data, tmp_path):
    """2 gloo processes, no find_unused_parameters: after epoch 1 (unfreeze_at=1) every body tensor, its
    BatchNorm statistics included, is the loaded one and the head moved; after epoch 2 the body moved too."""
    torch.manual_seed(3)
    start = create_model("resnet18", num_classes=5).state_dict()
    torch.save(start, tmp_path / "w.pth")
    out = tmp_path / "run"
    proc = run_entry("train_multi_gpu_ddp.py", *run_args(data, out, "train.unfreeze_at=1", "train.keep_last=2",
                                                         "optim.weight_decay=0.01", epochs=2),
                     "--weights", tmp_path / "w.pth", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (load(run_files.epoch_checkpoint(out / "checkpoints", e))["model"] for e in (1, 2))
    body = [k for k in start if not k.startswith("fc.")]
    assert [k for k in body if not torch.equal(first[k], start[k])] == []
    assert not torch.equal(first["fc.weight"], start["fc.weight"])
    moved = [k for k in body if not torch.equal(second[k], start[k])]
    assert "conv1.weight" in moved and "layer1.0.bn1.running_mean" in moved


def test_a_schedule_placed_for_another_layout_keeps_each_groups_scale_and_the_unfreeze_ramp():
    """An elastic restart at another world size (utils/optim.place_schedule): every group's lr from then on
    is that of a run of this size from the start, each times its own lr scale, the body's ramp included."""
    from utils.config import load_config
    from utils.optim import build_optimizer, build_scheduler, place_schedule
    cfg = load_config(["optim.lr=0.01", "optim.warmup_epochs=0.5", "optim.head_lr_scale=4"]).optim
    epochs, unfreeze, scales, head = 4, (1, 1.5), {"0.weight": 0.25, "0.bias": 0.25, "1.weight": 4.0, "1.bias": 4.0}, \
        {"1.weight", "1.bias"}

    def made(world, steps):
        opt = build_optimizer(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), cfg, world, lr_scales=scales, head=head)
        return opt, build_scheduler(opt, cfg, epochs, steps, unfreeze)

    def run(opt, sched, n):
        lrs = []
        for _ in range(n):
            lrs.append([g["lr"] for g in opt.param_groups])
            opt.step()
            sched.step()
        return lrs

    old, old_sched = made(1, 10)
    run(old, old_sched, 10)  # epoch 1 as 1 process of 10 steps, then 2 processes of 5
    opt, sched = made(2, 5)
    opt.load_state_dict(old.state_dict())
    sched.load_state_dict(old_sched.state_dict())
    place_schedule(sched, cfg, 2, epochs, 5, 5, unfreeze=unfreeze)
    straight = run(*made(2, 5), epochs * 5)
    placed = run(opt, sched, (epochs - 1) * 5)
    assert sum(placed, []) == pytest.approx(sum(straight[5:], []), rel=1e-12)
    body, top = opt.param_groups[0]["lr_scale"], opt.param_groups[1]["lr_scale"]
    assert (body, top) == (0.25, 4.0) and straight[0][1] > 0  # the head trains from the first step
    assert [lrs[0] for lrs in straight[:5]] == [0.0] * 5 and straight[5][0] > 0  # the body from epoch 2 on


def test_drop_path_reaches_timm_and_torchvision_blocks_and_a_model_without_it_is_one_error_line(data, tmp_path):
    """model.drop_path: timm's drop_path_rate (a ViT's blocks) and torchvision's stochastic_depth_prob (ConvNeXt);
    torchvision's ResNet has neither: train.py stops in one line before training."""
    vit = create_model("timm/vit_tiny_patch16_224", 5, img_size=32, drop_path=0.1)
    assert vit.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    with torch.device("meta"):
        convnext = create_model("convnext_tiny", 5, drop_path=0.2)
    assert convnext.features[7][2].stochastic_depth.p == pytest.approx(0.2)
    proc = run_entry("train.py", *FAST_ARGS, "--data-path", data, "--output-dir", tmp_path / "run",
                     "model.drop_path=0.1")
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and lines == ["error: model.drop_path=0.1: model.name=resnet18 has no drop path "
                                              "(stochastic depth) to set; set model.drop_path=0"], proc.stderr[-2000:]


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_body_at_lr_0_stays_bit_for_bit_under_weight_decay_and_momentum(name):
    """train.unfreeze_at's frozen epochs: SGD (momentum, decay on every tensor) and AdamW (decoupled decay,
    moments) step the body at lr 0: not a bit of it moves, while the head trains; after epoch K it moves."""
    from utils.config import load_config
    from utils.optim import build_optimizer, build_scheduler
    cfg = load_config([f"optim.name={name}", "optim.weight_decay=0.1", "optim.lr=0.1"]).optim
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    scales = {n: 1.0 for n, _ in net.named_parameters()}
    opt = build_optimizer(net, cfg, lr_scales=scales, head={"1.weight", "1.bias"})
    sched = build_scheduler(opt, cfg, 2, 3, unfreeze=(1, 0.0))
    start = {k: v.clone() for k, v in net.state_dict().items()}
    for i in range(6):
        if i == 3:
            assert all(torch.equal(net.state_dict()[k], start[k]) for k in ("0.weight", "0.bias"))
            assert not torch.equal(net.state_dict()["1.weight"], start["1.weight"])
        net(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert not torch.equal(net.state_dict()["0.weight"], start["0.weight"])
