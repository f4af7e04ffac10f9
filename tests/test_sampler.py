"""data.py's training samplers: data.sampler=shuffle (DistributedSampler, unchanged) and
data.sampler=balanced (BalancedSampler): exact class balance per epoch, disjoint rank
shares, an order that is a function of (seed, epoch) only, and exact mid-epoch resume.

    python -m pytest tests/test_sampler.py -q
"""
import math
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from data import ImageList
from utils.samplers import BalancedSampler, epoch_sampler

# Class sizes 50, 10, 3, 2 and no image of class 2: 65 images, 4 classes present.
SIZES = {0: 50, 1: 10, 3: 3, 4: 2}
LABELS = [c for c, n in SIZES.items() for _ in range(n)]
N, C = len(LABELS), len(SIZES)


def rank_shares(labels, seed, world, epoch):
    """What each of `world` ranks iterates in `epoch`, each from its own fresh sampler."""
    shares = []
    for rank in range(world):
        sampler = BalancedSampler(labels, seed, world, rank)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
        assert len(shares[-1]) == len(sampler)
    return shares


def interleave(shares):
    """The one epoch sequence the ranks' shares are slices of: rank r holds positions r, r+W, ..."""
    return [i for step in zip(*shares) for i in step]


def class_slots(order, labels=LABELS):
    return Counter(labels[i] for i in order)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_class_within_one_of_its_share_and_ranks_split_one_sequence(world):
    total = math.ceil(N / world) * world
    for epoch in range(6):
        shares = rank_shares(LABELS, 0, world, epoch)
        # As many steps as the shuffle sampler, every rank the same number.
        assert all(len(s) == total // world for s in shares)
        assert len(shares[0]) == len(DistributedSampler(range(N), world, 0))
        seq = interleave(shares)
        assert len(seq) == total
        full = BalancedSampler(LABELS, 0, world, 0)
        full.set_epoch(epoch)
        assert seq == full.epoch_order().tolist()
        counts = class_slots(seq)
        assert set(counts) == set(SIZES), "only classes with images are drawn"
        assert [LABELS[i] for i in seq] != sorted(LABELS[i] for i in seq), "slots are shuffled, not class by class"
        for c in SIZES:
            assert abs(counts[c] - total / C) < 1, (epoch, c, counts)


def test_the_extra_slot_rotates_over_classes():
    """T = 65 slots over 4 classes: one class gets 17 each epoch; not always the same one."""
    favoured = Counter()
    for epoch in range(40):
        (seq,) = rank_shares(LABELS, 0, 1, epoch)
        counts = class_slots(seq)
        favoured.update(c for c in SIZES if counts[c] == math.ceil(N / C))
    assert set(favoured) == set(SIZES), favoured
    assert max(favoured.values()) < 40


def test_order_is_a_function_of_seed_and_epoch_only():
    before = torch.get_rng_state()
    torch.manual_seed(1)
    a = rank_shares(LABELS, 7, 2, 3)
    torch.manual_seed(2)
    torch.rand(5)
    assert rank_shares(LABELS, 7, 2, 3) == a
    assert rank_shares(LABELS, 7, 2, 4) != a
    assert rank_shares(LABELS, 8, 2, 3) != a
    # Rebuilt on each rank and each resumed run: nothing may come from (or disturb) the global RNG.
    torch.set_rng_state(before)
    rank_shares(LABELS, 7, 2, 3)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("world", [1, 3])
def test_images_within_a_class_repeat_only_when_they_must_and_evenly(world):
    for epoch in range(4):
        seq = interleave(rank_shares(LABELS, 0, world, epoch))
        slots = class_slots(seq)
        seen = Counter(seq)
        for c, size in SIZES.items():
            images = [i for i, y in enumerate(LABELS) if y == c]
            times = [seen[i] for i in images]
            if size >= slots[c]:
                assert max(times) == 1, (c, times)          # class 0: 50 images, ~16 slots
            else:
                assert max(times) - min(times) <= 1, (c, times)  # classes 3, 4: every image, evenly
                assert min(times) >= 1


@pytest.mark.parametrize("world", [1, 3])
def test_shuffle_is_still_distributed_sampler_with_its_order(world):
    ds = ImageList([(f"img{i}.jpg", y) for i, y in enumerate(LABELS)])
    for rank in range(world):
        for kind in ({}, {"kind": "shuffle"}):
            got = epoch_sampler(ds, 5, world, rank, **kind)
            ref = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5)
            assert isinstance(got, DistributedSampler)
            for epoch in (0, 2):
                got.set_epoch(epoch), ref.set_epoch(epoch)
                assert list(got) == list(ref)


