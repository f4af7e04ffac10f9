"""Worker for tests/test_fsdp.py: one launch checks FSDP2 against DDP and itself.

    python -m torch.distributed.run --nproc_per_node=2 tests/_fsdp_worker.py OUT [SCRIPTS.json]

SCRIPTS.json, if given, lists entry-script runs ([script, [args...]]) that every rank first makes
through the script's main(), in order, as the launched script would: one torch start-up for them
all. Then every rank trains the same tiny models with the project's own code (init_distributed_mode,
utils/fsdp.py's shard_model and checkpoint_blocks, engine.train_one_epoch with its accumulation
and clipping) once under DDP and once sharded, and writes what it found to OUT/rank<R>.json.
Not a product file: the template never imports it.
"""
import importlib
import json
import sys
from pathlib import Path

import torch
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import Step, evaluate, train_one_epoch  # noqa: E402
from utils.distributed_utils import broadcast_buffers, broadcast_object, cleanup, init_distributed_mode  # noqa: E402
from utils import distributed_utils, fsdp  # noqa: E402
from utils.fsdp import checkpoint_blocks, full_state_dict, load_full_state_dict, make_mesh, shard_model  # noqa: E402
from utils.optim import build_scaler  # noqa: E402

CLASSES = 4  # even: every parameter of the ResNet has an even first dimension, so it halves exactly


def resnet():
    torch.manual_seed(0)
    return torchvision.models.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=CLASSES)


def vit():
    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                                hidden_dim=16, mlp_dim=32, num_classes=CLASSES)


def batches(rank, n=4, size=16):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(2, 3, size, size, generator=g), torch.randint(0, CLASSES, (2,), generator=g))
            for _ in range(n)]


def train(model, opt, rank, accum, clip, channels_last=False, size=16):
    """engine.train_one_epoch over this rank's 4 batches: 4 / accum optimizer steps."""
    opt = opt(model.parameters())
    step = Step(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                scaler=build_scaler(None, torch.device("cpu")), device=torch.device("cpu"),
                accum_steps=accum, clip_grad_norm=clip, channels_last=channels_last)
    train_one_epoch(step, batches(rank, size=size), epoch=0)
    return opt


def groups(model):
    """The sharded model's FSDP groups: each is one all-gather and one reduce-scatter per pass."""
    states = [fsdp.fully_shard.state(m) for m in model.modules() if isinstance(m, fsdp.FSDPModule)]
    return len({id(s._fsdp_param_group) for s in states if s._fsdp_param_group is not None})


def state_of(model):
    """Rank 0's full weights and buffers as a plain state dict (every rank calls); copies: on the CPU
    full_state_dict hands out the module's own buffers, which the next training forward changes."""
    state = model.module.state_dict() if isinstance(model, DDP) else full_state_dict(model)
    return {k: v.detach().clone() for k, v in state.items()}


def differing(a, b):
    return [k for k in a if not torch.equal(a[k], b[k])] if a.keys() == b.keys() else ["keys differ"]


def local_numels(tensors):
    return sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in tensors)


def chunk_rows(rows, world, rank):
    """The rows of rank's first-dimension shard as torch.chunk cuts them (FSDP2's split): the last ranks
    get fewer, or none (a ViT's class token has one row)."""
    parts = torch.arange(rows).chunk(world)
    return len(parts[rank]) if rank < len(parts) else 0


def own_key_space(name, store=distributed_utils.restart_store):
    """restart_store with a key space of its own in torchrun's store, as a restart's is: each process group
    after the first would find the group before's gloo addresses under the same keys."""
    def keyed(*args):
        agent = store(*args)
        return None if agent is None else torch.distributed.PrefixStore(name, agent)
    distributed_utils.restart_store = keyed


def run_scripts(listing):
    """Each entry script's main() as `python script args` would call it; their exit codes."""
    codes = []
    for i, (script, args) in enumerate(listing):
        own_key_space(f"script_{i}")
        sys.argv = [script, *args]
        try:
            importlib.import_module(Path(script).stem).main(args)
            codes.append(0)  # the script's exit status: main's return value is not it
        except SystemExit as e:
            codes.append(e.code)
        sys.stdout.flush()
    own_key_space("worker")
    return codes


