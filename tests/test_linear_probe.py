"""The linear probe (linear_probe.py) through the real scripts.

    python -m pytest tests/test_linear_probe.py -q

One torchrun run (2 gloo processes, three lrs) encodes each image once and keeps the best head on val;
train.py resumes it from the cache (at another world size: the features do not depend on it) and keeps
the best of its own grid; --eval-only scores that checkpoint as the probe did. The refusals are in
tests/test_bad_config.py.
"""
import json
import re

import pytest
import torch

import train
from bad_files import call_main
from conftest import FAST_ARGS, make_image_folder, run_entry
from utils import run_dir as run_files

LRS = [0.001, 0.03, 0.3]


def _kept(stdout):
    """(lr, epoch) of the log's 'kept the head of lr X (of 3) at epoch E' line."""
    found = re.search(r"kept the head of lr (\S+) \(of 3\) at epoch (\d+)", stdout)
    assert found, stdout[-3000:]
    return float(found.group(1)), int(found.group(2))


def _best_in_metrics(out):
    """(val_loss, lr, epoch, val_acc) of the lowest probe_val_loss over metrics.jsonl's epochs and heads."""
    rows = run_files.read_metrics(out, epochs_only=True)
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]
    return min((r["probe_val_loss"][k], LRS[k], r["epoch"], r["probe_val_acc"][k])
               for r in rows for k in range(len(LRS)))


@pytest.mark.slow
def test_probe_encodes_each_image_once_under_ddp_resumes_from_its_cache_and_keeps_the_best_head(tmp_path):
    root = make_image_folder(tmp_path / "flowers")  # 25 train / 5 val
    out = tmp_path / "run"
    args = [*FAST_ARGS, "--data-path", root, "--output-dir", out, "train.linear_probe=true", "train.epochs=4",
            f"optim.lr=[{','.join(map(str, LRS))}]", "train.best_metric=val_loss"]
    proc = run_entry("train_multi_gpu_ddp.py", *args, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each image once: rank 0 and rank 1 encode disjoint halves, the cache holds every index once.
    for split, n in (("train", 25), ("val", 5)):
        assert f"encoded {split}: {n} images once on 2 process(es) ({(n + 1) // 2} + {n // 2})" in proc.stdout
        rows = torch.load(out / "features" / f"{split}.pt", weights_only=True)
        assert rows["index"].tolist() == list(range(n)) and rows["features"].shape == (n, 512)
    assert proc.stdout.count("no augmentation") == 1
    # The kept head is the best (epoch, lr) of the grid metrics.jsonl reports; best.pt says so too.
    val_loss, lr, epoch, val_acc = _best_in_metrics(out)
    assert _kept(proc.stdout) == (lr, epoch)
    best = torch.load(run_files.best(out), map_location="cpu", weights_only=False)
    assert best["best_epoch"] == epoch and best["best_score"] == pytest.approx(val_loss, abs=1e-6)

    # Resumed by train.py (one process, its main() here): both splits from the cache, no file rewritten. Its
    # heads train again with a batch of one process (scale_lr's rule), and it keeps the best of its own grid.
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "features").iterdir()}
    code, stdout, stderr = call_main(train.main, [*args, "--resume", "auto"])
    assert code == 0, stderr[-3000:]
    assert "linear probe: encoded" not in stdout
    assert stdout.count("features read from the cache") == 2
    assert {p.name: p.stat().st_mtime_ns for p in (out / "features").iterdir()} == mtimes
    val_loss, lr, epoch, val_acc = _best_in_metrics(out)
    assert _kept(stdout) == (lr, epoch)

    # The checkpoint is an ordinary one: --eval-only of the whole network on the images gives the probe's numbers.
    code, stdout, stderr = call_main(train.main, [*FAST_ARGS, "--data-path", root, "--output-dir", out,
                                                  "--eval-only", "--resume", run_files.best(out)])
    assert code == 0, stderr[-3000:]
    report = json.loads((out / run_files.EVAL).read_text())
    assert report["val_acc"] == val_acc
    assert report["val_loss"] == pytest.approx(val_loss, abs=1e-4)


def test_the_cache_digest_follows_the_body_transform_and_images_not_the_head(tmp_path):
    """A stale cache is never read: its digest changes with a body tensor, the image size and the split's
    images, and not with the head (a sweep's trials differ in the head's seed and settings only)."""
    from data import build_datasets
    from linear_probe import feature_digest
    from model import create_model
    from utils.config import load_config

    def digest(net, root, *extra):
        cfg = load_config([*FAST_ARGS, "--data-path", str(root), *extra])
        _, val_set, classes = build_datasets(cfg.data)
        return feature_digest(net, "fc", cfg, val_set, classes, "val", None)

    root, fewer = make_image_folder(tmp_path / "a"), make_image_folder(tmp_path / "b", per_class=11)
    torch.manual_seed(0)
    net = create_model("resnet18", num_classes=5)
    before = digest(net, root)
    with torch.no_grad():
        net.fc.weight.add_(1.0)
    assert digest(net, root) == before
    assert digest(net, root, "data.img_size=48", "data.val_resize=52") != before
    assert digest(net, fewer) != before
    with torch.no_grad():
        net.layer4[1].bn2.running_var[0] += 1e-3
    assert digest(net, root) != before
