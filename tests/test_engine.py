"""engine.py, called directly on tiny in-memory data: evaluate, train_one_epoch and fit.

    python -m pytest tests/test_engine.py -q

A list of (images, labels) batches serves as a loader for train_one_epoch and evaluate;
fit gets real loaders from data.make_loader over a TensorDataset. The results are
checked against the same arithmetic done by hand. The loop's promise of no host sync
per step is counted here on CPU, and checked on CUDA with torch's sync debug mode.
(utils/optim.py, which fit uses for the optimizer, schedule and amp: tests/test_optim.py.)
"""
import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data import make_loader
import engine
import run
from utils.config import load_config
from utils.distributed_utils import DistInfo
from utils.errors import RUNTIME_EXIT, UserError
from utils.samplers import ShardSampler, epoch_sampler
from utils.optim import build_optimizer, build_scaler

CPU = torch.device("cpu")


def tiny_model(num_classes=3, seed=0):
    """12 inputs (3x2x2 images) -> num_classes, with a BatchNorm so train/eval mode matters."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 6), torch.nn.BatchNorm1d(6),
                               torch.nn.ReLU(), torch.nn.Linear(6, num_classes))


def make_batches(sizes, num_classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, 2, 2, generator=g), torch.randint(0, num_classes, (n,), generator=g))
            for n in sizes]


def sgd(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))


# --------------------------------------------------------------------------- evaluate

def test_evaluate_equals_a_hand_computation():
    """Loss, accuracy and per-class accuracy (recall: right / images of that class) over all
    batches, the last one short, in eval mode. The model reads its logits off the first four
    inputs, so the predictions are set by hand; class 3 has no image: its accuracy is 0, not NaN."""
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 0, 1])
    preds = torch.tensor([0, 1, 0, 1, 2, 2, 2, 0, 0, 0, 1])  # 5 predicted 0, 4 of class 0: recall != precision
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 12, generator=g) * 0.5
    x[:, :4] += 4 * F.one_hot(preds, 4)
    model = torch.nn.Sequential(torch.nn.Linear(12, 4, bias=False), torch.nn.BatchNorm1d(4))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4, 12))
        model[1].running_mean.fill_(0.25)
        model[1].running_var.fill_(4.0)
    batches = [(x[i:i + 4], labels[i:i + 4]) for i in (0, 4, 8)]
    got = engine.evaluate(model, batches, CPU, num_classes=4)

    assert not model.training  # train mode would normalise by the batch's own statistics
    with torch.no_grad():
        logits = model(x).double()
    assert torch.equal(logits.argmax(1), preds)
    loss = engine.Criterion().per_image(logits, labels).mean().item()  # whatever loss Criterion holds
    assert got["val_count"] == 11
    assert got["val_loss"] == pytest.approx(loss, rel=1e-6)
    assert got["val_acc"] == pytest.approx(7 / 11)
    assert got["val_per_class_acc"] == pytest.approx([3 / 4, 2 / 3, 2 / 4, 0.0])


# --------------------------------------------------------------------------- train_one_epoch

def test_train_one_epoch_loss_and_steps_match_a_hand_loop():
    """train_loss is the mean over images of the per-step losses (each step's loss weighted by
    its batch size), the same steps a plain loop takes, one optimizer and scheduler step per batch."""
    model = tiny_model()
    by_hand = copy.deepcopy(model)
    batches = make_batches([4, 4, 4, 4, 3])
    opt, sched = sgd(model)
    steps = []
    opt.register_step_post_hook(lambda *a: steps.append(1))

    out = engine.train_one_epoch(engine.Step(model, opt, sched, build_scaler(None, CPU), CPU), batches, 0,
                                 global_step=7, hooks=engine.EpochHooks(log_every=2))

    opt2, sched2 = sgd(by_hand)
    by_hand.train()
    losses = []
    for x, y in batches:
        loss = engine.Criterion()(by_hand(x), y)  # the training loss, whatever Criterion holds
        opt2.zero_grad(set_to_none=True)
        loss.backward()
        opt2.step()
        sched2.step()
        losses.append((loss.item(), len(y)))
    expected = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
    assert out.metrics["train_loss"] == pytest.approx(expected, rel=1e-6)
    assert expected != pytest.approx(sum(loss for loss, _ in losses) / len(losses), rel=1e-6)  # weighting shows
    assert len(steps) == len(batches) and sched.last_epoch == len(batches)
    assert out.global_step == 7 + len(batches)
    assert out.metrics["img_per_s"] > 0 and out.metrics["train_seconds"] > 0
    for (name, a), b in zip(model.state_dict().items(), by_hand.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("log_every", [2, 100])
def test_a_nan_loss_names_its_step(log_every):
    """A NaN at global step 13 (the 4th batch of an epoch that starts at step 10) is reported as
    step 13, whichever log window finds it; later steps are NaN too, the first one is named."""
    model = tiny_model()
    batches = make_batches([4] * 6)
    batches[3][0][0, 0, 0, 0] = float("nan")
    opt, sched = sgd(model)
    with pytest.raises(UserError, match=r"loss is nan at epoch 2, step 13; stopping") as e:
        engine.train_one_epoch(engine.Step(model, opt, sched, build_scaler(None, CPU), CPU), batches, 1,
                               global_step=10, hooks=engine.EpochHooks(log_every=log_every))
    assert e.value.exit_code == RUNTIME_EXIT and e.value.every_rank


# --------------------------------------------------------------------------- fit

def loaders(cfg, n_train=24, n_val=9):
    """fit's loaders, as train.py builds them, over in-memory 3x2x2 images of 3 classes."""
    g = torch.Generator().manual_seed(3)
    train = torch.utils.data.TensorDataset(torch.randn(n_train, 3, 2, 2, generator=g),
                                           torch.arange(n_train) % 3)
    val = torch.utils.data.TensorDataset(torch.randn(n_val, 3, 2, 2, generator=g), torch.arange(n_val) % 3)
    bs = cfg.train.batch_size
    return (make_loader(train, bs, epoch_sampler(train, cfg.train.seed), cfg.data, CPU, train=True),
            make_loader(val, bs, ShardSampler(val), cfg.data, CPU, train=False))


