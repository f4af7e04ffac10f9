"""Worker for tests/test_fsdp.py: every family with a BatchNorm that is a block by itself, sharded.

    python -m torch.distributed.run --nproc_per_node=2 tests/_fsdp_families_worker.py OUT

Each rank shards each model with utils/fsdp.py's shard_model at fp32 and at bf16 (BatchNorm in its
fp32 group), makes one forward and backward step on a 32 px batch, and writes, per model and dtype,
"ok" or the one-line reason it raised, to OUT/rank<R>.json. One launch for every family: a torch
start-up per family would cost more than the steps. Not a product file.
"""
import json
import sys
from pathlib import Path

import torch
import torchvision

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from utils.distributed_utils import cleanup, init_distributed_mode  # noqa: E402
from utils.fsdp import make_mesh, shard_model  # noqa: E402

CLASSES = 4
TORCHVISION = ("regnet_y_400mf", "vgg11_bn", "densenet121", "shufflenet_v2_x0_5", "mnasnet0_5")
TIMM = ("densenet121", "vgg11_bn")


def builders():
    for name in TORCHVISION:
        yield f"torchvision.{name}", lambda n=name: torchvision.models.get_model(n, num_classes=CLASSES)
    try:
        import timm
    except ImportError:
        return
    for name in TIMM:
        yield f"timm.{name}", lambda n=name: timm.create_model(n, pretrained=False, num_classes=CLASSES)


def step(build, mesh, dtype, rank):
    torch.manual_seed(0)
    model = shard_model(build(), mesh, amp_dtype=dtype, verbose=False).train()
    g = torch.Generator().manual_seed(rank)
    images, labels = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, CLASSES, (2,), generator=g)
    logits = model(images)
    torch.nn.functional.cross_entropy(logits.float(), labels).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads), "a parameter got no gradient"
    assert torch.isfinite(logits.float()).all(), "logits not finite"
    return "ok"


def main(out):
    info = init_distributed_mode("cpu")
    mesh = make_mesh(info.device, info.world_size)
    found = {}
    for name, build in builders():
        for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            try:
                found[f"{name}/{label}"] = step(build, mesh, dtype, info.rank)
            except Exception as e:  # the reason, on one line, and on to the next family
                found[f"{name}/{label}"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    Path(out, f"rank{info.rank}.json").write_text(json.dumps(found))
    cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:])
