"""train.py, DataParallel and DDP run as a user runs them, and what a run leaves behind (FSDP: test_fsdp.py).

    python -m pytest tests/test_entry_scripts.py -q

One short run of each script is shared by all tests of this file (they run side by
side, in the module fixture `runs`):
    train.py                 2 epochs, --output-dir out (relative to its cwd)
    train_multi_gpu_dp.py    1 epoch, no --output-dir   -> runs/<timestamp>-dp
    train_multi_gpu_ddp.py   torchrun, 2 gloo processes, --syncBN True, no --output-dir -> runs/<timestamp>-ddp,
                             1 loader worker each, on a copy of the data that also holds unreadable files

"Written once" is checked from the inside: a sitecustomize.py put on PYTHONPATH
installs an audit hook (sys.addaudithook) in every process, torchrun's workers
included, that logs each file opened for writing and each rename, with the rank.
"""
import json
import math
import os
import re
import textwrap
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from _resume_utils import one_thread, run_main  # noqa: F401 (a fixture)
from bad_files import BROKEN
from conftest import FAST_ARGS, make_image_folder, run_entry
from model import create_model
from utils.config import load_config
from utils.run_dir import read_metrics

pytestmark = pytest.mark.slow

METRIC_KEYS = {"epoch", "train_loss", "val_loss", "val_acc", "lr", "img_per_s", "epoch_seconds"}
TB_TAGS = {"train/loss": "train_loss", "val/loss": "val_loss", "val/acc": "val_acc",
           "train/epoch_lr": "lr", "train/img_per_s": "img_per_s", "train/data_wait": "train_data_wait"}
CLASSES = ["daisy", "dandelion", "roses", "sunflowers", "tulips"]

WRITE_AUDIT = textwrap.dedent('''
    """Test helper: log every file this process opens for writing, and every rename."""
    import os, sys
    _dir = os.environ.get("WRITE_AUDIT_DIR")
    if _dir:
        _log = open(os.path.join(_dir, f"{os.getpid()}.log"), "a", buffering=1)
        _tag = f"{os.environ.get('RANK', '-')}\\t{os.getpid()}"
        _writing = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT

        def _hook(event, args):
            if event == "open" and args[2] & _writing and isinstance(args[0], (str, bytes, os.PathLike)):
                path = args[0]
            elif event == "os.rename":
                path = args[1]
            else:
                return
            _log.write(f"{_tag}\\t{event}\\t{os.path.abspath(os.fsdecode(path))}\\n")

        sys.addaudithook(_hook)
''')


@dataclass
class Run:
    name: str
    proc: object            # CompletedProcess
    cwd: Path
    run_dir: Path
    argv: list
    epochs: int
    writes: list            # (rank, pid, event, absolute path)
    data_root: Path

    @property
    def output(self):
        return self.proc.stdout + self.proc.stderr


def _launch(name, script, argv, epochs, tmp, data_root, nproc=None):
    cwd = tmp / f"{name}_cwd"
    audit = tmp / f"{name}_audit"
    cwd.mkdir()
    audit.mkdir()
    env = {"WRITE_AUDIT_DIR": str(audit),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp / "hook"), os.environ.get("PYTHONPATH")]))}
    argv = [*FAST_ARGS, f"train.epochs={epochs}", "--data-path", str(data_root), *argv]
    proc = run_entry(script, *argv, nproc=nproc, env=env, cwd=cwd)
    writes = [tuple(line.split("\t")) for log in audit.iterdir() for line in log.read_text().splitlines()]
    if "--output-dir" in argv:
        run_dir = cwd / argv[argv.index("--output-dir") + 1]
    else:
        found = sorted((cwd / "runs").iterdir()) if (cwd / "runs").is_dir() else []
        run_dir = found[0] if len(found) == 1 else None
    return Run(name, proc, cwd, run_dir, argv, epochs, writes, data_root)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("entry")
    data_root = make_image_folder(tmp / "flowers")
    # The DDP run's data also holds every kind of unreadable file, met in loader workers on both ranks
    # (test_ddp_workers_and_ranks_report_each_bad_file_once_and_sum_the_count needs no torchrun of its
    # own). 7 per class: 32 train images, 2 ranks x 4 steps x 4, so that every file is read.
    with_bad = make_image_folder(tmp / "flowers_with_bad_files", per_class=7)
    for name, write in BROKEN.items():
        write(with_bad / ("daisy" if name < "p" else "roses") / name)
    (tmp / "hook").mkdir()
    (tmp / "hook" / "sitecustomize.py").write_text(WRITE_AUDIT)
    jobs = {
        "train": ("train.py", ["--output-dir", "out"], 2, None, data_root),
        "dp": ("train_multi_gpu_dp.py", [], 1, None, data_root),
        "ddp": ("train_multi_gpu_ddp.py", ["data.num_workers=1", "--syncBN", "True"], 1, 2, with_bad),
    }
    # Side by side: most of each run is interpreter and torch start-up, not training.
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(_launch, name, script, argv, epochs, tmp, root, nproc)
                   for name, (script, argv, epochs, nproc, root) in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(params=["train", "dp", "ddp"])
