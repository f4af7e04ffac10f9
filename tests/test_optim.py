"""utils/optim.py: the optimizer (sgd; adamw without decay on norms and biases), the warm-up +
cosine schedule, the linear lr scaling with world size, the autocast dtype choice, loss scaling,
the DataParallel autocast wrapper, and the loop's optim.label_smoothing, optim.clip_grad_norm,
optim.class_weights, data.mixup_alpha / data.cutmix_alpha, train.ema_decay and train.accum_steps.

    python -m pytest tests/test_optim.py -q
"""
import copy
import inspect
import threading

import pytest
import torch
import torch.nn.functional as F

from test_engine import MarkingLoader, sync_log  # noqa: F401 - sync_log is a fixture
from utils.config import load_config
from engine import Criterion, EpochHooks, Step, class_weights, train_one_epoch
from utils.errors import UserError
from train_multi_gpu_dp import AutocastForward
from utils.mixing import batch_mixer
from utils.optim import WeightEMA, build_optimizer, build_scaler, build_scheduler, load_optimizer_state, resolve_amp
from utils.run_logger import RunLogger

CPU = torch.device("cpu")


def optim_cfg(**kw):
    """configs/default.yaml's optim section with `kw` as overrides (the schema holds no values)."""
    return load_config([f"optim.{k}={v}" for k, v in kw.items()]).optim


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


def test_auto_picks_fp16_where_bf16_is_only_emulated(monkeypatch):
    """torch >= 2.3: is_bf16_supported() counts emulation by default (True on V100/T4, where bf16
    is slow); resolve_amp must ask for native support and choose fp16 with loss scaling there."""
    def emulating_gpu(including_emulation=True):  # the real signature; no GPU needed
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulating_gpu)
    assert resolve_amp("auto", torch.device("cuda", 0)) is torch.float16
    assert resolve_amp("bf16", torch.device("cuda", 0)) is torch.bfloat16  # asked for explicitly: kept


def in_new_thread(fn):
    """fn() in a fresh thread (as DataParallel runs each replica); its result or its exception."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_autocast_dtype_is_per_thread():
    """Why AutocastForward exists: a thread does not inherit the autocast dtype of the thread that
    started it. Under autocast(float16) in the main thread, a new thread's autocast without a dtype
    computes in the device's default (bfloat16 on CPU, float16 on CUDA), not what was asked for."""
    x = torch.randn(2, 8)

    def thread_default():
        # A Linear of its own, as each DataParallel replica has: autocast's weight cast cache is
        # shared by all threads, and the main thread's float16 copy of a shared weight would be used.
        with torch.autocast("cpu", enabled=True):
            return torch.nn.Linear(8, 4)(x).dtype

    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.nn.Linear(8, 4)(x).dtype is torch.float16  # the main thread: as asked
        assert in_new_thread(thread_default) is torch.bfloat16  # the thread: CPU's default, not float16


def test_autocast_forward_sets_the_dtype_in_the_replica_thread():
    """AutocastForward(module, float16, "cpu") called in a new thread computes in float16, although
    the thread's own autocast default is bfloat16 (what DataParallel's replica threads would use;
    on CUDA the default is float16 and the chosen dtype bfloat16)."""
    x = torch.randn(2, 8)

    def replica():
        return AutocastForward(torch.nn.Linear(8, 4), torch.float16, device_type="cpu")(x).dtype

    with torch.autocast("cpu", dtype=torch.bfloat16):  # the main thread's choice, to be overridden
        assert in_new_thread(replica) is torch.float16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_forward_in_a_thread_on_cuda(dtype):
    x = torch.randn(2, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16 if dtype is torch.bfloat16 else torch.bfloat16):
        got = in_new_thread(lambda: AutocastForward(torch.nn.Linear(8, 4).cuda(), dtype)(x).dtype)
    assert got is dtype


# ------------------------------------------------------------------ optim.name=adamw, label smoothing, clipping

