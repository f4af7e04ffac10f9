"""Hyperparameter sweep on Optuna: every trial is a real training run in DIR/trial_<n>/.

    python tools/sweep.py configs/sweeps/demo.yaml --trials 20 --dir runs/sweep -- python train.py --config configs/demo.yaml
    python tools/sweep.py space.yaml --trials 20 --n-jobs 4 --dir runs/sweep -- python train.py --config my.yaml
    export SWEEP_DB='postgresql://user:password@dbhost/optuna'     # the same study from several machines
    python tools/sweep.py space.yaml --trials 100 --n-jobs 4 --gpus-per-job 2 --dir runs/sweep --storage env:SWEEP_DB \\
        -- torchrun --nproc_per_node=2 train_multi_gpu_ddp.py --config my.yaml
    tensorboard --logdir runs/sweep                              # HParams: every trial in one view

space.yaml names config keys (utils/config.py checks each before trial 1):

    optim.lr: {low: 1.0e-4, high: 1.0e-1, log: true}   # a float (log scale)
    train.batch_size: {low: 8, high: 32, step: 8}      # an int: low and high are ints
    model.name: [resnet18, resnet34]                   # a choice

The command after `--` runs as typed, plus `--output-dir DIR/trial_<n>`, the trial's key=value
overrides and `--resume auto` when the trial's folder holds a checkpoint (utils/jobs.py run_job).
`--n-jobs J` runs J trials at once, trial slot k on GPU k (CUDA_VISIBLE_DEVICES; --gpus-per-job G:
the k-th group of G) with its own torchrun port and its share of the CPU cores (OMP_NUM_THREADS).

Objective: the best value over the epochs of `--metric` (default val_acc) in the trial's
metrics.jsonl, `--direction max|min`. Each epoch's value goes to trial.report; the median pruner
(--pruner none: off) stops a trial behind the median of the finished ones with SIGTERM: the run saves
last.pt and exits, the trial is PRUNED, its folder stays. k-fold trials: tools/kfold.py takes the
appended --output-dir as its --dir, and the trial's kfold.json "mean" (the folds' last epochs; --metric
best_acc for their best) is the objective. Such trials are not pruned: their epochs are in the folds'
folders. `{trial_dir}` in a command becomes the trial's folder.

    python tools/sweep.py space.yaml --trials 10 --dir runs/sweep \\
        -- python tools/kfold.py --folds 3 -- python train.py --config my.yaml

Storage: sqlite:///DIR/study.db by default, for one sweep process (SQLite cannot lock a row, so
several sweep processes share a study through `--storage journal`, DIR/journal.log, which also serves a
shared filesystem, or a database server); any SQLAlchemy URL; or `env:VAR` to read the URL from an
environment variable: a URL with a password is never printed (it shows as ***) nor written into DIR,
and the trials do not inherit the variable.

It resumes: the same command again continues the study. A trial whose sweep process ended (killed,
or this sweep stopped by SIGTERM/Ctrl-C) is marked FAIL and run again as a new trial in the same
folder, from its last.pt (the tables call it RETRIED); --trials N counts the trials that ended on their
own (COMPLETE, PRUNED, FAIL), so a killed and restarted sweep still ends with N (machines sharing a study
each stop once N have ended; trials already running finish). An RDB study's driver is the user's to
install (psycopg2-binary, PyMySQL). A trial that fails (a bad value, a NaN loss, out of
memory) is FAIL with its `error:` line, and the sweep goes on.

Writes DIR/trials.md and DIR/trials.csv (number, state, value, params, error, folder) after every trial,
and DIR/best.yaml: the recipe of the best trial (the command's --config file, its own overrides and the
trial's values), for `python train.py --config DIR/best.yaml`.
"""
import csv
import io
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from utils.cli import ArgumentParser, cli_entry  # noqa: E402
from utils.config import CLASSIC_FLAGS, _load_yaml, build_arg_parser, load_config, schema_only  # noqa: E402
from utils import run_dir as run_files  # noqa: E402
from utils import run_record  # noqa: E402
from utils.errors import RUNTIME_EXIT, UserError  # noqa: E402
from utils.jobs import Slots, check_slots, forwarding_signals, run_job, slot_devices, stopping  # noqa: E402