def test_fit_logs_each_epoch_and_keeps_the_best(tmp_path, monkeypatch):
    """metrics.jsonl gets one line per epoch and best_acc is the running max of val_acc; best.pt
    is the best epoch's. The val_acc sequence is scripted (0.5, 0.8, 0.6) around the real evaluate,
    so the best epoch is not the last one."""
    out = tmp_path / "run"
    cfg = load_config(["--device", "cpu", "--output-dir", str(out), "train.epochs=3", "train.batch_size=4",
                       "train.log_every=2", "data.num_workers=0", "optim.lr=0.05"])
    scripted = iter([0.5, 0.8, 0.6])
    real_evaluate = run.evaluate

    def evaluate(*a, **k):
        return {**real_evaluate(*a, **k), "val_acc": next(scripted)}

    monkeypatch.setattr(run, "evaluate", evaluate)
    train_loader, val_loader = loaders(cfg)
    result = run.fit(cfg, tiny_model(), train_loader, val_loader, ["a", "b", "c"], DistInfo(device=CPU),
                     script_name="test")

    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2, 3]
    assert [m["step"] for m in lines] == [6, 12, 18]  # 24 images / batch 4, per epoch
    assert [m["val_acc"] for m in lines] == [0.5, 0.8, 0.6]
    assert [m["best_acc"] for m in lines] == [0.5, 0.8, 0.8]
    assert result["best_acc"] == 0.8 == max(m["val_acc"] for m in lines)
    assert result["run_dir"] == str(out) and result["last"]["epoch"] == 3
    assert all(math.isfinite(m["train_loss"]) and m["val_count"] == 9 for m in lines)
    best = torch.load(out / "checkpoints" / "best.pt", map_location="cpu", weights_only=False)
    last = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    assert (best["epoch"], best["best_acc"]) == (2, 0.8) and (last["epoch"], last["best_acc"]) == (3, 0.8)
    assert json.loads((out / "class_indices.json").read_text()) == {"0": "a", "1": "b", "2": "c"}