def run(request, runs):
    r = runs[request.param]
    assert r.proc.returncode == 0, f"{r.name} failed:\n{r.output[-4000:]}"
    return r


# --------------------------------------------------------------------------- run directory and files

def test_run_directory_lands_under_the_cwd(run):
    if run.name == "train":
        assert run.run_dir == run.cwd / "out"
        assert sorted(p.name for p in run.cwd.iterdir()) == ["out"]
    else:
        # Default: runs/<timestamp>-<script>, relative to where the user started it, and only one.
        assert sorted(p.name for p in run.cwd.iterdir()) == ["runs"]
        assert run.run_dir is not None, list((run.cwd / "runs").iterdir())
        assert re.fullmatch(rf"\d{{8}}-\d{{6}}-{run.name}", run.run_dir.name), run.run_dir.name
    assert run.output.count(f"run directory: {run.run_dir.relative_to(run.cwd)}") == 1


def test_outputs_present_and_nothing_else(run):
    files = sorted(p.relative_to(run.run_dir).as_posix() for p in run.run_dir.rglob("*") if p.is_file())
    events = [f for f in files if f.startswith("events.out.tfevents.")]
    assert len(events) == 1, files
    assert sorted(set(files) - set(events)) == ["checkpoints/best.pt", "checkpoints/last.pt",
                                                "class_indices.json", "config.yaml", "metrics.jsonl",
                                                "param_groups.json", "run_record.json"]


def test_outputs_written_once_by_one_process(run):
    inside = [w for w in run.writes if Path(w[3]).is_relative_to(run.run_dir)]
    writers = {(rank, pid) for rank, pid, _, _ in inside}
    assert len(writers) == 1, writers
    assert next(iter(writers))[0] in ("0", "-")  # rank 0 under torchrun; the only process otherwise
    count = Counter(Path(w[3]).relative_to(run.run_dir).as_posix() for w in inside)
    assert count["config.yaml"] == 1
    assert count["class_indices.json"] == 1
    assert count["param_groups.json"] == 1
    assert count["metrics.jsonl"] == run.epochs         # one append per epoch
    assert count["checkpoints/last.pt"] == run.epochs   # one atomic rename per epoch
    assert 1 <= count["checkpoints/best.pt"] <= run.epochs
    # Nor anything beside the run directory or into the data (temp files elsewhere are fine).
    stray = {w[3] for w in run.writes if not Path(w[3]).is_relative_to(run.run_dir)
             and (Path(w[3]).is_relative_to(run.cwd) or Path(w[3]).is_relative_to(run.data_root))}
    assert not stray, stray


def test_class_indices_json(run):
    assert json.loads((run.run_dir / "class_indices.json").read_text()) == {str(i): c for i, c in enumerate(CLASSES)}


def test_saved_config_equals_the_loaded_one(run):
    saved = OmegaConf.load(run.run_dir / "config.yaml")
    expected = load_config(run.argv)
    assert OmegaConf.to_container(saved) == OmegaConf.to_container(expected)
    assert saved.train.epochs == run.epochs and saved.model.name == "resnet18"


# --------------------------------------------------------------------------- metrics and TensorBoard

def test_metrics_jsonl_has_one_line_per_epoch(run):
    rows = read_metrics(run.run_dir)
    assert [r["epoch"] for r in rows] == list(range(1, run.epochs + 1))
    for r in rows:
        assert METRIC_KEYS <= set(r), METRIC_KEYS - set(r)
        assert all(math.isfinite(r[k]) for k in METRIC_KEYS)
        assert 0.0 <= r["val_acc"] <= 1.0 and r["img_per_s"] > 0 and r["epoch_seconds"] > 0
        # A share of the time; how small it is, is the loader benchmark's goal (tests/test_benchmarks.py).
        assert 0 <= r["train_data_wait"] <= 1, r["train_data_wait"]
    # 0.01 per process; DDP scales it by its 2 processes, DataParallel's batch is already global.
    assert rows[0]["lr"] == pytest.approx(0.02 if run.name == "ddp" else 0.01)
    if run.epochs > 1:
        assert rows[-1]["lr"] < rows[0]["lr"]  # the cosine schedule moved


