"""Process-group setup and the few collectives the template needs.

torchrun (and srun) describe each process through the environment (the old
launcher's --local-rank becomes LOCAL_RANK in utils/config.py). Rule used everywhere:
every rank calls every collective; only the side effects (files, prints, bars) are rank-0 guarded.
"""
import contextlib
import datetime
import gc
import inspect
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from utils.errors import RUNTIME_EXIT, UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1     # processes on this node: they share its CPU cores for data loading
    device: torch.device = torch.device("cpu")
    distributed: bool = False


def _env_int(*names):
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return None


def read_launch_env():
    """(rank, world_size, local_rank) from torchrun's or SLURM's variables, or None."""
    rank = _env_int("RANK")
    if rank is not None:
        return rank, _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK") or 0
    rank = _env_int("SLURM_PROCID")
    if rank is not None and _env_int("SLURM_NTASKS") is not None:
        return rank, _env_int("SLURM_NTASKS"), _env_int("SLURM_LOCALID") or 0
    return None


def _parse_device(requested):
    """train.device -> torch.device, checked; creates no CUDA context."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"--device '{requested}' is not a device; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {requested} asked for CUDA, but torch sees no CUDA device; use --device cpu")
    return device


def resolve_device(requested="auto"):
    """train.device -> torch.device for a single process: auto = CUDA if present, else CPU.

    A CUDA device always carries its index ("cuda" -> "cuda:0"): torch.cuda.set_device
    refuses a device without one, and torch.device("cuda") != torch.device("cuda:0").
    """
    device = _parse_device(requested)
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    # current_device() would create a CUDA context; before any CUDA call it is 0 anyway.
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    if index >= count:
        raise UserError(f"--device {requested}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def use_device(device, deterministic=False):
    """Make `device` (from resolve_device or init_distributed_mode) this process's current device, and
    set how its kernels are chosen, here alone: train.deterministic=true asks for the same bits on every
    run (torch.use_deterministic_algorithms, no cuDNN autotuning, a fixed cuBLAS workspace); false, for
    the fastest kernels (cudnn.benchmark: fixed input size)."""
    if deterministic:
        # cuBLAS reads it when it makes its handle (the first matmul): before any CUDA work. torch takes
        # only these two values, and a user's own other one would stop the run at its first matmul.
        own = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if own not in (None, ":4096:8", ":16:8"):
            raise UserError(f"train.deterministic=true, and CUBLAS_WORKSPACE_CONFIG={own} in the environment: "
                            "cuBLAS's deterministic kernels need :4096:8 or :16:8; unset it or set one of them",
                            every_rank=True)  # torchrun gives every rank the same environment
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Set either way: a process that calls main() twice (the tests) must not keep the last run's mode.
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic
    if device.type == "cuda":
        torch.cuda.set_device(device)


def store_libuv(environ, probe):
    """Whether this process's TCPStores use libuv (torch >= 2.4 defaults to it), deciding once:
    USE_LIBUV from the environment wins; else libuv where this build has it. `probe()` says whether
    it has it (True/False), or None where this torch has no use_libuv switch at all. When the build
    lacks it, USE_LIBUV=0 is set in `environ`, which env:// rendezvous (init_process_group) reads."""
    if "USE_LIBUV" in environ:
        return environ["USE_LIBUV"] == "1"
    has = probe()
    if has is False:
        environ["USE_LIBUV"] = "0"
    return bool(has)


def has_libuv():
    """Open (and close) a listening TCPStore with libuv: False where the build lacks it, None where
    this torch predates the switch. Costs one local socket."""
    try:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    except TypeError:  # no use_libuv parameter
        return None
    except RuntimeError as e:
        if "without libuv" in str(e):  # "use_libuv was requested but PyTorch was build without libuv support"
            return False
        raise
    del store
    return True


