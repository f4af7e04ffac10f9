"""The training recipe built from the config: optimizer, learning-rate schedule, mixed
precision and the EMA of the weights."""
import copy
import inspect
import math

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from utils.errors import UserError


def scaled_lr(optim_cfg, world_size, global_batch=0):
    """The run's peak lr, the one rule for it (build_optimizer says why).

    train.global_batch=N (global_batch > 0): optim.lr itself, the lr of N images per step, whatever the
    process count, batch size and accumulation (1 process x 4 accumulated batches and 4 processes x 1 take
    the same step, so the same lr). Off: optim.lr is one process's batch's, times world_size under
    optim.scale_lr."""
    if global_batch:
        return optim_cfg.lr
    return optim_cfg.lr * (world_size if optim_cfg.scale_lr else 1)


def accumulation(train_cfg, world_size):
    """Batches per optimizer step: train.accum_steps, or with train.global_batch=N, N / (batch_size x
    processes) (DataParallel is one process whose batch is already the global one). One line when N does
    not divide, naming what would."""
    n, batch = train_cfg.global_batch, train_cfg.batch_size
    if not n:
        return train_cfg.accum_steps
    per_step = batch * world_size  # images of one micro-batch over all processes
    if n % per_step == 0:
        return n // per_step
    near = " or ".join(str(g) for g in (n // per_step * per_step, (n // per_step + 1) * per_step) if g)
    if n % world_size:
        fix = f"a global batch divisible by the {world_size} processes, e.g. {near}"
    else:
        mine = n // world_size  # images per process per step
        sizes = sorted(sorted((d for d in range(1, mine + 1) if mine % d == 0), key=lambda d: abs(d - batch))[:3])
        fix = f"--batch-size {', '.join(map(str, sizes))} (dividing its {mine} per process), or a global batch of {near}"
    raise UserError(f"train.global_batch={n} does not divide into --batch-size {batch} x {world_size} process(es) "
                    f"= {per_step} images per micro-batch; use {fix}", every_rank=True)


def build_optimizer(model, optim_cfg, world_size=1, fused=False, global_batch=0, lr_scales=None, head=()):
    """optim.name over the trainable tensors; lr scaled by world size under the linear scaling rule.

    In DDP each process sees `batch_size` images, so the global batch is
    batch_size * world_size; keeping lr per image constant means lr * world_size.
    With train.global_batch the images per step are fixed, and so is the lr (scaled_lr).
    `fused` (fp16 on CUDA): GradScaler then reads the inf/NaN check inside the
    fused kernel; with a plain optimizer it copies that flag to the host every step.
    sgd: one group, decay on every tensor (the default recipe, and its checkpoints, unchanged).
    adamw: decay only on weights, not on norm layers and biases (decay_groups).
    lr_scales ({parameter name: scale}, utils/param_groups.py) splits each of those groups by scale, and
    the head's parameters (names in `head`) from the body's: group["lr_scale"], group["head"] (scaled_groups).
    """
    lr = scaled_lr(optim_cfg, world_size, global_batch)
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optim_cfg.name]
    extra = {"fused": True} if fused and "fused" in inspect.signature(cls).parameters else {}
    if optim_cfg.name == "sgd":
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": params, "weight_decay": optim_cfg.weight_decay}]
        extra["momentum"] = optim_cfg.momentum
    else:
        groups = decay_groups(model, optim_cfg.weight_decay)
    if lr_scales is not None:
        groups = scaled_groups(model, groups, lr_scales, head, lr)
    optimizer = cls(groups if lr_scales is not None or optim_cfg.name == "adamw" else groups[0]["params"],
                    lr=lr, **({"weight_decay": optim_cfg.weight_decay} if optim_cfg.name == "sgd" else {}), **extra)
    zero_momentum(optimizer)
    return optimizer


def scaled_groups(model, groups, lr_scales, head, lr):
    """Each weight-decay group split by lr scale, the head apart from the body (train.unfreeze_at holds
    the body alone at lr 0): in order of first appearance, so all scales 1 keep one group per decay
    group, the head's only where it differs or where asked. group["lr"] = lr x its scale, which
    LambdaLR keeps as the group's initial_lr: the schedule scales each group by its own factor."""
    names = {id(p): name for name, p in model.named_parameters()}
    out = []
    for group in groups:
        parts = {}
        for p in group["params"]:
            name = names[id(p)]
            parts.setdefault((lr_scales[name], name in head), []).append(p)
        out += [{**group, "params": params, "lr": lr * scale, "lr_scale": scale, "head": is_head}
                for (scale, is_head), params in parts.items()]
    return out


def per_group_lrs(optimizer):
    """Whether the groups have lrs of their own (scaled_groups made them): the lowest is then shown too."""
    return any("head" in group for group in optimizer.param_groups)


def group_lrs(optimizer):
    """(the head's lr, the lowest group's lr) now: what the epoch line and TensorBoard show. Without a
    head group (all scales 1), the first group's for both."""
    groups = optimizer.param_groups
    head = next((g["lr"] for g in groups if g.get("head")), groups[0]["lr"])
    return head, min(g["lr"] for g in groups)


def zero_momentum(optimizer):
    """Give fused SGD zero momentum buffers before its first step.

    Fused SGD makes them with torch.empty_like on its first step and returns early when
    GradScaler skips that step (inf gradients, common at fp16's starting scale of 2**16):
    the next step would take uninitialised memory for momentum. From zeros, the first real
    step gives buf = momentum * 0 + grad = grad, plain SGD's first step exactly (no dampening)."""
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD) and group.get("fused") and group["momentum"]:
            for p in group["params"]:
                if optimizer.state[p].get("momentum_buffer") is None:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# How the optimizer computes, not what: this run's choice, never a checkpoint's.
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_state(optimizer, saved):
    """optimizer.load_state_dict(saved), keeping this optimizer's own implementation flags.

    load_state_dict takes the saved groups' settings, `fused` included: an fp16 run (fused, for
    GradScaler's on-device inf check) resumed from a bf16, fp32 or CPU checkpoint would step a plain
    optimizer through GradScaler's fused branch and assert. The saved groups get this optimizer's
    flags before loading, so torch also places the state (AdamW's step count) for this implementation.

    load_state_dict moves the momentum and Adam moments with .to(), which keeps the saved strides: a
    CPU checkpoint (contiguous) resumed on a GPU (channels_last parameters) would give state whose
    layout differs from its parameter's, which CUDA's fused SGD and AdamW refuse at the first step.
    Each such tensor is copied into its parameter's layout."""
    groups = [{**g, **{k: own[k] for k in _IMPLEMENTATION if k in own}}
              for g, own in zip(saved["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**saved, "param_groups": groups})
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})  # .get: no empty entry for a parameter without state
            for key, value in list(state.items()):
                if key != "step" and torch.is_tensor(value) and value.shape == p.shape \
                        and value.stride() != p.stride():
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)
            step = state.get("step")
            if not (group.get("fused") or group.get("capturable")) and torch.is_tensor(step) \
                    and step.device.type != "cpu":
                # A fused run keeps AdamW's step counts on the device; plain AdamW reads its count on
                # the host each step, which would then be a host sync per step.
                state["step"] = step.cpu()
    zero_momentum(optimizer)


