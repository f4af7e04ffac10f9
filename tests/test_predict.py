"""predict.py as a user runs it, on the shared finished run (conftest.trained_run).

    python -m pytest tests/test_predict.py -q

Its top-1 equals the argmax of the model evaluate() scores (same checkpoint, same
validation transform) and its probabilities are their softmax; a corrupt image among good ones is warned about and
skipped; each bad input is one `error:` line, a non-zero exit, and nothing written.
"""
import csv
import json

import pytest
import torch
import yaml

import predict
from conftest import checkpoint_with_sizes, run_entry
from data import ImageList, build_transforms
from model import create_model
from utils import normalization

pytestmark = pytest.mark.slow


def call(capsys, *argv):
    """predict.main in this process (bad inputs fail before any model work), -> (exit code, stderr)."""
    with pytest.raises(SystemExit) as e:
        predict.main([str(a) for a in argv])
    return e.value.code, capsys.readouterr().err


def test_top1_equals_the_evaluated_models_argmax(trained_run, tmp_path):
    run_dir, daisy = trained_run["run_dir"], trained_run["data"] / "daisy"
    out = tmp_path / "preds.csv"
    proc = run_entry("predict.py", run_dir, daisy, "--out", out, "--device", "cpu", "--batch-size", 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 6 and list(rows[0])[:5] == ["path", "class1", "prob1", "class2", "prob2"]
    assert "prob5" in rows[0] and "daisy_000.jpg" in proc.stdout  # the table: top-5 per image
    # The same images through evaluate()'s path: data.py's val transform and the checkpoint's weights.
    state = torch.load(run_dir / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    model = create_model("resnet18", num_classes=5)
    model.load_state_dict(state[state["best_weights"]])  # the weights that scored best: what predict.py loads
    val_tf = build_transforms(32, 36)[1]
    images = ImageList([(r["path"], 0) for r in rows], val_tf)
    batch = torch.stack([images[i][0] for i in range(len(rows))])  # uint8: normalised as the loop does
    cpu = torch.device("cpu")
    batch = normalization.model_input(batch, cpu, normalization.normalization_of(images, cpu))
    with torch.no_grad():
        logits = model.eval()(batch)
    assert [r["class1"] for r in rows] == [state["classes"][i] for i in logits.argmax(1).tolist()]
    # Each of the five columns is the softmax of those logits over the run's temperature, to the 6 decimals written.
    top = (logits.double() / state["temperature"]).softmax(1).topk(5, dim=1)
    for row, probs, classes in zip(rows, top.values.tolist(), top.indices.tolist()):
        assert [row[f"class{k}"] for k in range(1, 6)] == [state["classes"][c] for c in classes]
        assert [float(row[f"prob{k}"]) for k in range(1, 6)] == pytest.approx(probs, abs=2e-6)


def test_a_corrupt_image_is_warned_and_skipped_json_out(trained_run, tmp_path, capsys):
    folder = tmp_path / "mixed"
    folder.mkdir()
    for src in sorted((trained_run["data"] / "roses").iterdir())[:2]:
        (folder / src.name).write_bytes(src.read_bytes())
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "p.json"
    rows = predict.main([str(trained_run["run_dir"]), str(folder), "--out", str(out), "--topk", "2",
                         "--device", "cpu"])
    err = capsys.readouterr().err
    assert err.count("warning: skipping unreadable image") == 1 and "broken.jpg" in err
    written = json.loads(out.read_text())
    assert len(rows) == len(written) == 2 and all(len(r["top"]) == 2 for r in written)


def test_bad_inputs_are_one_error_line_and_write_nothing(trained_run, tmp_path, capsys):
    run_dir, good = trained_run["run_dir"], trained_run["data"] / "daisy"
    out = tmp_path / "p.csv"
    empty = tmp_path / "empty"
    empty.mkdir()
    pickled = tmp_path / "evil.pt"
    torch.save({"model": {}, "optimizer": {}, "epoch": 0, "code": print}, pickled)  # a pickled callable
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 truncated")
    cases = {
        "missing checkpoint": ([tmp_path / "nope.pt", good], 2, "does not exist"),
        "pickled code": ([pickled, good], 2, "cannot load checkpoint"),
        "folder without images": ([run_dir, empty], 2, "holds no images"),
        "glob without match": ([run_dir, str(tmp_path / "*.png")], 2, "matches no image"),
        "only unreadable images": ([run_dir, broken], 1, "could be read"),
        "bad --out suffix": ([run_dir, good, "--out", tmp_path / "p.txt"], 2, "must end in .csv or .json"),
    }
    for name, (argv, code, text) in cases.items():
        got, err = call(capsys, *argv, "--device", "cpu", *([] if "--out" in argv else ["--out", out]))
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert got == code and len(lines) == 1 and text in lines[0], (name, got, err)
        assert not out.exists() and not (tmp_path / "p.txt").exists(), name
    assert not (run_dir / "predictions.csv").exists()


def test_the_weights_that_scored_best_are_the_ones_used(trained_run, tmp_path):
    """The run kept an EMA (train.ema_decay): a checkpoint's "best_weights" names the weights
    predict.py, export.py and --eval-only load (model.load_trained), and metrics.jsonl has both scores."""
    from model import load_trained
    state = torch.load(trained_run["run_dir"] / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    assert state["best_weights"] in ("model", "ema")
    assert any(not torch.equal(state["ema"][k], v) for k, v in state["model"].items())
    for which in ("model", "ema"):
        torch.save({**state, "best_weights": which}, tmp_path / f"{which}.pt")
        model, *_ = load_trained(tmp_path / f"{which}.pt")
        assert all(torch.equal(v, state[which][k]) for k, v in model.state_dict().items()), which
    last = json.loads((trained_run["run_dir"] / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"val_acc", "val_acc_ema", "best_weights"} <= set(last)
    assert last["best_acc"] == max(max(m["val_acc"], m["val_acc_ema"]) for m in map(
        json.loads, (trained_run["run_dir"] / "metrics.jsonl").read_text().splitlines()))


def test_sizes_a_checkpoint_lacks_come_from_default_yaml(trained_run, tmp_path, monkeypatch):
    """Sizes (and the pixel limit) the checkpoint lacks come from configs/default.yaml as it stands."""
    state = torch.load(trained_run["run_dir"] / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    path = checkpoint_with_sizes(tmp_path, monkeypatch, state, None, 40, 52)
    asked = []
    monkeypatch.setattr(predict, "build_transforms", lambda *a, **k: asked.append(a) or build_transforms(*a, **k))
    real_predict = predict.predict
    monkeypatch.setattr(predict, "predict", lambda *a, **k: asked.append((a[3], a[-1])) or real_predict(*a, **k))
    rows = predict.main([str(path), str(trained_run["data"] / "daisy"), "--out", str(tmp_path / "p.csv"),
                         "--device", "cpu"])
    limit = yaml.safe_load((tmp_path / "default.yaml").read_text())["data"]["max_image_pixels"]
    assert asked == [(40, 52), (40, limit)] and len(rows) == 6
