"""What the model costs, and where a training step's time goes.

    python train.py --config configs/demo.yaml train.profile=5           # 5 steps of rank 0 -> <run>/profile/
    torchrun --nproc_per_node=2 train_multi_gpu_ddp.py train.profile=5 train.profile_ranks=all

model_cost: parameters and FLOPs of one image's forward, counted by torch's own FlopCounterMode on
the meta device (shapes only: no memory, no compute, no random draw, the weights untouched).

StepProfiler (train.profile=N): torch.profiler records N optimizer steps after PROFILE_WAIT + PROFILE_WARMUP
of the first epoch this process trains; the Chrome trace (Perfetto, chrome://tracing, TensorBoard's trace
viewer) goes to <run>/profile/rank<R>.pt.trace.json and the top operators by time to the log.
The step's regions are record_function ranges, no-ops while no profiler records.
How to read a trace: docs/troubleshooting.md.
"""
import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

# engine.py names the step's regions with record_function: "data wait", "forward", "backward" and
# "optimizer step". DDP's gradient all-reduce runs inside "backward" as the backend's own event,
# gloo:all_reduce or nccl:all_reduce.
PROFILE_WAIT, PROFILE_WARMUP = 1, 1  # steps skipped (the loader's first batches), steps traced but dropped
TOP_OPERATORS = 15


# --------------------------------------------------------------------------- parameters and FLOPs

def model_cost(model, img_size, channels=3):
    """{"params", "trainable_params", "gflops"} of the bare `model` (checkpoint.unwrap'ed): gflops is
    one image's forward at img_size x img_size in GFLOPs, 2 per multiply-add (torchvision's weight
    metadata "_ops" counts multiply-adds: half this); None where the model does not run on the meta device.

    The forward runs on meta copies of the parameters and buffers, in eval mode, with the modules'
    hooks set aside: FSDP2's all-gathers never run, so a sharded model needs no collective (its
    DTensors' shapes are the full ones)."""
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode
    params = list(model.parameters())
    cost = {"params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad), "gflops": None}
    tensors = {name: torch.empty(t.shape, dtype=t.dtype, device="meta")
               for name, t in [*model.named_parameters(), *model.named_buffers()]}
    image = torch.empty(1, channels, img_size, img_size, device="meta")
    try:
        with _as_is(model), torch.no_grad(), FlopCounterMode(display=False) as counter:
            functional_call(model, tensors, (image,))
        cost["gflops"] = counter.get_total_flops() / 1e9
    except Exception:  # noqa: BLE001 - an op without a meta kernel: the start line says the count is unknown
        pass
    return cost


@contextlib.contextmanager
def _as_is(model):
    """Eval mode and no forward hooks for the count; every module's mode and hooks come back."""
    modules = list(model.modules())
    saved = [(m.training, m._forward_pre_hooks, m._forward_hooks) for m in modules]
    for m in modules:
        m.training, m._forward_pre_hooks, m._forward_hooks = False, type(m._forward_pre_hooks)(), \
            type(m._forward_hooks)()
    try:
        yield
    finally:
        for m, (training, pre, post) in zip(modules, saved):
            m.training, m._forward_pre_hooks, m._forward_hooks = training, pre, post


def cost_line(cost, img_size):
    """The start-of-run line: parameters and GFLOPs per image."""
    flops = (f"{cost['gflops']:.3g} GFLOPs per {img_size} px image ({cost['gflops'] / 2:.3g} G multiply-adds)"
             if cost["gflops"] is not None else "GFLOPs unknown (the model does not run on the meta device)")
    return f"model: {cost['params'] / 1e6:.2f}M parameters ({cost['trainable_params'] / 1e6:.2f}M trained), {flops}"


# --------------------------------------------------------------------------- train.profile

class StepProfiler:
    """torch.profiler over one epoch's optimizer steps: PROFILE_WAIT, PROFILE_WARMUP, then `steps` recorded.
    The trace is written and the table logged as soon as the last recorded step ends (or the epoch does)."""

    def __init__(self, steps, run_dir, rank, device, log):
        self.path = Path(run_dir) / "profile" / f"rank{rank}.pt.trace.json"
        self.log, self.cuda = log, device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profiler = profile(activities=activities, on_trace_ready=self._ready,
                                schedule=schedule(wait=PROFILE_WAIT, warmup=PROFILE_WARMUP, active=steps, repeat=1))

    def _ready(self, prof):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        averages = prof.key_averages()
        sort_by = "self_cpu_time_total"
        if self.cuda and len(averages):  # the device's time: "device" since torch 2.4, "cuda" before
            sort_by = next(k for k in ("self_device_time_total", "self_cuda_time_total") if hasattr(averages[0], k))
        self.log(f"profile: {self.path} (open it in https://ui.perfetto.dev or chrome://tracing; "
                 f"docs/troubleshooting.md); top operators by {sort_by}:\n"
                 + averages.table(sort_by=sort_by, row_limit=TOP_OPERATORS))

    def steps(self, batches, every=1):
        """The batches, the profiler running around them and stepping after every `every` (one optimizer step)."""
        with self.profiler:
            for i, batch in enumerate(batches, 1):
                yield batch
                if i % every == 0:
                    self.profiler.step()


def epoch_profiler(train_cfg, rank, run_dir, device, log, steps_per_epoch):
    """train.profile's StepProfiler for this rank (train.profile_ranks: 0 or all), or None (off, or another rank)."""
    if not train_cfg.profile or (rank != 0 and train_cfg.profile_ranks != "all"):
        return None
    steps = min(train_cfg.profile, steps_per_epoch - PROFILE_WAIT - PROFILE_WARMUP)
    if steps < 1:
        log(f"note: train.profile={train_cfg.profile} skipped: an epoch has {steps_per_epoch} steps, the profiler "
            f"needs more than {PROFILE_WAIT + PROFILE_WARMUP} (its wait and warm-up)")
        return None
    if steps < train_cfg.profile:
        log(f"note: train.profile={train_cfg.profile}: an epoch has {steps_per_epoch} steps, {steps} are recorded "
            f"after the profiler's {PROFILE_WAIT + PROFILE_WARMUP} of wait and warm-up")
    return StepProfiler(steps, run_dir, rank, device, log)


def profiled(batches, profiler, every=1):
    """The loop's batches, through `profiler` when one records (else the batches themselves: no overhead)."""
    return batches if profiler is None else profiler.steps(batches, every)
