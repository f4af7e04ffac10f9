"""Worker for tests/test_parallel_semantics.py: one launch checks several parallel properties.

    python -m torch.distributed.run --nproc_per_node=2 tests/_ddp_worker.py OUT IMAGE_ROOT
    python -m torch.distributed.run --nproc_per_node=3 tests/_ddp_worker.py OUT IMAGE_ROOT --also-world 2 PORT
    python -m torch.distributed.run --nproc_per_node=2 tests/_ddp_worker.py OUT IMAGE_ROOT --syncbn-gpu
    python -m torch.distributed.run --nproc_per_node=4 tests/_ddp_worker.py OUT IMAGE_ROOT --global-batch PORT

Every rank runs the project's own code (init_distributed_mode, split_dataset,
epoch_sampler, ShardSampler, make_loader, DDP, fit, evaluate) and writes what
it saw to OUT/rank<R>.json; the test compares ranks with each other and with
single-process runs of the same functions (imported from this file).
Not a product file: the template never imports it.
"""
import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import data  # noqa: E402
import model as model_module  # noqa: E402
from data import build_datasets, make_loader, split_dataset  # noqa: E402
from model import build_model  # noqa: E402
from utils.config import load_config  # noqa: E402
from utils.distributed_utils import DistInfo, cleanup, convert_sync_bn, init_distributed_mode  # noqa: E402
from utils.samplers import ShardSampler, epoch_sampler  # noqa: E402
import engine  # noqa: E402
from engine import evaluate  # noqa: E402
from run import fit  # noqa: E402
from utils.errors import UserError  # noqa: E402

PER_RANK_BATCH = 2      # DDP batch per process in the gradient test; the single run uses world x this
TRAIN_LR = 0.05         # optim.lr of the DDP run; scale_lr makes it world x this
TINY_TRAIN, TINY_VAL = 24, 7   # 24 = whole steps for world 2 and 3; 7 val samples: not divisible by either
EVAL_BATCHES = (1, 4)   # batch 1: each logit computed alone, so losses compare to float64 rounding


class TinyNet(nn.Sequential):
    """Conv net with GroupNorm: no batch statistics, so a sample's gradient does not depend on
    which other samples share its batch. With BatchNorm each DDP rank normalises over its own
    b samples, by design not over 2b, and "DDP == one big batch" would not hold exactly."""

    def __init__(self, num_classes=5):
        super().__init__(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))


def unaugmented_transforms(*args, **kwargs):
    """data.build_transforms with the validation transform for training too: the random crop and flip
    draw from a stream per rank, so they differ between world sizes (docs/parallelism.md)."""
    _, val = _BUILD_TRANSFORMS(*args, **kwargs)
    return val, val


_BUILD_TRANSFORMS = data.build_transforms
GLOBAL_BATCH, GB_BATCH = 8, 2   # train.global_batch and --batch-size of tests/test_global_batch.py's runs


def global_batch_args(image_root, run_dir, *extra):
    """A run of the entry scripts with train.global_batch=8 on TinyNet (model.name=tiny_gn): two epochs of
    two steps over 16 training images, epoch_001.pt kept for the elastic restart."""
    return ["--data-path", str(image_root), "--output-dir", str(run_dir), "--device", "cpu", "model.name=tiny_gn",
            "data.img_size=32", "data.val_resize=36", "data.num_workers=0", "train.epochs=2", "train.log_every=1",
            "train.figures=false", "train.amp=off", "train.keep_last=2", "optim.lr=0.05",
            f"train.batch_size={GB_BATCH}", f"train.global_batch={GLOBAL_BATCH}", *map(str, extra)]


def use_plain_tiny_net(patch):
    """What the global-batch runs train: TinyNet (no batch statistics), on unaugmented inputs; `patch`:
    a pytest MonkeyPatch."""
    patch.setitem(model_module.MODELS, "tiny_gn", lambda num_classes: TinyNet(num_classes))
    patch.setattr(data, "build_transforms", unaugmented_transforms)


def global_batch_runs(out, image_root, port):
    """train_multi_gpu_ddp.py's own main() with train.global_batch at this launch's world size (4:
    accumulation 1), then in ranks 0 and 1 as a group of 2 (accumulation 2): OUT/world4, OUT/world2."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_multi_gpu_ddp", REPO / "train_multi_gpu_ddp.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    import pytest
    use_plain_tiny_net(pytest.MonkeyPatch())  # for the life of this process
    world = int(os.environ["WORLD_SIZE"])
    sys.argv = ["train_multi_gpu_ddp.py"]
    script.main(global_batch_args(image_root, out / f"world{world}"))  # cli_entry leaves no group behind
    if fewer_env(2, port):
        script.main(global_batch_args(image_root, out / "world2"))


class RecordingSet(Dataset):
    """Fixed tensors (no random augmentation, which is seeded per rank) that log each index read."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(n) % 5
        self.images = torch.randn(n, 3, 12, 12, generator=g) + self.labels.view(-1, 1, 1, 1) * 0.3
        self.seen = []

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return self.images[i], int(self.labels[i])


