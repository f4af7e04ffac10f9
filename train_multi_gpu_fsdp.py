"""Train with FSDP2 (fully_shard): one process per GPU, launched by torchrun, the model sharded.

    torchrun --nproc_per_node=8 train_multi_gpu_fsdp.py model.name=vit_l_16 optim.name=adamw
    torchrun --nproc_per_node=2 train_multi_gpu_fsdp.py --config configs/demo.yaml   # CPU works too (gloo)
    # two machines, 8 GPUs each; run on both, with --node_rank 0 and 1:
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=HOST0:29400 train_multi_gpu_fsdp.py --output-dir runs/big

The same as train_multi_gpu_ddp.py but for the wrapping: instead of a replica
per process, each process keeps 1/W of every parameter, gradient and optimizer
state (utils/fsdp.py), so a model too large for one GPU trains on several.
Data, batch size, lr scaling and the loop are DDP's, and on 2 processes the
weights after each step are DDP's, bit for bit (tests/test_fsdp.py).
Checkpoints are sharded (DCP) beside a full-weights last.pt (docs/resume.md).
"""
import sys

import torch

from data import build_datasets, make_loader
from model import build_model, sync_bn_wanted
from utils.cli import cli_entry
from utils.config import load_config
from utils.distributed_utils import convert_sync_bn, init_distributed_mode
from utils.fsdp import check_config, make_mesh, shard_model
from utils.samplers import ShardSampler, epoch_sampler
from utils.optim import resolve_amp
from run import fit


@cli_entry
def main(argv=None):
    cfg = load_config(argv, description=__doc__.splitlines()[0])

    # -- device: this process's GPU (LOCAL_RANK), or the CPU with gloo; without torchrun, a group of one --
    dist_info = init_distributed_mode(cfg.train.device, timeout_minutes=cfg.ddp.timeout_minutes,
                                      backend=cfg.ddp.backend, deterministic=cfg.train.deterministic)
    device, rank, world = dist_info.device, dist_info.rank, dist_info.world_size
    check_config(cfg, device)  # what FSDP cannot do here: one error line, before any data is read
    torch.manual_seed(cfg.train.seed)  # same init everywhere; shard_model also broadcasts rank 0's weights

    # -- data: a disjoint shard per rank, reshuffled each epoch (set_epoch in fit); exact, unpadded val shards --
    train_set, val_set, classes = build_datasets(cfg.data, eval_only=cfg.eval_only)
    train_sampler = epoch_sampler(train_set, cfg.train.seed, world, rank, kind=cfg.data.sampler)
    train_loader = make_loader(train_set, cfg.train.batch_size, train_sampler, cfg.data, device, train=True,
                               channels_last=cfg.model.channels_last)
    val_sampler = ShardSampler(val_set, world, rank)
    val_loader = make_loader(val_set, cfg.train.batch_size, val_sampler, cfg.data, device, train=False,
                               channels_last=cfg.model.channels_last)

    # -- model: SyncBN (CUDA only), then each block sharded over the mesh, then the root --
    model = build_model(cfg.model, len(classes), device, verbose=rank == 0, img_size=cfg.data.img_size,
                        channels=cfg.data.channels)
    sync_bn = sync_bn_wanted(model, cfg.model.sync_bn, verbose=rank == 0)  # not where no BatchNorm trains
    model = convert_sync_bn(model, sync_bn, device, verbose=rank == 0)
    # train.amp -> a MixedPrecisionPolicy (bf16 compute, fp32 reduction and BatchNorm); model.blocks names the units.
    # A channels_last model gets NCHW weights back (FSDP2 shards contiguous ones only); the batches stay channels_last.
    model = shard_model(model, make_mesh(device, world), amp_dtype=resolve_amp(cfg.train.amp, device),
                        names=cfg.model.blocks, verbose=rank == 0)

    return fit(cfg, model, train_loader, val_loader, classes, dist_info, script_name="fsdp")  # cli_entry cleans up


if __name__ == "__main__":
    main(sys.argv[1:])
