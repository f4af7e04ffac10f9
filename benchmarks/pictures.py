"""What the epoch's pictures cost the training steps that run beside them, and what the checksum of their records does.

    OMP_NUM_THREADS=1 python benchmarks/pictures.py     # 12 rounds; about 3 minutes on 2 cores
    python benchmarks/pictures.py --quick               # 2 rounds of 2 steps (the test suite's)

Why (issue 44): rank 0 draws each epoch's pictures on its logger thread (utils/run_logger.Background) while
the next epoch trains. A thread shares Python's lock (the GIL) with the training loop, which takes it back
between its ops: what the thread does while holding it (Python code, and C code that keeps the lock)
stalls the steps, however many cores are idle. Timing whole runs cannot show a cost of 1-2 %: the runs
of one command here differ by ±10 %. This times the steps themselves, in one process, interleaved.

The steps: a resnet18 training step (SGD, batch 64 of 32 px images) on the main thread, as the loop's.
The picture job: the template's own, `figures.epoch_pictures` of that resnet18's validation on
benchmarks/vs_timm.py's set (the confusion matrix; the 16 worst mistakes with their Grad-CAM maps), through
a RunLogger to TensorBoard on its logger thread, and the event file flushed, as every epoch does; it is run
again and again while its window lasts. Each round times a window of --steps steps alone and, for each arm, a
window with the job beside it (the three in turn in each place of the round):
  tensorboard   TensorBoard's own checksum of each record: pure Python without TensorFlow;
  c             google-crc32c's, what the template installs (utils/run_logger.checksum_in_c).
Per arm: the median over rounds of (window with the job) / (the round's window alone), and the steps'
seconds lost per second of picture job (the windows' sums: lost / job time). A run draws its pictures
for about 0.25 s an epoch of 5 s here (BENCHMARKS.md), so a loss of L per second costs a run about 5 L %.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repository's modules: this file runs as a script

ARMS = ("tensorboard", "c")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=6, help="training steps in each timed window; default 6")
    p.add_argument("--data", help="the image set's root (default data/vs_timm_32, generated if absent)")
    p.add_argument("--out-dir", default="runs/pictures", help="the RunLogger's directory (event files)")
    p.add_argument("--json", help="also write the rounds and the table here")
    p.add_argument("--quick", action="store_true", help="2 rounds of 2 steps on 8 + 4 images per class")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 2
    return args


def picture_job(args):
    """A function drawing the template's epoch pictures to TensorBoard once, and the RunLogger it writes to."""
    import torch
    from benchmarks import vs_timm
    from data import build_datasets, make_loader
    from engine import evaluate
    from model import build_model
    from utils import figures
    from utils.cam import gallery_explainer
    from utils.config import load_config
    from utils.run_logger import RunLogger
    from utils.samplers import ShardSampler
    root = Path(args.data or REPO / "data" / ("tiny_32" if args.quick else "vs_timm_32"))
    vs_timm.make_set(root, *((8, 4) if args.quick else (100, 25)))
    cfg = load_config(["--data-path", str(root), "--device", "cpu", "model.name=resnet18", "data.img_size=32",
                       "data.val_resize=36", "data.num_workers=0"])
    _, val_set, classes = build_datasets(cfg.data)
    device = torch.device("cpu")
    net = build_model(cfg.model, len(classes), device, img_size=32, channels=3)
    loader = make_loader(val_set, 64, ShardSampler(val_set), cfg.data, device, train=False)
    val = evaluate(net, loader, device, len(classes), worst_k=16)
    worst = val.pop("val_worst")
    logger = RunLogger(args.out_dir, enabled=True)
    cam = gallery_explainer(net, None)

    def job():
        figures.epoch_pictures(logger, val, worst, classes, val_set, 0, None, cam)
        logger.writer.flush()  # the TensorBoard records written, as at each epoch's end (RunLogger._epoch)
    return job, logger


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torchvision
    from tensorboard.summary.writer import record_writer
    from utils.run_logger import checksum_in_c, masked_crc32c
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    job, logger = picture_job(args)
    logger.wait()  # the writer opened, which installs the C checksum
    if not checksum_in_c():
        raise SystemExit("error: google-crc32c's C code is not installed: pip install -r requirements.txt")
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as in_python
    checksums = {"tensorboard": in_python, "c": masked_crc32c}

    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))

    def window():
        start = time.perf_counter()
        for _ in range(args.steps):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        return time.perf_counter() - start

    busy, idle, stop, job_seconds = threading.Event(), threading.Event(), threading.Event(), [0.0]

    def draw():  # the job, again and again while a window lasts, on a thread as the logger's
        while not stop.is_set():
            idle.set()
            if not busy.wait(0.01):
                continue
            idle.clear()
            start = time.perf_counter()
            job()
            job_seconds[0] += time.perf_counter() - start
    job()  # fonts, Grad-CAM hooks and TensorBoard's writer warmed up
    window()
    drawer = threading.Thread(target=draw, daemon=True)
    drawer.start()
    alone, beside = [], {arm: [] for arm in ARMS}
    spent = {arm: 0.0 for arm in ARMS}
    for r in range(args.rounds):
        order = ("alone", *ARMS)
        for arm in order[r % 3:] + order[:r % 3]:  # each in each place in turn: a drifting load falls on all
            if arm == "alone":
                alone.append(window())
                continue
            record_writer.masked_crc32c = checksums[arm]
            job_seconds[0] = 0.0
            busy.set()
            beside[arm].append(window())
            busy.clear()
            time.sleep(0.02)
            idle.wait()  # the job under way ends (and counts) before the next window
            spent[arm] += job_seconds[0]
        print(f"round {r + 1}/{args.rounds}: alone {alone[-1]:.2f} s, "
              + ", ".join(f"{arm} {beside[arm][-1]:.2f} s" for arm in ARMS), flush=True)
    stop.set()
    busy.set()
    drawer.join()
    record_writer.masked_crc32c = masked_crc32c
    logger.close()

    if min(spent.values()) == 0:
        raise SystemExit("error: the picture job never ran beside the steps; give more --steps")
    rows = {arm: {"ratio": statistics.median(b / a for a, b in zip(alone, beside[arm])),
                  "lost_per_job_second": (sum(beside[arm]) - sum(alone)) / spent[arm], "job_seconds": spent[arm]}
            for arm in ARMS}
    print(f"\n| checksum of TensorBoard's records | steps with the pictures beside them / alone (median of "
          f"{args.rounds}) | steps' seconds lost per second of picture job | picture job, s |")
    print("|---|---|---|---|")
    for arm, row in rows.items():
        print(f"| {arm} | {row['ratio']:.3f} | {row['lost_per_job_second']:.2f} | {row['job_seconds']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"alone": alone, "beside": beside, "rows": rows}, indent=1))
    print(f"\n{args.steps} steps a window, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), "
          f"torch {torch.__version__}, Python {platform.python_version()}; load average at the end "
          f"{', '.join(f'{v:.2f}' for v in os.getloadavg())}; `python benchmarks/pictures.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}`")


if __name__ == "__main__":
    main()