_NORM_TYPES = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.GroupNorm, torch.nn.LayerNorm,
               torch.nn.LocalResponseNorm, torch.nn.modules.instancenorm._InstanceNorm)


def decay_groups(model, weight_decay):
    """[decay group, no-decay group] of the trainable tensors: decaying a norm layer's scale or a
    bias only pulls it towards 0 without regularising anything; weights (ndim >= 2) keep the decay.
    Any 1-d tensor counts as a norm or bias (e.g. a norm class of one's own)."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                exempt = isinstance(module, _NORM_TYPES) or name == "bias" or p.ndim <= 1
                (no_decay if exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def lr_factor(step, total_steps, warmup_steps, lrf):
    """Multiplier of the base lr at `step`: linear warm-up, then cosine from 1 down to lrf."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return lrf + (1 - lrf) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class WarmupCosine:
    """Picklable lr_lambda, so the schedule lives in the scheduler's state, not in a closure.

    frozen_steps, ramp_steps (train.unfreeze_at, train.unfreeze_warmup, on the body's groups): 0 for the
    first frozen_steps, then a linear ramp to the schedule over ramp_steps."""

    def __init__(self, total_steps, warmup_steps, lrf, frozen_steps=0, ramp_steps=0):
        self.total_steps, self.warmup_steps, self.lrf = total_steps, warmup_steps, lrf
        self.frozen_steps, self.ramp_steps = frozen_steps, ramp_steps

    @classmethod
    def for_run(cls, optim_cfg, epochs, steps_per_epoch, unfreeze_at=0, unfreeze_warmup=0.0):
        """The schedule of `epochs` x `steps_per_epoch` optimizer steps, optim.warmup_epochs of them
        (rounded to whole steps) warming up; with unfreeze_at=K the first K epochs at 0, then
        unfreeze_warmup epochs (rounded to whole steps) ramping up."""
        return cls(epochs * steps_per_epoch, int(round(optim_cfg.warmup_epochs * steps_per_epoch)), optim_cfg.lrf,
                   unfreeze_at * steps_per_epoch, int(round(unfreeze_warmup * steps_per_epoch)))

    def __call__(self, step):
        factor = lr_factor(step, self.total_steps, self.warmup_steps, self.lrf)
        if step < self.frozen_steps:
            return 0.0
        if step - self.frozen_steps < self.ramp_steps:
            return factor * (step - self.frozen_steps + 1) / self.ramp_steps
        return factor


def _shapes(groups, optim_cfg, epochs, steps_per_epoch, unfreeze):
    """One WarmupCosine per group: the body's (not group["head"]) held at 0 by train.unfreeze_at."""
    return [WarmupCosine.for_run(optim_cfg, epochs, steps_per_epoch,
                                 *(unfreeze if unfreeze[0] and not group.get("head", True) else (0, 0.0)))
            for group in groups]


