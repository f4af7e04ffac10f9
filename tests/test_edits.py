"""The edits the README's "Make it yours" invites, each made in a scratch copy of the repository:
the tests it concerns still pass there, and the product does what the README promises.

    python -m pytest tests/test_edits.py -q

- an augmentation (ColorJitter in data.build_transforms): data.pipeline=auto trains on the PIL
  path, data.pipeline=gpu stops with its one line, and the data and gpu-pipeline tests pass;
- a focal loss in engine.Criterion.loss: training runs on it, the loop tests pass, and the NaN
  fault still reaches the training loss (tests/_faults.py patches the criterion);
- a metric in engine.sample_metrics: it lands in metrics.jsonl, TensorBoard and eval.json;
- a config key (schema line + commented default): the config tests pass and the key overrides.
"""
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import FAST_ARGS, REPO, make_image_folder

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}

EDITS = {
    "augmentation": ("data.py", "        transforms.RandomHorizontalFlip(),\n",
                     "        transforms.RandomHorizontalFlip(),\n"
                     "        transforms.ColorJitter(0.4, 0.4, 0.4),\n"),
    "focal_loss": ("engine.py",
                   "        return F.cross_entropy(logits, targets, weight=weight, label_smoothing=label_smoothing, "
                   "reduction=reduction)\n",
                   "        ce = F.cross_entropy(logits, targets, weight=weight, label_smoothing=label_smoothing,\n"
                   "                             reduction=\"none\")\n"
                   "        focal = (1 - torch.exp(-ce)) ** 2 * ce\n"
                   "        return focal.mean() if reduction == \"mean\" else focal\n"),
    "metric": ("engine.py", "    if num_classes >= 5:\n",
               "    metrics[\"val_top3\"] = lambda logits, labels: (logits.topk(3, dim=1).indices == labels[:, None]).any(dim=1)\n"
               "    if num_classes >= 5:\n"),
    "config_key": [("utils/config.py", "    class_weights: Any = MISSING\n",
                    "    class_weights: Any = MISSING\n    focal_gamma: float = MISSING\n"),
                   ("configs/default.yaml", "\ntrain:\n",
                    "  focal_gamma: 2.0             # focal loss: how much the easy images count less; 0 = cross entropy\n"
                    "\ntrain:\n")],
}


def scratch_copy(dest):
    """The repository's files as git sees them (tracked, and untracked but not ignored), copied to dest."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    return dest


def apply(root, edit):
    for path, old, new in edit if isinstance(edit, list) else [edit]:
        text = (root / path).read_text()
        assert text.count(old) == 1, f"{path} no longer holds the line this edit changes: {old!r}"
        (root / path).write_text(text.replace(old, new))


def run(root, *args, timeout=600):
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=root, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **ENV})
    return proc.returncode, proc.stdout + proc.stderr


def pytest_in(root, *args):
    rc, out = run(root, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *args)
    assert rc == 0, out[-4000:]


@pytest.fixture
def edited(request, tmp_path):
    root = scratch_copy(tmp_path / "repo")
    apply(root, EDITS[request.param])
    return root, make_image_folder(tmp_path / "flowers")


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("edited", ["augmentation"], indirect=True)
def test_an_added_augmentation_trains_on_the_pil_path_and_the_gpu_pipeline_says_why_not(edited, tmp_path):
    root, images = edited
    pytest_in(root, "tests/test_data.py", "tests/test_gpu_pipeline.py")
    rc, out = run(root, "train.py", *FAST_ARGS, "--data-path", images, "--output-dir", tmp_path / "auto",
                  "data.pipeline=auto")
    assert rc == 0 and len(metrics(tmp_path / "auto")) == 1, out[-3000:]
    assert "gpu pipeline:" not in out  # auto on the CPU: the PIL loader, which applies the jitter
    rc, out = run(root, "train.py", *FAST_ARGS, "--data-path", images, "--output-dir", tmp_path / "gpu",
                  "data.pipeline=gpu")
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "ColorJitter" in errors[0], out[-3000:]
    assert not (tmp_path / "gpu").exists()


@pytest.mark.parametrize("edited", ["focal_loss"], indirect=True)
def test_a_focal_loss_trains_and_the_loop_tests_and_the_nan_fault_still_hold(edited, tmp_path):
    root, images = edited
    pytest_in(root, "tests/test_engine.py",
              "tests/test_kill_resume.py::test_nan_on_one_rank_stops_every_rank_and_keeps_the_last_good_checkpoint")
    rc, out = run(root, "-c", "import torch, engine; x = torch.tensor([[2.0, 0.0, 0.0]]); "
                              "print(engine.Criterion()(x, torch.tensor([0])).item())")
    p = 1 / (1 + 2 * 2.718281828459045 ** -2)  # softmax probability of the true class
    assert rc == 0 and float(out.split()[-1]) == pytest.approx((1 - p) ** 2 * -math.log(p), rel=1e-5)
    rc, out = run(root, "train.py", *FAST_ARGS, "--data-path", images, "--output-dir", tmp_path / "run")
    assert rc == 0 and len(metrics(tmp_path / "run")) == 1, out[-3000:]


@pytest.mark.parametrize("edited", ["metric"], indirect=True)
def test_a_new_metric_reaches_metrics_tensorboard_and_eval_json(edited, tmp_path):
    root, images = edited
    out_dir = tmp_path / "run"
    rc, out = run(root, "train.py", *FAST_ARGS, "--data-path", images, "--output-dir", out_dir)
    assert rc == 0, out[-3000:]
    assert 0 <= metrics(out_dir)[0]["val_top3"] <= 1 and metrics(out_dir)[0]["val_top3"] >= metrics(out_dir)[0]["val_acc"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out_dir)).Reload()
    assert "val/top3" in events.Tags()["scalars"]
    rc, out = run(root, "train.py", *FAST_ARGS, "--data-path", images, "--eval-only", "--resume",
                  out_dir / "checkpoints" / "best.pt", "--output-dir", tmp_path / "eval")
    assert rc == 0, out[-3000:]
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["val_top3"] == metrics(out_dir)[0]["val_top3"]


@pytest.mark.parametrize("edited", ["config_key"], indirect=True)
def test_a_new_config_key_is_checked_commented_and_overridable(edited):
    root, _ = edited
    pytest_in(root, "tests/test_config.py")
    rc, out = run(root, "-c", "from utils.config import load_config; "
                              "print(load_config([]).optim.focal_gamma, load_config(['optim.focal_gamma=0.5'])"
                              ".optim.focal_gamma)")
    assert rc == 0 and out.split()[-2:] == ["2.0", "0.5"], out[-2000:]
    rc, out = run(root, "train.py", "optim.focal_gama=1")
    assert rc == 2 and "did you mean 'optim.focal_gamma'" in out, out[-2000:]