OWNER = f"{socket.gethostname()}:{os.getpid()}"  # which sweep process runs a trial: a dead one's trials are retried
POLL_S = 0.1  # how often a running trial's metrics.jsonl is read


def parse_args(argv):
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise UserError("give the training command after --, e.g. "
                        "tools/sweep.py space.yaml --trials 20 --dir runs/sweep -- python train.py")
    cut = argv.index("--")
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("space", help="YAML file: config key -> {low, high[, log, step]} or a list of choices")
    p.add_argument("--trials", type=int, required=True, help="trials in the study, counted over restarts")
    p.add_argument("--dir", type=Path, required=True, help="the sweep folder: trial_<n>/, tables, best.yaml")
    p.add_argument("--n-jobs", type=int, default=1, help="trials at once on this machine, one GPU slot each")
    p.add_argument("--gpus-per-job", type=int, default=None, help="GPUs per trial (a torchrun command's processes)")
    p.add_argument("--storage", default=None, help="sqlite:///DIR/study.db (default), journal, a URL, or env:VAR")
    p.add_argument("--study-name", default=None, help="default: the name of --dir")
    p.add_argument("--metric", default="val_acc", help="metrics.jsonl key to optimise (default val_acc)")
    p.add_argument("--direction", choices=("max", "min"), default="max")
    p.add_argument("--pruner", choices=("median", "none"), default="median")
    p.add_argument("--prune-startup", type=int, default=2,
                   help="finished trials before the median pruner prunes (default 2)")
    p.add_argument("--prune-warmup", type=int, default=0, help="epochs of a trial never pruned (default 0)")
    p.add_argument("--seed", type=int, default=None, help="the sampler's seed")
    args = p.parse_args(argv[:cut])
    args.command = argv[cut + 1:]
    if args.trials < 1 or args.n_jobs < 1:
        raise UserError("--trials and --n-jobs must be at least 1")
    return args


# --------------------------------------------------------------------------- the search space

def read_space(path):
    """{key: ("float"|"int", low, high, log, step) or ("choice", [values])}, each key and value
    checked against the config schema, before any trial runs."""
    path = Path(path)
    raw = _load_yaml(path)  # the config files' own checks: missing, malformed, not a mapping
    if not raw:
        raise UserError(f"search space '{path}' must map config keys to ranges or lists of choices")
    space = {}
    for key, spec in raw.items():
        space[key] = _parse_spec(path, key, spec)
        for value in (space[key][1:3] if space[key][0] != "choice" else space[key][1]):
            try:  # the schema's own check: an unknown key or a value of the wrong type stops here
                with schema_only():
                    load_config([f"{key}={value}"])
            except UserError as e:
                raise UserError(f"search space '{path}': {e}") from None
    return space


def _number(value):
    """YAML reads 1e-4 (no dot) as text: take it as the number it means."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _parse_spec(path, key, spec):
    where = f"search space '{path}': '{key}'"
    if isinstance(spec, list):
        if not spec:
            raise UserError(f"{where}: an empty list of choices")
        return ("choice", spec)
    if not isinstance(spec, dict) or not {"low", "high"} <= set(spec) or set(spec) - {"low", "high", "log", "step"}:
        raise UserError(f"{where}: give {{low: A, high: B}} (optionally log: true, step: S) or a list of choices")
    low, high, step = _number(spec["low"]), _number(spec["high"]), _number(spec.get("step"))
    log = spec.get("log", False)
    numbers = [v for v in (low, high, step) if v is not None]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers) or not low < high:
        raise UserError(f"{where}: low and high must be numbers with low < high (got {low}, {high})")
    if log and (low <= 0 or step is not None):
        raise UserError(f"{where}: log: true needs low > 0 and no step")
    kind = "int" if all(isinstance(v, int) for v in numbers) else "float"
    return (kind, low, high, bool(log), step)


def suggest(trial, key, spec):
    kind = spec[0]
    if kind == "choice":
        return trial.suggest_categorical(key, spec[1])
    _, low, high, log, step = spec
    if kind == "int":
        return trial.suggest_int(key, low, high, step=step or 1, log=log)
    return trial.suggest_float(key, low, high, step=step, log=log)


# --------------------------------------------------------------------------- storage, secrets

def resolve_storage(spec, sweep_dir):
    """(what Optuna opens, the text shown for it, the secrets to mask). env:VAR is read and removed
    from this process's environment, so the trials never see it."""
    if spec is None:
        return f"sqlite:///{(sweep_dir / 'study.db').resolve()}", "sqlite:///" + str(sweep_dir / "study.db"), []
    if spec == "journal":
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend
        path = sweep_dir / "journal.log"
        return JournalStorage(JournalFileBackend(str(path))), f"journal {path}", []
    if spec.startswith("env:"):
        var = spec[4:]
        url = os.environ.pop(var, None)
        if not url:
            raise UserError(f"--storage {spec}: the environment variable {var} is not set")
    else:
        url = spec
    secrets = _passwords(url)
    shown = mask(url, secrets + [url])
    if secrets and not spec.startswith("env:"):
        print(f"note: the storage URL holds a password, which this command line shows to anyone on the machine "
              f"(ps, shell history): pass --storage env:VAR instead", file=sys.stderr, flush=True)
    return url, shown, secrets


