"""The benchmark and the scaling tool run end to end on CPU (--quick), and while they run their
files always hold a valid table of what is finished (what a time limit would leave).

(The train step's freedom from per-step host syncs is tested in tests/test_engine.py.)

    python -m pytest tests/test_benchmarks.py -q
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from PIL import Image

import data
from _resume_utils import run_main, single_thread
from benchmarks import benchmark, scaling
from conftest import REPO

# Only borrowed, under another name: data.py's own is patched per test (run_watching).
_spec = importlib.util.spec_from_file_location("plain_transforms", REPO / "tests" / "plain_transforms" /
                                               "sitecustomize.py")
_plain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_plain)
plain_transforms = _plain.plain_transforms

# The tools run train.py (and torchrun) with the shipped transforms, whatever data.py holds now: a
# user's ColorJitter would rightly stop the gpu pipeline's part (tests/plain_transforms/sitecustomize.py).
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO / "tests" / "plain_transforms")}


def run_watching(out_dir, stem, tool, *args, monkeypatch, timeout=600):
    """Run a tool's main() in this process and, every 0.1 s while it runs, read the OUT/<stem>.json and
    .md it writes (from a thread). In-process: what is tested is the files and the table it prints, not
    the process (a scaling row is still a process of its own, as a user runs it).

    -> (exit code, [each distinct json seen, parsed], [each distinct md seen]): what a time limit would
    have left, had it stopped the tool at that moment. A json that does not parse (a half-written file)
    is kept as None.
    """
    texts = {"json": [], "md": []}
    done = threading.Event()

    def watch():
        deadline = time.monotonic() + timeout
        while not done.is_set() and time.monotonic() < deadline:
            for ext, seen in texts.items():
                try:
                    text = (out_dir / f"{stem}.{ext}").read_text()
                except FileNotFoundError:
                    continue
                if not seen or seen[-1] != text:
                    seen.append(text)
            done.wait(0.1)

    # What ENV gives a tool's own process: the shipped transforms (here and in the rows' processes), one
    # thread; a port it sets for its process group is put back after.
    monkeypatch.setattr(data, "build_transforms", plain_transforms)
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with single_thread():
            code = run_main(tool, [str(a) for a in args], monkeypatch)
    finally:
        done.set()
        watcher.join()

    def parse(text):
        try:
            return json.loads(text)
        except ValueError:
            return None
    return code, [parse(t) for t in texts["json"]], texts["md"]


@pytest.mark.slow
def test_benchmark_quick_reports_every_part(tmp_path, monkeypatch, capfd):
    code, jsons, mds = run_watching(tmp_path, "benchmark", benchmark, "--quick", "--steps", "1", "--out-dir",
                                    tmp_path, monkeypatch=monkeypatch)
    r = subprocess.CompletedProcess("benchmark.py", code, *capfd.readouterr())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # While it ran, the files held each finished part and named the part running and those not started.
    assert None not in jsons
    partial = [j for j in jsons if j["parts"]["done"] == ["ceiling"] and j["parts"]["running"] == "e2e pil"]
    assert partial and partial[0]["ceiling"]["img_per_s"] > 0, [j["parts"] for j in jsons]
    assert partial[0]["parts"]["not_started"] == ["e2e gpu", "ddp", "bare"]
    assert any("| ceiling img/s (eager) |" in md and "- not started: e2e gpu, ddp, bare" in md for md in mds)
    res = json.loads((tmp_path / "benchmark.json").read_text())
    assert res["parts"] == {"done": ["ceiling", "e2e pil", "e2e gpu", "ddp", "bare"], "failed": {},
                            "running": None, "not_started": []}
    assert res["ceiling"]["img_per_s"] > 0 and res["ceiling"]["peak_mem_mb"] > 0
    for pipe in ("pil", "gpu"):
        e2e = res["end_to_end"][pipe]
        assert e2e["img_per_s"] > 0 and e2e["ratio_to_ceiling"] > 0
        assert 0 < e2e["train_seconds"] < e2e["epoch_seconds"] <= e2e["epoch_seconds_with_checkpoint"] + 1e-6
        assert 0 <= e2e["val_acc"] <= 1
    ddp = res["ddp_ws1"]
    assert ddp["ratio"] > 0 and ddp["bound"] == 1.05 and "ddp_pytorch_defaults" in ddp["variants"]
    assert ddp["configured_options"]["gradient_as_bucket_view"] is True
    bare = res["bare_loop"]
    assert bare["ratio"] > 0 and bare["bound"] == 1.05 and bare["device"] == "cpu"
    assert res["meta"]["torch"] == torch.__version__ and res["meta"]["date"]
    md = (tmp_path / "benchmark.md").read_text()
    assert "| e2e / ceiling (gpu) |" in md and "| CPU project / bare loop step |" in md
    assert r.stdout.rstrip().endswith(md.strip().splitlines()[-1])  # the table is printed last


@pytest.mark.slow
def test_scaling_quick_runs_single_and_ddp_over_gloo(tmp_path, monkeypatch, capfd):
    code, jsons, mds = run_watching(tmp_path, "scaling", scaling, "--quick", "--pipeline", "gpu", "--out-dir",
                                    tmp_path, monkeypatch=monkeypatch)
    r = subprocess.CompletedProcess("scaling.py", code, *capfd.readouterr())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # Before and after each row the files held the rows so far and marked the running one and the rest.
    assert None not in jsons
    # (--quick plans two rows, single 1 and ddp 2: a DDP row of 1 process is not run there.)
    counts = [len(j["rows"]) for j in jsons]
    assert counts == sorted(counts) and set(counts) == {0, 1, 2}, counts
    zero = [j for j in jsons if not j["rows"] and j["running"] == ["single", 1]]
    assert zero and zero[0]["not_started"] == [["ddp", 2]], [(len(j["rows"]), j["running"]) for j in jsons]
    one = [j for j in jsons if len(j["rows"]) == 1 and j["running"] == ["ddp", 2]]
    assert one, [(len(j["rows"]), j["running"]) for j in jsons]
    assert one[0]["rows"][0]["mode"] == "single" and one[0]["rows"][0]["img_per_s"] > 0
    assert one[0]["not_started"] == []
    assert any("| single | 1 | | started, no result yet" in md and "| ddp | 2 | | not started |" in md
               for md in mds), mds
    assert any("| single | 1 | 8 |" in md and "| ddp | 2 | | started, no result yet" in md for md in mds), mds
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert [(x["mode"], x["devices"]) for x in rows] == [("single", 1), ("ddp", 2)]
    for row in rows:
        assert "error" not in row, row
        assert row["s_per_epoch"] > 0 and row["img_per_s"] > 0 and row["efficiency"] > 0
        assert row["peak_mem_mb"]["largest process"] > 50
    assert rows[0]["speedup"] == 1.0 and rows[1]["global_batch"] == 16
    # Exact evaluation under the gpu pipeline too: every val image once, whatever the world size.
    assert len({row["val_count"] for row in rows}) == 1
    assert "| ddp | 2 | 16 |" in (tmp_path / "scaling.md").read_text()
    with Image.open(tmp_path / "scaling.png") as png:
        assert png.size == (720, 420) and len(png.getcolors(1 << 16)) > 3


def test_loader_benchmark_quick_times_both_loaders_on_the_same_files(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/loader.py", "--quick", "--repeats", "2", "--out-dir",
                        str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **ENV})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "loader.json").read_text())
    assert list(res["sets"]) == ["flowers", "photos"] and res["meta"]["workers"] >= 1
    for name, files, batch in (("flowers", 20, 8), ("photos", 10, 4)):
        s = res["sets"][name]
        assert s["files"] == files and s["batch_size"] == batch, s
        for kind, dtype in (("template", "uint8"), ("template_model_input", "float32"), ("reference", "float32")):
            assert len(s[kind]["runs"]) == 2 and min(s[kind]["runs"]) > 0
            # Delivered: the loader's uint8 batches; as the model's input: normalised to float by the loop.
            assert s[kind]["shape"] == [batch, 3, 32, 32] and s[kind]["dtype"] == dtype, (kind, s[kind])
        # Each ratio is the median of runs back to back in this invocation, not of two medians.
        for kind, key in (("template", "ratio"), ("template_model_input", "model_input_ratio")):
            pairs = [t / ref for t, ref in zip(s[kind]["runs"], s["reference"]["runs"])]
            assert s[key] == pytest.approx(sum(pairs) / 2), (kind, s)
        assert s["pair_ratios"] == pytest.approx([t / ref for t, ref in zip(s["template"]["runs"],
                                                                            s["reference"]["runs"])])
        assert s["goal_met"] == (s["ratio"] >= s["goal"])
        assert f"| {name} | {files} | {batch} |" in r.stdout
    with Image.open(next((tmp_path / "data" / "tiny_photos" / "daisy").glob("*.jpg"))) as photo:
        assert photo.size == (400, 300) and photo.format == "JPEG"
    md = (tmp_path / "loader.md").read_text()
    assert r.stdout.rstrip().endswith(md.strip().splitlines()[-1])  # the table is printed last


@pytest.mark.slow
def test_sample_memory_quick_workers_copy_the_list_but_not_the_sample_list(tmp_path):
    """Forked workers that read every sample copy a list of tuples (pytorch/pytorch#13246), not a SampleList."""
    out = tmp_path / "sample_memory.json"
    r = subprocess.run([sys.executable, "benchmarks/sample_memory.py", "--quick", "--json", out], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    old, new = rows["list of tuples"], rows["SampleList"]
    assert len(old["worker_growth_mb"]) == len(new["worker_growth_mb"]) == 2
    # 50,000 tuples of a 63-character path and a label: about 10 MiB, copied by each worker.
    assert min(old["worker_growth_mb"]) > 5, old
    assert max(new["worker_growth_mb"]) < min(old["worker_growth_mb"]) / 10, rows
    assert "| SampleList |" in r.stdout


@pytest.mark.slow
def test_init_quick_prints_a_table_of_both_settings(tmp_path):
    """benchmarks/init.py --quick: train.py with model.zero_init_residual true and false, interleaved, from
    scratch and from --weights (the demo's checkpoints, trained first); the table's every row holds the two
    means and their difference. One set of the three: each set's runs are the same code with other data."""
    r = subprocess.run([sys.executable, "benchmarks/init.py", "--quick", "--tasks", "digits", "--data",
                        tmp_path / "data", "--out-dir", tmp_path], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env={**os.environ, **ENV})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "init.json").read_text())
    assert [run["zero_init_residual"] for run in res["runs"]] == [True, False] * 2  # interleaved
    assert all(0 <= run["metric"] <= 1 for run in res["runs"])
    # Each setting's --weights runs start from the checkpoint trained with that setting.
    for z in ("true", "false"):
        log = (tmp_path / f"digits-weights-seed0-{z}.log").read_text()
        assert f"pretrain-demo-{z}" in log and "loaded " in log, log[-2000:]
    number = r"(\d\.\d{3}) \[(\d\.\d{3}), (\d\.\d{3})\]"
    rows = re.findall(rf"^\| (digits \(top-1\)|digit pairs \(mAP\)|demo \(top-1\)) \| (scratch|--weights \(\w+\)) "
                      rf"\| {number} \| {number} \| ([+-]\d\.\d{{3}}) \|$", r.stdout, re.M)
    assert [row[:2] for row in rows] == [("digits (top-1)", "scratch"), ("digits (top-1)", "--weights (demo)")], \
        r.stdout
    for row in rows:
        true_mean, false_mean, diff = float(row[2]), float(row[5]), float(row[8])
        assert diff == pytest.approx(true_mean - false_mean, abs=1.5e-3), row
    assert re.search(r"better or equal in \d rows with true, \d with false", r.stdout)
    md = (tmp_path / "init.md").read_text()
    assert r.stdout.rstrip().endswith(md.strip().splitlines()[-1])  # the table is printed last