def fit_tiny(dist_info, run_dir, batch_size, lr, epochs=2, accum=1, log_every=2, resume=None):
    """The project's fit() on TinyNet, DDP-wrapped when distributed; returns what the ranks saw."""
    cfg = load_config(["--device", "cpu", "data.num_workers=0", f"train.epochs={epochs}",
                       f"train.batch_size={batch_size}", f"optim.lr={lr}", "optim.scale_lr=true",
                       f"train.log_every={log_every}", f"train.accum_steps={accum}", "--output-dir", str(run_dir)]
                      + (["--resume", resume] if resume else []))
    world, rank, device = dist_info.world_size, dist_info.rank, dist_info.device
    train_set, val_set = RecordingSet(TINY_TRAIN, seed=1), RecordingSet(TINY_VAL, seed=2)
    train_loader = make_loader(train_set, batch_size, epoch_sampler(train_set, cfg.train.seed, world, rank),
                               cfg.data, device, train=True)
    val_loader = make_loader(val_set, batch_size, ShardSampler(val_set, world, rank), cfg.data, device,
                             train=False)
    torch.manual_seed(cfg.train.seed)
    model = TinyNet().to(device)
    buckets = []  # the index of each gradient bucket DDP all-reduces, in order
    if dist_info.distributed:
        model = DDP(model)

        def counting_allreduce(state, bucket):
            buckets.append(bucket.index())
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_allreduce)
    result = fit(cfg, model, train_loader, val_loader, [str(c) for c in range(5)], dist_info, script_name="t")
    return {"seen": train_set.seen, "steps_per_epoch": len(train_loader) // accum, "last": result["last"],
            "allreduced_buckets": buckets}


def fit_accumulated(dist_info, out):
    """fit_tiny with train.accum_steps=2 straight through, and again stopped by a SIGTERM on rank 0
    in the middle of epoch 2 (between the micro-batches of a step) and resumed from its last.pt."""
    straight = fit_tiny(dist_info, out / "accum", PER_RANK_BATCH, TRAIN_LR, accum=2, log_every=1)
    calls = [0]

    def signal_in_epoch_2(images, labels):  # a training batch
        calls[0] += 1
        if dist_info.rank == 0 and calls[0] == straight["steps_per_epoch"] * 2 + 1:
            os.kill(os.getpid(), signal.SIGTERM)

    hook = engine.register_batch_hook(signal_in_epoch_2)
    try:
        fit_tiny(dist_info, out / "accum_resumed", PER_RANK_BATCH, TRAIN_LR, accum=2, log_every=1)
        stopped_at = None
    except (UserError, SystemExit):
        ckpt = torch.load(out / "accum_resumed" / "checkpoints" / "last.pt", weights_only=True)
        stopped_at = [ckpt["epoch"], ckpt["epoch_step"], ckpt["global_step"]]
    finally:
        hook.remove()
    fit_tiny(dist_info, out / "accum_resumed", PER_RANK_BATCH, TRAIN_LR, accum=2, log_every=1, resume="auto")
    return {**straight, "stopped_at": stopped_at}


def eval_fixed(dist_info, image_root):
    """evaluate() of one fixed resnet18 on the validation split, sharded as train_multi_gpu_ddp.py does,
    at each of EVAL_BATCHES."""
    cfg = load_config(["--device", "cpu", "model.name=resnet18", "data.img_size=32", "data.val_resize=36",
                       "data.num_workers=0", "--data-path", str(image_root)])
    world, rank, device = dist_info.world_size, dist_info.rank, dist_info.device
    _, val_set, classes = build_datasets(cfg.data)
    torch.manual_seed(0)  # the same weights in every process (DDP would broadcast rank 0's anyway)
    model = build_model(cfg.model, len(classes), device, verbose=False)
    if dist_info.distributed:
        model = DDP(model)
        # As after training: BatchNorm statistics differ between ranks (each saw its own batches).
        # evaluate() must use rank 0's, the checkpointed ones the one-process reference has.
        for name, buf in model.module.named_buffers():
            if rank and name.endswith(("running_mean", "running_var")):
                buf.add_(0.5 * rank)
    results = {}
    # First a single image, so some ranks have no validation batch at all, while DDP still owes
    # its first-forward buffer broadcast (as after every training epoch).
    for name, batch, images in [("one", 4, Subset(val_set, [3]))] + [(str(b), b, val_set) for b in EVAL_BATCHES]:
        loader = make_loader(images, batch, ShardSampler(images, world, rank), cfg.data, device, train=False)
        out = evaluate(model, loader, device, len(classes))
        out.pop("val_seconds")
        results[name] = {**out, "val_size": len(images)}
    return results


