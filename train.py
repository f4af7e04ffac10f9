"""Train an image classifier on one device: one GPU, or the CPU.

    python train.py --config configs/demo.yaml                 # offline demo, no download
    python train.py --data-path data/flower_photos --epochs 30 # the real flower_photos
    python train.py --device cpu --batch-size 8 optim.lr=0.005 # any config key as key=value

For several GPUs see train_multi_gpu_ddp.py (recommended) and train_multi_gpu_dp.py.
Only the device, the model wrapping and the sampler are set here; the loop,
checkpoints, logging and config live in data.py, model.py, engine.py, run.py and utils/.
"""
import sys

import torch

from data import build_datasets, make_loader
from model import build_model
from utils.cli import cli_entry, refuse_launcher
from utils.config import load_config
from utils.distributed_utils import DistInfo, resolve_device, use_device
from utils.samplers import ShardSampler, epoch_sampler
from run import fit


@cli_entry
def main(argv=None):
    refuse_launcher("train.py")
    cfg = load_config(argv, description=__doc__.splitlines()[0])

    # -- device: exactly one, --device auto = CUDA if present --
    device = resolve_device(cfg.train.device)  # cuda:N or cpu
    use_device(device, cfg.train.deterministic)  # and how kernels are chosen (train.deterministic)
    dist_info = DistInfo(device=device)
    if cfg.model.sync_bn:
        print("note: --syncBN applies to the DDP and FSDP scripts only; one device keeps plain BatchNorm")
    torch.manual_seed(cfg.train.seed)

    # -- data: the whole training set on this one process, reshuffled every epoch --
    train_set, val_set, classes = build_datasets(cfg.data, eval_only=cfg.eval_only)
    train_sampler = epoch_sampler(train_set, cfg.train.seed, kind=cfg.data.sampler)
    train_loader = make_loader(train_set, cfg.train.batch_size, train_sampler, cfg.data, device, train=True,
                               channels_last=cfg.model.channels_last)
    val_sampler = ShardSampler(val_set)
    val_loader = make_loader(val_set, cfg.train.batch_size, val_sampler, cfg.data, device, train=False,
                               channels_last=cfg.model.channels_last)

    # -- model: no wrapper --
    model = build_model(cfg.model, len(classes), device, img_size=cfg.data.img_size, channels=cfg.data.channels)

    return fit(cfg, model, train_loader, val_loader, classes, dist_info, script_name="train")


if __name__ == "__main__":
    main(sys.argv[1:])