def test_tensorboard_events_read_back(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run.run_dir))
    acc.Reload()
    assert set(TB_TAGS) <= set(acc.Tags()["scalars"])
    rows = read_metrics(run.run_dir)
    for tag, key in TB_TAGS.items():
        points = acc.Scalars(tag)
        assert [p.step for p in points] == [r["step"] for r in rows], tag  # the global step an epoch ends at
        assert [p.value for p in points] == pytest.approx([r[key] for r in rows], rel=1e-5), tag


def test_logged_window_losses_average_to_the_epochs_train_loss(run):
    """train/loss_step is each log window's mean batch loss over all ranks: weighted by the window's
    batches (all of one size: drop_last), the windows of an epoch average to its train_loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run.run_dir))
    acc.Reload()
    windows = [(p.step, p.value) for p in acc.Scalars("train/loss_step")]
    start = 0
    for row in read_metrics(run.run_dir):
        epoch = [(step, loss) for step, loss in windows if start < step <= row["step"]]
        steps = [step - before for (step, _), before in zip(epoch, [start] + [s for s, _ in epoch])]
        assert epoch[-1][0] == row["step"] and len(epoch) == math.ceil((row["step"] - start) / 2)  # log_every=2
        mean = sum(n * loss for n, (_, loss) in zip(steps, epoch)) / sum(steps)
        assert mean == pytest.approx(row["train_loss"], rel=1e-5), (run.name, row["epoch"], epoch)
        start = row["step"]


# --------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("which", ["last.pt", "best.pt"])
def test_checkpoint_contents(run, which):
    state = torch.load(run.run_dir / "checkpoints" / which, map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "scheduler", "epoch", "config"} <= set(state)
    assert not any(k.startswith("module.") for k in state["model"])
    create_model("resnet18", num_classes=5).load_state_dict(state["model"])  # strict: every name fits
    assert state["config"] == OmegaConf.to_container(OmegaConf.load(run.run_dir / "config.yaml"))
    assert state["optimizer"]["param_groups"][0]["initial_lr"] == pytest.approx(0.02 if run.name == "ddp" else 0.01)
    if which == "last.pt":
        assert state["epoch"] == run.epochs
        assert state["scheduler"]["last_epoch"] == state["global_step"] > 0


# --------------------------------------------------------------------------- DDP specifics

def test_ddp_syncbn_on_cpu_warns_once_and_continues(runs):
    ddp = runs["ddp"]
    assert ddp.proc.returncode == 0, ddp.output[-4000:]
    # The run's last lines repeat the command (--syncBN True among its flags), indented: they are not notes.
    lines = [line for line in ddp.output.replace("\r", "\n").splitlines()
             if re.search(r"syncbn|syncbatchnorm", line, re.I) and not line.startswith("  ")]
    assert len(lines) == 1, lines
    assert "warning" in lines[0].lower()
    assert len(read_metrics(ddp.run_dir)) == 1  # and it trained


def test_ddp_workers_and_ranks_report_each_bad_file_once_and_sum_the_count(runs):
    """tests/test_bad_data.py's case through DDP: finds in loader workers reach their rank's main
    process and are summed over ranks; each unreadable file is warned about once."""
    ddp = runs["ddp"]
    assert ddp.proc.returncode == 0, ddp.output[-4000:]
    assert ddp.output.count("SyncBatchNorm needs CUDA") == 1
    warned = [line for line in ddp.output.splitlines() if "skipping unreadable image" in line]
    assert sorted(name for name in BROKEN for w in warned if name in w) == sorted(BROKEN), ddp.output[-3000:]
    assert read_metrics(ddp.run_dir)[0]["bad_images"] == len(BROKEN)


# --------------------------------------------------------------------------- non-ASCII class names

def test_chinese_class_names_train_resume_and_stay_readable(tmp_path, monkeypatch, capsys, one_thread):
    """Class folders named 玫瑰, 郁金香, 雏菊 (and files named after them): train.py trains, logs to
    TensorBoard, checkpoints the names, resumes with --resume auto, predict.py names them, and
    class_indices.json holds the characters themselves (UTF-8), not \\uXXXX escapes a person cannot read.
    The three runs call the scripts' main() in this process: what is checked is what they write and print."""
    import predict
    import train
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    names = ("玫瑰", "郁金香", "雏菊")
    data = make_image_folder(tmp_path / "花", classes=names)
    out = tmp_path / "运行"
    args = [str(a) for a in (*FAST_ARGS, "--data-path", data, "--output-dir", out)]
    code = run_main(train, args, monkeypatch)
    assert code == 0, capsys.readouterr().err[-4000:]

    classes = sorted(names)  # the class index order: sorted folder names
    raw = (out / "class_indices.json").read_bytes().decode("utf-8")
    assert all(name in raw for name in names) and "\\u" not in raw, raw
    assert json.loads(raw) == {str(i): c for i, c in enumerate(classes)}
    assert list(out.glob("events.out.tfevents.*")), sorted(p.name for p in out.iterdir())
    acc = EventAccumulator(str(out))
    acc.Reload()
    assert [p.step for p in acc.Scalars("val/acc")] == [3]  # 3 classes x 6 images, 15 to train in batches of 4
    state = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert state["classes"] == classes and state["epoch"] == 1

    capsys.readouterr()
    code = run_main(train, [*args, "--resume", "auto", "train.epochs=2"], monkeypatch)
    second = capsys.readouterr()
    assert code == 0, (second.out + second.err)[-4000:]
    assert "resumed from" in second.out + second.err
    state = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert state["classes"] == classes and state["epoch"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]

    # predict.py names the classes as they are written, in its table and in its JSON.
    code = run_main(predict, [str(out / "checkpoints" / "last.pt"), str(data / "雏菊"), "--device", "cpu",
                              "--out", str(out / "预测.json")], monkeypatch)
    pred = capsys.readouterr()
    assert code == 0, (pred.out + pred.err)[-4000:]
    assert any(name in pred.out for name in names), pred.out
    raw = (out / "预测.json").read_bytes().decode("utf-8")
    assert "\\u" not in raw and len(json.loads(raw)) == 6
    assert {t["class"] for row in json.loads(raw) for t in row["top"]} == set(names)