def build_scheduler(optimizer, optim_cfg, epochs, steps_per_epoch, unfreeze=(0, 0.0)):
    """Stepped once per optimizer step (not per epoch), so warm-up can be a fraction of an epoch.
    unfreeze: (train.unfreeze_at, train.unfreeze_warmup) for the body's groups."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _shapes(optimizer.param_groups, optim_cfg, epochs,
                                                                steps_per_epoch, unfreeze))


def place_schedule(scheduler, optim_cfg, world_size, epochs, steps_per_epoch, step, global_batch=0,
                   unfreeze=(0, 0.0)):
    """Re-place a restored schedule for this run's layout, at global step `step`.

    A checkpoint of another world size or batch size counts its schedule in its own
    steps per epoch and scales lr for its own world size (optim.scale_lr); kept as is,
    the cosine would end early or late. The optimizer's lr follows at once, each group's
    times its own lr scale (optim.head_lr_scale, optim.layer_decay).
    """
    base = scaled_lr(optim_cfg, world_size, global_batch)
    groups = scheduler.optimizer.param_groups
    scheduler.lr_lambdas = _shapes(groups, optim_cfg, epochs, steps_per_epoch, unfreeze)
    scheduler.base_lrs = [base * group.get("lr_scale", 1.0) for group in groups]
    scheduler.last_epoch = step
    for group, initial, shape in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = initial, initial * shape(step)
    scheduler._last_lr = [group["lr"] for group in groups]


def resolve_amp(amp, device):
    """Config's train.amp -> autocast dtype, or None for full fp32."""
    if device.type != "cuda" or amp == "off":
        return None  # CPU autocast is slower than fp32 for convolutions on most CPUs
    if amp == "auto":
        return torch.bfloat16 if _native_bf16() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]


def _native_bf16():
    """bf16 in hardware (Ampere and later). Since torch 2.3 is_bf16_supported() also counts
    emulation, which makes V100 and T4 slow; they get fp16 with loss scaling instead (which
    utils/fsdp.check_config refuses: FSDP's sharded gradients have no loss scaler)."""
    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.is_bf16_supported()


def build_scaler(amp_dtype, device):
    """Loss scaling is needed for fp16 only; bf16 has fp32's range."""
    enabled = amp_dtype == torch.float16
    return torch.amp.GradScaler(device.type if enabled else "cpu", enabled=enabled)


class WeightEMA:
    """train.ema_decay: an exponential moving average of the model's weights and buffers,
    ema = decay * ema + (1 - decay) * weights after every optimizer step, starting from the
    weights it is built with. The update is one foreach lerp over the tensors on the device:
    no host sync (swa_utils.AveragedModel checks its step count on the host every update).
    `module` is an eval-mode copy of the model to evaluate and save.

    warmup (train.ema_warmup): the decay of update n (the run's optimizer step count, 1-based) is timm's
    ModelEmaV3's with use_warmup: 0 at n = 1 (the average starts at the first step's weights), then
    1 - n^(-warmup_power) (warmup_gamma 1), capped at `decay`; a short fine-tune's average then
    forgets the starting weights at once instead of after ~1/(1 - decay) steps. The count is the run's
    global step, so a resumed run continues the ramp where it was."""

    def __init__(self, model, decay, warmup=False, warmup_gamma=1.0, warmup_power=2 / 3):
        self.decay, self.warmup, self.warmup_gamma, self.warmup_power = decay, warmup, warmup_gamma, warmup_power
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self._lerp = get_ema_multi_avg_fn(decay)
        pairs = list(zip(self.module.state_dict().values(), model.state_dict().values()))
        floats = [p for p in pairs if p[0].is_floating_point()]
        others = [p for p in pairs if not p[0].is_floating_point()]  # e.g. BatchNorm's step count: copied
        # (EMA tensors, model tensors), listed once: no per-step Python work over the state dict.
        self._floats = ([e for e, _ in floats], [m for _, m in floats])
        self._others = ([e for e, _ in others], [m for _, m in others])

    def decay_at(self, step):
        """The decay of update number `step` (1-based): `decay`, or with warmup ModelEmaV3.get_decay's."""
        if not self.warmup:
            return self.decay
        step = max(0, step - 1)
        if step <= 0:
            return 0.0
        return min(1 - (1 + step / self.warmup_gamma) ** -self.warmup_power, self.decay)

    @torch.no_grad()
    def update(self, step=None):
        """Average in the model's current weights; `step`: this update's number (train.ema_warmup's)."""
        if self.warmup and self._floats[0]:
            # A host float (no sync): the decay ramps with the step count.
            torch._foreach_lerp_(*self._floats, 1 - self.decay_at(step))
        else:
            self._lerp(*self._floats, None)
        if self._others[0]:
            torch._foreach_copy_(*self._others)  # one fused copy, not a kernel launch per BatchNorm

    @torch.no_grad()
    def reset(self):
        """Start the average afresh from the model's current weights."""
        for ema, model in (self._floats, self._others):
            if ema:
                torch._foreach_copy_(ema, model)