def restart_store(world_size, timeout):
    """Under torchrun, the agent's store with a key space of its own for each restart attempt.

    torchrun keeps one store for the whole job; after `--max-restarts` restarts
    the group, the new workers would otherwise find the dead workers' gloo/NCCL
    addresses under the same keys and try to connect to them (seen as a refused
    connection, or a hang in process-group creation, in tests/test_ddp_resume.py).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    libuv = {"use_libuv": os.environ["USE_LIBUV"] == "1"} if "USE_LIBUV" in os.environ else {}
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                is_master=False, timeout=timeout, **libuv)
    return dist.PrefixStore(f"train_template/attempt_{attempt}", agent_store)


def resolve_backend(requested, want_cuda):
    """ddp.backend -> "nccl" or "gloo". auto: nccl on CUDA where this torch has it, else gloo
    (CPU runs, Windows, CUDA builds without NCCL); gloo also runs on CUDA tensors."""
    if requested == "nccl" and not want_cuda:
        raise UserError("ddp.backend=nccl needs CUDA GPUs, and this run is on the CPU; use ddp.backend=gloo (or auto)")
    if requested == "nccl" and not dist.is_nccl_available():
        raise UserError("ddp.backend=nccl: this torch build has no NCCL; use ddp.backend=gloo (or auto)")
    if requested == "auto":
        return "nccl" if want_cuda and dist.is_nccl_available() else "gloo"
    return requested


def ddp_kwargs(ddp_cfg):
    """The config's ddp section as DistributedDataParallel's keyword arguments: all but `backend`,
    which is the process group's (init_distributed_mode), not DDP's.

    ddp.broadcast_buffers (off by default): training forwards in train mode never read the running
    statistics, evaluate() broadcasts rank 0's first and checkpoints hold rank 0's, so the per-forward
    broadcast (108 tensors for ResNet34) changes nothing that is kept. torch 2.13 renamed it
    forward_sync_buffers and warns about the old name; before that, broadcast_buffers=False also left
    buffers out of DDP's initial sync, which is harmless here: every rank builds the same buffers."""
    kwargs = dict(ddp_cfg)
    kwargs.pop("backend")
    kwargs.pop("timeout_minutes", None)  # the process group's too (init_distributed_mode)
    renamed = "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    kwargs["forward_sync_buffers" if renamed else "broadcast_buffers"] = kwargs.pop("broadcast_buffers")
    return kwargs


def init_distributed_mode(device="auto", timeout_minutes=30, backend="auto", deterministic=False):
    """Join the process group described by the environment and pick this rank's device.

    `device` is the config's train.device: "auto" takes CUDA when present,
    otherwise CPU; `backend` is ddp.backend (resolve_backend). Outside torchrun/srun it
    forms a group of one process, so `python train_multi_gpu_ddp.py` trains as one
    process, wrapped in DDP like every rank of a bigger job. `deterministic`: train.deterministic (use_device).
    """
    launch = read_launch_env()
    want_cuda = _parse_device(device).type == "cuda"
    backend = resolve_backend(backend, want_cuda)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if launch is None:
        dev = resolve_device(device)
        use_device(dev, deterministic)
        print(f"note: no torchrun or srun environment: training as one process on {dev}; for N GPUs "
              f"launch with: torchrun --nproc_per_node=N {os.path.basename(sys.argv[0])} ...", flush=True)
        # An in-process store: a group of one needs no address or port.
        _join(dict(backend=backend, rank=0, world_size=1, timeout=timeout,
                   store=dist.HashStore()), dev, rank=0)
        return DistInfo(device=dev, distributed=True)
    rank, world_size, local_rank = launch
    if want_cuda:
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
                            "lower --nproc_per_node")
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    use_device(dev, deterministic)
    if "MASTER_ADDR" not in os.environ:  # srun without torchrun: single-node default
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    kwargs = dict(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    store_libuv(os.environ, has_libuv)  # the Windows wheels have no libuv: the plain TCPStore then
    store = restart_store(world_size, timeout)
    if store is not None:
        kwargs["store"] = store
    _join(kwargs, dev, rank)
    local_world = _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE") or 1
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world,
                    device=dev, distributed=True)


def _join(kwargs, dev, rank):
    """init_process_group, with a busy or unreachable address as one `error:` line."""
    if kwargs["backend"] == "nccl":
        kwargs["device_id"] = dev  # binds NCCL to this GPU at once; no stray context on GPU 0
    try:
        try:
            dist.init_process_group(**kwargs)
        except TypeError:  # torch < 2.3 has no device_id
            kwargs.pop("device_id", None)
            dist.init_process_group(**kwargs)
    except RuntimeError as e:  # DistNetworkError, DistStoreError, ... (a busy port is the usual cause)
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise UserError(f"rank {rank} could not join the process group at {where}: "
                        f"{str(e).splitlines()[0]}; if the port is in use (another run?), pick a free "
                        "one: torchrun --master_port=PORT, or --standalone", exit_code=RUNTIME_EXIT) from None