@pytest.mark.parametrize("before, after", [(2, 1), (3, 2), (2, 3)])
def test_an_epoch_started_part_way_on_another_world_size_deals_each_image_once(before, after):
    """k batches of 4 on `before` ranks, then ShuffleSampler.set_epoch(epoch, start=k*4*before) on `after`
    ranks (an elastic restart, utils.checkpoint.resume_point): together each image once (and the last share's
    padding, as DistributedSampler pads)."""
    ds = ImageList([(f"img{i}.jpg", y) for i, y in enumerate(LABELS)])
    for k in (1, 2):
        trained = []
        for rank in range(before):
            sampler = epoch_sampler(ds, 5, before, rank)
            sampler.set_epoch(3)
            trained += list(sampler)[:k * 4]
        rest = []
        for rank in range(after):
            sampler = epoch_sampler(ds, 5, after, rank)
            sampler.set_epoch(3, start=k * 4 * before)
            assert len(list(sampler)) == len(sampler)
            rest += list(sampler)
        assert sorted(set(trained + rest)) == list(range(len(ds)))
        assert len(trained + rest) - len(ds) == (-(len(ds) - k * 4 * before)) % after  # the padding alone


def test_balanced_kind_reads_the_datasets_labels():
    ds = ImageList([(f"img{i}.jpg", y) for i, y in enumerate(LABELS)])
    sampler = epoch_sampler(ds, 0, 2, 1, kind="balanced")
    assert isinstance(sampler, BalancedSampler)
    assert list(sampler) == rank_shares(LABELS, 0, 2, 0)[1]

    class WithTargets(torch.utils.data.Dataset):
        targets = LABELS

    assert list(epoch_sampler(WithTargets(), 0, kind="balanced")) == rank_shares(LABELS, 0, 1, 0)[0]
    with pytest.raises(ValueError, match="unknown sampler kind"):
        epoch_sampler(ds, 0, kind="balance")


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
def test_resume_skips_batches_and_continues_exactly(world, rank):
    """What fit does on resume: a new iterator (or a new process's new sampler), k batches dropped."""
    def loader():
        sampler = BalancedSampler(LABELS, 3, world, rank)
        sampler.set_epoch(2)
        return DataLoader(TensorDataset(torch.arange(N)), batch_size=4, sampler=sampler)

    same = loader()
    whole = [b[0].tolist() for b in same]
    assert len(whole) == math.ceil(len(same.sampler) / 4)
    for k in (1, 3, len(whole) - 1):
        for dl in (same, loader()):
            batches = iter(dl)
            for _ in range(k):
                next(batches)
            assert [b[0].tolist() for b in batches] == whole[k:], k


@pytest.mark.parametrize("recipe", ["imbalanced.yaml", "class_weights"])
def test_skewed_classes_through_train_py(recipe, tmp_path, monkeypatch, capsys, request):
    """train.py on daisy 20 images, four classes of 5 (32 train images): configs/imbalanced.yaml
    trains on every class within 1 of 32/5 images per epoch (daisy would be 16 of 32 shuffled);
    optim.class_weights=auto prints the inverse-frequency weights N / (C * n_c) it trains with."""
    import train
    from _resume_utils import run_main
    from conftest import FAST_ARGS, REPO, make_image_folder
    import engine
    root = make_image_folder(tmp_path / "skewed", per_class=20)
    for folder in sorted(root.iterdir())[1:]:  # daisy keeps 20
        for image in sorted(folder.iterdir())[5:]:
            image.unlink()
    seen = Counter()
    request.addfinalizer(engine.register_batch_hook(lambda images, labels: seen.update(labels.tolist())).remove)
    extra = ["--config", str(REPO / "configs" / recipe)] if recipe.endswith(".yaml") else ["optim.class_weights=auto"]
    args = [*extra, "--data-path", str(root), "--output-dir", str(tmp_path / "run"), *FAST_ARGS]
    assert run_main(train, args, monkeypatch) == 0
    out = capsys.readouterr().out
    assert sum(seen.values()) == 32
    if recipe == "class_weights":
        assert seen[0] == 16  # daisy, class 0: the default sampler shows every training image once
        assert "class weights: daisy 0.4, dandelion 1.6, roses 1.6, sunflowers 1.6, tulips 1.6" in out
    else:
        assert all(count in (6, 7) for count in seen.values()) and len(seen) == 5, seen
        assert "class weights" not in out
