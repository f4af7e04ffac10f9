"""tools/sweep.py on Optuna: one real sweep of 6 tiny trials, 2 at once, killed and started again.

    python -m pytest tests/test_sweep.py -q

The space is a seeded draw over two choices, so the trials are known in advance (seed 41: lr 0.02,
bogus_net, 0.02, 1e-6, 0.02, 1e-6): model.name=bogus_net fails at its config check, optim.lr=1e-6 is
behind the median val_acc and pruned before its last epoch (3 epochs: 2 left too little time between the prune and the end), optim.lr=0.02 completes. The sweep is killed
(SIGKILL: its runs get SIGTERM from utils/jobs' death signal) while a good trial trains its second
epoch, after one trial of each kind ended; the same command, run again in this process, retries that
trial from its last.pt and ends the study at 6.
"""
import contextlib
import csv
import importlib.util
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import FAST_ARGS, REPO, cmdline_of, make_image_folder

TOOL = REPO / "tools" / "sweep.py"
SPACE = "optim.lr: [0.02, 1.0e-6]\nmodel.name: [resnet18, bogus_net]\n"
TRIALS, EPOCHS = 6, 3
SECRET = "SECRET"


def load_tool():
    spec = importlib.util.spec_from_file_location("sweep_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_in_process(argv):
    """(exit code, stdout, stderr) of tools/sweep.py's main(argv), run in this process."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            load_tool().main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def rows(sweep_dir):
    path = sweep_dir / "trials.csv"
    return list(csv.DictReader(path.open())) if path.exists() else []


def _running_good_trial_with_a_checkpoint(sweep_dir):
    """A trial of lr 0.02 past its first epoch's last.pt, not yet in its second epoch's line."""
    ended = {r["folder"] for r in rows(sweep_dir) if r["state"] not in ("RUNNING", "WAITING")}
    for d in sweep_dir.glob("trial_*"):
        log, metrics = d / "job.log", d / "metrics.jsonl"
        if d.name in ended or not (d / "checkpoints" / "last.pt").exists() or not log.exists():
            continue
        if "optim.lr=0.02" in log.read_text() and metrics.exists() and len(metrics.read_text().splitlines()) == 1:
            return d
    return None


def _trainers_of(sweep_dir):
    """Processes (Linux /proc) whose command line names the sweep folder: the runs of its trials."""
    found = []
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if p.name.isdigit() and str(sweep_dir) in "\0".join(cmdline_of(p.name)):
                found.append(int(p.name))
    return found


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    data = make_image_folder(root / "flowers")
    (root / "space.yaml").write_text(SPACE)
    sweep_dir = root / "sw"
    train = [sys.executable, str(REPO / "train.py"), *FAST_ARGS, f"train.epochs={EPOCHS}", "--data-path", str(data)]
    argv = [str(root / "space.yaml"), "--trials", str(TRIALS), "--n-jobs", "2", "--dir", str(sweep_dir),
            "--seed", "41", "--prune-startup", "1", "--", *train]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen([sys.executable, str(TOOL), *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env, cwd=REPO)
    deadline, target = time.time() + 400, None
    while time.time() < deadline and first.poll() is None:
        states = {r["state"] for r in rows(sweep_dir)}
        if {"COMPLETE", "PRUNED", "FAIL"} <= states:
            target = _running_good_trial_with_a_checkpoint(sweep_dir)
            if target is not None:
                break
        time.sleep(0.2)
    before = {r["number"]: r for r in rows(sweep_dir) if r["state"] not in ("RUNNING", "WAITING")}
    first.kill()
    first_out = first.communicate()[0]
    assert target is not None, f"no trial to interrupt; the first sweep printed:\n{first_out[-3000:]}"
    deadline = time.time() + 120
    while _trainers_of(sweep_dir) and time.time() < deadline:  # on the death signal's SIGTERM they save and end
        time.sleep(0.2)
    snapshot = {n: {f: (sweep_dir / r["folder"] / f).read_bytes() for f in ("metrics.jsonl", "job.log")
                    if (sweep_dir / r["folder"] / f).exists()} for n, r in before.items()}
    old_env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the runs this process starts: one thread, as above
    try:
        code, out, err = run_in_process(argv)
    finally:
        os.environ.pop("OMP_NUM_THREADS") if old_env is None else os.environ.update(OMP_NUM_THREADS=old_env)
    assert code == 0, (out + err)[-3000:]
    return {"dir": sweep_dir, "data": data, "before": before, "snapshot": snapshot, "target": target,
            "out": out, "rows": rows(sweep_dir), "root": root}


@pytest.mark.slow
def test_a_trial_behind_the_median_is_pruned_and_its_run_ends_cleanly_early(sweep):
    pruned = [r for r in sweep["rows"] if r["state"] == "PRUNED"]
    assert pruned and all(r["optim.lr"] == "1e-06" for r in pruned)
    stopped = []
    for r in pruned:
        run = sweep["dir"] / r["folder"]
        epochs = [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert (run / "checkpoints" / "last.pt").exists()
        # A tiny trial may finish its last epoch before the SIGTERM lands; at least one is stopped early.
        if epochs[-1] < EPOCHS:
            stopped.append(r)
            assert "error: stopped by SIGTERM" in (run / "job.log").read_text()  # by SIGTERM, after saving
    assert stopped, pruned


@pytest.mark.slow
def test_a_killed_sweep_started_again_ends_with_6_trials_none_lost_the_interrupted_one_resumed(sweep):
    ended = [r for r in sweep["rows"] if r["state"] in ("COMPLETE", "PRUNED", "FAIL")]
    assert len(ended) == TRIALS, sweep["rows"]
    assert not [r for r in sweep["rows"] if r["state"] in ("RUNNING", "WAITING")]
    by_number = {r["number"]: r for r in sweep["rows"]}
    for number, r in sweep["before"].items():  # what had ended before the kill: kept, never run again
        assert {k: by_number[number][k] for k in ("state", "val_acc", "folder")} == \
               {k: r[k] for k in ("state", "val_acc", "folder")}
        for name, content in sweep["snapshot"][number].items():
            assert (sweep["dir"] / r["folder"] / name).read_bytes() == content, f"trial {number}'s {name} changed"
    retried = {r["folder"]: r for r in sweep["rows"] if r["state"] == "RETRIED"}  # the other slot's run too
    assert sweep["target"].name in retried
    for folder, r in retried.items():  # each run again in its own folder, and ended there
        again = by_number[r["error"].rsplit(" ", 1)[-1]]
        assert again["folder"] == folder and again["state"] in ("COMPLETE", "PRUNED")
    assert by_number[retried[sweep["target"].name]["error"].rsplit(" ", 1)[-1]]["state"] == "COMPLETE"
    log = (sweep["target"] / "job.log").read_text()
    assert "--resume auto" in log.splitlines()[-1] or "resumed from" in log  # from the first epoch's last.pt
    epochs = [json.loads(x)["epoch"] for x in (sweep["target"] / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, EPOCHS + 1))


@pytest.mark.slow
def test_a_failing_trial_is_recorded_with_its_error_line_and_the_sweep_goes_on(sweep):
    failed = [r for r in sweep["rows"] if r["state"] == "FAIL"]
    assert failed and all(r["model.name"] == "bogus_net" for r in failed)
    assert failed[0]["error"].startswith("error: bad value for 'model.name': 'bogus_net'")
    assert any(int(r["number"]) > int(failed[0]["number"]) and r["state"] == "COMPLETE" for r in sweep["rows"])
    assert f"| {failed[0]['number']} | FAIL |" in (sweep["dir"] / "trials.md").read_text()


@pytest.mark.slow
def test_best_yaml_is_a_recipe_that_config_takes(sweep):
    from utils.config import load_config
    cfg = load_config(["--config", str(sweep["dir"] / "best.yaml")])
    assert (cfg.optim.lr, cfg.model.name) == (0.02, "resnet18")
    assert (cfg.data.path, cfg.train.epochs, cfg.data.img_size) == (str(sweep["data"]), EPOCHS, 32)  # the command's own
    assert cfg.output_dir is None


@pytest.mark.slow
def test_a_storage_url_from_the_environment_never_shows_its_password(sweep, monkeypatch):
    sweep_dir = sweep["root"] / "secret"
    monkeypatch.setenv("SWEEP_DB", f"postgresql://u:{SECRET}@127.0.0.1:1/db")
    code, out, err = run_in_process([str(sweep["root"] / "space.yaml"), "--trials", "1", "--dir", str(sweep_dir),
                                     "--storage", "env:SWEEP_DB", "--", sys.executable, "train.py"])
    assert code != 0
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: storage postgresql://u:***@127.0.0.1:1/db"), err
    assert SECRET not in out + err
    assert "SWEEP_DB" not in os.environ  # read, then out of the environment the trials inherit
    for path in [*sweep_dir.rglob("*"), *sweep["dir"].rglob("*")]:
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


def test_a_typo_in_the_space_stops_before_trial_1_in_one_line(tmp_path):
    (tmp_path / "space.yaml").write_text("optim.lrr: {low: 1e-4, high: 1e-1, log: true}\n")
    code, out, err = run_in_process([str(tmp_path / "space.yaml"), "--trials", "2", "--dir", str(tmp_path / "sw"),
                                     "--", sys.executable, "train.py"])
    assert code == 2
    assert err.strip() == (f"error: search space '{tmp_path / 'space.yaml'}': unknown config key 'optim.lrr' "
                           "(did you mean 'optim.lr'?)")
    assert not (tmp_path / "sw").exists()


def test_a_retried_trial_that_its_old_epochs_prune_is_never_started_again(tmp_path):
    """The interrupted run's epochs are reported before the retry starts: when they prune it, no run
    starts (a SIGTERM during a run's start-up would end it before it could save and say so)."""
    import optuna
    tool = load_tool()

    class Always(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return True

    run_dir = tmp_path / "trial_0"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "val_acc": 0.2}) + "\n")
    args = tool.parse_args([str(tmp_path / "space.yaml"), "--trials", "1", "--dir", str(tmp_path), "--",
                            sys.executable, "-c", "pass"])
    trial = optuna.create_study(pruner=Always(), direction="maximize").ask()
    result, pruned_at = tool.Sweep(args, {})._watch(trial, args.command, run_dir, [], None)
    assert (result, pruned_at) == (None, 1)
    assert not (run_dir / "job.log").exists()  # run_job writes it as a run starts


