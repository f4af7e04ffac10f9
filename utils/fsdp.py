"""FSDP2 (fully_shard) for train_multi_gpu_fsdp.py: blocks, mesh, mixed precision, checkpoints.

    torchrun --nproc_per_node=8 train_multi_gpu_fsdp.py --config configs/finetune.yaml model.name=vit_l_16

Each rank keeps 1/W of every parameter, gradient and optimizer state. A block (`find_blocks`)
is gathered whole just before its forward and its backward and freed after them, so one
rank holds the full weights of one block at a time, plus its own shards.

The blocks, and the model.blocks key that names them instead:
    torchvision ResNets     layer1 ... layer4 (the stages)
    timm models             the parts of their `stages` (ConvNeXt, MaxViT, RegNet...), else of `blocks`
                            (ViT, EfficientNet...), else of `layers` (Swin); timm's ResNets: layer1 ... layer4
    anything else           the parts with weights of each outermost nn.Sequential / nn.ModuleList
                            that holds two or more (ViT: encoder.layers.N; ConvNeXt, EfficientNet,
                            MobileNet, Swin: features.N, and the classifier's layers); a MODELS
                            entry gets the same rule
    model.blocks=[a, B]     modules whose qualified name or class name is listed
Activation checkpointing (model.activation_checkpointing, every script) recomputes each block's
forward in its backward; it lives here because it uses the same blocks.

Checkpoints: `save_sharded` writes model and optimizer with torch.distributed.checkpoint (DCP),
each rank its own shards, into a directory beside last.pt; last.pt itself holds the full weights
(`full_state_dict`), so predict.py, export.py and --weights read it as any other run's.
"""
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint

from utils.distributed_utils import broadcast_buffers, broadcast_object
from utils.errors import RUNTIME_EXIT, UserError
from utils.optim import resolve_amp

try:  # torch >= 2.6; 2.4 and 2.5 had it under _composable
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - depends on the torch version
    try:
        from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:
        FSDPModule = MixedPrecisionPolicy = fully_shard = None

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
# On torch 2.4 and 2.5 FSDP2 uses CUDA streams even for CPU tensors.
CPU_FSDP_TORCH = (2, 6)
# fully_shard([a, b]): one group of several modules, from torch 2.5 on; 2.4 gives each BatchNorm its own.
GROUP_LISTS = TORCH_VERSION >= (2, 5)


def check_config(cfg, device):
    """What train_multi_gpu_fsdp.py cannot do, each as one error line before any data is read."""
    def refuse(why):
        raise UserError(f"train_multi_gpu_fsdp.py: {why}", every_rank=True)

    if fully_shard is None:
        refuse(f"FSDP2 (fully_shard) needs torch >= 2.4; this is {torch.__version__}")
    if device.type == "cpu" and TORCH_VERSION < CPU_FSDP_TORCH:
        refuse(f"FSDP2 on the CPU needs torch >= 2.6 (2.4 and 2.5 need CUDA streams); this is {torch.__version__}")
    if cfg.train.compile:
        refuse("train.compile=true is not supported: torch.compile of a sharded model runs eager "
               "(see docs/parallelism.md); set train.compile=false")
    if cfg.train.ema_decay:
        refuse("train.ema_decay is not supported: the average would be a second, unsharded copy of the "
               "model on every GPU; set train.ema_decay=0 or train with train_multi_gpu_ddp.py")
    if cfg.train.amp == "fp16":
        refuse("train.amp=fp16 is not supported: fp16 needs a loss scaler for sharded gradients; "
               "set train.amp=bf16 or off")
    # The loop's own choice (resolve_amp: native bf16 only), so what passes here is what trains.
    if resolve_amp(cfg.train.amp, device) is torch.float16:
        major, minor = torch.cuda.get_device_capability(device)
        refuse(f"train.amp=auto means fp16 on this GPU ({torch.cuda.get_device_name(device)}, compute capability "
               f"{major}.{minor}: no native bf16), and fp16 needs a loss scaler for sharded gradients; "
               "set train.amp=off (fp32)")  # not bf16: emulated there, its convolutions run outside cuDNN


# --------------------------------------------------------------------------- blocks

def _has_params(module):
    return any(True for _ in module.parameters())


# Where timm's models keep their blocks, in the order looked for (model.name=timm/<name>).
TIMM_CONTAINERS = ("stages", "blocks", "layers")
RESNET_STAGES = ("layer1", "layer2", "layer3", "layer4")


