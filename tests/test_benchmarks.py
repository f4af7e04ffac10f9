"""The benchmark and the scaling tool run end to end on CPU (--quick).

(The train step's freedom from per-step host syncs is tested in tests/test_engine.py.)

    python -m pytest tests/test_benchmarks.py -q
"""
import json
import subprocess
import sys

import pytest
import torch
from PIL import Image

from conftest import REPO

ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_tool(*args, timeout=600):
    import os
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=timeout)


@pytest.mark.slow
def test_benchmark_quick_reports_every_part(tmp_path):
    r = run_tool("benchmarks/benchmark.py", "--quick", "--steps", "2", "--out-dir", tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "benchmark.json").read_text())
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
def test_scaling_quick_runs_single_and_ddp_over_gloo(tmp_path):
    r = run_tool("benchmarks/scaling.py", "--quick", "--pipeline", "gpu", "--out-dir", tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    assert [(x["mode"], x["devices"]) for x in rows] == [("single", 1), ("ddp", 1), ("ddp", 2)]
    for row in rows:
        assert "error" not in row, row
        assert row["s_per_epoch"] > 0 and row["img_per_s"] > 0 and row["efficiency"] > 0
        assert row["peak_mem_mb"]["largest process"] > 50
    assert rows[0]["speedup"] == 1.0 and rows[2]["global_batch"] == 16
    # Exact evaluation under the gpu pipeline too: every val image once, whatever the world size.
    assert len({row["val_count"] for row in rows}) == 1
    assert "| ddp | 2 | 16 |" in (tmp_path / "scaling.md").read_text()
    with Image.open(tmp_path / "scaling.png") as png:
        assert png.size == (720, 420) and len(png.getcolors(1 << 16)) > 3