@pytest.mark.slow
def test_init_recipes_quick_runs_the_shipped_demo_recipes(tmp_path):
    """benchmarks/init.py --recipes: the README's two demo recipes as shipped (their --config, the default
    model), true then false, one row each with the two means and their difference."""
    r = subprocess.run([sys.executable, "benchmarks/init.py", "--recipes", "--quick", "--data", tmp_path / "data",
                        "--out-dir", tmp_path], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, **ENV})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "init.json").read_text())
    assert [(run["task"], run["zero_init_residual"]) for run in res["runs"]] == [
        ("demo recipe", True), ("demo recipe", False), ("multi-label demo recipe", True),
        ("multi-label demo recipe", False)]
    for name, config in (("demo_recipe", "configs/demo.yaml"), ("multi-label_demo_recipe", "configs/demo_multilabel.yaml")):
        saved = (tmp_path / f"{name}-scratch-seed0-true" / "config.yaml").read_text()
        assert "name: resnet34" in saved and "lr: 0.05" in saved, saved  # the default model, the recipe's lr
        assert config in (tmp_path / f"{name}-scratch-seed0-true" / "run_record.json").read_text()
    number = r"(\d\.\d{3}) \[\d\.\d{3}, \d\.\d{3}\]"
    rows = re.findall(rf"^\| (demo recipe \(top-1\)|multi-label demo recipe \(mAP\)) \| scratch \| {number} \| "
                      rf"{number} \| ([+-]\d\.\d{{3}}) \|$", r.stdout, re.M)
    assert len(rows) == 2, r.stdout
    for _, true_mean, false_mean, diff in rows:
        assert float(diff) == pytest.approx(float(true_mean) - float(false_mean), abs=1.5e-3)