def _timm_blocks(model):
    """A timm model's blocks (TIMM_CONTAINERS), [] for any other model. timm is not imported here:
    its models are known by their class's module."""
    if not type(model).__module__.startswith("timm."):
        return []
    if all(hasattr(model, n) for n in RESNET_STAGES):
        return [(n, getattr(model, n)) for n in RESNET_STAGES]
    for attr in TIMM_CONTAINERS:
        container = getattr(model, attr, None)
        if isinstance(container, (nn.Sequential, nn.ModuleList)):
            parts = [(f"{attr}.{c}", child) for c, child in container.named_children() if _has_params(child)]
            if len(parts) >= 2:
                return parts
    return []


def find_blocks(model, names=()):
    """[(qualified name, module)] of the units to shard (and to checkpoint), outermost first.
    `names` (model.blocks): qualified names or class names; an entry that matches nothing stops."""
    modules = list(model.named_modules())
    if names:
        found = [(n, m) for n, m in modules if n and (n in names or type(m).__name__ in names)]
        missing = [x for x in names if not any(x in (n, type(m).__name__) for n, m in found)]
        if missing:
            raise UserError(f"model.blocks: {', '.join(map(str, missing))} is neither the qualified name nor the "
                            f"class name of a module of {type(model).__name__}", every_rank=True)
        # A listed module inside another listed one is part of that block already.
        return [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]
    if isinstance(model, torchvision.models.ResNet):
        return [(n, getattr(model, n)) for n in RESNET_STAGES]
    timm_blocks = _timm_blocks(model)
    if timm_blocks:
        return timm_blocks
    # The outermost containers of two or more parts with weights: their parts are the blocks.
    containers = [(n, m) for n, m in modules if isinstance(m, (nn.Sequential, nn.ModuleList))
                  and sum(_has_params(c) for c in m.children()) >= 2]
    outermost = [(n, m) for n, m in containers if not any(o == "" or n.startswith(o + ".") for o, _ in containers
                                                           if o != n)]
    return [(f"{n}.{c}" if n else c, child) for n, m in outermost for c, child in m.named_children()
            if _has_params(child)]


# --------------------------------------------------------------------------- activation checkpointing

def _batchnorms(module):
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@contextlib.contextmanager
def _statistics_kept(norms):
    """The recomputed forward normalises with the batch's statistics, as the first one did, but its
    update of the running mean, var and num_batches_tracked is undone: one update per step. (Turning
    track_running_stats off instead changes what BatchNorm saves for its backward, which checkpoint refuses.)"""
    kept = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (mean, var, count) in zip(norms, kept):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)


class _Checkpointed:
    """Mixed into a block's class: its forward runs under torch.utils.checkpoint. A class of its
    own, not a wrapper module, so parameter names, state dicts and checkpoints stay unchanged."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        norms = _batchnorms(self)
        return checkpoint(super().forward, *args, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), _statistics_kept(norms)), **kwargs)


def checkpoint_blocks(model, names=()):
    """model.activation_checkpointing: each block's activations are recomputed in the backward
    instead of kept. Returns the blocks' names."""
    blocks = find_blocks(model, names)
    for _, block in blocks:
        cls = type(block)
        block.__class__ = type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {})
    return [n for n, _ in blocks]


# --------------------------------------------------------------------------- sharding

def make_mesh(device, world_size):
    """A 1-D mesh over the process group, of this rank's device type. The default mesh follows the
    accelerator, not the backend: gloo on a GPU machine would get a CUDA mesh (pytorch#132471)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device.type, (world_size,))


def _policies(amp_dtype):
    """(blocks' policy, the root's, the BatchNorms') for autocast's dtype; None for fp32.
    bf16: parameters gathered in bf16, gradients reduced in fp32. BatchNorm keeps fp32 weights in
    groups of their own (with bf16 weights it fails: "expected scalar type BFloat16 but found Float")."""
    if amp_dtype is None:
        return None, None, None
    block = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32)
    norm = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=amp_dtype)
    return block, root, norm


@torch.no_grad()
def _broadcast_state(model):
    """Rank 0's weights and buffers on every rank. FSDP2 keeps each rank's own slice and never
    broadcasts, so a weight built differently on one rank (an unseeded init) would stay different."""
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, 0)


def _norm_groups(model, blocks):
    """The BatchNorms with weights, as fp32 groups: one per block and one for the root's, so bf16
    adds one group (its gathers and its reduction) per block, not per BatchNorm (ResNet34: 10 groups
    in all, not 41)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and _has_params(m)]
    if not GROUP_LISTS:
        return [[m] for m in norms]
    ids = {id(m) for m in norms}
    inside = [[m for m in block.modules() if id(m) in ids] for _, block in blocks]
    taken = {id(m) for group in inside for m in group}
    return [group for group in inside + [[m for m in norms if id(m) not in taken]] if group]