def small_net():
    """Conv + BatchNorm + LayerNorm + Linear: every kind of tensor the decay rule sorts."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.LayerNorm(4),
                               torch.nn.Linear(4, 3))


def test_adamw_groups_exclude_norm_parameters_and_biases_from_decay():
    model = small_net()
    opt = build_optimizer(model, optim_cfg(name="adamw", weight_decay=0.5))
    assert isinstance(opt, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [(g["weight_decay"], sorted(names[id(p)] for p in g["params"])) for g in opt.param_groups]
    assert groups == [(0.5, ["0.weight", "6.weight"]),
                      (0.0, ["0.bias", "1.bias", "1.weight", "5.bias", "5.weight", "6.bias"])]
    # The groups act: with zero gradients one AdamW step only shrinks the decayed weights.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        expected = before[n] * (1 - 0.01 * 0.5) if n in ("0.weight", "6.weight") else before[n]
        assert torch.allclose(p, expected), n


def test_adamw_groups_on_a_torchvision_model_and_sgd_keeps_one_group():
    from model import create_model
    model = create_model("mobilenet_v3_small", num_classes=3)
    decay, no_decay = build_optimizer(model, optim_cfg(name="adamw")).param_groups
    norm_params = {id(p) for m in model.modules() if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.LayerNorm))
                   for p in m.parameters(recurse=False)}
    biases = {id(p) for n, p in model.named_parameters() if n.endswith(".bias")}
    assert norm_params and biases
    assert {id(p) for p in no_decay["params"]} == norm_params | biases
    assert not {id(p) for p in decay["params"]} & (norm_params | biases)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    # sgd: the default recipe's single group, decay on every tensor (its checkpoints resume as before)
    sgd = build_optimizer(model, optim_cfg())
    assert isinstance(sgd, torch.optim.SGD) and len(sgd.param_groups) == 1
    assert sgd.param_groups[0]["weight_decay"] == 1e-4


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_fp16_steps_use_a_fused_optimizer_where_torch_has_it(name):
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[name]
    fused = build_optimizer(small_net(), optim_cfg(name=name), fused=True)
    assert fused.param_groups[0].get("fused", False) is ("fused" in inspect.signature(cls).parameters)
    assert not build_optimizer(small_net(), optim_cfg(name=name)).param_groups[0].get("fused")


def batches(n=1, size=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 8, 8, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(n)]


class ScalarLog(RunLogger):
    """A disabled logger that keeps the scalars the loop logs."""

    def __init__(self):
        super().__init__(".", enabled=False)
        self.scalars = []

    def scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def run_epoch(model, loader, opt, sched, scaler=None, *, logger=None, log_every=20, label_smoothing=0.0,
              class_weight=None, **step_options):
    """engine.train_one_epoch over `loader` on the CPU; step_options: the other engine.Step fields."""
    step = Step(model, opt, sched, scaler or build_scaler(None, CPU), CPU,
                criterion=Criterion(label_smoothing, class_weight), **step_options)
    return train_one_epoch(step, loader, 0, hooks=EpochHooks(logger=logger, log_every=log_every))


def one_epoch(model, data, scaler=None, **kw):
    opt = build_optimizer(model, optim_cfg(lr=0.1))
    sched = build_scheduler(opt, optim_cfg(lr=0.1), 1, len(data))
    logger = ScalarLog()
    out = run_epoch(model, data, opt, sched, scaler, logger=logger, log_every=1, **kw)
    return out, opt, logger


def test_the_shipped_criterion_is_cross_entropy_and_evaluation_takes_the_plain_loss():
    """Training: cross entropy with the config's label smoothing and class weights, soft targets too;
    evaluation (per_image): each image's plain cross entropy, neither smoothed nor weighted."""
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(6, 3, generator=g), torch.tensor([0, 1, 2, 2, 1, 0])
    weight = torch.tensor([1.0, 2.0, 0.5])
    criterion = Criterion(label_smoothing=0.1, class_weight=weight)
    plain = logits.logsumexp(1) - logits[torch.arange(6), labels]
    assert torch.allclose(criterion.per_image(logits, labels), plain)
    assert criterion(logits, labels).item() == pytest.approx(
        F.cross_entropy(logits, labels, weight=weight, label_smoothing=0.1).item())
    soft = F.one_hot(labels, 3).float() * 0.7 + 0.1  # MixUp/CutMix targets: a distribution per image
    assert criterion(logits, soft).item() == pytest.approx(
        F.cross_entropy(logits, soft, weight=weight, label_smoothing=0.1).item())


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothing_matches_cross_entropy(smoothing):
    data = batches()
    model = small_net().eval()  # eval: BatchNorm normalises the same way in both computations
    expected = torch.nn.functional.cross_entropy(model(data[0][0]), data[0][1], label_smoothing=smoothing)
    model.train = lambda mode=True: model  # keep eval mode inside the loop (no batch statistics)
    out, _, _ = one_epoch(model, data, label_smoothing=smoothing)
    assert out.metrics["train_loss"] == pytest.approx(expected.item(), rel=1e-6)
    if smoothing:
        plain = torch.nn.functional.cross_entropy(small_net().eval()(data[0][0]), data[0][1])
        assert abs(out.metrics["train_loss"] - plain.item()) > 1e-3  # the smoothing did change the loss


