"""The training loader: workers that live across epochs, sample lists that forked workers read
without copying them, and the share of the time the loop waits for batches. (A resumed run with
such workers: tests/test_resume.py; the lists' memory at a million samples:
benchmarks/sample_memory.py, run by tests/test_benchmarks.py; a fast run's data wait and no hint:
tests/test_entry_scripts.py.)

    python -m pytest tests/test_loader.py -q
"""
import json
import os
import pickle
import time

import pytest
import torch
from torchvision import transforms as T

import data
import train
from _resume_utils import one_thread, run_args, run_main  # noqa: F401
from conftest import make_image_folder
from utils.config import load_config
from utils.data_wait import DATA_WAIT_HINT
from utils.errors import UserError
from utils.gpu_pipeline import GpuLoader
from utils.loader import PersistentLoader
from utils.sample_list import SampleList
from utils.samplers import ShardSampler, epoch_sampler


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("loader") / "flowers", per_class=4)  # 16 train


def epochs_of_batches(root, persistent, seeds, cut_short=()):
    """Train batches of one epoch per seed, the loader reseeded with it before each epoch as
    run._train_epoch does; the epochs in `cut_short` are left after their first batch (the rest
    prefetched, never taken)."""
    cfg = load_config([f"data.path={root}", "data.num_workers=2", "data.img_size=16", "data.val_resize=18",
                       f"data.persistent_workers={str(persistent).lower()}"])
    train_set, _, _ = data.build_datasets(cfg.data)
    sampler = epoch_sampler(train_set, seed=7)
    loader = data.make_loader(train_set, 4, sampler, cfg.data, torch.device("cpu"), train=True)
    assert isinstance(loader, PersistentLoader) == persistent
    seen = []
    for epoch, seed in enumerate(seeds):
        sampler.set_epoch(epoch)
        loader.generator.manual_seed(seed)
        batches = []
        for images, _ in loader:
            batches.append(images)
            if epoch in cut_short:
                break
        seen.append(torch.stack(batches))
    return seen


def test_persistent_workers_give_each_epoch_the_batches_fresh_workers_give(root):
    """Workers that live across epochs draw each epoch's augmentation from the seed fresh workers
    would take from the reseeded generator: after an epoch whose prefetched batches were left, and
    when the generator is given the same seed again."""
    seeds = (1000, 1001, 1001)
    fresh = epochs_of_batches(root, persistent=False, seeds=seeds)
    kept = epochs_of_batches(root, persistent=True, seeds=seeds, cut_short={0})
    assert torch.equal(kept[0], fresh[0][:1])
    for epoch in (1, 2):
        assert torch.equal(kept[epoch], fresh[epoch]), f"epoch {epoch + 1} differs"


def test_the_input_path_is_chosen_from_the_datasets_own_transform(root):
    """data.pipeline=gpu reproduces the transform the dataset holds, and the held-out set takes the path
    of the training transform it was built beside: an augmentation added to the dataset itself (not in
    data.build_transforms) is refused by name on both loaders."""
    cfg = load_config([f"data.path={root}", "data.num_workers=0", "data.img_size=16", "data.val_resize=18",
                       "data.pipeline=gpu"])
    cpu, (train_set, val_set, _) = torch.device("cpu"), data.build_datasets(cfg.data)
    pairs = ((train_set, True), (val_set, False))
    assert all(isinstance(data.make_loader(ds, 2, ShardSampler(ds), cfg.data, cpu, train=t), GpuLoader)
               for ds, t in pairs)
    train_set.transform.transforms.insert(1, T.ColorJitter(0.4))
    for ds, t in pairs:
        with pytest.raises(UserError, match="also has ColorJitter"):
            data.make_loader(ds, 2, ShardSampler(ds), cfg.data, cpu, train=t)


def test_sample_list_reads_as_the_list_of_pairs_it_packs(tmp_path):
    pairs = [("/data/a/x.jpg", 0), ("/data/b/\udcff-not-utf8.jpg", 3), ("/data/c/é.png", 1)]
    samples = SampleList(pairs)
    assert len(samples) == 3 and list(samples) == pairs
    assert samples[1] == pairs[1] and samples[-1] == pairs[-1] and samples[0][0] == "/data/a/x.jpg"
    with pytest.raises(IndexError):
        samples[3]
    assert list(pickle.loads(pickle.dumps(samples))) == pairs  # spawned workers, broadcast_object
    assert not SampleList([])
    ds = data.ImageList(pairs)
    assert isinstance(ds.samples, SampleList) and ds.targets == [0, 3, 1] and len(ds) == 3
    # The bytes of a name that is not UTF-8 reach the file system unchanged.
    name = os.fsencode("\udcff-not-utf8.jpg")
    (tmp_path / os.fsdecode(name)).write_bytes(b"")
    assert os.path.exists(SampleList([(str(tmp_path / os.fsdecode(name)), 0)])[0][0])


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_an_input_bound_run_logs_its_data_wait_and_is_told_once(tmp_path, monkeypatch, capsys):
    """Each image read 60 ms late (2 epochs of 3 one-step log windows): train/data_wait_step per window
    in TensorBoard, train_data_wait per epoch in metrics.jsonl and TensorBoard, one hint for the run."""
    root = make_image_folder(tmp_path / "flowers")  # 25 train images: 3 steps of 8
    real = data.ImageList.__getitem__

    def late(self, index):
        time.sleep(0.06)
        return real(self, index)

    monkeypatch.setattr(data.ImageList, "__getitem__", late)
    out = tmp_path / "run"
    assert run_main(train, run_args(root, out, "train.batch_size=8", "train.log_every=1", epochs=2), monkeypatch) == 0
    hints = [line for line in capsys.readouterr().out.splitlines() if "input-bound" in line]
    assert len(hints) == 1 and "data.num_workers (now 0)" in hints[0] and "docs/troubleshooting.md" in hints[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(DATA_WAIT_HINT < r["train_data_wait"] <= 1 for r in rows), rows
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out)).Reload()
    windows = events.Scalars("train/data_wait_step")
    assert [p.step for p in windows] == [1, 2, 3, 4, 5, 6]
    assert all(DATA_WAIT_HINT < p.value <= 1 for p in windows)
    assert [p.value for p in events.Scalars("train/data_wait")] == pytest.approx([r["train_data_wait"] for r in rows])
