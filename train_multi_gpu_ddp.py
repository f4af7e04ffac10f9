"""Train with DistributedDataParallel: one process per GPU, launched by torchrun.

    torchrun --nproc_per_node=8 train_multi_gpu_ddp.py --syncBN True
    torchrun --nproc_per_node=2 train_multi_gpu_ddp.py --config configs/demo.yaml   # CPU works too (gloo)
    # two machines, 8 GPUs each; run on both, with --node_rank 0 and 1:
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=HOST0:29400 train_multi_gpu_ddp.py --output-dir runs/big

Each process loads its own shard of the data (DistributedSampler), runs its
own forward/backward, and DDP averages the gradients with an all-reduce, so
every replica takes the same step. --batch-size is per process: the global
batch is batch_size x world size, and optim.lr is scaled by the world size
(optim.scale_lr); train.global_batch=N fixes the global batch at N on any world
size instead (accumulating N / (batch_size x world size) batches per step, lr
optim.lr). Only rank 0 writes files and shows progress.
"""
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from data import build_datasets, make_loader
from model import build_model, sync_bn_wanted
from utils.cli import cli_entry
from utils.config import load_config
from utils.distributed_utils import convert_sync_bn, ddp_kwargs, init_distributed_mode
from utils.samplers import ShardSampler, epoch_sampler
from run import fit


@cli_entry
def main(argv=None):
    cfg = load_config(argv, description=__doc__.splitlines()[0])

    # -- device: this process's GPU (LOCAL_RANK), or the CPU with gloo; without torchrun, a group of one --
    dist_info = init_distributed_mode(cfg.train.device, timeout_minutes=cfg.ddp.timeout_minutes,
                                      backend=cfg.ddp.backend, deterministic=cfg.train.deterministic)
    device, rank, world = dist_info.device, dist_info.rank, dist_info.world_size
    torch.manual_seed(cfg.train.seed)  # same init everywhere; DDP also broadcasts rank 0's weights

    # -- data: a disjoint shard per rank, reshuffled each epoch (set_epoch in fit); exact, unpadded val shards --
    train_set, val_set, classes = build_datasets(cfg.data, eval_only=cfg.eval_only)
    train_sampler = epoch_sampler(train_set, cfg.train.seed, world, rank, kind=cfg.data.sampler)
    train_loader = make_loader(train_set, cfg.train.batch_size, train_sampler, cfg.data, device, train=True,
                               channels_last=cfg.model.channels_last)
    val_sampler = ShardSampler(val_set, world, rank)
    val_loader = make_loader(val_set, cfg.train.batch_size, val_sampler, cfg.data, device, train=False,
                               channels_last=cfg.model.channels_last)

    # -- model: SyncBN (CUDA only), then one DDP replica per process --
    model = build_model(cfg.model, len(classes), device, verbose=rank == 0, img_size=cfg.data.img_size,
                        channels=cfg.data.channels)
    sync_bn = sync_bn_wanted(model, cfg.model.sync_bn, verbose=rank == 0)  # not where no BatchNorm trains
    model = convert_sync_bn(model, sync_bn, device, verbose=rank == 0)
    # cfg.ddp less the process group's keys: buckets, broadcast_buffers, find_unused_parameters... (configs/default.yaml).
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs(cfg.ddp))

    return fit(cfg, model, train_loader, val_loader, classes, dist_info, script_name="ddp")  # cli_entry cleans up


if __name__ == "__main__":
    main(sys.argv[1:])