def grad_norm(params):
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])).item()


@pytest.mark.parametrize("fp16", [False, True])
def test_clip_caps_the_measured_norm_and_logs_the_unclipped_one(monkeypatch, fp16):
    """The norm the optimizer steps with is min(true norm, clip); under fp16 the clip acts on the
    unscaled gradients (clipping the scaled ones would leave clip / scale, far below the cap)."""
    data = batches(3)
    seen = []
    real_step = torch.optim.SGD.step

    def recording_step(self, *a, **k):
        seen.append(grad_norm([p for g in self.param_groups for p in g["params"]]))
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.SGD, "step", recording_step)
    one_epoch(small_net(), data)
    free = list(seen)
    assert min(free) > 0.05  # the gradients' true norms, each well above the cap below
    seen.clear()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if fp16 else None
    _, _, logger = one_epoch(small_net(), data, scaler=scaler, clip_grad_norm=0.05)
    assert seen == [pytest.approx(0.05, rel=1e-4)] * 3
    logged = [v for tag, v, _ in logger.scalars if tag == "train/grad_norm"]
    assert logged[0] == pytest.approx(free[0], rel=1e-4)  # step 1: same weights, the pre-clip norm
    assert len(logged) == 3 and min(logged) > 0.05


def test_recipe_options_add_no_per_step_host_sync(sync_log):
    """Clipping, label smoothing, class weights, the EMA update and accumulation read nothing back
    per batch. MixUp's only reads are torchvision drawing its mixing weight from a CPU distribution
    (torchvision/transforms/v2/_augment.py), never a tensor of the device."""
    data = batches(6)
    loader = MarkingLoader(data, sync_log)
    model = small_net()
    opt = build_optimizer(model, optim_cfg(lr=0.1))
    sched = build_scheduler(opt, optim_cfg(lr=0.1), 1, 3)
    run_epoch(model, loader, opt, sched, log_every=100, clip_grad_norm=0.05, label_smoothing=0.1,
              class_weight=torch.tensor([1.0, 2.0, 0.5]), ema=WeightEMA(model, 0.9), accum_steps=2,
              mix=batch_mixer(0.4, 0.0, 3))
    per_batch = [sync_log[a:b] for a, b in zip(loader.marks, loader.marks[1:])]
    assert len(per_batch) == 5 and all(set(reads) <= {("__float__", "_augment.py")} for reads in per_batch), per_batch