def main(out, scripts=None):
    codes = run_scripts(json.loads(Path(scripts).read_text())) if scripts else []
    info = init_distributed_mode("cpu")
    rank, world, mesh = info.rank, info.world_size, make_mesh(info.device, info.world_size)
    found = {"script_codes": codes}
    adamw = lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.05)  # noqa: E731
    sgd = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4)  # noqa: E731

    # 1. FSDP == DDP: a BatchNorm ResNet (AdamW, 2 micro-batches per step), a ViT (SGD) and the ViT clipped.
    for name, build, opt, accum, clip in (("resnet", resnet, adamw, 2, 0.0), ("vit", vit, sgd, 1, 0.0),
                                          ("vit_clipped", vit, sgd, 1, 0.01)):
        ddp = DDP(build())
        train(ddp, opt, rank, accum, clip)
        sharded = shard_model(build(), mesh, verbose=False)
        optimizer = train(sharded, opt, rank, accum, clip)
        a, b = state_of(ddp), state_of(sharded)
        found[f"{name}_differ"] = differing(a, b) if rank == 0 else []
        # Clipping's total norm adds the shards' norms in another order: equal up to rounding only.
        found[f"{name}_max_relative"] = max(((x - b[k]).abs().max() / x.abs().max().clamp(min=1e-12)).item()
                                            for k, x in a.items() if x.is_floating_point()) if rank == 0 else 0.0
        found[f"{name}_tensors"] = len(a)
        # 2. Each rank's shares: the first-dimension chunk of every parameter, its gradient and AdamW state.
        params = list(sharded.parameters())
        found[f"{name}_local_params"] = local_numels(params)
        found[f"{name}_full_params"] = sum(p.numel() for p in params)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        found[f"{name}_chunks_ok"] = all(mine.shape[0] == chunk_rows(p.shape[0], world, rank)
                                         for p, mine in zip(params, local))
        if name == "resnet":
            found["optimizer_local"] = {k: local_numels(optimizer.state[p][k] for p in params)
                                        for k in ("exp_avg", "exp_avg_sq")}
            images, labels = batches(rank)[0]
            torch.nn.functional.cross_entropy(sharded(images), labels).backward()
            found["grad_local"] = local_numels(p.grad for p in params)
            fsdp_model, trained = sharded, b
        if name == "vit":
            # Exact evaluation with 2 validation batches on rank 0 and 1 on rank 1: every sharded forward is
            # a collective, so rank 1 must make a second one; the result is DDP's, to the bit.
            val = batches(10 + rank, n=2 - rank)
            found["eval_equal"] = evaluate(sharded, val, info.device, CLASSES) | {"val_seconds": 0} == \
                evaluate(ddp, val, info.device, CLASSES) | {"val_seconds": 0}

    # 3. The full state loads strict into a plain torchvision model: its eval output is the sharded model's.
    images = batches(0)[0][0]
    broadcast_buffers(fsdp_model)  # the full state holds rank 0's BatchNorm statistics
    full = state_of(fsdp_model)
    with torch.no_grad():
        sharded_out = fsdp_model.eval()(images)
        reloaded = shard_model(resnet(), mesh, verbose=False)
        # full_state_dict hands rank 0 alone the tensors; every rank loads them.
        load_full_state_dict(reloaded, broadcast_object(full if rank == 0 else None))
        reloaded_out = reloaded.eval()(images)
    if rank == 0:
        plain = resnet()
        plain.load_state_dict(full, strict=True)
        found["plain_equal"] = torch.equal(plain.eval()(images), sharded_out)
    found["reloaded_equal"] = torch.equal(reloaded_out, sharded_out)

    # 4. Activation checkpointing: the weights of run 1's ResNet, and BatchNorm counts each of the 4 forwards once.
    checkpointed = resnet()
    found["checkpointed_blocks"] = checkpoint_blocks(checkpointed)
    checkpointed = shard_model(checkpointed, mesh, verbose=False)
    train(checkpointed, adamw, rank, 2, 0.0)
    again = state_of(checkpointed)
    found["checkpointing_differ"] = differing(trained, again) if rank == 0 else []
    found["batches_tracked"] = int(again["bn1.num_batches_tracked"]) if rank == 0 else None

    # 5. bf16 compute with BatchNorm: BatchNorm keeps fp32 weights in its own group; the logits come out fp32.
    # With activation checkpointing too: a recomputed block gathers its BatchNorms' groups again.
    # 32 px, not 16: on a 1x1 input, oneDNN's bf16 weight gradient of a padded stride-2 3x3 convolution
    # (layer4.0.conv1 at 16 px) differs from call to call and is sometimes NaN, with or without FSDP.
    mixed = resnet()
    checkpoint_blocks(mixed)
    mixed = shard_model(mixed, mesh, amp_dtype=torch.bfloat16, verbose=False)
    train(mixed, sgd, rank, 2, 0.0, size=32)
    grouped, lists = state_of(mixed), fsdp.GROUP_LISTS
    logits = mixed.train()(batches(rank, size=32)[0][0])
    found["bf16_logits"] = str(logits.dtype)
    found["bf16_finite"] = bool(torch.isfinite(logits).all())
    found["bf16_bn_dtype"] = str(mixed.bn1.weight.dtype)
    # A block's BatchNorms share one fp32 group: the same weights as one group per BatchNorm (torch 2.4's way).
    fsdp.GROUP_LISTS = False
    alone = resnet()
    checkpoint_blocks(alone)
    alone = shard_model(alone, mesh, amp_dtype=torch.bfloat16, verbose=False)
    train(alone, sgd, rank, 2, 0.0, size=32)
    ungrouped = state_of(alone)  # every rank: a collective
    found["bf16_grouping_differ"] = differing(grouped, ungrouped) if rank == 0 else []
    fsdp.GROUP_LISTS = lists
    found["bf16_groups"] = groups(mixed)
    found["bf16_groups_resnet34"] = groups(shard_model(torchvision.models.resnet34(num_classes=CLASSES), mesh,
                                                       amp_dtype=torch.bfloat16, verbose=False))

    # 6. channels_last, as build_model leaves the model on CUDA: shard_model takes it (FSDP2 shards contiguous
    # parameters only) and trains it on channels_last batches, with NHWC convolutions, to DDP's weights on the
    # same batches. (DDP of the channels_last model itself is not the reference: other kernels, other rounding.)
    layouts = []
    ddp = DDP(resnet())
    train(ddp, sgd, rank, 1, 0.0, channels_last=True)
    sharded = shard_model(resnet().to(memory_format=torch.channels_last), mesh, verbose=False)
    nhwc = lambda t: t.is_contiguous(memory_format=torch.channels_last)  # noqa: E731
    sharded.register_forward_pre_hook(lambda m, args: layouts.append(("input", nhwc(args[0]))))
    sharded.conv1.register_forward_hook(lambda m, args, out: layouts.append(("conv1", nhwc(out))))
    train(sharded, sgd, rank, 1, 0.0, channels_last=True)
    found["channels_last_layouts"] = sorted(set(layouts))
    a, b = state_of(ddp), state_of(sharded)
    found["channels_last_differ"] = differing(a, b) if rank == 0 else []

    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:])