def _passwords(url):
    """The URL's password, as written and as decoded; a URL without one has no secret."""
    found = re.match(r"^[\w+.-]+://[^:/@]*:([^@]*)@", url)
    if not found or not found.group(1):
        return []
    from urllib.parse import unquote
    return sorted({found.group(1), unquote(found.group(1))}, key=len, reverse=True)


def mask(text, secrets):
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return re.sub(r"(://[^:/@\s]*:)[^@\s]+@", r"\1***@", text)  # any other URL's password too


def open_study(args, storage, shown, secrets):
    import optuna
    pruner = optuna.pruners.MedianPruner(n_startup_trials=args.prune_startup, n_warmup_steps=args.prune_warmup) \
        if args.pruner == "median" else optuna.pruners.NopPruner()
    sampler = optuna.samplers.TPESampler(seed=args.seed)
    if args.seed is not None:
        # Optuna reseeds the sampler in each --n-jobs thread (made for processes); here the threads share it and
        # draw under one lock (Sweep.objective), so a seeded sweep keeps its seed's values.
        sampler.reseed_rng = lambda: None
    try:
        if isinstance(storage, str):
            storage = rdb_storage(storage) if storage.startswith("sqlite") else shared_storage(storage)
        return optuna.create_study(storage=storage, study_name=args.study_name or args.dir.resolve().name,
                                   sampler=sampler, pruner=pruner,
                                   direction="maximize" if args.direction == "max" else "minimize",
                                   load_if_exists=True)
    except Exception as e:  # a driver missing, the server unreachable, another study's direction
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"storage {shown}: {mask(first, secrets)}", exit_code=RUNTIME_EXIT) from None


def shared_storage(url):
    """An RDB study several machines share: a trial whose machine stopped beating (a minute each) for
    3 minutes is failed and retried by the next sweep process that starts a trial."""
    import inspect
    import warnings

    import optuna
    # Optuna 4.9 renamed the callback; older versions know only failed_trial_callback.
    name = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in \
        inspect.signature(optuna.storages.RDBStorage).parameters else "failed_trial_callback"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return rdb_storage(url, heartbeat_interval=60, grace_period=180, **{name: retry})


_CLAIM = threading.Lock()


def rdb_storage(url, **kwargs):
    """Optuna's RDBStorage, claiming a queued (retried) trial one thread at a time. Its claim reads WAITING
    then writes RUNNING, and SQLite has no SELECT ... FOR UPDATE: two --n-jobs threads could both take one
    trial, run it twice in one folder, and fail telling it twice (optuna #4002)."""
    import optuna
    from optuna.trial import TrialState

    class Storage(optuna.storages.RDBStorage):
        def set_trial_state_values(self, trial_id, state, values=None):
            if state != TrialState.RUNNING:
                return super().set_trial_state_values(trial_id, state, values)
            with _CLAIM:  # the next thread reads the committed RUNNING and passes the trial by
                return super().set_trial_state_values(trial_id, state, values)

    return Storage(url, **kwargs)


# --------------------------------------------------------------------------- counting and retries

def retried(trials):
    """{trial number: the number of the trial that runs it again}."""
    return {t.user_attrs["retry_of"]: t.number for t in trials if "retry_of" in t.user_attrs}


