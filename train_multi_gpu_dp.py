"""Train on every visible GPU of one machine with nn.DataParallel (one process, one thread per GPU).

    python train_multi_gpu_dp.py --config configs/demo.yaml
    CUDA_VISIBLE_DEVICES=0,1 python train_multi_gpu_dp.py --batch-size 32
    python train_multi_gpu_dp.py --device cuda:1    # outputs gathered on GPU 1; every visible GPU still used

--batch-size is the GLOBAL batch: each step scatters it over the GPUs, so it
must be at least the number of GPUs (train.global_batch=N accumulates N / batch_size of them). DataParallel is the easy path, not the
fast one: the first GPU gathers outputs and holds extra memory, and one Python
process drives all GPUs. Prefer train_multi_gpu_ddp.py. Without a GPU
(or with --device cpu) it trains on the CPU without the wrapper.
"""
import sys

import torch
from torch import nn

from data import build_datasets, make_loader
from model import build_model
from utils.cli import cli_entry, refuse_launcher
from utils.config import load_config
from utils.distributed_utils import DistInfo, resolve_device, use_device
from utils.samplers import ShardSampler, epoch_sampler
from run import fit
from utils.errors import UserError
from utils.optim import resolve_amp


class AutocastForward(torch.nn.Module):
    """Runs `module` under autocast(dtype) inside its own forward.

    DataParallel runs each GPU's replica in a thread of its own, and autocast's
    dtype is per thread: the replicas would compute in fp16 (CUDA's default)
    while bf16 was chosen and the GradScaler is off.
    """

    def __init__(self, module, dtype, device_type="cuda"):
        super().__init__()
        self.module, self.dtype, self.device_type = module, dtype, device_type

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.module(*args, **kwargs)


@cli_entry
def main(argv=None):
    refuse_launcher("train_multi_gpu_dp.py")
    cfg = load_config(argv, description=__doc__.splitlines()[0])

    # -- device: all visible GPUs, outputs gathered on the first: --device cuda:N's GPU, then the others --
    device = resolve_device(cfg.train.device)
    gpu_ids = [device.index] + [i for i in range(torch.cuda.device_count()) if i != device.index] \
        if device.type == "cuda" else []
    if len(gpu_ids) > cfg.train.batch_size:
        raise UserError(f"--batch-size {cfg.train.batch_size} is smaller than the {len(gpu_ids)} GPUs "
                        "DataParallel splits it over; use at least one image per GPU")
    if gpu_ids:
        device = torch.device("cuda", gpu_ids[0])
    use_device(device, cfg.train.deterministic)  # and how kernels are chosen (train.deterministic)
    dist_info = DistInfo(device=device)
    if cfg.model.sync_bn:
        print("note: --syncBN applies to the DDP and FSDP scripts only; DataParallel keeps per-GPU BatchNorm")
    torch.manual_seed(cfg.train.seed)

    # -- data: one process loads the global batch, DataParallel splits it --
    train_set, val_set, classes = build_datasets(cfg.data, eval_only=cfg.eval_only)
    train_sampler = epoch_sampler(train_set, cfg.train.seed, kind=cfg.data.sampler)
    train_loader = make_loader(train_set, cfg.train.batch_size, train_sampler, cfg.data, device, train=True,
                               channels_last=cfg.model.channels_last)
    val_sampler = ShardSampler(val_set)
    val_loader = make_loader(val_set, cfg.train.batch_size, val_sampler, cfg.data, device, train=False,
                               channels_last=cfg.model.channels_last)

    # -- model: replicated onto every GPU at each forward; on the CPU no wrapper (it would grab the GPUs) --
    model = build_model(cfg.model, len(classes), device, img_size=cfg.data.img_size, channels=cfg.data.channels)
    if gpu_ids:
        # Each replica runs in a thread of its own, which does not inherit autocast's dtype.
        model = nn.DataParallel(AutocastForward(model, resolve_amp(cfg.train.amp, device)), device_ids=gpu_ids)
    print(f"DataParallel over {len(gpu_ids)} GPU(s), global batch {cfg.train.batch_size}" if gpu_ids
          else f"no GPU: one {device} process without DataParallel, batch {cfg.train.batch_size}")

    return fit(cfg, model, train_loader, val_loader, classes, dist_info, script_name="dp")


if __name__ == "__main__":
    main(sys.argv[1:])
