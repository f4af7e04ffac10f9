#!/usr/bin/env bash
# Every GPU test, an FSDP training, an fp16 resume, the FSDP memory tool and both benchmarks of this
# repository in one run of at most 9 minutes, on a CUDA machine.
#
#   bash tools/gpu_checks.sh                   # results in runs/gpu_checks/: summary.md and gpu_checks.tgz
#   OUT=DIR bash tools/gpu_checks.sh           # results in DIR instead
#   WHEELS=DIR bash tools/gpu_checks.sh        # no package index: the modules python lacks (of MODULES
#                                              # below) are installed from the wheels in DIR
#   QUICK=1 bash tools/gpu_checks.sh           # rehearsal on a CPU: tiny sizes, same steps
#   STEPS="test_optim benchmark" bash ...      # only these steps (setup still runs when a module is missing)
#   TESTS="tests/test_optim.py" bash ...       # these pytest files instead of every file with GPU tests
#   LANES=1 bash tools/gpu_checks.sh           # the test files one after another (default 3 lanes side by side)
#   PYTHON (default python3), WORK (scratch, default /tmp/gpu_checks), TOTAL, GRACE and each L_* below
#   can be set the same way.
#
# The GPU machine (Python 3.12, x86_64; no package index) has every module the steps import (torch,
# torchvision, numpy, Pillow, PyYAML, tqdm, tensorboard, matplotlib, pytest) but omegaconf. Fill the wheel
# folder once, on a machine with an index, in the repository root
# (git-ignored there by: echo /.whl/ >> .git/info/exclude):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl omegaconf==2.4.0
# omegaconf 2.4.0 is one py3-none-any wheel whose only requirement is PyYAML>=5.1.0, which that machine
# has: setup installs with --no-deps, so nothing else need be in the folder. The call to make there, with
# .whl carried along and OUT the folder whose files come back:
#   WHEELS=.whl OUT="$OUT" bash tools/gpu_checks.sh
#
# Steps, each under its own time limit (LIMITS below), in this order:
#   setup              every module the selected steps import (MODULES; pytest only for test steps) is
#                      looked up first, and a missing one is named at once: without WHEELS in one error
#                      line; with it, pip install --no-index --no-deps from WHEELS into WORK/site (put on
#                      PYTHONPATH). If that fails the run stops here
#   data               benchmark.py --prepare-data: the flower-sized folder the tools read (3,670 JPEGs in
#                      data/bench_flowers, kept for later runs); made in the background while the tests run
#   test_<file>        pytest -m gpu, one call per test file with GPU tests, so that one slow file cannot
#                      starve the others; no -x: every test gets its chance. Each writes junit-<file>.xml
#                      (also when stopped by its limit: SIGTERM ends the pytest session cleanly). The files
#                      run in LANES lanes side by side (the longest limits first, each into the lane with
#                      the least so far): they check results, not speed, and take a few GiB of one GPU at
#                      most; every torchrun they start binds a free port. Nothing timed runs beside them
#   ddp_check          tools/ddp_check.py under torchrun, one process per visible GPU (2 gloo processes on
#                      a CPU): NCCL group, all-reduce, bus bandwidth, /dev/shm, variables; the GPU-pair
#                      check needs 2 or more GPUs and says skip on one
#   fsdp_memory        tools/fsdp_memory.py under torchrun, one process per GPU: vit_l_16 under DDP and
#                      FSDP (peak memory, img/s), then the ladder from vit_h_14 up (vit_l_16 trained
#                      already; vit_b_16 is smaller) for the largest that trains. Early, so that it gets
#                      its time; fsdp_memory.json/.md
#   train_fsdp         train_multi_gpu_fsdp.py with the default config (ResNet34, channels_last, bf16,
#                      batch 16, 224 px) and train.profile=3 for 2 epochs of the flower-sized folder, one
#                      process per GPU; then its metrics.jsonl must hold both epochs and rank 0's profiler
#                      trace its recorded steps (with their CUDA kernels on a GPU)
#   resume_fp16        train.py, 1 epoch on the CPU (a checkpoint with contiguous SGD momentum), then
#                      resumed on CUDA with train.amp=fp16 (channels_last weights, fused SGD) for a 2nd
#                      epoch, on demo/flowers.py's images, 8 a class (30 train, 10 val) at 64 px; the
#                      2nd epoch must take its steps and change the weights (epoch_001.pt against 002)
#   deterministic      train.deterministic=true: train.py twice on CUDA with 2 DataLoader workers must end
#                      bit for bit equal (weights, optimizer state, schedule). Before the timed steps: what
#                      it proves matters more than any figure after it
#   benchmark          benchmarks/benchmark.py: ResNet34, batch 128, bf16, channels_last, 224 px: ceiling,
#                      end to end with data.pipeline=pil and gpu, DDP world-size-1 ratio, CPU bare-loop
#                      ratio; on a GPU with --repeats 3 --epochs 2 (its defaults: 5 and 3), to fit the call
#   scaling            benchmarks/scaling.py --pipeline gpu: single / DP / DDP on every visible GPU
#   deterministic_cost the mode's cost: the ResNet34 training step at 224 px, batch 128, bf16 with
#                      train.deterministic on and off, interleaved, 5 timings of 30 steps each: img/s
#                      medians and their ratio
#   benchmark_compile  benchmark.py --compile --skip e2e,ddp,bare: eager and torch.compile ceilings. Last,
#                      with what is left of TOTAL (a cold compile is the longest and least sure part):
#                      summary.md names it "not run" when too little is left; not run with QUICK=1
# The training steps end with a line `result: ...` (what they trained, on which device, with which amp):
# summary.md shows it. With QUICK=1 they run on the CPU at tiny sizes (resnet18, 32 px): the plumbing only.
# A step that fails or hits its limit leaves what it finished, and the next step still runs. When a step
# ends, whether by itself, by its limit or by a signal to this script, every process it started ends too
# (torchrun's workers, a test's setsid'd launcher, DataLoader workers): none is left to slow the next.
#
# OUT gets two files, rewritten after every step and when the script is stopped by a signal: summary.md
# (per step its result, seconds, limit, what finished and what did not) and gpu_checks.tgz, which holds
# gpu_checks/ with summary.md, gpu_checks.log (everything printed), logs/<step>.log (each step's output,
# logs/scaling-<row>.log per scaling row), junit-<file>.xml, fsdp_memory.json/.md, benchmark.json/.md,
# benchmark_compile.json/.md, scaling.json/.md/.png. (A device call returns at most 8 files.) The same
# files, unpacked, are in WORK/results/gpu_checks; scratch (checkpoints, run folders) stays in WORK.
set -uo pipefail
CALLER=$PWD  # relative OUT, WORK, WHEELS and TESTS are read from the caller's folder
abs() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$CALLER/$1" ;; esac; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(abs "${OUT:-$REPO/runs/gpu_checks}")
WORK=$(abs "${WORK:-/tmp/gpu_checks}")
WHEELS=${WHEELS:+$(abs "$WHEELS")}
PY=${PYTHON:-python3}
case $PY in */*) PY=$(abs "$PY") ;; esac  # a path, not a name looked up on PATH
QUICK=${QUICK:-}
GRACE=${GRACE:-15}  # seconds between a stopped step's SIGTERM (pytest writes its junit) and SIGKILL
cd "$REPO"
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
    echo "error: WHEELS=$WHEELS is not a folder"
    exit 1
fi
R=$WORK/results/gpu_checks
# What an earlier run left must not pass for this run's results.
rm -rf "$R" "$WORK"/bench/benchmark.{json,md} "$WORK"/bench_compile/benchmark.{json,md} "$WORK/scaling"
mkdir -p "$OUT" "$R/logs" || { echo "error: cannot create $OUT and $R"; exit 1; }
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/summary.md" "$OUT/gpu_checks.tgz"
export PYTHONUNBUFFERED=1
exec 3>&1 4>&2  # the caller's stdout/stderr, restored at the end so the log is complete before packing
exec > >(tee "$R/gpu_checks.log") 2>&1
TEE_PID=$!
TSV=$WORK/steps.tsv
: > "$TSV"

# ---------------------------------------------------------------------------------------------------
# LIMITS, in seconds. No GPU has run this script yet: every GPU figure below is REASONING, not
# measurement. Measured: the CPU rehearsal (QUICK=1 on a 2-core x86-64 VM shared with other jobs,
# OMP_NUM_THREADS=1; runs 1-7 in BENCHMARKS.md), which skips the GPU tests and runs the tools at tiny
# sizes, so it gives each step's fixed costs (imports, pytest, process starts). A step's limit is 2 x the
# longest rehearsal, rounded up to 10 s, plus the GPU work the rehearsal skips, reasoned from the work
# counted in the tests and tools. For ResNet34, 224 px, batch 128, bf16, channels_last on one H200
# (~790 bf16 TFLOP/s dense; ResNets reach far less, BatchNorm and ReLU being memory-bound): 22 GFLOP an
# image for forward + backward, 2.8 TFLOP a step, taken as ~20-30 ms a step (~4,000-6,500 img/s).
# Expected (not limits), in order: setup 3 + tests ~110 (3 lanes: gpu_pipeline ~110; cuda_scripts ~70 +
# engine ~20; optim ~10 + parallel_semantics ~25) + ddp_check ~15 + fsdp_memory ~55 + train_fsdp ~50 +
# resume_fp16 ~25 + deterministic ~30 + benchmark ~85 (--repeats 3 --epochs 2) + scaling ~65 +
# deterministic_cost ~20 = ~460 s, which leaves benchmark_compile ~80 s of its ~70-120: one call. Where
# the GPU runs slower than reasoned, the steps before them get less, and summary.md says what they did not
# finish. A limit bounds a hung
# step; TOTAL cuts any step's limit to what is left of the whole, so the script ends within TOTAL +
# GRACE + a few seconds of packing (~560 s), inside a 600 s device call (30 s more only if a process
# outlives SIGKILL, stuck in the kernel; the runner then leaves it and says so).
TOTAL=${TOTAL:-540}
L_SETUP=${L_SETUP:-30}     # pip from WHEELS (omegaconf, --no-deps): 1-2 s in runs 4-7 -> 10; +20 s for
                           # a slower disk
L_DATA=${L_DATA:-120}      # the flower-sized folder, the same work on any machine: measured 50 s and 57 s
                           # on one core (benchmark.py --prepare-data); beside the tests, so off the total
L_CUDA_SCRIPTS=${L_CUDA_SCRIPTS:-150}  # 7 trainings, 9 Python starts (3 scripts, SyncBN ResNet34, a run
                           # and its resume, DP with --device cpu), run at the same sizes on the CPU
                           # (CUDA_SCRIPTS_DEVICE=cpu): 54-74 s -> 150. Reasoned: on CUDA each start adds
                           # ~1-3 s of CUDA context and cuDNN handles, the tiny epochs get faster: ~60-80 s
L_GPU_PIPELINE=${L_GPU_PIPELINE:-160}  # 5-9 s (both GPU tests skip) -> 20. Reasoned +140: train.py with
                           # train.compile=true starts cold and compiles resnet18 three times (the train
                           # step forward + backward ~30-60 s, eval mode ~15 s, a recompile for the last val
                           # batch of 2 ~15 s; 1.5x if process starts and cache writes are slow there), a
                           # torchrun DDP run with data.pipeline=gpu (2 starts, ~15 s), the in-process
                           # pipeline test (~5 s): ~85-155 s
L_ENGINE=${L_ENGINE:-50}   # 5-15 s (its GPU tests skip) -> 30; reasoned +20: CUDA start-up and 3 in-process
                           # resnet18 loops of 2 x 8 tiny steps (bf16, fp16 with GradScaler, the recipe)
L_OPTIM=${L_OPTIM:-40}     # 3-11 s (its GPU tests skip) -> 30; reasoned +10: CUDA start-up, tiny tests
L_OTHER=${L_OTHER:-40}     # any other file with GPU tests, now test_parallel_semantics: 4-7 s -> 20;
                           # reasoned +20: a torchrun of 2 gloo ranks sharing GPU 0 (3 Python starts, CUDA
                           # start-up, ResNet34 built on the GPU, SyncBN over 4 samples): ~25 s
L_DDP_CHECK=${L_DDP_CHECK:-40}  # QUICK=1 (2 gloo processes, load 4): 9 s -> 20; reasoned +20: CUDA and NCCL
                           # start-up per process, the bandwidth sizes (1, 16, 64 MB) in well under 1 s
L_FSDP_MEMORY=${L_FSDP_MEMORY:-150}  # --quick (mobilenet_v3_small, 2 gloo processes, load ~6): 46 s -> 100;
                           # reasoned +50 for 6 runs (DDP and FSDP of vit_l_16, vit_h_14, regnet_y_128gf),
                           # each a model of 0.3-0.65 G parameters built on the CPU (~3-8 s) and 13 AdamW
                           # steps at batch 32 (<1 s), after ~10 s of start-up: ~40-70 s
L_TRAIN_FSDP=${L_TRAIN_FSDP:-120}  # QUICK=1 (resnet18, 32 px, 50 images, 2 gloo processes, load 2-6): 36-41 s
                           # -> 90; reasoned +30: 2 epochs of 184 ResNet34 steps (~20 ms each, launch-bound
                           # at batch 16) beside 8 decoding workers, eval, pictures and 2 sharded + full
                           # checkpoints: ~25 s of work after ~15 s of start-up
L_RESUME_FP16=${L_RESUME_FP16:-150}  # QUICK=1 (3 Python starts: the images, the CPU run, the resume; load
                           # 2-6): 56-62 s -> 130; reasoned +20: the CPU epoch is ResNet34's 7 steps at 64 px
                           # (threads on every core there), the CUDA start-up: ~25 s in all
L_BENCH=${L_BENCH:-200}    # quick sizes: 16-34 s -> 70, a floor only: the rehearsal does none of the
                           # full-size work. Counted from benchmark.py's defaults (50 steps, 5 repeats,
                           # 3 epochs), reasoned on one H200: start-up and CUDA ~10 s; (a) ceiling, warm-up
                           # + 5 x 50 = 300 steps ~8 s; (b) train.main twice over 3 epochs of 2,935 + 735
                           # images (pil: decoding with 8 workers, ~4 s an epoch; gpu: decoding once into
                           # the cache, ~10 s, then ~1 s an epoch) with set-up and checkpoints ~40 s;
                           # (c) bare + 5 DDP variants, each warm-up + 5 x 50 steps: 1,800 steps ~35-55 s;
                           # (d) on the CPU at full size, 9 repeats: 42 s on one thread of the VM (measured),
                           # ~20-40 s there. ~115-155 s; 200 leaves ~1.3x
L_SCALING=${L_SCALING:-140}  # quick rows: 3 took 24-47 s (~10 s each, mostly start-up; now 2) -> 100; reasoned +40
                           # for one GPU's 3 rows (single, DP, DDP) at full size: per row a start, decoding
                           # 3,670 JPEGs once into the cache (~3 s with 8 workers) and 2 ResNet34 epochs at
                           # batch 16 (230 launch-bound steps an epoch, ~3 s): ~20 s a row, ~65 s in all
L_DETERMINISTIC=${L_DETERMINISTIC:-90}  # QUICK=1 (resnet18, 32 px; 3 Python starts: the images, 2 runs): 9 s at
                           # load ~1 (with its timed part, once one step, 111 s at load 7-14) -> 90, room for such
                           # load. Reasoned: 3 starts and 2 CUDA start-ups ~20 s, ResNet34's 7 steps at 64 px
                           # twice: ~30 s
L_DET_COST=${L_DET_COST:-60}  # QUICK=1: 4 s -> 10; reasoned +50: a start, CUDA start-up, ResNet34 built, 10 x 30
                           # + 10 warm-up steps at batch 128 (~20-30 ms each, the deterministic ones slower)
ROW_LIMIT=${ROW_LIMIT:-45}  # scaling.py --timeout, per row, so a hung row leaves the others their time:
                           # longest quick row 12.2 s -> 30; reasoned +15 s (that row's decoding and epochs)
L_COMPILE=${L_COMPILE:-120}  # not rehearsed (no compiler runs on the CPU VM). Reasoned: start-up ~10 s, the
                           # eager ceiling again (300 steps, ~8 s), a cold inductor compile of ResNet34's
                           # train step ~40-90 s, then warm-up 50 + 300 timed steps ~8 s: ~70-120 s
COMPILE_NEED=${COMPILE_NEED:-60}  # benchmark_compile starts only with this much left of TOTAL: with less, a cold
                           # compile cannot finish, and summary.md names the step "not run" instead
# ---------------------------------------------------------------------------------------------------

T0=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }

# The step runner: CMD under a time limit, and on any end (its own, the limit's, a signal's) every process
# it started is stopped: SIGTERM to all, GRACE seconds, then SIGKILL until none is left. Processes are
# found by walking /proc's parent links. A test's launcher started with start_new_session escapes a kill
# of the process group, and the children of a process that dies are handed to init: so the runner makes
# itself their "child subreaper" (they are handed to it instead) and also remembers every process it has
# seen below it, to find one that was handed elsewhere. Exit: CMD's status; 124 when the limit stopped
# it, 137 when CMD itself had to be killed; 143 when the runner was signalled.
RUN_STEP=$WORK/run_step.py
cat > "$RUN_STEP" <<'EOF'
import ctypes, os, signal, subprocess, sys, time

limit, grace, cmd = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
me = os.getpid()
seen = {}  # pid -> start time (so a reused pid is not taken for it) of every process found below
stop = None


def note(msg):  # on a line of its own: pytest -v may have left the running test's name unfinished
    print(f"\n[gpu_checks] {msg}", file=sys.stderr, flush=True)


def proc_table():
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    s = f.read()
            except OSError:
                continue
            fields = s[s.rindex(b")") + 2:].split()  # the name in (...) may hold spaces
            table[int(d)] = (fields[0], int(fields[1]), int(fields[19]))  # state, ppid, start time
    return table


def tree():
    """Live processes this runner started: its descendants, and those seen earlier, wherever they went."""
    table = proc_table()
    kids = {}
    for pid, (_, ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    found = {p for p, start in seen.items() if p in table and table[p][2] == start}
    todo = [me, *found]
    while todo:
        for c in kids.get(todo.pop(), ()):
            if c not in found and c != me:
                found.add(c)
                todo.append(c)
    for p in found:
        seen[p] = table[p][2]
    return [p for p in found if table[p][0] != b"Z"]  # zombies are dead; reap() collects ours


def reap():
    global rc
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == child.pid:
            code = os.waitstatus_to_exitcode(status)
            rc = child.returncode = 128 - code if code < 0 else code


def signal_all(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


def on_signal(signum, frame):
    global stop
    stop = stop or "signal"


try:  # orphans of the step are then handed to this runner, not to init, and stay findable
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
except (OSError, AttributeError):
    pass
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on_signal)
rc = None
t0 = time.monotonic()
child = subprocess.Popen(cmd)
while True:
    reap()
    tree()
    if rc is not None or stop:
        break
    if time.monotonic() - t0 > limit:
        stop = "limit"
        break
    time.sleep(0.5)  # each look reads every /proc/PID/stat: cheap, but not free under gVisor

alive = tree()
child_killed = False
if alive:
    why = {"limit": f"time limit of {limit:g} s reached", "signal": "stopped by a signal"}.get(
        stop, "the step ended but left processes running")
    note(f"{why}: SIGTERM to {len(alive)} processes")
    signal_all(alive, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        reap()
        alive = tree()
    killed, give_up = set(), time.monotonic() + 30
    while alive and time.monotonic() < give_up:  # again: a process may fork while its siblings die
        child_killed |= rc is None and child.pid in alive
        killed.update(alive)
        signal_all(alive, signal.SIGKILL)
        time.sleep(0.05)
        reap()
        alive = tree()
    if killed:
        note(f"SIGKILL to {len(killed)} processes still running after {grace:g} s")
    if alive:  # stuck in the kernel (a GPU driver call, say): the script must still end
        note(f"still alive 30 s after SIGKILL, left running: {sorted(alive)}")
reap()
if stop == "limit":
    sys.exit(137 if child_killed else 124)
sys.exit(143 if stop == "signal" else rc)
EOF

# The training steps: run the entry script(s), pass their output through, then check what they wrote and
# end with one line `result: ...` for summary.md. Exit 1 (with the reason) when a check fails.
TRAIN_CHECK=$WORK/train_check.py
cat > "$TRAIN_CHECK" <<'EOF'
import json, re, shutil, subprocess, sys
from pathlib import Path

PY = sys.executable


def fail(msg):
    print(f"failed: {msg}", flush=True)
    sys.exit(1)


def run(*cmd):
    """cmd's output, passed through as it comes; a failed run ends the step."""
    print("$ " + " ".join(map(str, cmd)), flush=True)
    proc = subprocess.Popen([*map(str, cmd)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    if proc.wait():
        fail(f"exit {proc.returncode}: {' '.join(map(str, cmd[:4]))} ...")
    return "".join(lines)


def setup_line(out):
    """'N process(es) on DEVICE, amp DTYPE' from the run's start-up line."""
    m = re.search(r"(\d+) process\(es\) on (\S+), lr \S+, amp (\S+)", out)
    if m is None:
        fail("no '... process(es) on ..., amp ...' line in the output")
    return f"{m.group(1)} process(es) on {m.group(2)}, amp {m.group(3).replace('torch.', '')}"


def epochs(run_dir, n):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if [r["epoch"] for r in rows] != list(range(1, n + 1)):
        fail(f"metrics.jsonl holds epochs {[r['epoch'] for r in rows]}, not 1..{n}")
    return rows


def fsdp(run_dir, data, nproc, *extra):
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    out = run(PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
              "train_multi_gpu_fsdp.py", "--data-path", data, "--output-dir", run_dir, "train.epochs=2",
              f"train.profile={PROFILED}", *extra)
    last = epochs(run_dir, 2)[-1]
    print(f"result: 2 epochs, {last['step']} steps, {setup_line(out)}; val_acc {last['val_acc']:.3f}, "
          f"{last['img_per_s']:.0f} img/s; {profile_line(run_dir, 'cuda' in setup_line(out))}", flush=True)


PROFILED = 3  # train_fsdp's train.profile: steps rank 0's profiler records in the first epoch


def profile_line(run_dir, cuda):
    """What rank 0's train.profile trace holds: its recorded steps, and on CUDA their GPU kernels."""
    trace = run_dir / "profile" / "rank0.pt.trace.json"
    try:
        events = json.loads(trace.read_text())["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        fail(f"train.profile={PROFILED} left no readable trace {trace}: {e}")
    steps = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    kernels = sum(e.get("cat") == "kernel" for e in events)
    if len(steps) != PROFILED or (cuda and kernels == 0):
        fail(f"the trace holds {len(steps)} recorded steps (not {PROFILED}) and {kernels} GPU kernels")
    return f"profile: {len(steps)} steps" + (f", {kernels} GPU kernels" if cuda else "") + " in rank0's trace"


def resume(work, device, *extra):
    import torch
    work = Path(work)
    run_dir, data = work / "run", work / "data"
    shutil.rmtree(run_dir, ignore_errors=True)
    run(PY, "demo/flowers.py", data, "--images-per-class", 8)  # kept: nothing written when already there
    common = ["--data-path", data, "--output-dir", run_dir, "train.keep_last=2", *extra]
    run(PY, "train.py", "--device", "cpu", *common, "train.epochs=1")
    out = run(PY, "train.py", "--device", device, *common, "train.epochs=2", "train.amp=fp16", "--resume", "auto")
    if "resumed from" not in out:
        fail("the second run did not resume")
    first, second = epochs(run_dir, 2)
    steps = second["step"] - first["step"]
    before, after = (torch.load(run_dir / "checkpoints" / f"epoch_{e:03d}.pt", map_location="cpu",
                                weights_only=False)["model"] for e in (1, 2))
    # Weights and biases only: BatchNorm's running statistics move in every forward, stepped or not
    # (fp16's GradScaler skips the steps whose gradients overflow).
    params = [k for k in after if k.rsplit(".", 1)[-1] in ("weight", "bias")]
    if not all(torch.isfinite(after[k]).all() for k in params):
        fail("the resumed epoch left weights that are not finite")
    changed = sum(not torch.equal(before[k], after[k]) for k in params)
    if steps < 1 or changed == 0:
        fail(f"the resumed epoch took {steps} steps and changed {changed} of {len(params)} parameters")
    print(f"result: 1 epoch on cpu, resumed with {setup_line(out)}: {steps} steps, {changed} of "
          f"{len(params)} parameters changed", flush=True)


def deterministic(work, device, *sizes):
    """train.deterministic=true: train.py twice with 2 DataLoader workers must give bit-identical weights,
    optimizer state and schedule (tests/test_deterministic.py on CUDA)."""
    import torch
    work = Path(work)
    data = work / "data"
    run(PY, "demo/flowers.py", data, "--images-per-class", 8)  # kept: nothing written when already there
    states = []
    for name in ("a", "b"):
        run_dir = work / name
        shutil.rmtree(run_dir, ignore_errors=True)
        out = run(PY, "train.py", "--device", device, "--data-path", data, "--output-dir", run_dir, "train.epochs=1",
                  "train.deterministic=true", "data.num_workers=2", "train.batch_size=4", *sizes)
        if ", deterministic" not in out:
            fail("the run's start-up line does not say deterministic")
        states.append(torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=False))
    a, b = states
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    differ += [f"optimizer {p}.{k}" for p, st in a["optimizer"]["state"].items() for k, t in st.items()
               if torch.is_tensor(t) and not torch.equal(t, b["optimizer"]["state"][p][k])]
    if differ or a["scheduler"] != b["scheduler"]:
        fail(f"two deterministic runs differ: {', '.join(differ[:3]) or 'the schedule'}")
    print(f"result: 2 deterministic train.py runs (1 epoch, 2 workers) bitwise equal on {device}: "
          f"{len(a['model'])} weights and buffers, {len(a['optimizer']['state'])} optimizer states, the schedule",
          flush=True)


def deterministic_cost(device, model_name, img_size, batch, steps):
    """train.deterministic's cost: the project's model and optimizer on a synthetic batch (no loader, so the
    kernels are what is timed), `steps` training steps per timing, with the mode on and off in turn, 5 times
    each; img/s medians and their ratio."""
    import os, statistics, time
    import torch
    sys.path.insert(0, os.getcwd())  # the repository (the step runs there): its model and utils
    from model import build_model
    from utils.config import load_config
    from utils.distributed_utils import use_device
    from utils.optim import build_optimizer, resolve_amp
    cfg = load_config(["--device", device, f"model.name={model_name}", f"data.img_size={img_size}"])
    dev = torch.device(device)
    amp = resolve_amp(cfg.train.amp, dev)
    net = build_model(cfg.model, 5, dev, verbose=False, img_size=int(img_size))
    memory = torch.channels_last if dev.type == "cuda" and cfg.model.channels_last else torch.contiguous_format
    net = net.to(memory_format=memory)
    opt = build_optimizer(net, cfg.optim)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(batch), 3, int(img_size), int(img_size), generator=g).to(dev, memory_format=memory)
    y = torch.randint(0, 5, (int(batch),), generator=g).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(mode, n):
        use_device(dev, mode)  # the entry scripts' one switch: algorithms, cudnn.benchmark, cuBLAS workspace
        t = time.perf_counter()
        for _ in range(n):
            with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
                loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        return n * x.shape[0] / (time.perf_counter() - t)

    speed = {True: [], False: []}
    for mode in (False, True):  # warm-up of each: cuDNN's autotuning, the deterministic kernels' first use
        timed(mode, 5)
    for _ in range(5):
        for mode in (True, False):
            speed[mode].append(timed(mode, int(steps)))
    use_device(dev, False)
    on, off = statistics.median(speed[True]), statistics.median(speed[False])
    print(f"deterministic img/s {[round(v) for v in speed[True]]}, default {[round(v) for v in speed[False]]}")
    print(f"result: {model_name} step on {device} at {img_size} px, batch {batch}, amp {str(amp).replace('torch.', '') if amp else 'off'}: deterministic "
          f"{on:.0f} img/s / default {off:.0f} img/s = {on / off:.3f} (medians of 5, interleaved)", flush=True)


{"fsdp": fsdp, "resume": resume, "deterministic": deterministic,
 "deterministic_cost": deterministic_cost}[sys.argv[1]](*sys.argv[2:])
EOF

summary() {  # the table from steps.tsv and the steps' own result files -> R/summary.md, stdout
    # Lanes report side by side: each through a temporary file of its own, then a rename. (Named here:
    # a redirection is expanded in the forked child, whose $BASHPID is another.)
    local tmp=$R/.summary.$BASHPID.md
    "$PY" - "$TSV" "$R" "${PLANNED[@]}" > "$tmp" <<'EOF'
import json, re, sys, xml.etree.ElementTree as ET
from pathlib import Path
steps, out, planned = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]

def pytest_detail(name, rc):
    log = out / "logs" / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    done = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", text, re.M)
    started = re.findall(r"^(\S+::\S+) ?$", text, re.M)
    stopped_in = [t for t in started if t not in {d[0] for d in done}]
    counts = {}
    junit = out / f"junit-{name[5:]}.xml"
    try:  # junit first: it has errors in setup/teardown too
        for case in ET.parse(junit).iter("testcase"):
            if not case.get("name"):
                continue  # the entry of a test interrupted by the limit
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            counts[kind] = counts.get(kind, 0) + 1
    except (OSError, ET.ParseError):
        for _, outcome in done:
            counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    fin = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "-"
    failed = [d[0].split("::", 1)[1] for d in done if d[1] in ("FAILED", "ERROR")]
    if failed:
        fin += " (" + ", ".join(failed)[:150] + ")"
    m = re.search(r"collected (\d+) items?(?: / (\d+) deselected)?", text)
    selected = int(m.group(1)) - int(m.group(2) or 0) if m else None
    missing = []
    if stopped_in:
        missing.append("stopped in " + stopped_in[-1].split("::", 1)[1])
    if selected is not None and selected > len(done) + len(stopped_in):
        missing.append(f"{selected - len(done) - len(stopped_in)} not started")
    if rc == 5:
        fin = "no GPU tests in this file"
    return fin, "; ".join(missing) or "-"

def bench_detail(name):
    try:
        parts = json.loads((out / f"{name}.json").read_text())["parts"]
    except (OSError, ValueError, KeyError):
        return "-", f"no {name}.json"
    missing = [f"failed: {k}" for k in parts["failed"]]
    if parts.get("running"):
        missing.append(f"stopped in {parts['running']}")
    missing += [f"not started: {', '.join(parts['not_started'])}"] if parts["not_started"] else []
    return ", ".join(parts["done"]) or "-", "; ".join(missing) or "-"

def fsdp_memory_detail():
    try:
        data = json.loads((out / "fsdp_memory.json").read_text())
        rows = data["rows"]
    except (OSError, ValueError, KeyError):
        return "-", "no fsdp_memory.json"
    first = [f"{r['wrap']} {r['model']} {r['peak_gib']} GiB {r['img_per_s']} img/s" for r in rows
             if not r.get("ladder") and "error" not in r]
    largest = ", ".join(f"{w} {m}" for w, m in data.get("largest", {}).items() if m)
    fin = ", ".join(first) + (f"; largest that trains: {largest}" if largest else "")
    bad = [f"{r['wrap']} {r['model']} ({r['error'][:40]})" for r in rows if "error" in r]
    return fin or "-", ("failed: " + ", ".join(bad)) if bad else "-"

def own_line(name, tag, default):
    """The step's own last `result: ...` or `failed: ...` line (the training steps print them)."""
    log = out / "logs" / f"{name}.log"
    found = re.findall(rf"^{tag}: (.*)$", log.read_text(errors="replace"), re.M) if log.exists() else []
    return found[-1][:200] if found else default

def scaling_detail():
    try:
        s = json.loads((out / "scaling.json").read_text())
    except (OSError, ValueError):
        return "-", "no scaling.json"
    ok = [f"{r['mode']} {r['devices']}" for r in s["rows"] if "error" not in r]
    missing = [f"failed: {r['mode']} {r['devices']}" for r in s["rows"] if "error" in r]
    if s.get("running"):
        missing.append("stopped in {} {}".format(*s["running"]))
    if s.get("not_started"):
        missing.append("not started: " + ", ".join(f"{m} {k}" for m, k in s["not_started"]))
    return ", ".join(ok) or "-", "; ".join(missing) or "-"

print("| step | result | seconds | limit | finished | not finished |")
print("|---|---|---|---|---|---|")
lines = steps.read_text().splitlines()
seen = {line.split("\t")[0] for line in lines}
for name in planned:  # steps this run has not reached (yet): the script was stopped, or is still going
    if name not in seen:
        lines.append(f"{name}\tnot started\t-\t-")
order = {name: i for i, name in enumerate(["setup", *planned])}  # the lanes finish in any order
lines.sort(key=lambda line: order.get(line.split("\t")[0], len(order)))
for line in lines:
    name, rc, secs, limit, *why = line.split("\t")
    rc = int(rc) if rc.lstrip("-").isdigit() else rc
    result = {0: "ok", 124: "TIMED OUT", 137: "TIMED OUT (killed)", 143: "STOPPED (script ended)",
              "running": "STOPPED (script ended)", "skipped": "not run",
              "not started": "not started"}.get(rc, f"exit {rc}")
    if name.startswith("test_"):
        fin, missing = pytest_detail(name, rc)
        result = {1: "tests failed", 5: "ok"}.get(rc, result)
    elif name.startswith("benchmark"):
        fin, missing = bench_detail(name)
    elif name == "scaling":
        fin, missing = scaling_detail()
    elif name == "fsdp_memory":
        fin, missing = fsdp_memory_detail()
        missing = missing if rc == 0 else "see logs/fsdp_memory.log" + ("; " + missing if missing != "-" else "")
    else:
        fin, missing = ((own_line(name, "result", "done"), "-") if rc == 0 else
                        ("-", own_line(name, "failed", "see logs/" + name + ".log")))
    if rc in ("skipped", "not started"):
        fin, missing = "-", (why[0] if why else "no time left of TOTAL") if rc == "skipped" else "-"
    print(f"| {name} | {result} | {secs} | {limit} | {fin} | {missing} |")
EOF
    mv "$tmp" "$R/summary.md"
}

collect() {  # the tools' own result files -> R
    local f
    for f in benchmark.json benchmark.md; do
        [ -f "$WORK/bench/$f" ] && cp "$WORK/bench/$f" "$R/"
        [ -f "$WORK/bench_compile/$f" ] && cp "$WORK/bench_compile/$f" "$R/${f/benchmark/benchmark_compile}"
    done
    for f in "$WORK"/scaling/scaling.{json,md,png} "$WORK"/scaling/*.log; do
        [ -f "$f" ] || continue
        case $f in *.log) cp "$f" "$R/logs/scaling-$(basename "$f")" ;; *) cp "$f" "$R/" ;; esac
    done
}

pack() {  # R -> OUT/gpu_checks.tgz, summary.md beside it; each through a temporary file and a rename
    local tmp=$OUT/.gpu_checks.$BASHPID.tgz
    tar -czf "$tmp" --exclude='.summary.*' -C "$WORK/results" gpu_checks 2>/dev/null
    [ $? -le 1 ] && mv -f "$tmp" "$OUT/gpu_checks.tgz"  # 1: a log grew while read
    rm -f "$tmp"
    [ -f "$R/summary.md" ] && cp "$R/summary.md" "$OUT/.summary.$BASHPID.md" && \
        mv -f "$OUT/.summary.$BASHPID.md" "$OUT/summary.md"
}

report() {  # after every step: the table, then the archive
    collect
    summary
    pack
}

finish() {  # the last word: the table on the console and in the log, then the archive with the whole log
    local rc=$1
    [ -f "$R/summary.md" ] && cat "$R/summary.md"
    exec 1>&3 2>&4 3>&- 4>&-
    for _ in $(seq 50); do kill -0 "$TEE_PID" 2>/dev/null || break; sleep 0.1; done
    pack
    exit "$rc"
}

# The plan: these four files first (their limits above), then any other file that marks tests gpu (a
# decorator, pytestmark or marks=; not a mention in a string, as tests/test_gpu_checks.py's fake test).
declare -A LIMIT=([test_cuda_scripts]=$L_CUDA_SCRIPTS [test_gpu_pipeline]=$L_GPU_PIPELINE
                  [test_engine]=$L_ENGINE [test_optim]=$L_OPTIM)
TEST_FILES=()
if [ -n "${TESTS:-}" ]; then
    for f in $TESTS; do
        f=$(abs "$f")
        [ -f "$f" ] || { echo "error: TESTS: no such file: $f"; exit 1; }
        TEST_FILES+=("$f")
    done
else
    for f in tests/test_cuda_scripts.py tests/test_gpu_pipeline.py tests/test_engine.py tests/test_optim.py \
             $(grep -lE '^\s*@pytest\.mark\.gpu|^pytestmark\b.*mark\.gpu|marks=.*mark\.gpu' tests/test_*.py); do
        [ -f "$f" ] && [[ ! " ${TEST_FILES[*]} " =~ " $f " ]] && TEST_FILES+=("$f")
    done
fi
KNOWN=(setup data)
for f in "${TEST_FILES[@]}"; do KNOWN+=("$(basename "$f" .py)"); done
KNOWN+=(ddp_check fsdp_memory train_fsdp resume_fp16 deterministic benchmark scaling deterministic_cost
        benchmark_compile)
DEFAULT_STEPS="${KNOWN[*]}"
[ -n "$QUICK" ] && DEFAULT_STEPS=${DEFAULT_STEPS% benchmark_compile}  # no compiler run on a CPU rehearsal
read -ra SEL <<< "${STEPS:-$DEFAULT_STEPS}"
SELECTED=" ${SEL[*]} "  # one space between names and at each end, for wanted()
for s in "${SEL[@]}"; do
    [[ " ${KNOWN[*]} " =~ " $s " ]] || { echo "error: STEPS: unknown step '$s'; the steps: ${KNOWN[*]}"; exit 1; }
done
wanted() { [[ $SELECTED =~ " $1 " ]]; }
PLANNED=()
for s in "${KNOWN[@]}"; do [ "$s" != setup ] && wanted "$s" && PLANNED+=("$s"); done

STEP_PID=
STEP_RC=
CURRENT=
DATA_PID=
LANE_PIDS=()
on_stop() {  # this script was signalled: stop the running step(s), keep what they left, print the table
    trap - TERM INT HUP
    [ -n "$STEP_PID" ] && kill -TERM "$STEP_PID" 2>/dev/null && wait "$STEP_PID"
    if [ ${#LANE_PIDS[@]} -gt 0 ]; then
        kill -TERM "${LANE_PIDS[@]}" 2>/dev/null
        wait "${LANE_PIDS[@]}"
    fi
    if [ -n "$DATA_PID" ] && [ ! -f "$WORK/data.rc" ]; then
        [ -f "$WORK/data.pid" ] && kill -TERM "$(cat "$WORK/data.pid")" 2>/dev/null
        wait "$DATA_PID"
        printf 'data\trunning\t%s\t%s\n' "$(( $(date +%s) - DATA_T0 ))" "$L_DATA" >> "$TSV"
    fi
    [ -n "$CURRENT" ] && printf '%s\trunning\t%s\t%s\n' "$CURRENT" "$(( $(date +%s) - STEP_T0 ))" "-" >> "$TSV"
    echo "== stopped by a signal"
    report
    finish 143
}
trap on_stop TERM INT HUP

step() {  # [NEED=S] step NAME LIMIT CMD...: run with a time limit (cut to what is left of TOTAL), log,
          # record; not started when less than NEED seconds (default 5) are left of TOTAL
    local name=$1 limit=$2; shift 2
    local l need=${NEED:-5}
    l=$(left)
    if [ "$l" -lt "$need" ]; then
        printf '%s\tskipped\t0\t%s\tnot run: %s s left of TOTAL=%s, it needs %s\n' "$name" "$limit" \
            "$(( l > 0 ? l : 0 ))" "$TOTAL" "$need" >> "$TSV"
        STEP_RC=skipped
        echo "== $name: not run, $(( l > 0 ? l : 0 )) s left of TOTAL=${TOTAL}s and it needs ${need}"
        report
        return
    fi
    [ "$l" -lt "$limit" ] && limit=$l
    echo "== $name (limit ${limit}s): $*"
    CURRENT=$name STEP_T0=$(date +%s)
    "$PY" "$RUN_STEP" "$limit" "$GRACE" "$@" > "$R/logs/$name.log" 2>&1 &
    STEP_PID=$!
    wait "$STEP_PID"
    STEP_RC=$?
    STEP_PID= CURRENT=
    local secs=$(( $(date +%s) - STEP_T0 ))
    tail -n 15 "$R/logs/$name.log"
    printf '%s\t%s\t%s\t%s\n' "$name" "$STEP_RC" "$secs" "$limit" >> "$TSV"
    echo "== $name: exit $STEP_RC in ${secs} s"
    report
}

# -- environment --------------------------------------------------------------------------------------
date -u +%FT%TZ
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
echo "cpu cores: $(nproc), load: $(cut -d' ' -f1-3 /proc/loadavg)${QUICK:+, QUICK=1 (CPU rehearsal, tiny sizes)}"
echo "steps:${SELECTED% }"
"$PY" -c pass 2>/dev/null || { echo "error: PYTHON=$PY does not run"; finish 1; }
# What the steps import (the entry scripts: config, data, logging and its pictures; the tools), looked up
# without importing; pytest only when a test step runs. A module missing here would fail steps later.
MODULES="torch torchvision numpy PIL yaml omegaconf tqdm tensorboard matplotlib"
for s in "${SEL[@]}"; do [[ $s == test_* ]] && { MODULES+=" pytest"; break; }; done
missing=$("$PY" - $MODULES <<'EOF'
import importlib.util, sys

def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False

print(" ".join(m for m in sys.argv[1:] if not found(m)))
EOF
)
if [ -n "$missing" ]; then
    if [ -z "$WHEELS" ]; then
        echo "error: python modules missing: $missing; pip install -r requirements.txt, or WHEELS=<folder of wheels>"
        finish 1
    fi
    rm -rf "$WORK/site"
    wheels=$(for m in $missing; do case $m in PIL) echo pillow ;; yaml) echo PyYAML ;; *) echo "$m" ;; esac; done)
    # --no-deps: --target ignores what is installed, so pip would want PyYAML from the folder too.
    step setup "$L_SETUP" bash -c '"$1" -m pip install --no-index --no-deps --find-links "$2" --target "$3" \
        --no-cache-dir --disable-pip-version-check $4 && PYTHONPATH=$3${PYTHONPATH:+:$PYTHONPATH} "$1" -c \
        "import importlib, sys; [print(m, \"from\", importlib.import_module(m).__file__) for m in sys.argv[1:]]" \
        $5' setup "$PY" "$WHEELS" "$WORK/site" "$(echo $wheels)" "$missing"
    if [ "$STEP_RC" != 0 ]; then
        echo "error: setup could not install $missing from WHEELS=$WHEELS (logs/setup.log above)"
        finish 1
    fi
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
VERSIONS=$("$PY" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())")
echo "$VERSIONS"
# One process per GPU, as a user would launch it; a CPU rehearsal takes 2 gloo processes. (Read from the
# line above: one torch import less.)
NPROC=${VERSIONS##* devices }
case $NPROC in ''|*[!0-9]*|0) NPROC=2 ;; esac
report

Q= COMPILE=--compile
FLOWERS=$REPO/data/bench_flowers  # where the data step puts the folder (benchmark.py's flower_folder)
SMALL=()        # train_fsdp: the config's sizes on a GPU
RESUME_SIZES=(data.img_size=64 data.val_resize=73)  # resume_fp16's 40 demo images, a CPU epoch in seconds
RESUME_DEVICE=cuda
DET_STEP=(resnet34 224 128 30)  # deterministic_cost's timed step: model, px, batch, steps per timing
BENCH_SIZES=(--repeats 3 --epochs 2)  # benchmark.py's defaults are 5 and 3: ~50 s more than the call has
FSDP_QUICK=()
if [ -n "$QUICK" ]; then
    Q=--quick COMPILE=
    FLOWERS=$WORK/bench/data/tiny_flowers
    SMALL=(model.name=resnet18 data.img_size=32 data.val_resize=36)
    RESUME_SIZES=("${SMALL[@]}")
    RESUME_DEVICE=cpu
    DET_STEP=(resnet18 32 4 2)
    BENCH_SIZES=()
    FSDP_QUICK=(train.batch_size=4)  # the tiny folder's 40 training images: 5 steps a rank, 3 of them profiled
    # The rehearsal runs test_cuda_scripts.py's trainings on the CPU (its own switch); other GPU tests skip.
    export CUDA_SCRIPTS_DEVICE=${CUDA_SCRIPTS_DEVICE:-cpu}
    # One thread per process: on a shared CPU, torch's spinning threads make any other load a many-fold
    # slowdown (seen: a quick benchmark at 140+ s instead of 16-34 s); the rehearsal times the steps.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

# -- data, in the background while the tests run ------------------------------------------------------
DATA_T0=$(date +%s)
rm -f "$WORK/data.rc" "$WORK/data.pid"
if wanted data; then
    ( "$PY" "$RUN_STEP" "$L_DATA" "$GRACE" "$PY" benchmarks/benchmark.py $Q --prepare-data --out-dir "$WORK/bench" &
      echo $! > "$WORK/data.pid"
      wait $!
      echo "$? $(( $(date +%s) - DATA_T0 ))" > "$WORK/data.rc" ) > "$R/logs/data.log" 2>&1 &
    DATA_PID=$!
fi

# -- GPU tests, one pytest call per file, in LANES lanes side by side ---------------------------------
# SIGTERM (from the runner) becomes KeyboardInterrupt: pytest then ends the session and writes its junit xml.
PYTEST=("$PY" -c "import signal, sys, pytest; signal.signal(signal.SIGTERM, signal.default_int_handler); sys.exit(pytest.main())"
        -v -m gpu -p no:cacheprovider)
lane_stop() {  # a lane was signalled (by on_stop): stop its step, record it as running, end
    trap - TERM
    [ -n "$STEP_PID" ] && kill -TERM "$STEP_PID" 2>/dev/null && wait "$STEP_PID"
    [ -n "$CURRENT" ] && printf '%s\trunning\t%s\t%s\n' "$CURRENT" "$(( $(date +%s) - STEP_T0 ))" "-" >> "$TSV"
    exit 143
}
run_lane() {  # run_lane FILE...: their test steps one after another, in a subshell beside the other lanes
    trap lane_stop TERM
    local f name
    for f; do
        name=$(basename "$f" .py)
        step "$name" "${LIMIT[$name]:-$L_OTHER}" "${PYTEST[@]}" --junitxml="$R/junit-${name#test_}.xml" "$f"
    done
}
# Longest limit first, each file into the lane whose limits add up to least so far.
NLANES=${LANES:-3}
case $NLANES in ''|*[!0-9]*|0) echo "error: LANES=$NLANES is not a positive number"; finish 1 ;; esac
declare -a LANE_FILES LANE_LOAD
for ((i = 0; i < NLANES; i++)); do LANE_FILES[i]= LANE_LOAD[i]=0; done
while read -r limit f; do
    [ -n "$f" ] || continue
    least=0
    for ((i = 1; i < NLANES; i++)); do [ "${LANE_LOAD[i]}" -lt "${LANE_LOAD[least]}" ] && least=$i; done
    LANE_FILES[least]+=" $f"
    LANE_LOAD[least]=$(( LANE_LOAD[least] + limit ))
done < <(for f in "${TEST_FILES[@]}"; do
             name=$(basename "$f" .py)
             wanted "$name" && echo "${LIMIT[$name]:-$L_OTHER} $f"
         done | sort -s -k1,1nr)
LANE_PIDS=()
for ((i = 0; i < NLANES; i++)); do
    [ -n "${LANE_FILES[i]}" ] || continue
    echo "== lane $((i + 1)):$(for f in ${LANE_FILES[i]}; do printf ' %s' "$(basename "$f" .py)"; done)"
    run_lane ${LANE_FILES[i]} &
    LANE_PIDS+=($!)
done
[ ${#LANE_PIDS[@]} -gt 0 ] && wait "${LANE_PIDS[@]}"
LANE_PIDS=()

# -- the tools, the trainings, then the benchmarks ----------------------------------------------------
if [ -n "$DATA_PID" ]; then
    wait "$DATA_PID"
    DATA_PID=
    read -r rc secs < "$WORK/data.rc" 2>/dev/null || { rc=running; secs=-; }
    printf '%s\t%s\t%s\t%s\n' data "$rc" "$secs" "$L_DATA (beside the tests)" >> "$TSV"
    echo "== data: exit $rc in ${secs} s (beside the tests)"; tail -n 3 "$R/logs/data.log"
    report
fi
wanted ddp_check && step ddp_check "$L_DDP_CHECK" "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node="$NPROC" tools/ddp_check.py
wanted fsdp_memory && step fsdp_memory "$L_FSDP_MEMORY" "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node="$NPROC" tools/fsdp_memory.py $Q --ladder vit_h_14,regnet_y_128gf --out-dir "$R"
wanted train_fsdp && step train_fsdp "$L_TRAIN_FSDP" "$PY" "$TRAIN_CHECK" fsdp "$WORK/train_fsdp" "$FLOWERS" \
    "$NPROC" ${SMALL[@]+"${SMALL[@]}"} ${FSDP_QUICK[@]+"${FSDP_QUICK[@]}"}
wanted resume_fp16 && step resume_fp16 "$L_RESUME_FP16" "$PY" "$TRAIN_CHECK" resume "$WORK/resume_fp16" \
    "$RESUME_DEVICE" "${RESUME_SIZES[@]}" train.batch_size=4
wanted deterministic && step deterministic "$L_DETERMINISTIC" "$PY" "$TRAIN_CHECK" deterministic \
    "$WORK/deterministic" "$RESUME_DEVICE" "${RESUME_SIZES[@]}"
wanted benchmark && step benchmark "$L_BENCH" "$PY" benchmarks/benchmark.py $Q ${BENCH_SIZES[@]+"${BENCH_SIZES[@]}"} \
    --out-dir "$WORK/bench"
wanted scaling && step scaling "$L_SCALING" "$PY" benchmarks/scaling.py $Q --pipeline gpu --timeout "$ROW_LIMIT" \
    --out-dir "$WORK/scaling"
wanted deterministic_cost && step deterministic_cost "$L_DET_COST" "$PY" "$TRAIN_CHECK" deterministic_cost \
    "$RESUME_DEVICE" "${DET_STEP[@]}"
wanted benchmark_compile && NEED=$COMPILE_NEED step benchmark_compile "$L_COMPILE" "$PY" benchmarks/benchmark.py \
    $Q $COMPILE --skip e2e,ddp,bare --out-dir "$WORK/bench_compile"

# -- results ------------------------------------------------------------------------------------------
echo
for f in scaling.md benchmark.md benchmark_compile.md; do [ -f "$R/$f" ] && { cat "$R/$f"; echo; }; done
echo "== $(( $(date +%s) - T0 )) s in all; results in $OUT (summary.md, gpu_checks.tgz) and $R"
echo
report
finish 0
