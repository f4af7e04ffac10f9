"""Samplers: each epoch's order, a function of (seed, epoch) alone, and evaluation's unpadded shards.

Every rank computes the same order from the seed, so nothing is sent between ranks, and a resumed
run replays it. Evaluation shards are not padded, so each image is counted once.
"""
import torch
from torch.utils.data import DistributedSampler, Sampler

from utils.errors import UserError


def epoch_sampler(dataset, seed, num_replicas=1, rank=0, kind="shuffle"):
    """Training order that depends only on (seed, epoch), set with set_epoch().

    A fixed order per epoch is what lets a resumed run see the same batches as
    an uninterrupted one. With num_replicas > 1 each rank gets a disjoint shard
    of equal length. kind (data.sampler):
      shuffle   each image once per epoch (ShuffleSampler: DistributedSampler, its last shard padded with
                repeats, whose epoch can start part way through its order);
      balanced  every class drawn equally often, rare classes repeating (BalancedSampler);
                an epoch has as many steps as with shuffle.
    No dataset (an --eval-only run's training set) gives None.
    """
    if dataset is None:
        return None
    if kind == "shuffle":
        return ShuffleSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
    if kind == "balanced":
        if getattr(dataset, "multilabel", False):
            raise UserError("data.sampler=balanced draws each class equally often, which a multi-label image "
                            "(several classes at once) cannot be; use data.sampler=shuffle", every_rank=True)
        if not hasattr(dataset, "targets"):
            raise TypeError(f"{type(dataset).__name__} has no .targets (a label per sample) to balance classes by")
        return BalancedSampler(list(dataset.targets), seed, num_replicas, rank)
    raise ValueError(f"unknown sampler kind {kind!r}; expected 'shuffle' or 'balanced'")


class ShuffleSampler(DistributedSampler):
    """DistributedSampler whose epoch may start at position `start` of the epoch's whole order: the seeded
    permutation, which does not depend on the world size, with rank r taking positions r, r+W, r+2W, ...
    So the first k batches of B on W ranks are exactly its first k*B*W positions, and an elastic restart
    (utils.checkpoint.resume_point) deals the rest of the epoch, each image once, to the ranks it has now."""

    start = 0

    def set_epoch(self, epoch, start=0):
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        if not self.start:
            return super().__iter__()
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)  # as DistributedSampler derives it
        rest = torch.randperm(len(self.dataset), generator=g)[self.start:].tolist()
        if rest:  # padded with repeats to whole shares, as DistributedSampler pads
            rest += (rest * -(-len(self) * self.num_replicas // len(rest)))[:len(self) * self.num_replicas - len(rest)]
        return iter(rest[self.rank::self.num_replicas])

    def __len__(self):
        if not self.start:
            return super().__len__()
        return -(-max(len(self.dataset) - self.start, 0) // self.num_replicas)


class BalancedSampler(Sampler):
    """Class-balanced order for DDP, a function of (seed, epoch) only, set with set_epoch().

    One epoch is T = ceil(N / W) * W draws (N images, W ranks: as many steps as
    DistributedSampler), and rank r takes positions r, r+W, r+2W, ... of it.
    Each of the C classes present in `labels` fills floor(T/C) or ceil(T/C) of
    the T slots, so over all ranks every class count is within 1 of T/C (the
    tolerance; one rank's share is balanced only on average). Which classes get
    the extra slot starts at a random offset each epoch. Within a class, images
    come from fresh random permutations of it, one after another: a class with
    enough images repeats none, a rare one repeats each image equally often, +-1.
    Every rank computes the same sequence from its own generator; nothing else
    is kept between epochs, so a fresh iterator replays the epoch exactly
    (mid-epoch resume skips batches of it).
    """

    def __init__(self, labels, seed=0, num_replicas=1, rank=0):
        labels = torch.as_tensor(labels, dtype=torch.long)
        _, sizes = torch.unique(labels, return_counts=True)
        # Image indices of each class present, in index order: O(N log N), not one pass per class.
        self.members = torch.argsort(labels, stable=True).split(sizes.tolist())
        self.seed, self.num_replicas, self.rank, self.epoch = seed, num_replicas, rank, 0
        self.total = -(-len(labels) // num_replicas) * num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.total // self.num_replicas

    def epoch_order(self):
        """The whole epoch's sequence of dataset indices, all ranks' shares interleaved."""
        if not self.members:
            return torch.zeros(0, dtype=torch.long)
        g = torch.Generator().manual_seed(self.seed + self.epoch)  # as DistributedSampler derives it
        n_cls = len(self.members)
        base, extra = divmod(self.total, n_cls)
        slots = torch.full((n_cls,), base)
        # A fixed set of classes with the extra slot would favour them every epoch; rotate it.
        offset = int(torch.randint(n_cls, (1,), generator=g))
        slots[(offset + torch.arange(extra)) % n_cls] += 1
        picks = []
        for idx, n in zip(self.members, slots.tolist()):
            cycles = -(-n // len(idx))
            # `cycles` independent permutations in one op (float64 keys: ties are negligible).
            perms = torch.rand(cycles, len(idx), generator=g, dtype=torch.float64).argsort(dim=1, stable=True)
            picks.append(idx[perms.flatten()[:n]])
        order = torch.cat(picks)
        return order[torch.randperm(len(order), generator=g)]

    def __iter__(self):
        return iter(self.epoch_order()[self.rank::self.num_replicas].tolist())


class ShardSampler(Sampler):
    """Rank r takes samples r, r+W, r+2W, ...: no padding, so no image is counted twice.

    DistributedSampler pads the last shard with repeats, which makes a
    distributed accuracy differ from the single-process one; evaluation sums
    correct counts over these exact shards instead.
    """

    def __init__(self, dataset, num_replicas=1, rank=0):
        self.indices = list(range(rank, len(dataset), num_replicas))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)