def shard_model(model, mesh, amp_dtype=None, names=(), verbose=True):
    """fully_shard each block, then the root (which takes what is left: stem, head). Every rank calls."""
    # FSDP2 shards contiguous parameters only (each becomes rows of one flat buffer), so a channels_last
    # model (build_model on CUDA) goes back to NCHW weights. Its channels_last inputs still get NHWC
    # convolutions: cuDNN (and oneDNN) choose NHWC when the input or the weight is NHWC.
    if not all(p.is_contiguous() for p in model.parameters()):
        model.to(memory_format=torch.contiguous_format)
    _broadcast_state(model)
    block_mp, root_mp, norm_mp = _policies(amp_dtype)
    kwargs = lambda mp: {"mesh": mesh, **({"mp_policy": mp} if mp is not None else {})}  # noqa: E731
    blocks = find_blocks(model, names)
    in_norm_group = set()
    if norm_mp is not None:
        for group in _norm_groups(model, blocks):
            fully_shard(group if len(group) > 1 else group[0], **kwargs(norm_mp))
            in_norm_group.update(id(m) for m in group)
    for _, block in blocks:
        # A BatchNorm that is a block by itself (RegNet's stem, DenseNet's and VGG's features.N) is in its
        # fp32 group already: fully_shard applies once per module.
        if id(block) not in in_norm_group:
            fully_shard(block, **kwargs(block_mp))
    fully_shard(model, **kwargs(root_mp))
    if verbose:
        shown = ", ".join(n for n, _ in blocks[:6]) + (", ..." if len(blocks) > 6 else "")
        print(f"FSDP: {len(blocks)} blocks ({shown}) and the root sharded over {mesh.size()} processes"
              + (f"; {amp_dtype} compute, fp32 gradient reduction and BatchNorm" if amp_dtype else ""), flush=True)
    return model


def is_sharded(model):
    return FSDPModule is not None and isinstance(model, FSDPModule)


# --------------------------------------------------------------------------- state dicts and checkpoints

def full_state_dict(model):
    """The full weights and buffers on rank 0's CPU ({} elsewhere): a collective, every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model, state_dict):
    """Full weights (a plain model's state dict, on every rank) into the sharded model; every rank calls."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    # A copy: set_model_state_dict replaces the dict's tensors by the DTensors it distributes.
    set_model_state_dict(model, dict(state_dict), options=StateDictOptions(full_state_dict=True))


def save_sharded(model, optimizer, ckpt_dir, name, rank):
    """DCP: model and optimizer shards into ckpt_dir/name, via a temp directory renamed by rank 0
    (atomic as last.pt). Buffers are replicated, not sharded, and DCP would keep any rank's copy:
    rank 0's BatchNorm statistics go to every rank first, as before evaluation. Every rank calls."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    broadcast_buffers(model)
    tmp = None
    if rank == 0:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=ckpt_dir)
    tmp = broadcast_object(tmp)
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
        if rank == 0:
            os.replace(tmp, Path(ckpt_dir) / name)
    except Exception as e:  # noqa: BLE001 - DCP hands every rank the writer's OSError wrapped
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write the sharded checkpoint in '{ckpt_dir}': {str(e).splitlines()[0]}; "
                        "the previous checkpoint is intact", exit_code=RUNTIME_EXIT, every_rank=True) from None


def load_sharded(model, optimizer, path):
    """A save_sharded directory into the model and optimizer (each rank reads its shards; another
    world size is resharded). Every rank calls."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def remove_sharded(ckpt_dir, keep):
    """Sharded directories of earlier saves (and of one killed between its rename and last.pt)."""
    for old in Path(ckpt_dir).glob("sharded-*"):
        if old.is_dir() and old.name != keep:
            shutil.rmtree(old, ignore_errors=True)