# --------------------------------------------------------------------------- no host sync per step

# Tensor methods that copy a value to the host (and wait for the device to get there).
SYNC_METHODS = ("item", "tolist", "__float__", "__bool__", "__int__", "cpu", "numpy")


@pytest.fixture
def sync_log(monkeypatch):
    """Every host read of a tensor and every reduction the engine starts (reduce_sums, reduce_min),
    as (what, calling file)."""
    log = []
    for name in SYNC_METHODS:
        real = getattr(torch.Tensor, name)

        def counting(self, *a, _real=real, _name=name, **k):
            log.append((_name, Path(sys._getframe(1).f_code.co_filename).name))
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    for name in ("reduce_sums", "reduce_min"):
        real_reduce = getattr(engine, name)

        def counting_reduce(*a, _real=real_reduce, _name=name, **k):
            log.append((_name, "engine.py"))
            return _real(*a, **k)

        monkeypatch.setattr(engine, name, counting_reduce)
    return log


class MarkingLoader:
    """A list of batches that notes, each time the loop takes one, how long `log` is by then
    (or what `note()` returns)."""

    def __init__(self, batches, log=(), note=None):
        self.batches, self.marks = batches, []
        self.note = note or (lambda: len(log))

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.marks.append(self.note())
            yield batch


@pytest.mark.parametrize("amp", ["fp32", "fp16", "uint8"])
def test_train_step_has_no_per_step_sync(sync_log, amp):
    """12 steps with log_every=100: no host read and no all-reduce in steps 1..11; the last step
    ends the log window (one reduce_sums: one all-reduce, one copy to the host) and the epoch (one more).

    fp16 runs with the enabled CPU GradScaler that build_scaler makes for it (torch >= 2.4). Observed
    with torch 2.14: GradScaler.step itself calls .item() on its found-inf flag once per step (in
    torch/amp/grad_scaler.py, _maybe_opt_step), unless the optimizer is fused (e.g.
    torch.optim.SGD(..., fused=True) steps with no read). The engine's own steps stay sync-free.
    uint8: fp32 on uint8 batches, which the loop converts and normalises (data.py's transforms)."""
    dtype = torch.float16 if amp == "fp16" else None
    scaler = build_scaler(dtype, CPU)
    assert scaler.is_enabled() is (amp == "fp16")
    model = tiny_model()
    opt, sched = sgd(model)
    steps = 12
    batches = make_batches([4] * steps)
    if amp == "uint8":
        batches = [(x.mul(40).add(128).clamp(0, 255).to(torch.uint8), y) for x, y in batches]
    loader = MarkingLoader(batches, sync_log)
    engine.train_one_epoch(engine.Step(model, opt, sched, scaler, CPU, amp_dtype=dtype), loader, 0,
                           hooks=engine.EpochHooks(log_every=100))

    assert len(loader.marks) == steps
    per_step = [sync_log[a:b] for a, b in zip(loader.marks, loader.marks[1:])]  # steps 1..11
    tail = sync_log[loader.marks[-1]:]                                         # step 12 and the ends
    ours = [[s for s in step if s[1] != "grad_scaler.py"] for step in per_step]
    assert ours == [[]] * (steps - 1), f"host syncs per step: {ours}"
    from_scaler = [s for step in per_step for s in step if s[1] == "grad_scaler.py"]
    if amp == "fp32":
        assert not from_scaler
    else:  # at most GradScaler's one .item() per step (11 seen with torch 2.14 and plain SGD)
        assert set(from_scaler) <= {("item", "grad_scaler.py")} and len(from_scaler) <= steps - 1
    # The window's end and the epoch's: one reduction each, copied to the host once each.
    assert [s for s in tail if s[1] == "engine.py"] == [("reduce_sums", "engine.py")] * 2, tail
    assert [s for s in tail if s[0] == "cpu"] == [("cpu", "distributed_utils.py")] * 2, tail