def test_zero_init_residual_default_is_the_measured_tables_verdict():
    """configs/default.yaml's model.zero_init_residual is what BENCHMARKS.md's "Initialisation" section says
    by its rule: the shipped demo recipes' rows decide (better or equal in more of them; a tie is false), the
    other table is told but does not vote. Remeasure, and the default follows."""
    from utils.config import load_config
    text = (REPO / "BENCHMARKS.md").read_text()
    section = text[text.index("\n## Initialisation\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| ([^|\n]+) \|[^|\n]+\|[^|\n]+\|[^|\n]+\| ([+-]\d\.\d{3}) \|$", section, re.M)
    assert len(rows) == 8, section  # three data sets from scratch and from --weights, and the two recipes
    diffs = [float(d) for name, d in rows if "recipe" in name]
    assert len(diffs) == 2, rows
    wins_true, wins_false = sum(d >= 0 for d in diffs), sum(d <= 0 for d in diffs)
    assert load_config([]).model.zero_init_residual is (wins_true > wins_false)
    assert f"the default is **{str(wins_true > wins_false).lower()}**" in section


@pytest.mark.slow
def test_whole_run_quick_prints_the_ratio_and_the_breakdown(tmp_path):
    """benchmarks/whole_run.py --quick: train.py and the bare loop, one pair, as real processes; the ratio is
    template / bare of the two walls, both trained the same steps on the same images, and the template's
    breakdown (from its metrics.jsonl and the launch and exit times) accounts for its wall time."""
    from utils import run_dir as run_files
    r = subprocess.run([sys.executable, "benchmarks/whole_run.py", "--quick", "--out-dir", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={**os.environ, **ENV})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "whole_run.json").read_text())
    assert len(res["runs"]) == 1
    pair = res["runs"][0]
    template, bare = pair["template"], pair["bare"]
    assert template["wall_s"] > 0 and bare["wall_s"] > 0
    assert pair["wall_ratio"] == pytest.approx(template["wall_s"] / bare["wall_s"])
    assert res["wall_ratio"] == pair["wall_ratio"] and res["goal_met"] == (res["wall_ratio"] <= 1.03)
    # 80 train images in batches of 64, the last partial one dropped: one step in each of 2 epochs; 40 val images.
    assert template["steps_per_epoch"] == bare["steps_per_epoch"] == [1, 1]
    assert template["val_count"] == bare["val_count"] == 40
    assert template["epoch_lrs"] == pytest.approx(bare["epoch_lrs"])
    parts = {"start", "steps", "validation", "pictures", "saves_and_rest", "between_epochs", "end"}
    for side in (template, bare):
        assert set(side["breakdown"]) == parts, side["breakdown"]
        assert min(side["breakdown"].values()) >= 0, side["breakdown"]
        # The parts tile the wall time, to metrics.jsonl's millisecond stamps.
        assert sum(side["breakdown"].values()) == pytest.approx(side["wall_s"], abs=0.005), side
        assert min(side["breakdown"][k] for k in ("start", "steps", "validation", "end")) > 0, side["breakdown"]
    # The template's parts are its own clocks: metrics.jsonl's seconds, pictures on by default.
    rows = run_files.read_metrics(tmp_path / "template-0", epochs_only=True)
    assert template["breakdown"]["steps"] == pytest.approx(sum(row["train_seconds"] for row in rows))
    assert template["breakdown"]["validation"] == pytest.approx(sum(row["val_seconds"] for row in rows))
    assert template["breakdown"]["pictures"] == pytest.approx(sum(row["figure_seconds"] for row in rows))
    assert template["breakdown"]["pictures"] > 0 and bare["breakdown"]["pictures"] == 0
    assert template["breakdown"]["between_epochs"] > 0  # epoch 1's TensorBoard scalars, after its stamp
    assert bare["save_s"] > 0
    assert f"wall time, template / bare: {res['wall_ratio']:.3f} (median of 1 pair(s))" in r.stdout
    assert f"| 0 | template | {template['wall_s']:.2f} | {bare['wall_s']:.2f} | {pair['wall_ratio']:.3f} |" in r.stdout
    md = (tmp_path / "whole_run.md").read_text()
    assert r.stdout.rstrip().endswith(md.strip().splitlines()[-1])  # the table is printed last