def counted(trials):
    """The trials that ended on their own: COMPLETE, PRUNED, FAIL (an interrupted one, retried, is not)."""
    from optuna.trial import TrialState
    again = retried(trials)
    return [t for t in trials if t.state.is_finished() and t.number not in again and t.state != TrialState.WAITING]


def retry(study, trial):
    """Run an interrupted trial again: same values, same folder (its last.pt resumes it)."""
    study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number,
                                                  "run_dir": trial.user_attrs.get("run_dir", f"trial_{trial.number}")})


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def recover(study):
    """RUNNING trials of a sweep process of this machine that is gone: FAIL, and queued again."""
    from optuna.trial import TrialState
    host = OWNER.rsplit(":", 1)[0]
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        their_host, _, pid = t.user_attrs.get("owner", "").rpartition(":")
        # No owner a minute after its start: its sweep died between creating it and naming itself.
        orphan = not pid and (datetime.now() - t.datetime_start).total_seconds() > 60
        if orphan or (their_host == host and pid.isdigit() and not _alive(int(pid))):
            study.tell(t.number, state=TrialState.FAIL)
            retry(study, t)
            print(f"trial {t.number}: its sweep process ended; it runs again in {t.user_attrs.get('run_dir')}",
                  flush=True)


# --------------------------------------------------------------------------- one trial

class TrialFailed(Exception):
    pass


class Sweep:
    def __init__(self, args, space):
        self.args, self.space = args, space
        self.slots = Slots(args.n_jobs)
        self.signal = None           # the signal that stopped the sweep (utils/jobs forwarded it to the runs)
        self.fatal = None            # an error every trial would hit: the metric is not logged
        self.lock = threading.Lock()

    def objective(self, trial):
        import optuna
        args = self.args
        trial.set_user_attr("owner", OWNER)
        with self.lock:  # one trial's draws at a time: a seeded sweep draws the same values with --n-jobs
            params = {key: suggest(trial, key, spec) for key, spec in self.space.items()}
        run_dir = args.dir / trial.user_attrs.get("run_dir", f"trial_{trial.number}")
        trial.set_user_attr("run_dir", run_dir.name)
        result, pruned_at = None, None
        if not (stopping() or self.fatal):
            command = [word.replace("{trial_dir}", str(run_dir)) for word in args.command]
            with self.slots.take() as slot:  # one trial: the caller's devices; more: a GPU slot each
                result, pruned_at = self._watch(trial, command, run_dir, [f"{k}={v}" for k, v in params.items()],
                                                slot if args.n_jobs > 1 else None)
        if pruned_at is not None:
            raise optuna.TrialPruned(f"at epoch {pruned_at}")
        if self.fatal:
            trial.study.stop()
            self._fail(trial, f"error: {self.fatal}")
        if stopping() and (result is None or result.rc != 0):
            trial.set_user_attr("error", "interrupted: the sweep was stopped")
            retry(trial.study, trial)
            trial.study.stop()
            raise TrialFailed("interrupted")
        if result.rc != 0:
            self._fail(trial, result.error_line)
        value = objective_value(run_dir, args.metric, args.direction)
        if value is None:
            self._fail(trial, f"error: no '{args.metric}' in {run_dir}/metrics.jsonl or kfold.json")
        return value

    def _fail(self, trial, line):
        trial.set_user_attr("error", line)
        raise TrialFailed(line)

    def _watch(self, trial, command, run_dir, overrides, slot):
        """run_job in a thread; meanwhile each new epoch line of metrics.jsonl goes to trial.report,
        and a run the pruner stops (or that logs no --metric) gets SIGTERM: it saves last.pt and exits."""
        outcome, procs = {}, []

        def job():
            try:
                outcome["result"] = run_job(command, run_dir, overrides, slot=slot,
                                            gpus_per_job=self.args.gpus_per_job, on_start=procs.append,
                                            sharing=self.args.n_jobs)
            except BaseException as e:  # raised again in the trial's own thread
                outcome["error"] = e

        def terminate():
            if procs and procs[0].poll() is None:
                procs[0].send_signal(signal.SIGTERM)  # torchrun passes it on to its workers

        def missing(line, metric):  # every trial would fail the same way: stop the sweep
            names = ", ".join(sorted(k for k, v in line.items() if isinstance(v, (int, float))))
            self.fatal = self.fatal or f"--metric {metric} is not in the runs' metrics.jsonl; it has: {names}"
            terminate()

        seen, pruned_at = 0, None

        def report():  # the epochs metrics.jsonl holds beyond those already reported
            nonlocal seen, pruned_at
            for epoch, value in epoch_values(run_dir, self.args.metric, missing)[seen:]:
                seen += 1
                if pruned_at is None and self.args.pruner != "none":
                    trial.report(value, epoch)
                    if trial.should_prune():
                        pruned_at = epoch
                        terminate()

        # A retried trial's epochs so far come first: a run they prune is never started (a SIGTERM
        # during its start-up would end it before it could save and say so).
        report()
        if pruned_at is not None:
            return None, pruned_at
        thread = threading.Thread(target=job, daemon=True)
        thread.start()
        while True:
            done = not thread.is_alive()  # read once more after the run ended: its last epoch
            report()
            if done:
                break
            time.sleep(POLL_S)
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"], pruned_at

    def note_signal(self, handler):
        """Wrap utils/jobs' forwarding handler: remember which signal stopped the sweep."""
        def noted(signum, frame):
            self.signal = self.signal or signum
            print(f"{signal.Signals(signum).name}: each running trial saves its last.pt and stops; "
                  "the same command continues the sweep", flush=True)
            handler(signum, frame)
        return noted