class SyncDebugLoader:
    """Batches already on the GPU; torch's sync debug mode is "error" while steps 1..n-1 run, and
    back to "default" for the last step (it ends the log window: one read by design) and the end."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            torch.cuda.set_sync_debug_mode("error" if i < len(self.batches) - 1 else "default")
            yield batch


def exempt_grad_scaler_step(scaler):
    """With a plain SGD, GradScaler.step reads its found-inf flag on the host (see
    test_train_step_has_no_per_step_sync): torch's sync, not the engine's. Let that one call sync."""
    real = scaler._maybe_opt_step

    def lenient(*a, **k):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    scaler._maybe_opt_step = lenient


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amp, recipe", [("bf16", False), ("fp16", False), ("bf16", True), ("bf16", "uint8")])
def test_train_steps_on_cuda_do_not_synchronize(amp, recipe):
    """A resnet18 on CUDA under autocast (bf16; fp16 with its GradScaler): any synchronizing call
    in steps 1..n-1 of train_one_epoch raises under torch.cuda.set_sync_debug_mode("error").
    recipe: also the EMA update, 2-batch accumulation, MixUp/CutMix, class weights, clipping; "uint8": uint8
    batches, converted and normalised on the device by the loop (data.py's transforms give them).
    Scope: one process with plain BatchNorm. --syncBN with 2+ processes is torch's SyncBatchNorm, whose
    forward masks the gathered statistics by batch size, a host sync per layer (36 per ResNet34 step)."""
    from utils.mixing import batch_mixer
    from utils.optim import WeightEMA
    from model import create_model
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    torch.manual_seed(0)
    model = create_model("resnet18", num_classes=3).to(device)
    # What fit builds: with fp16, a fused SGD, whose kernel reads GradScaler's inf/NaN flag on the device.
    opt = build_optimizer(model, load_config([]).optim, fused=dtype is torch.float16)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
    scaler = build_scaler(dtype, device)
    assert scaler.is_enabled() is (amp == "fp16")
    if scaler.is_enabled() and not opt.param_groups[0].get("fused"):
        exempt_grad_scaler_step(scaler)  # a torch without fused SGD: its per-step host read is torch's
    batches = [(torch.randn(8, 3, 32, 32, device=device), torch.randint(0, 3, (8,), device=device))
               for _ in range(8)]
    if recipe == "uint8":
        batches = [(x.mul(40).add(128).clamp(0, 255).to(torch.uint8), y) for x, y in batches]
    options = dict(ema=WeightEMA(model, 0.9), accum_steps=2, mix=batch_mixer(0.2, 1.0, 3), clip_grad_norm=1.0,
                   criterion=engine.Criterion(class_weight=torch.tensor([1.0, 2.0, 0.5], device=device))) \
        if recipe is True else {}
    step = engine.Step(model, opt, sched, scaler, device, amp_dtype=dtype, **options)
    steps = len(batches) // step.accum_steps
    hooks = engine.EpochHooks(log_every=100)
    previous = torch.cuda.get_sync_debug_mode()
    try:
        # One epoch to warm up (cuDNN/cuBLAS handles, optimizer state), then the checked one.
        engine.train_one_epoch(step, batches, 0, hooks=hooks)
        out = engine.train_one_epoch(step, SyncDebugLoader(batches), 1, global_step=steps, hooks=hooks)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert math.isfinite(out.metrics["train_loss"]) and out.global_step == 2 * steps
