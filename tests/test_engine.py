"""Loop-level pieces of utils/optim.py used by utils/engine.fit: the warm-up + cosine
schedule, the autocast dtype choice and the linear lr scaling with world size.

    python -m pytest tests/test_engine.py -q
"""
import pytest
import torch
from omegaconf import OmegaConf

from utils.config import OptimConfig
from utils.optim import build_optimizer, build_scaler, build_scheduler, resolve_amp


def optim_cfg(**kw):
    return OmegaConf.structured(OptimConfig(**kw))


def lrs_per_step(cfg, epochs, steps_per_epoch, world_size=1):
    """The lr each optimizer step runs with, plus the lr left after the last step."""
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, cfg, world_size)
    sched = build_scheduler(opt, cfg, epochs, steps_per_epoch)
    lrs = []
    for _ in range(epochs * steps_per_epoch):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs, opt.param_groups[0]["lr"]


def test_cosine_runs_from_lr_to_lr_times_lrf():
    lrs, final = lrs_per_step(optim_cfg(lr=0.1, lrf=0.01), epochs=4, steps_per_epoch=5)
    assert lrs[0] == pytest.approx(0.1)
    assert final == pytest.approx(0.1 * 0.01)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))          # never goes up
    assert lrs[10] == pytest.approx(0.1 * (1 + 0.01) / 2)     # half way: the cosine's midpoint
    assert min(lrs) > 0.1 * 0.01                              # lr * lrf is the floor, reached at the end


@pytest.mark.parametrize("warmup_epochs, warmup_steps", [(1.0, 10), (0.5, 5)])
def test_linear_warmup_then_cosine(warmup_epochs, warmup_steps):
    lrs, final = lrs_per_step(optim_cfg(lr=0.2, lrf=0.05, warmup_epochs=warmup_epochs),
                              epochs=3, steps_per_epoch=10)
    warm = lrs[:warmup_steps]
    assert warm[0] == pytest.approx(0.2 / warmup_steps)
    assert warm[-1] == pytest.approx(0.2)
    steps = [b - a for a, b in zip(warm, warm[1:])]
    assert all(s == pytest.approx(0.2 / warmup_steps) for s in steps)   # linear
    cosine = lrs[warmup_steps:]
    assert cosine[0] == pytest.approx(0.2)
    assert all(a >= b for a, b in zip(cosine, cosine[1:]))
    assert final == pytest.approx(0.2 * 0.05)


@pytest.mark.parametrize("world_size, scale_lr, expected", [
    (1, True, 0.01), (2, True, 0.02), (8, True, 0.08), (8, False, 0.01),
])
def test_lr_scales_linearly_with_world_size(world_size, scale_lr, expected):
    lrs, _ = lrs_per_step(optim_cfg(lr=0.01, scale_lr=scale_lr), epochs=1, steps_per_epoch=2,
                          world_size=world_size)
    assert lrs[0] == pytest.approx(expected)


def test_optimizer_holds_only_trainable_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    opt = build_optimizer(model, optim_cfg())
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model[1].parameters()}


# --------------------------------------------------------------------------- autocast

@pytest.mark.parametrize("amp", ["auto", "off", "bf16", "fp16"])
def test_amp_is_off_on_cpu(amp):
    assert resolve_amp(amp, torch.device("cpu")) is None


@pytest.mark.parametrize("amp, bf16_supported, expected", [
    ("auto", True, torch.bfloat16),
    ("auto", False, torch.float16),
    ("bf16", True, torch.bfloat16),
    ("fp16", True, torch.float16),
    ("off", True, None),
])
def test_amp_on_cuda(monkeypatch, amp, bf16_supported, expected):
    # Only the dtype choice is tested here, so no GPU is needed: pretend about bf16 support.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    assert resolve_amp(amp, torch.device("cuda", 0)) is expected


@pytest.mark.parametrize("dtype, enabled", [(None, False), (torch.bfloat16, False), (torch.float16, True)])
def test_loss_scaling_only_for_fp16(dtype, enabled):
    # A scaler built for CUDA would warn without a GPU; the CPU one answers the same question.
    scaler = build_scaler(dtype, torch.device("cpu"))
    assert scaler.is_enabled() is enabled
