"""What the model costs and where the step's time goes: the start-of-run line, train.profile, TensorBoard's layout.

    python -m pytest tests/test_inside.py -q

One profiled train.py run and its twin without the profiler (in this process), one --eval-only of it,
and one 2-process DDP launch (gloo) profiling every rank.
"""
import contextlib
import io
import json
import re

import pytest
import torch
import torchvision
from torch.utils.flop_counter import FlopCounterMode

import train
from _resume_utils import assert_same_weights, metrics, run_args, run_main, single_thread
from conftest import make_image_folder, run_entry
from utils.profiling import model_cost

REGIONS = {"data wait", "forward", "backward", "optimizer step"}
START_LINE = re.compile(r"model: ([\d.]+)M parameters \(([\d.]+)M trained\), ([\d.]+) GFLOPs per 32 px image "
                        r"\(([\d.]+) G multiply-adds\)")
PROFILED_STEPS = 2
TABLE = "top operators by self_cpu_time_total"


def run_train(args):
    out = io.StringIO()
    with single_thread(), pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(out):
        assert run_main(train, [str(a) for a in args], monkeypatch) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """25 train images, batch 4: 6 steps; the profiler waits 1, warms up 1, records 2. The EMA is on so that
    val/acc_ema exists for the layout."""
    tmp = tmp_path_factory.mktemp("inside")
    data = make_image_folder(tmp / "flowers")
    common = ("train.ema_decay=0.5",)
    logs = {name: run_train(run_args(data, tmp / name, *common, f"train.profile={profile}", epochs=1))
            for name, profile in (("profiled", PROFILED_STEPS), ("plain", 0))}
    logs["eval"] = run_train(run_args(data, tmp / "eval", flags=("--eval-only", "--resume",
                                                                 tmp / "profiled" / "checkpoints" / "last.pt")))
    return {"dir": tmp, "logs": logs}


def events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def trace_events(path):
    return json.loads(path.read_text())["traceEvents"]  # Chrome trace JSON: what Perfetto and TensorBoard read


# --------------------------------------------------------------------------- parameters and FLOPs

def test_resnet34_at_224_px_costs_what_torchvision_says():
    """torchvision's "_ops" (called GFLOPS there) counts multiply-adds: 3.664 G for ResNet34; FlopCounterMode 2 each."""
    weights = torchvision.models.ResNet34_Weights.IMAGENET1K_V1
    cost = model_cost(torchvision.models.resnet34(), 224)
    assert cost["gflops"] / 2 == pytest.approx(weights.meta["_ops"], rel=0.02)
    assert cost["params"] == cost["trainable_params"] == weights.meta["num_params"]


def test_the_start_line_counts_the_trained_model_at_data_img_size(runs):
    found = START_LINE.search(runs["logs"]["profiled"])
    assert found, runs["logs"]["profiled"][-3000:]
    # Counted apart: a real forward of the run's model (resnet18, 5 classes) on one 32 px image.
    net = torchvision.models.resnet18(num_classes=5).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        net(torch.zeros(1, 3, 32, 32))
    gflops, params = counter.get_total_flops() / 1e9, sum(p.numel() for p in net.parameters())
    assert float(found.group(3)) == pytest.approx(gflops, rel=1e-3)
    assert float(found.group(4)) == pytest.approx(gflops / 2, rel=1e-3)
    assert float(found.group(1)) == float(found.group(2)) == pytest.approx(params / 1e6, abs=0.005)
    # The same figures in the HParams tab and in --eval-only's eval.json.
    from tensorboard.plugins.hparams import plugin_data_pb2
    content = events(runs["dir"] / "profiled").SummaryMetadata("_hparams_/session_start_info").plugin_data.content
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    result = json.loads((runs["dir"] / "eval" / "eval.json").read_text())
    for figures in ({k: hparams[k].number_value for k in ("params", "trainable_params", "gflops")}, result):
        assert figures["params"] == figures["trainable_params"] == params
        assert figures["gflops"] == pytest.approx(gflops, rel=1e-6)


# --------------------------------------------------------------------------- train.profile

def test_the_profile_holds_the_steps_regions_and_the_log_its_top_operators(runs):
    trace = trace_events(runs["dir"] / "profiled" / "profile" / "rank0.pt.trace.json")
    names = [e["name"] for e in trace if e.get("cat") == "user_annotation"]
    assert REGIONS <= set(names)
    assert sum(n.startswith("ProfilerStep#") for n in names) == PROFILED_STEPS
    assert all(names.count(r) == PROFILED_STEPS for r in REGIONS), names
    log = runs["logs"]["profiled"]
    assert log.count(TABLE) == 1 and "Self CPU %" in log and "aten::convolution_backward" in log


def test_profiling_off_writes_nothing_and_profiling_on_changes_no_weight(runs):
    plain = runs["dir"] / "plain"
    assert not (plain / "profile").exists() and TABLE not in runs["logs"]["plain"]
    assert_same_weights(runs["dir"] / "profiled" / "checkpoints" / "last.pt", plain / "checkpoints" / "last.pt")
    assert metrics(runs["dir"] / "profiled") == metrics(plain)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inside_ddp")
    data = make_image_folder(tmp / "flowers")
    args = run_args(data, tmp / "run", "train.batch_size=2", f"train.profile={PROFILED_STEPS}",
                    "train.profile_ranks=all", epochs=1)
    proc = run_entry("train_multi_gpu_ddp.py", *args, nproc=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return tmp / "run", proc.stdout


def test_ddp_profiles_every_rank_and_its_all_reduce_runs_in_the_backward(ddp_run):
    run_dir, log = ddp_run
    for rank in (0, 1):
        trace = trace_events(run_dir / "profile" / f"rank{rank}.pt.trace.json")
        assert REGIONS <= {e["name"] for e in trace if e.get("cat") == "user_annotation"}
        backward = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e["name"] == "backward"]
        # DDP's gradient buckets: the backend's all-reduce, within a backward region (docs/troubleshooting.md).
        reduces = [e["ts"] for e in trace if e["name"] == "gloo:all_reduce"]
        assert any(start <= ts <= end for ts in reduces for start, end in backward), rank
    assert log.count(TABLE) == 1 and len(START_LINE.findall(log)) == 1  # rank 0 alone prints


# --------------------------------------------------------------------------- TensorBoard's first view

def test_custom_scalars_put_train_and_val_on_one_chart_and_bookkeeping_sorts_last(runs):
    from tensorboard.plugins.custom_scalar import layout_pb2
    acc = events(runs["dir"] / "profiled")
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    tags = set(acc.Tags()["scalars"])
    charts = [[t for t in tags if any(re.search(r, t) for r in chart.multiline.tag)]
              for category in layout.category for chart in category.chart]
    for wanted in ({"train/loss", "val/loss"}, {"val/acc", "val/acc_ema", "val/top5"}, {"train/lr"},
                   {"train/img_per_s"}, {"train/data_wait", "train/data_wait_step"}):
        assert wanted <= tags and any(wanted <= set(chart) for chart in charts), wanted
    assert not any(t in chart for chart in charts for t in ("train/loss_step", "val/loss_step")), charts
    # TensorBoard orders its sections by the tag's first part: the curves', then the bookkeeping.
    sections = sorted({t.split("/")[0] for t in tags})
    assert sections == ["train", "val", "~run"], sections
    assert {"~run/epoch_seconds", "~run/bad_images", "~run/val_count", "~run/epoch"} <= tags