def test_auto_class_weights_are_inverse_frequency_and_weight_the_loss():
    labels = [0] * 6 + [1] * 2 + [2]  # N = 9 over C = 3 classes
    weights = class_weights("auto", labels, 3, CPU)
    assert weights.tolist() == pytest.approx([9 / (3 * 6), 9 / (3 * 2), 9 / (3 * 1)])
    data = [(batches()[0][0], torch.tensor([0, 0, 1, 2]))]
    model = small_net().eval()  # eval: the same normalisation in the loop and here
    nll = -torch.log_softmax(model(data[0][0]), dim=1)[torch.arange(4), data[0][1]].detach()
    w = weights[data[0][1]]
    expected = (w * nll).sum() / w.sum()  # torch's weighted mean: sum_i w_yi * nll_i / sum_i w_yi
    model.train = lambda mode=True: model
    out, _, _ = one_epoch(model, data, class_weight=weights)
    assert out.metrics["train_loss"] == pytest.approx(expected.item(), rel=1e-6)
    assert abs(out.metrics["train_loss"] - nll.mean().item()) > 1e-2  # the weights did change the loss
    assert class_weights([1, 2.5, 3], labels, 3, CPU).tolist() == [1.0, 2.5, 3.0]
    assert class_weights("none", labels, 3, CPU) is None
    with pytest.raises(UserError, match="has 3 weights, the data has 4 classes"):
        class_weights([1, 2, 3], labels, 4, CPU)
    with pytest.raises(UserError, match="needs the training labels"):  # a dataset without .targets
        class_weights("auto", None, 3, CPU)


@pytest.mark.parametrize("mixup, cutmix", [(0.4, 0.0), (0.0, 1.0), (0.4, 1.0)])
def test_mixup_and_cutmix_train_on_soft_targets(mixup, cutmix):
    data = batches(size=8)
    model = small_net().eval()
    images, labels = data[0]
    torch.manual_seed(5)
    mixed, soft = batch_mixer(mixup, cutmix, 3)(images, labels)
    assert soft.shape == (8, 3) and torch.allclose(soft.sum(dim=1), torch.ones(8))
    assert (soft.max(dim=1).values < 1).any()  # mixed labels (a pair of one class stays one-hot)
    expected = torch.nn.functional.cross_entropy(model(mixed), soft).item()
    plain = torch.nn.functional.cross_entropy(model(images), labels).item()
    model.train = lambda mode=True: model
    torch.manual_seed(5)  # the loop draws from the global generator, as the per-epoch seeding sets it
    out, _, _ = one_epoch(model, data, mix=batch_mixer(mixup, cutmix, 3))
    assert out.metrics["train_loss"] == pytest.approx(expected, rel=1e-6)
    assert abs(out.metrics["train_loss"] - plain) > 1e-3
    assert batch_mixer(0.0, 0.0, 3) is None