def epoch_values(run_dir, metric, on_missing):
    """[(epoch, value)] of the run's metrics.jsonl epoch lines (a line still being written is skipped)."""
    path = Path(run_dir) / run_files.METRICS
    if not path.exists():
        return []
    out = []
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if "epoch" not in line:
            continue  # not an epoch's line (an event marker)
        if not isinstance(line.get(metric), (int, float)):
            on_missing(line, metric)
            continue
        out.append((line["epoch"], float(line[metric])))
    return out


def objective_value(run_dir, metric, direction):
    """A k-fold trial's mean over folds (kfold.json), else the best epoch's value (None: not logged)."""
    kfold = Path(run_dir) / "kfold.json"
    if kfold.exists():
        value = json.loads(kfold.read_text()).get("mean", {}).get(metric)
        return float(value) if isinstance(value, (int, float)) else None
    values = [v for _, v in epoch_values(run_dir, metric, lambda line, m: None) if math.isfinite(v)]
    if not values:
        return None
    return max(values) if direction == "max" else min(values)


# --------------------------------------------------------------------------- tables and best.yaml

def write_outputs(args, space, study):
    from optuna.trial import TrialState
    trials = study.get_trials(deepcopy=False)
    again = retried(trials)
    header = ["number", "state", args.metric, *space, "error", "folder"]
    rows = []
    for t in trials:
        if t.state in (TrialState.RUNNING, TrialState.WAITING):
            state = t.state.name
        elif t.number in again:
            state = "RETRIED"
        else:
            state = t.state.name
        error = t.user_attrs.get("error", "")
        if t.number in again:
            error = f"interrupted; run again as trial {again[t.number]}"
        rows.append([t.number, state, "" if t.value is None else t.value,
                     *[t.params.get(k, "") for k in space], error, t.user_attrs.get("run_dir", "")])
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, *rows])
    _write(args.dir / "trials.csv", buf.getvalue())
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|")  # noqa: E731
    md = [f"| {' | '.join(header)} |", "|" + "---|" * len(header)] + [f"| {' | '.join(map(fmt, r))} |" for r in rows]
    note = record_note(trials)
    _write(args.dir / "trials.md", "\n".join(md + (["", note] if note else [])) + "\n")
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    if done:
        best = (max if args.direction == "max" else min)(done, key=lambda t: t.value)
        recipe = best_recipe(args.command, best.params)
        head = (f"# trial {best.number} of {len(counted(trials))}: {args.metric} {best.value:.6g} "
                f"({best.user_attrs.get('run_dir')}); train with --config {args.dir / 'best.yaml'}\n")
        _write(args.dir / "best.yaml", head + yaml.safe_dump(recipe, sort_keys=False))