def test_two_threads_of_one_sweep_never_claim_the_same_queued_trial(tmp_path, monkeypatch):
    """A retried trial waits in the queue; --n-jobs threads pop it. SQLite has no SELECT ... FOR UPDATE,
    so Optuna's read-then-write claim let two threads take one trial: the same run twice in one folder,
    then "Cannot tell a COMPLETE trial" (optuna #4002). The read is slowed here to open that window."""
    from optuna.storages._rdb import models
    tool = load_tool()
    args = tool.parse_args([str(tmp_path / "space.yaml"), "--trials", "2", "--dir", str(tmp_path / "sw"), "--",
                            sys.executable, "-c", "pass"])
    args.dir.mkdir()
    study = tool.open_study(args, *tool.resolve_storage(None, args.dir))
    study.enqueue_trial({"optim.lr": 0.02})
    find = models.TrialModel.find_or_raise_by_id.__func__

    def slow_find(cls, trial_id, session, for_update=False):
        found = find(cls, trial_id, session, for_update)
        time.sleep(0.3 if for_update else 0)  # between reading WAITING and writing RUNNING
        return found

    monkeypatch.setattr(models.TrialModel, "find_or_raise_by_id", classmethod(slow_find))
    numbers, start = [], threading.Barrier(2)

    def ask():
        start.wait()
        numbers.append(study.ask().number)

    threads = [threading.Thread(target=ask) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(numbers) == [0, 1]


@pytest.mark.parametrize("space", sorted(p.name for p in (REPO / "configs" / "sweeps").glob("*.yaml")))
def test_a_shipped_search_space_reads_and_says_why_each_key(space):
    path = REPO / "configs" / "sweeps" / space
    assert load_tool().read_space(path)  # every key and bound through the config schema
    keyed = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    assert keyed and all(" # " in line for line in keyed), [line for line in keyed if " # " not in line]


def test_trials_side_by_side_split_the_cores(tmp_path, monkeypatch):
    """--n-jobs 2 on 8 cores: each trial's processes get 4 threads (utils/jobs.job_threads), not all 8."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    (tmp_path / "space.yaml").write_text("optim.lr: [0.1, 0.2]\n")
    trial = ("import json, os, sys; d = sys.argv[sys.argv.index('--output-dir') + 1]; "
             "open(os.path.join(d, 'metrics.jsonl'), 'w').write(json.dumps("
             "{'epoch': 1, 'val_acc': float(os.environ.get('OMP_NUM_THREADS', 0))}) + '\\n')")
    code, out, err = run_in_process([str(tmp_path / "space.yaml"), "--trials", "2", "--n-jobs", "2",
                                     "--dir", str(tmp_path / "sw"), "--pruner", "none", "--",
                                     sys.executable, "-c", trial])
    assert code == 0, err
    assert [(r["state"], r["val_acc"]) for r in rows(tmp_path / "sw")] == [("COMPLETE", "4.0")] * 2, out


@pytest.mark.parametrize("direction", ["max", "min"])
def test_best_yaml_holds_the_best_trial_not_the_last_finished(tmp_path, direction):
    """Trials ended in an order where the best is neither the first nor the last: best.yaml and its header
    name the best one by the metric's direction."""
    import optuna
    from types import SimpleNamespace
    from optuna.distributions import FloatDistribution
    tool = load_tool()
    study = optuna.create_study(direction="maximize" if direction == "max" else "minimize")
    values = {0.1: 0.5, 0.02: 0.9, 0.3: 0.1, 0.05: 0.7}  # lr -> metric, in the order the trials ended
    for lr, value in values.items():
        study.add_trial(optuna.trial.create_trial(params={"optim.lr": lr}, value=value, user_attrs={"run_dir": f"r{lr}"},
                                                  distributions={"optim.lr": FloatDistribution(1e-3, 1.0)}))
    args = SimpleNamespace(dir=tmp_path, metric="val_loss", direction=direction,
                           command=[sys.executable, "train.py", "--epochs", "3"])
    tool.write_outputs(args, {"optim.lr": None}, study)
    best_lr = (max if direction == "max" else min)(values, key=values.get)
    text = (tmp_path / "best.yaml").read_text()
    assert text.startswith(f"# trial {list(values).index(best_lr)} of 4: val_loss {values[best_lr]:.6g} (r{best_lr})")
    from utils.config import load_config
    cfg = load_config(["--config", str(tmp_path / "best.yaml")])
    assert (cfg.optim.lr, cfg.train.epochs) == (best_lr, 3)