@pytest.mark.parametrize("accum", [1, 2])
def test_ema_equals_a_hand_computed_average_of_the_weights(accum):
    """ema_0 = w_0, ema_k = d * ema_(k-1) + (1 - d) * w_k after every optimizer step k, for the
    parameters and the BatchNorm statistics alike; with accumulation, once per step, not per batch."""
    decay, model = 0.8, small_net()
    # The weights each time the loop takes a batch: by then the previous step (and EMA update) is done.
    loader = MarkingLoader(batches(6), note=lambda: {k: v.double().clone() for k, v in model.state_dict().items()})
    ema = WeightEMA(model, decay)
    opt = build_optimizer(model, optim_cfg(lr=0.1))
    sched = build_scheduler(opt, optim_cfg(lr=0.1), 1, 6 // accum)
    out = run_epoch(model, loader, opt, sched, ema=ema, accum_steps=accum)
    assert out.global_step == 6 // accum
    weights = loader.marks[::accum] + [{k: v.double() for k, v in model.state_dict().items()}]
    hand = copy.deepcopy(weights[0])
    for w in weights[1:]:
        hand = {k: decay * hand[k] + (1 - decay) * w[k] for k in hand}
    averaged = ema.module.state_dict()
    for k, v in averaged.items():
        if v.is_floating_point():
            assert torch.allclose(v.double(), hand[k], rtol=1e-5, atol=1e-7), k
        else:  # BatchNorm's step count is copied, not averaged
            assert torch.equal(v, model.state_dict()[k]), k
    assert not any(p.requires_grad for p in ema.module.parameters())
    moved = max((averaged[k].double() - w).norm().item() / w.norm().item() for k, w in weights[-1].items()
                if w.is_floating_point() and w.norm() > 0)
    assert moved > 1e-2  # the average lags the weights: the comparison above is not with the weights themselves


def test_accumulation_trains_whole_steps_and_leaves_a_short_tail_out():
    """5 batches at accum_steps=2: 2 optimizer steps of 2 batches; the 5th batch is not even loaded."""
    loader = MarkingLoader(batches(5))
    model = small_net()
    opt = build_optimizer(model, optim_cfg(lr=0.1))
    sched = build_scheduler(opt, optim_cfg(lr=0.1), 1, 2)
    steps = []
    opt.register_step_post_hook(lambda *a: steps.append(1))
    out = run_epoch(model, loader, opt, sched, accum_steps=2)
    assert (len(steps), out.global_step, len(loader.marks)) == (2, 2, 4)
    assert sched.last_epoch == 2  # the schedule counts optimizer steps


# ------------------------------------------------------------------ fp16: fused optimizers under GradScaler

def _cpu_fused(name):
    """A fused optimizer of `name` runs on this torch's CPU (fused SGD/AdamW on CPU: torch >= 2.4-2.5)."""
    try:
        opt = build_optimizer(torch.nn.Linear(2, 2), optim_cfg(name=name), fused=True)
        torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
        return bool(opt.param_groups[0].get("fused"))
    except RuntimeError:
        return False


def scaled_step(model, opt, scaler, data, poison=False):
    """One GradScaler step on `data`; poison: inf gradients with a finite loss (GradScaler skips it)."""
    images, labels = data
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    scaler.scale(loss * (float("inf") if poison else 1.0)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_an_fp16_run_resumes_a_plain_optimizers_checkpoint_and_stays_fused(name):
    """A bf16, fp32 or CPU run saves a plain optimizer's state; Optimizer.load_state_dict would take its
    fused=None over this fp16 run's fused=True, and the first GradScaler step asserted ("Expected
    grad_scale and found_inf to be None"). The restored optimizer stays fused and steps as a plain one."""
    from utils import checkpoint as ckpt
    if not _cpu_fused(name):
        pytest.skip(f"this torch has no fused {name} on the CPU")
    data = batches(1)[0]
    model = small_net()
    plain = build_optimizer(model, optim_cfg(name=name, lr=0.1))
    scaled_step(model, plain, build_scaler(None, CPU), data)  # a step of the run that saved it
    sched = build_scheduler(plain, optim_cfg(name=name, lr=0.1), 1, 10)
    state = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(plain.state_dict()),
             "scheduler": sched.state_dict(), "scaler": {}, "epoch": 1, "global_step": 1, "best_acc": 0.0,
             "classes": ["a", "b", "c"]}
    results = {}
    for fused in (False, True):
        resumed = small_net()
        opt = build_optimizer(resumed, optim_cfg(name=name, lr=0.1), fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # what an fp16 run uses (CUDA there)
        # A copy each time: a loaded optimizer shares the state dict's tensors and steps them in place.
        ckpt.restore(copy.deepcopy(state), resumed, opt, build_scheduler(opt, optim_cfg(name=name, lr=0.1), 1, 10),
                     scaler, ["a", "b", "c"])
        assert bool(opt.param_groups[0].get("fused")) is fused
        scaled_step(resumed, opt, scaler, data)
        results[fused] = resumed.state_dict()
    for key, value in results[False].items():
        assert torch.allclose(results[True][key], value, rtol=1e-5, atol=1e-6), key


def test_fused_sgd_after_a_skipped_first_step_takes_plain_sgds_step():
    """GradScaler skips a step whose gradients overflowed (common at fp16's starting scale 2**16). Fused
    SGD made its momentum buffers with empty_like on that skipped first step and the next step read
    the uninitialised memory as momentum (weights moved by 1e21 or went NaN); plain SGD moved by 0.004."""
    if not _cpu_fused("sgd"):
        pytest.skip("this torch has no fused SGD on the CPU")
    first, second = batches(2)
    weights = {}
    for fused in (False, True):
        model = small_net()
        opt = build_optimizer(model, optim_cfg(lr=0.1), fused=fused)
        scaler = torch.amp.GradScaler("cpu")  # starting scale 2**16
        scaled_step(model, opt, scaler, first, poison=True)
        assert scaler.get_scale() == 2.0 ** 15  # skipped: the scale backed off, nothing moved
        scaled_step(model, opt, scaler, second)
        weights[fused] = model.state_dict()
    moved = max((weights[False][k] - p).abs().max().item() for k, p in small_net().named_parameters())
    assert 1e-4 < moved < 1.0
    for key, value in weights[False].items():
        assert torch.allclose(weights[True][key], value, rtol=1e-5, atol=1e-7), key


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_grad_norm_is_the_finite_steps_mean_and_skipped_steps_are_counted(fused, monkeypatch):
    """Under fp16 a skipped step's pre-clip norm is inf; train/grad_norm used to log inf for any window
    holding one. It is the mean over the window's finite steps, and train/skipped_steps counts the rest."""
    if fused and not _cpu_fused("sgd"):
        pytest.skip("this torch has no fused SGD on the CPU")
    data = batches(4)
    model = small_net()
    calls = [0]

    def overflow_on_second_step(grad):  # finite loss, inf gradients: what fp16 overflow looks like
        calls[0] += 1
        return grad * float("inf") if calls[0] == 2 else grad

    model[6].weight.register_hook(overflow_on_second_step)
    opt = build_optimizer(model, optim_cfg(lr=0.1), fused=fused)
    sched = build_scheduler(opt, optim_cfg(lr=0.1), 1, len(data))
    logger = ScalarLog()
    norms, real_clip = [], torch.nn.utils.clip_grad_norm_  # each step's pre-clip norm, as the loop gets it
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: norms.append(real_clip(*a, **k)) or
                        norms[-1])
    run_epoch(model, data, opt, sched, torch.amp.GradScaler("cpu", init_scale=1024.0), logger=logger, log_every=4,
              clip_grad_norm=100.0)
    logged = {tag: v for tag, v, _ in logger.scalars}
    assert logged["train/skipped_steps"] == 1
    finite = [n.item() for n in norms if torch.isfinite(n)]
    assert len(norms) == 4 and len(finite) == 3
    assert logged["train/grad_norm"] == pytest.approx(sum(finite) / 3, rel=1e-6)  # the mean, not the sum
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name,fused", [("sgd", False), ("sgd", True), ("adamw", False), ("adamw", True)])
def test_restored_optimizer_state_takes_the_parameters_layout(name, fused):
    """A CPU run saves contiguous momentum and Adam moments; resumed on a GPU, where build_model makes
    the parameters channels_last, load_state_dict's .to() kept the saved strides and CUDA's fused
    kernels refused the first step. Here on CPU: the conv weight's state has the parameter's strides."""
    if fused and not _cpu_fused(name):
        pytest.skip(f"this torch has no fused {name} on the CPU")
    saving = small_net()
    opt = build_optimizer(saving, optim_cfg(name=name, lr=0.1))
    scaled_step(saving, opt, build_scaler(None, CPU), batches(1)[0])
    saved = copy.deepcopy(opt.state_dict())
    resumed = small_net().to(memory_format=torch.channels_last)
    conv = resumed[0].weight
    assert not conv.is_contiguous() and saved["state"][0]["momentum_buffer" if name == "sgd" else "exp_avg"] \
        .is_contiguous()
    restored = build_optimizer(resumed, optim_cfg(name=name, lr=0.1), fused=fused)
    load_optimizer_state(restored, saved)
    keys = ["momentum_buffer"] if name == "sgd" else ["exp_avg", "exp_avg_sq"]
    for key in keys:
        assert restored.state[conv][key].stride() == conv.stride(), key
        assert torch.equal(restored.state[conv][key], saved["state"][0][key]), key
    scaled_step(resumed, restored, build_scaler(None, CPU), batches(1)[0])  # and it steps


@pytest.mark.parametrize("saved_world, world", [(1, 2), (4, 2)])
def test_a_schedule_resumed_at_another_world_size_continues_as_an_uninterrupted_run_of_that_size(saved_world,
                                                                                                 world):
    """An elastic restart at another world size: the restored optimizer and schedule hold the old run's
    scaled lr and step count (in its own steps per epoch). place_schedule puts them at this run's step,
    with this run's scaled lr, and every later step's lr is that of a run of this size from the start."""
    from utils.optim import place_schedule
    cfg, epochs, images = optim_cfg(lr=0.01, lrf=0.1, warmup_epochs=0.5), 3, 40
    saved_steps, steps = images // (4 * saved_world), images // (4 * world)  # batch 4 per rank
    old = build_optimizer(torch.nn.Linear(2, 2), cfg, saved_world)
    old_sched = build_scheduler(old, cfg, epochs, saved_steps)
    for _ in range(saved_steps):  # epoch 1 at the saved world size, then the restart
        old.step()
        old_sched.step()
    opt = build_optimizer(torch.nn.Linear(2, 2), cfg, world)
    sched = build_scheduler(opt, cfg, epochs, steps)
    opt.load_state_dict(old.state_dict())
    sched.load_state_dict(old_sched.state_dict())
    place_schedule(sched, cfg, world, epochs, steps, steps)
    lrs = []
    for _ in range((epochs - 1) * steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    straight, final = lrs_per_step(cfg, epochs, steps, world_size=world)
    assert lrs == pytest.approx(straight[steps:], rel=1e-9) and opt.param_groups[0]["lr"] == pytest.approx(final)
    assert lrs[0] != pytest.approx(old.param_groups[0]["lr"])  # the restored lr alone would be wrong


@pytest.mark.slow
def test_ema_warmup_equals_timms_model_ema_v3_on_the_same_updates(tmp_path, monkeypatch):
    """train.py with train.ema_decay=0.99 train.ema_warmup=true, 2 epochs of 3 steps of 2 batches each:
    timm's ModelEmaV3(use_warmup=True), updated after each of the same optimizer steps with timm's step count,
    holds bit for bit the checkpoint's EMA (weights and BatchNorm statistics)."""
    timm_ema = pytest.importorskip("timm.utils.model_ema")
    import engine
    import train
    from bad_files import call_main
    from conftest import FAST_ARGS, make_image_folder
    real, reference, steps = engine._optimizer_step, [], []

    def step_then_timm(step, window, params, global_step=None):
        real(step, window, params, global_step)
        if not reference:
            reference.append(timm_ema.ModelEmaV3(step.net, decay=0.99, use_warmup=True))
        steps.append(global_step)
        reference[0].update(step.net, step=len(steps))  # timm's train.py: num_updates, counted after the step

    monkeypatch.setattr(engine, "_optimizer_step", step_then_timm)
    data = make_image_folder(tmp_path / "flowers")  # 25 train images: 6 batches of 4
    code, _, stderr = call_main(train.main, [*FAST_ARGS, "--data-path", data, "--output-dir", tmp_path / "run",
                                             "train.epochs=2", "train.accum_steps=2", "train.ema_decay=0.99",
                                             "train.ema_warmup=true", "model.name=mobilenet_v3_small"])
    assert code == 0, stderr[-3000:]
    assert steps == list(range(1, 7))
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["ema"]
    theirs = reference[0].module.state_dict()
    assert saved.keys() == theirs.keys()
    assert [k for k in saved if not torch.equal(saved[k], theirs[k])] == []
    assert WeightEMA(torch.nn.Linear(1, 1), 0.99, warmup=True).decay_at(6) == reference[0].get_decay(6) < 0.99