@pytest.mark.slow
def test_pictures_quick_times_the_steps_alone_and_beside_the_picture_job_with_each_checksum(tmp_path):
    """benchmarks/pictures.py --quick: the steps timed alone and with the template's epoch pictures drawn to
    TensorBoard beside them, once with each checksum; the job ran in both arms (its seconds, its pictures in
    the event file) and each printed row is computed from the windows' own times."""
    import statistics

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "json"
    r = subprocess.run([sys.executable, "benchmarks/pictures.py", "--quick", "--data", str(tmp_path / "data"),
                        "--out-dir", str(tmp_path / "logger"), "--json", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={**os.environ, **ENV})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert len(res["alone"]) == 2 and all(len(res["beside"][arm]) == 2 for arm in ("tensorboard", "c"))
    for arm, row in res["rows"].items():
        assert row["job_seconds"] > 0, arm
        ratio = statistics.median(b / a for a, b in zip(res["alone"], res["beside"][arm]))
        assert row["ratio"] == pytest.approx(ratio)
        assert row["lost_per_job_second"] == pytest.approx((sum(res["beside"][arm]) - sum(res["alone"])) /
                                                           row["job_seconds"])
        assert f"| {arm} | {row['ratio']:.3f} | {row['lost_per_job_second']:.2f} |" in r.stdout
    acc = EventAccumulator(str(tmp_path / "logger"), size_guidance={"images": 0})
    acc.Reload()  # TensorBoard's own reader checks every record's checksum, of both arms
    assert len(acc.Images("val/confusion_matrix")) == len(acc.Images("val/worst_mistakes")) >= 3


@pytest.mark.slow
def test_finetune_quick_runs_the_pretraining_the_rows_asked_and_distils_from_the_full_fine_tune(tmp_path):
    """benchmarks/finetune.py --quick: resnet18 pretrained on digits 0-4, then the rows asked on digits 5-9; the
    student's teacher is the full fine-tune of its seed, and each row of the table holds its mean and range."""
    r = subprocess.run([sys.executable, "benchmarks/finetune.py", "--quick", "--arms",
                        "full fine-tune,student + teacher", "--data", tmp_path / "data", "--out-dir", tmp_path],
                       cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **ENV})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "finetune.json").read_text())
    assert [run["arm"] for run in res["runs"]] == ["full fine-tune", "student + teacher"]
    assert sorted(p.name for p in (tmp_path / "data" / "digits5-9" / "train").iterdir()) == ["5", "6", "7", "8", "9"]
    record = json.loads((tmp_path / "student_and_teacher-seed0" / "run_record.json").read_text())
    teacher = tmp_path / "full_fine-tune-seed0" / "checkpoints" / "best.pt"
    assert record["teacher"]["path"] == str(teacher.resolve())
    assert "loaded " in (tmp_path / "full_fine-tune-seed0.log").read_text()
    number = r"(\d\.\d{3}) \[\d\.\d{3}, \d\.\d{3}\]"
    rows = re.findall(rf"^\| (full fine-tune|student \+ teacher) \| {number} \| ([+-]\d\.\d{{3}}) \|$", r.stdout, re.M)
    assert [row[0] for row in rows] == ["full fine-tune", "student + teacher"] and rows[0][2] == "+0.000", r.stdout