@contextlib.contextmanager
def no_sync(model):
    """Gradient accumulation's non-final micro-batches: gradients only add up locally, with no
    all-reduce (DDP's no_sync) or reduce-scatter (FSDP2's set_requires_gradient_sync(False))."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def convert_sync_bn(model, enabled, device, verbose=True):
    """--syncBN: every BatchNorm becomes SyncBatchNorm (statistics over the global batch).

    PyTorch runs SyncBatchNorm on GPUs only, so on CPU the model keeps plain,
    per-process BatchNorm and (if `verbose`, i.e. on rank 0) one warning says so.
    """
    if not enabled:
        return model
    if device.type == "cuda":
        convert = torch.nn.SyncBatchNorm.convert_sync_batchnorm
        if any(type(m).__module__.startswith("timm.") for m in model.modules()):
            # timm's BatchNormAct2d is a BatchNorm2d with its activation inside: torch's converter would
            # make it a bare SyncBatchNorm and drop the activation; timm's keeps it (SyncBatchNormAct).
            from timm.layers import convert_sync_batchnorm as convert
        model = convert(model)
        if verbose:
            count = sum(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
            print(f"SyncBatchNorm: {count} BatchNorm layers now normalise over the global batch")
        return model
    if verbose:
        print("warning: --syncBN True ignored: PyTorch's SyncBatchNorm needs CUDA GPUs; "
              "continuing with per-process BatchNorm")
    return model


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def is_main_process():
    return get_rank() == 0


def barrier():
    if is_dist_avail_and_initialized():
        dist.barrier()


def reduce_value(value, average=True):
    """All-reduce a tensor over ranks (sum, or mean if `average`); identity on one process.

    Called by every rank. The tensor must live on the backend's device.
    """
    if not is_dist_avail_and_initialized():
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    if average:
        value /= dist.get_world_size()
    return value


def reduce_sums(sums):
    """{name: tensor} summed over all ranks in one all-reduce and read in one host copy: a float
    per 0-d tensor, a float64 CPU tensor of its shape for the others. Called by every rank."""
    flat = reduce_value(torch.cat([v.double().reshape(-1) for v in sums.values()]), average=False).cpu()
    out, at = {}, 0
    for name, value in sums.items():
        part = flat[at:at + value.numel()]
        at += value.numel()
        out[name] = part.item() if value.dim() == 0 else part.view(value.shape)
    return out


def reduce_min(value):
    """Element-wise minimum over ranks; identity on one process. Called by every rank."""
    if not is_dist_avail_and_initialized():
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return value


def any_rank(flag, device):
    """True on every rank if `flag` is true on at least one (one all-reduce)."""
    t = torch.tensor(1.0 if flag else 0.0, device=device)
    return bool(reduce_value(t, average=False).item() > 0)


def gather_objects(obj):
    """Every rank's Python object, as a list indexed by rank, on every rank; [obj] on one process."""
    if not is_dist_avail_and_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_buffers(model, src=0):
    """Rank `src`'s buffers (BatchNorm running statistics) on every rank. Called by every rank.

    Used before evaluation: the ranks' statistics drift apart in training (each updates
    them from its own batches), and the checkpoint holds rank 0's. DDP would broadcast them
    itself in its first forward after training, but a rank with no validation batch (fewer
    images than processes) never makes that forward, and the others would wait forever; so
    it is done here, and DDP is told it is done.
    """
    if not is_dist_avail_and_initialized():
        return
    for buf in model.buffers():
        dist.broadcast(buf.data, src)
    for module in model.modules():
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module.require_forward_param_sync = False  # the state DDP itself leaves after a no-grad forward


def broadcast_object(obj, src=0):
    """Rank `src`'s Python object on every rank (e.g. the run directory name)."""
    if not is_dist_avail_and_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def cleanup():
    """Destroy the process group, so that gloo's worker threads end while the interpreter is alive.

    The threads end only when the group object is freed. One still running at exit that drops a
    collective's tensor takes the GIL during finalization and aborts the process ("terminate called
    without an active exception"). FSDP2 models sit in reference cycles, and DTensor's caches keep
    their device meshes, which hold the group: collect the cycles, then let go of the meshes' groups
    (eager DTensor looks groups up by name; the mesh's copy serves torch.compile's tracing only).
    """
    if not is_dist_avail_and_initialized():
        return
    gc.collect()
    dist.destroy_process_group()
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    mesh_type = getattr(mesh_module, "DeviceMesh", None)
    if isinstance(mesh_type, type):
        for obj in gc.get_objects():
            if mesh_type in type(obj).__mro__ and isinstance(getattr(obj, "_pg_registry", None), dict):
                obj._pg_registry.clear()
