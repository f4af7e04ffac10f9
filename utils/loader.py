"""The DataLoader that make_loader builds: persistent workers reseeded each epoch, and the uint8 collate.

Persistent workers spare a start per epoch per process, but keep their random state from one
epoch to the next. PersistentLoader hands every epoch the seeds fresh workers would take, so an
epoch's augmentation depends on loader.generator alone and a resumed run replays it exactly.
"""
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate
# The numpy seed torch's worker loop gives a fresh worker (private, unchanged since torch 1.9).
from torch.utils.data._utils.worker import _generate_state

PREFETCH_FACTOR = 4  # batches each loader worker keeps ready (tools/ddp_check.py counts them in /dev/shm)


def collate(batch):
    """DataLoader's default_collate, except for uint8 images as PILToTensor leaves them, (3, H, W) views of
    H x W x 3 pixels: stacked as they lie, a plain copy where a (N, 3, H, W) batch takes a transposing one,
    several times slower. Such a batch is (N, 3, H, W) in channels_last memory; the device pass reads it so."""
    first = batch[0][0] if isinstance(batch[0], (tuple, list)) and len(batch[0]) == 2 else None
    if (isinstance(first, torch.Tensor) and first.dtype == torch.uint8 and first.dim() == 3
            and first.permute(1, 2, 0).is_contiguous()):
        images = default_collate([img.permute(1, 2, 0) for img, _ in batch])
        return images.permute(0, 3, 1, 2), default_collate([label for _, label in batch])
    return default_collate(batch)


class SeededBatch(list):
    """A batch of dataset indices, with the (iteration, base seed) of the epoch it belongs to."""

    def __init__(self, indices, epoch):
        super().__init__(indices)
        self.epoch = epoch


class _EpochSeededBatches:
    """The loader's batches, each tagged with its epoch's (iteration, base seed)."""

    def __init__(self, batch_sampler):
        self.batch_sampler, self.epoch = batch_sampler, None

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        epoch = self.epoch
        return (SeededBatch(batch, epoch) for batch in self.batch_sampler)


class PersistentLoader(DataLoader):
    """A DataLoader whose workers live across epochs (persistent_workers) and still take each
    epoch's seeds as fresh workers would: reseeding loader.generator before an epoch fixes that
    epoch's augmentation, and a resumed run (its workers fresh) sees the same draws.

    Each iteration draws a base seed from loader.generator, as a fresh iterator draws its fresh
    workers' seeds, and every batch carries it (SeededBatch). A worker reseeds at the first batch
    of a new epoch it meets, in task order, so batches of an epoch that were prefetched but never
    taken (accum_steps' tail) still run on the old seeds. The dataset does it in __getitems__
    (ImageList, with reseed_worker); a dataset without one would keep one stream for all epochs."""

    def __iter__(self):
        seeded = self._index_sampler
        iteration = seeded.epoch[0] + 1 if seeded.epoch else 0
        seeded.epoch = (iteration, int(torch.empty((), dtype=torch.int64).random_(generator=self.generator)))
        return super().__iter__()

    @property
    def _index_sampler(self):
        # DataLoader's iterators take their batches from this (private) property.
        if "_seeded" not in self.__dict__:
            self.__dict__["_seeded"] = _EpochSeededBatches(self.batch_sampler)
        return self.__dict__["_seeded"]


def reseed_worker(dataset, batch):
    """In a DataLoader worker, at the first `batch` of an epoch (a SeededBatch): seed random, torch
    and numpy exactly as torch's worker loop seeds a fresh worker (base seed + worker id)."""
    info = torch.utils.data.get_worker_info()
    epoch = getattr(batch, "epoch", None)
    if info is None or epoch is None or epoch == getattr(dataset, "_worker_epoch", None):
        return
    dataset._worker_epoch = epoch
    base_seed = epoch[1]
    random.seed(base_seed + info.id)
    torch.manual_seed(base_seed + info.id)
    np.random.seed(_generate_state(base_seed, info.id))