# --------------------------------------------------------------------------- a one-process script under torchrun

def launcher_refusal(script, world):
    return (f"error: {script} trains as one process, but a launcher started {world} of them (WORLD_SIZE={world}): "
            "each would train alone and all would write one run directory; launch train_multi_gpu_ddp.py instead "
            "(or train_multi_gpu_fsdp.py to shard the model)")


def test_one_process_scripts_under_torchrun_stop_before_reading_data(tmp_path, monkeypatch, capsys):
    """`torchrun --nproc_per_node=2 train.py` started two trainings that knew nothing of each other and
    wrote one run directory (4 metrics lines for 2 epochs). Both one-process scripts stop, in one line
    that names the script to use, before reading any data (a missing --data-path is never reached)
    and without writing anything under their working directory. train.py under the real torchrun;
    the DataParallel script in this process, with the WORLD_SIZE torchrun sets (one torch start-up less)."""
    (tmp_path / "train").mkdir()
    proc = run_entry("train.py", *FAST_ARGS, "--data-path", tmp_path / "no_such_data", nproc=2, cwd=tmp_path / "train")
    text = proc.stdout + proc.stderr
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == [launcher_refusal("train.py", 2)], text[-3000:]
    assert "exitcode  : 2" in text, text[-3000:]  # torchrun's summary: the usage exit code, on a rank
    assert list((tmp_path / "train").iterdir()) == []

    import train_multi_gpu_dp
    (tmp_path / "dp").mkdir()
    monkeypatch.chdir(tmp_path / "dp")
    for key, value in {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    code = run_main(train_multi_gpu_dp, [*FAST_ARGS, "--data-path", str(tmp_path / "no_such_data")], monkeypatch)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and errors == [launcher_refusal("train_multi_gpu_dp.py", 3)], errors
    assert list((tmp_path / "dp").iterdir()) == []


def test_a_run_imports_only_the_packages_it_uses(tmp_path):
    """A plain run (pictures on, no MixUp, a torchvision model) loads none of the packages that only other
    features use: they would be seconds of start-up for nothing (issue 44's whole-run benchmark). Read from
    the finished process's own sys.modules, written by a sitecustomize.py at exit."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import atexit, sys
        atexit.register(lambda: open({str(tmp_path / 'modules.txt')!r}, "w").write("\\n".join(sorted(sys.modules))))
    """))
    data = make_image_folder(tmp_path / "flowers")
    proc = run_entry("train.py", *FAST_ARGS, "--data-path", data, "--output-dir", tmp_path / "run",
                     "train.figures=true", env={"PYTHONPATH": str(hook)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = set((tmp_path / "modules.txt").read_text().split())
    assert "torchvision.models" in modules  # the hook saw the run
    unused = {"optuna", "sklearn", "matplotlib", "onnx", "onnxruntime", "timm", "torchvision.transforms.v2"}
    assert not unused & modules, sorted(unused & modules)