def record_note(trials):
    """One line when the trials differ in their run record beyond the command: versions, GPUs, commit or data
    (the data too: trials of one study should see the same images, unless the space changes the split)."""
    records = {f"trial {t.number}": run_record.read(t.user_attrs["run_dir"]) for t in trials
               if t.user_attrs.get("run_dir")}
    return run_record.difference_line(records, "trials", keys=(*run_record.SHARED, "data"))


def best_recipe(command, params):
    """The trial's whole recipe as one file: the command's --config, its flags and overrides, and the
    trial's values on top (--config takes one file, so best.yaml holds the user's recipe too)."""
    from omegaconf import OmegaConf
    scripts = [i for i, word in enumerate(command) if word.endswith(".py")]
    argv = command[scripts[-1] + 1:] if scripts else []
    ns = build_arg_parser().parse_intermixed_args(argv)
    layers = [OmegaConf.create(_load_yaml(ns.config))] if ns.config else []
    dotlist = [f"{key}={getattr(ns, key.replace('.', '__'))}" for key in CLASSIC_FLAGS.values()
               if key not in ("output_dir", "resume") and getattr(ns, key.replace(".", "__")) is not None]
    dotlist += [item for item in ns.overrides if "=" in item]
    layers.append(OmegaConf.from_dotlist(dotlist + [f"{k}={v}" for k, v in params.items()]))
    return OmegaConf.to_container(OmegaConf.merge(*layers))


def _write(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# --------------------------------------------------------------------------- main

@cli_entry
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    space = read_space(args.space)
    if args.n_jobs > 1:
        check_slots(args.n_jobs, args.gpus_per_job or 1, "--n-jobs", "trial")
    args.dir.mkdir(parents=True, exist_ok=True)
    storage, shown, secrets = resolve_storage(args.storage, args.dir)
    import optuna
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # one line per trial below, without tracebacks
    study = open_study(args, storage, shown, secrets)
    recover(study)
    trials = study.get_trials(deepcopy=False)
    busy = [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    remaining = args.trials - len(counted(trials)) - len(busy)
    print(f"study '{study.study_name}' in {shown}: {len(counted(trials))} of {args.trials} trials ended, "
          f"{len(busy)} running elsewhere, {max(remaining, 0)} to run here, {args.n_jobs} at once", flush=True)
    sweep = Sweep(args, space)
    write_lock = threading.Lock()

    def after_trial(study, frozen):
        t = frozen
        state = "interrupted (runs again on the next start)" if t.user_attrs.get("error", "").startswith(
            "interrupted") else t.state.name
        line = t.user_attrs.get("error") if t.state.name == "FAIL" else \
            f"{args.metric} {t.value:.4g}" if t.value is not None else "pruned"
        print(f"trial {t.number} {state}: {line}  {t.params}", flush=True)
        with write_lock:
            write_outputs(args, space, study)
        if len(counted(study.get_trials(deepcopy=False))) >= args.trials:
            study.stop()  # another machine's trials filled the study

    if remaining > 0:
        with forwarding_signals():  # SIGTERM/SIGINT reach every running trial's run once
            for sig in (signal.SIGTERM, signal.SIGINT):
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, sweep.note_signal(signal.getsignal(sig)))
            study.optimize(sweep.objective, n_trials=remaining, n_jobs=args.n_jobs, catch=(TrialFailed,),
                           callbacks=[after_trial])
    write_outputs(args, space, study)
    if sweep.fatal:
        raise UserError(sweep.fatal)
    if stopping():
        signum = sweep.signal or signal.SIGTERM
        raise UserError(f"sweep stopped by {signal.Signals(signum).name}; the same command continues it",
                        exit_code=128 + signum)
    ended = counted(study.get_trials(deepcopy=False))
    states = {s: sum(t.state.name == s for t in ended) for s in ("COMPLETE", "PRUNED", "FAIL")}
    print(f"{len(ended)} trials: " + ", ".join(f"{n} {s.lower()}" for s, n in states.items())
          + f"; {args.dir / 'trials.md'}" + (f", {args.dir / 'best.yaml'}" if states["COMPLETE"] else ""), flush=True)
    note = record_note(study.get_trials(deepcopy=False))
    if note:
        print(note, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
