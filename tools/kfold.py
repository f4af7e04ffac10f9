"""Stratified k-fold cross-validation of a training command: each fold a run of its own, then the
mean and standard deviation of every final metric.

    python tools/kfold.py --folds 5 --dir runs/cv -- python train.py --config configs/demo.yaml
    python tools/kfold.py --folds 4 --dir runs/cv --parallel 4 -- python train.py --config my.yaml
    python tools/kfold.py --folds 5 --dir runs/cv -- torchrun --nproc_per_node=2 train_multi_gpu_ddp.py --config my.yaml
    python tools/kfold.py --summarize runs/cv          # only (re)write the summary, e.g. after a SLURM array:
    OUTPUT_DIR=runs/cv sbatch --array=0-4 slurm/train_ddp.sbatch data.folds=5 data.fold=\\$SLURM_ARRAY_TASK_ID ...

The command after `--` is given exactly as one types it. Fold i runs it with --output-dir
DIR/fold_<i> and data.folds=K data.fold=i (utils/splits.py: fold i is the validation set, the others
train); its output goes to DIR/fold_<i>/job.log. One fold after another, or --parallel N at a time,
each on its own GPU (CUDA_VISIBLE_DEVICES; --gpus-per-job G for a group each), its share of the CPU
cores (OMP_NUM_THREADS) and, with torchrun, its own port. Then DIR/kfold.json and DIR/kfold.md hold
each fold's final metrics (the last epoch of its metrics.jsonl) and their mean and sample standard
deviation over the finished folds:

    {"folds": K, "command": [...], "per_fold": [{"fold": 0, "status": "done", "error": null, "val_acc": ...}],
     "mean": {"val_acc": ...}, "std": {"val_acc": ...}}

Started again, it skips the finished folds (a run is finished when metrics.jsonl says so, or it
reached train.epochs) and resumes an interrupted one from its last.pt (--resume auto). A SIGTERM
or Ctrl-C reaches the running folds, which save last.pt and stop. Exit status 0 when every fold finished.
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from utils import run_dir as run_files  # noqa: E402
from utils import run_record  # noqa: E402
from utils.errors import RUNTIME_EXIT, USAGE_EXIT, UserError  # noqa: E402
from utils.jobs import Job, check_slots, run_jobs  # noqa: E402

# Final numbers worth a mean: validation, the best score and the training loss; not timings or counts.
METRIC_PREFIXES = ("val_", "best_", "train_loss", "train_acc")
NOT_METRICS = ("_seconds", "_count", "_wait")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage="%(prog)s --folds K --dir DIR "
                                "[--parallel N] -- COMMAND...  |  %(prog)s --summarize DIR")
    p.add_argument("--folds", type=int, help="K: the number of folds, each the validation set of one run")
    p.add_argument("--dir", help="the folder of the folds' runs (DIR/fold_<i>/) and the summary; default: "
                                 "the command's own --output-dir")
    p.add_argument("--parallel", type=int, default=1, help="folds at once, each on its own GPU (default 1)")
    p.add_argument("--gpus-per-job", type=int, default=None, help="with --parallel: GPUs per fold (default 1)")
    p.add_argument("--summarize", metavar="DIR", help="only (re)write DIR/kfold.json and kfold.md from DIR/fold_*/")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    return args


def split_command(command):
    """(command, its --output-dir or None): the folds set their own --output-dir and --resume, so the
    command's are taken out (a sweep's job, for example, appends them)."""
    kept, out, skip = [], None, False
    for i, arg in enumerate(command):
        if skip:
            skip = False
        elif arg in ("--output-dir", "--resume") and i + 1 < len(command):
            out = command[i + 1] if arg == "--output-dir" else out
            skip = True
        elif arg.startswith(("--output-dir=", "--resume=")):
            out = arg.split("=", 1)[1] if arg.startswith("--output-dir=") else out
        else:
            kept.append(arg)
    return kept, out


def check(args):
    """Refuse, in one line, what cannot work, before any fold starts."""
    if not args.command:
        raise UserError("no training command: give it after `--`, e.g. -- python train.py --config configs/demo.yaml")
    if args.folds is None or args.folds < 2:
        raise UserError(f"--folds {args.folds}: k-fold needs K >= 2 folds")
    if args.parallel < 1:
        raise UserError(f"--parallel {args.parallel}: must be at least 1")
    if args.parallel > 1:  # as many folds at once as there are GPUs for them, as sweep's --n-jobs
        check_slots(min(args.parallel, args.folds), args.gpus_per_job or 1, "--parallel", "fold")
    own = [a for a in args.command if a.startswith(("data.folds=", "data.fold="))]
    if own:
        raise UserError(f"the command sets {own[0]}; tools/kfold.py sets data.folds and data.fold for each fold")


def finished(run_dir):
    """(finished, the last epoch's metrics or None, a line on why not). Finished: metrics.jsonl has a
    "done" event, or its last epoch is the run's train.epochs (config.yaml, written at the start)."""
    path = Path(run_dir) / run_files.METRICS
    if not path.exists():
        return False, None, f"no metrics.jsonl in {run_dir}: no epoch finished"
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by a kill: that epoch did not finish
    epochs = [m for m in lines if "epoch" in m and "event" not in m]
    last = epochs[-1] if epochs else None
    if any(m.get("event") == "done" for m in lines):
        return True, last, None
    try:
        planned = yaml.safe_load((Path(run_dir) / run_files.CONFIG).read_text())["train"]["epochs"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        planned = None
    done = last is not None and planned is not None and last["epoch"] >= planned
    return done, last, None if done else f"stopped after epoch {last['epoch'] if last else 0} of {planned}"


def fold_entry(i, run_dir, error=None):
    """One fold's row of kfold.json: its status, its error line and its final metrics."""
    done, last, why = finished(run_dir)
    row = {"fold": i, "status": "done" if done else "failed", "error": None if done else (error or why)}
    for key, value in (last or {}).items():
        if (key.startswith(METRIC_PREFIXES) and not key.endswith(NOT_METRICS) and isinstance(value, (int, float))
                and not isinstance(value, bool)):
            row[key] = value
    return row


def summarize(out_dir, folds, command, rows):
    """Write DIR/kfold.json and DIR/kfold.md; returns the summary."""
    done = [r for r in rows if r["status"] == "done"]
    keys = [k for k in (done[0] if done else {}) if k not in ("fold", "status", "error")]
    values = {k: [r[k] for r in done if k in r] for k in keys}
    summary = {"folds": folds, "command": command, "per_fold": rows,
               "mean": {k: statistics.fmean(v) for k, v in values.items()},
               # The sample standard deviation (n - 1); none from one fold.
               "std": {k: statistics.stdev(v) if len(v) > 1 else None for k, v in values.items()}}
    out_dir = Path(out_dir)
    # The folds should differ only in their data: other versions, GPUs or commits are said (run_record.json).
    records = {f"fold {r['fold']}": run_record.read(out_dir / f"fold_{r['fold']}") for r in rows}
    summary["record_differences"] = run_record.differences(records)
    summary["record_note"] = run_record.difference_line(records, "folds")
    (out_dir / "kfold.json").write_text(json.dumps(summary, indent=1) + "\n")
    fmt = lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"  # noqa: E731
    table = [f"# {folds}-fold cross-validation: {len(done)} of {folds} folds finished", "",
             "| fold | status | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    table += [f"| {r['fold']} | {r['status']} | " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    table += ["| mean ± std | | " + " | ".join(f"{fmt(summary['mean'][k])} ± {fmt(summary['std'][k])}"
                                                for k in keys) + " |"]
    failed = [f"- fold {r['fold']}: {r['error']}" for r in rows if r["status"] != "done"]
    note = [summary["record_note"]] if summary["record_note"] else []
    (out_dir / "kfold.md").write_text("\n".join(table + ([""] + failed if failed else []) + ([""] + note if note
                                                                                          else [])) + "\n")
    return summary


def summarize_only(out_dir):
    """--summarize DIR: K from the folds' own config (data.folds), each fold_<i> as it stands."""
    out_dir = Path(out_dir)
    found = sorted(out_dir.glob("fold_*/config.yaml"))
    if not found:
        raise UserError(f"no fold runs in '{out_dir}' (DIR/fold_<i>/config.yaml); run the folds first")
    folds = yaml.safe_load(found[0].read_text())["data"]["folds"]
    old = out_dir / "kfold.json"
    command = json.loads(old.read_text()).get("command") if old.exists() else None
    return summarize(out_dir, folds, command, [fold_entry(i, out_dir / f"fold_{i}") for i in range(folds)])


def main(argv):
    args = parse_args(argv)
    if args.summarize:
        summary = summarize_only(args.summarize)
    else:
        check(args)
        command, own_dir = split_command(args.command)
        out_dir = Path(args.dir or own_dir or "")
        if not (args.dir or own_dir):
            raise UserError("--dir DIR is needed: the folder of the folds' runs")
        out_dir.mkdir(parents=True, exist_ok=True)
        folds = args.folds
        todo, rows = [], {}
        for i in range(folds):
            run_dir = out_dir / f"fold_{i}"
            if finished(run_dir)[0]:
                print(f"kfold: fold {i} finished before, skipped ({run_dir})", flush=True)
                rows[i] = fold_entry(i, run_dir)
            else:
                todo.append(Job(command, run_dir, [f"data.folds={folds}", f"data.fold={i}"], name=f"fold {i}"))
        for job, result in zip(todo, run_jobs(todo, args.parallel, args.gpus_per_job, log=print)):
            i = int(job.name.split()[-1])
            error = "not started (stopped)" if result is None else result.error_line
            rows[i] = fold_entry(i, job.run_dir, error)
        summary = summarize(out_dir, folds, args.command, [rows[i] for i in range(folds)])
    failed = [r for r in summary["per_fold"] if r["status"] != "done"]
    out = Path(args.summarize or out_dir)
    print(f"kfold: {len(summary['per_fold']) - len(failed)} of {summary['folds']} folds finished; "
          + "  ".join(f"{k} {v:.4f} ± {summary['std'][k] or 0:.4f}" for k, v in summary["mean"].items()
                      if k.startswith(("val_acc", "val_loss", "val_map", "best_"))), flush=True)
    if summary["record_note"]:
        print(f"kfold: {summary['record_note']}", flush=True)
    print(f"kfold: wrote {out / 'kfold.json'} and {out / 'kfold.md'}", flush=True)
    for r in failed:
        print(f"kfold: fold {r['fold']} failed: {r['error']}", file=sys.stderr, flush=True)
    return RUNTIME_EXIT if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code or USAGE_EXIT)
