"""Peak GPU memory and speed per process, DDP vs FSDP, and the largest torchvision model that trains.

    torchrun --nproc_per_node=N tools/fsdp_memory.py --out-dir DIR        # tools/gpu_checks.sh's last step
    torchrun --nproc_per_node=2 tools/fsdp_memory.py --quick --out-dir DIR  # CPU rehearsal: tiny sizes

An out-of-memory error on one rank only, in the middle of a collective, leaves the others waiting:
gpu_checks.sh's step limit ends that. (With equal shares the ranks run out together.)

Part 1: vit_l_16 at 224 px, batch 32 per process, AdamW, bf16 autocast, wrapped as
train_multi_gpu_ddp.py and train_multi_gpu_fsdp.py wrap it (DDP(...), utils.fsdp.shard_model),
--steps timed steps after --warmup: torch.cuda.max_memory_allocated per process and img/s over
all processes. Part 2: the --ladder models in order, each at the same sizes under both
wrappings, until both run out of memory; the last one each wrapping trained is its largest.
The inputs are random tensors: what is measured is the model's step, not the data path.
Rank 0 writes DIR/fsdp_memory.json and .md.
"""
import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model import create_model  # noqa: E402
from utils.distributed_utils import cleanup, init_distributed_mode, reduce_value  # noqa: E402
from utils.fsdp import make_mesh, shard_model  # noqa: E402

LADDER = "vit_b_16,vit_l_16,vit_h_14,regnet_y_128gf"  # torchvision's largest classifiers, in size order


def one_run(name, wrap, args, info):
    """{peak_gib, img_per_s, params} of `steps` AdamW steps, or {"error": ...} (out of memory included)."""
    device, cuda = info.device, info.device.type == "cuda"
    torch.manual_seed(0)
    model = create_model(name, num_classes=1000, img_size=args.size).to(device)
    params = sum(p.numel() for p in model.parameters())
    if wrap == "ddp":
        model = DDP(model, device_ids=[device.index] if cuda else None)
    else:
        model = shard_model(model, make_mesh(device, info.world_size),
                            amp_dtype=torch.bfloat16 if cuda else None, verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images = torch.randn(args.batch, 3, args.size, args.size, device=device)
    labels = torch.randint(0, 1000, (args.batch,), device=device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            torch.cuda.synchronize(device) if cuda else None
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device) if cuda else None
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else float("nan")
    return {"params": params, "peak_gib": round(peak, 2),  # rank 0's; every rank holds the same share
            "img_per_s": round(args.batch * args.steps * info.world_size / seconds, 1)}


def measured(name, wrap, args, info):
    """one_run, with out-of-memory (on any rank) as a result; every rank agrees on it."""
    try:
        result = one_run(name, wrap, args, info)
        failed = 0.0
    except torch.cuda.OutOfMemoryError as e:
        result, failed = {"error": "out of memory: " + str(e).splitlines()[0][:120]}, 1.0
    # An FSDP2 model sits in reference cycles and outlives one_run: without a collection the next
    # size would start with this one's parameters and optimizer state still allocated.
    gc.collect()
    torch.cuda.empty_cache() if info.device.type == "cuda" else None
    if reduce_value(torch.tensor(failed, device=info.device), average=False).item() and "error" not in result:
        result = {"error": "out of memory on another rank"}
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="runs/fsdp_memory")
    p.add_argument("--model", default="vit_l_16")
    p.add_argument("--ladder", default=LADDER)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="CPU rehearsal: mobilenet_v3_small, batch 2, 32 px")
    args = p.parse_args()
    if args.quick:
        args.model, args.ladder, args.batch, args.size, args.steps, args.warmup = ("mobilenet_v3_small",
                                                                                "mobilenet_v3_small", 2, 32, 1, 1)
    info = init_distributed_mode("auto")
    rows = [{"model": args.model, "wrap": w, **measured(args.model, w, args, info)} for w in ("ddp", "fsdp")]
    largest, trains = {}, {"ddp": True, "fsdp": True}
    for name in args.ladder.split(","):
        for wrap in [w for w, ok in trains.items() if ok]:
            row = {"model": name, "wrap": wrap, "ladder": True, **measured(name, wrap, args, info)}
            rows.append(row)
            trains[wrap] = "error" not in row
            largest[wrap] = name if trains[wrap] else largest.get(wrap)
        if not any(trains.values()):
            break
    if info.rank == 0:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        setup = {"gpus": info.world_size, "device": torch.cuda.get_device_name(info.device) if
                 info.device.type == "cuda" else "cpu", "torch": torch.__version__, "batch_per_process": args.batch,
                 "img_size": args.size, "steps": args.steps, "optimizer": "AdamW", "amp": "bf16"}
        (out / "fsdp_memory.json").write_text(json.dumps({"setup": setup, "rows": rows, "largest": largest}, indent=2))
        lines = [f"{setup['gpus']} x {setup['device']}, torch {setup['torch']}, batch {args.batch} per process, "
                 f"{args.size} px, AdamW, bf16", "", "| model | wrap | params | peak GiB per GPU | img/s |",
                 "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['wrap']} | {r.get('params', '-')} | {r.get('peak_gib', '-')} | "
                  f"{r.get('img_per_s', r.get('error'))} |" for r in rows]
        lines += ["", "largest that trains: " + ", ".join(f"{w} {m}" for w, m in largest.items())]
        (out / "fsdp_memory.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
    cleanup()  # frees the last FSDP state before the group, so gloo's threads end before the interpreter


if __name__ == "__main__":
    main()