def buffer_sync(dist_info):
    """Six DDP steps of a BatchNorm net with the configured ddp options, and again with
    ddp.broadcast_buffers=true: this rank's weights and buffers after them, and how many buffer
    broadcasts the steps made (DDP's init sync is done before counting)."""
    import torch.distributed as dist
    from utils.distributed_utils import ddp_kwargs
    report = {}
    for name, overrides in (("configured", []), ("broadcast", ["ddp.broadcast_buffers=true"])):
        cfg = load_config(["--device", "cpu"] + overrides)
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(4, 5)), **ddp_kwargs(cfg.ddp))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        broadcasts, real = [0], dist._broadcast_coalesced

        def counting(*args, **kwargs):
            broadcasts[0] += 1
            return real(*args, **kwargs)

        dist._broadcast_coalesced = counting
        try:
            g = torch.Generator().manual_seed(100 + dist_info.rank)  # each rank its own batches
            for _ in range(6):
                images, labels = torch.randn(4, 3, 8, 8, generator=g) * 3, torch.randint(0, 5, (4,), generator=g)
                nn.functional.cross_entropy(model(images), labels).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            dist._broadcast_coalesced = real
        report[name] = {"state": {k: v.tolist() for k, v in model.module.state_dict().items()},
                        "broadcasts": broadcasts[0]}
    return report


def split_and_shards(dist_info, image_root):
    """This rank's view of the split and of its training shards in epochs 0, 1 and 0 again."""
    split = split_dataset(load_config([f"data.path={image_root}"]).data)
    world, rank = dist_info.world_size, dist_info.rank
    shards = []
    for epoch in (0, 1, 0):
        sampler = epoch_sampler(split.train, 0, world, rank)  # a fresh sampler: reproducible from the seed
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return {"classes": split.classes, "train": list(split.train), "val": list(split.val), "n_train": len(split.train),
            "shards": shards}


def syncbn_gpu(dist_info):
    """Two processes share one GPU over gloo (NCCL refuses two ranks on one device)."""
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    global_batch = torch.randn(4, 3, 5, 5, device=device) * 2 + 1   # the same 4 samples on every rank
    bn = convert_sync_bn(nn.Sequential(nn.BatchNorm2d(3)), True, device).to(device)
    mine = global_batch[2 * dist_info.rank: 2 * dist_info.rank + 2].clone().requires_grad_()
    out = bn(mine)
    out.square().sum().backward()
    resnet = convert_sync_bn(build_model(load_config(["model.name=resnet34"]).model, 5, device, verbose=False),
                             True, device)
    return {"out": out.detach().cpu().tolist(), "grad_in": mine.grad.cpu().tolist(),
            "running_mean": bn[0].running_mean.cpu().tolist(), "running_var": bn[0].running_var.cpu().tolist(),
            "resnet34_sync_bn": sum(isinstance(m, nn.SyncBatchNorm) for m in resnet.modules()),
            "resnet34_plain_bn": sum(type(m) is nn.BatchNorm2d for m in resnet.modules())}


def report(dist_info, out, image_root):
    return {
        "rank": dist_info.rank, "world_size": dist_info.world_size,
        "split": split_and_shards(dist_info, image_root),
        "eval": eval_fixed(dist_info, image_root),
        "fit": fit_tiny(dist_info, out / "fit", PER_RANK_BATCH, TRAIN_LR),
        "accum": fit_accumulated(dist_info, out),
        "buffers": buffer_sync(dist_info),
    }


def join_fewer(world, port):
    """Ranks below `world` of this launch form a group of `world` through the project's own
    init_distributed_mode, as if torchrun had started `world` processes: its variables say so, and
    rank 0 serves the group's store on `port` (torchrun's store stays the first group's). The others
    leave. One launch then serves two world sizes: each process's torch start-up is what costs."""
    if not fewer_env(world, port):
        return None
    return init_distributed_mode("cpu", timeout_minutes=1)


def fewer_env(world, port):
    """join_fewer's variables for a group of `world` on `port`; False for a rank outside it."""
    if int(os.environ["RANK"]) >= world:
        return False
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_PORT=str(port))
    return True


def main(argv):
    out, image_root = Path(argv[0]), argv[1]
    # --also-world W PORT: after the launch's own world, its first W ranks run every check again as
    # a group of W (its store on PORT), reporting under OUT/world<W>/.
    also = [int(a) for a in argv[argv.index("--also-world") + 1:][:2]] if "--also-world" in argv else None
    if "--global-batch" in argv:  # the entry script forms (and leaves) its own groups
        return global_batch_runs(out, image_root, int(argv[argv.index("--global-batch") + 1]))
    # A short timeout turns a collective that only some ranks reach into a failure, not a hang.
    dist_info = init_distributed_mode("cpu", timeout_minutes=1)
    try:
        if "--syncbn-gpu" in argv:
            result = syncbn_gpu(dist_info)
        else:
            result = report(dist_info, out, image_root)
    finally:
        cleanup()
    (out / f"rank{dist_info.rank}.json").write_text(json.dumps(result))
    if also:
        dist_info = join_fewer(*also)
        if dist_info is not None:
            smaller = out / f"world{also[0]}"
            smaller.mkdir(exist_ok=True)
            try:
                result = report(dist_info, smaller, image_root)
            finally:
                cleanup()
            (smaller / f"rank{dist_info.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
