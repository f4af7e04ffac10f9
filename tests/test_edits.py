"""The edits the README's "Make it yours" invites, each made in a scratch copy of the repository:
the tests of what it touches still pass there, and the product does what the README promises.

    python -m pytest tests/test_edits.py -q

- an augmentation (ColorJitter in data.build_transforms): data.pipeline=auto trains on the PIL
  path, data.pipeline=gpu stops with its one line, and the transform tests pass;
- a focal loss with a gamma key (a Criterion field, the single-label return of Criterion.loss,
  optim.focal_gamma): training runs on it, the key reaches it, the multi-label branch above it still
  trains a label file on a sigmoid, the loop tests pass, and the NaN fault still reaches the training
  loss (tests/_faults.py patches the criterion; train.py stops at the step it names);
- a metric in engine.sample_metrics: it lands in metrics.jsonl, TensorBoard and eval.json;
- a config key (schema line + commented default): the config tests pass and the key overrides.

Each edit finds its place by the function or class it changes (ast), not by a line's exact text,
so reformatting the code does not break it.
"""
import ast
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import FAST_ARGS, REPO, make_image_folder
from demo import meadow
from utils.run_dir import read_metrics

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def _node(tree, qualname):
    """The function or class `qualname` ("Class.method" for a method) of a parsed module."""
    body = tree.body
    for name in qualname.split("."):
        found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
        assert len(found) == 1, f"no single {name!r} ({qualname})"
        node, body = found[0], found[0].body
    return node


def _insert(lines, at, code, indent):
    """`code` (dedented text) as lines indented by `indent` spaces, before 0-based line `at`."""
    lines[at:at] = [" " * indent + line if line else line for line in textwrap.dedent(code).splitlines(True)]


def in_function(path, qualname, code, where):
    """An edit of function (or class) `qualname` in `path`. where:
    "body"          `code` replaces its body, after the docstring;
    "last"          `code` replaces its last statement (the single-label return of Criterion.loss);
    "before_return" `code` goes before its last statement (a return);
    "after_fields"  `code` goes after a class's last annotated field;
    ("after_call", name) `code` goes after the call to `name` (e.g. a transform in a list)."""
    def edit(text):
        tree, lines = ast.parse(text), text.splitlines(True)
        node = _node(tree, qualname)
        if where == "body":
            first = node.body[1] if ast.get_docstring(node) else node.body[0]
            indent = first.col_offset
            del lines[first.lineno - 1:node.body[-1].end_lineno]
            _insert(lines, first.lineno - 1, code, indent)
        elif where == "last":
            last = node.body[-1]
            del lines[last.lineno - 1:last.end_lineno]
            _insert(lines, last.lineno - 1, code, last.col_offset)
        elif where == "before_return":
            last = node.body[-1]
            assert isinstance(last, ast.Return), f"{qualname} does not end in a return"
            _insert(lines, last.lineno - 1, code, last.col_offset)
        elif where == "after_fields":
            fields = [n for n in node.body if isinstance(n, ast.AnnAssign)]
            _insert(lines, fields[-1].end_lineno, code, fields[-1].col_offset)
        else:
            calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and getattr(n.func, "attr",
                     getattr(n.func, "id", None)) == where[1]]
            assert len(calls) == 1, f"{qualname} holds no single call to {where[1]}"
            _insert(lines, calls[0].end_lineno, code, calls[0].col_offset)
        return "".join(lines)
    return path, edit


def in_yaml_section(path, section, line):
    """`line` added at the end of the top-level `section:` of a YAML file (its keys indented two spaces)."""
    def edit(text):
        lines = text.splitlines(True)
        start = lines.index(f"{section}:\n")
        end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("  "))
        while not lines[end - 1].strip():
            end -= 1
        lines.insert(end, f"  {line}\n")
        return "".join(lines)
    return path, edit


CONFIG_KEY = [
    in_function("utils/config.py", "OptimConfig", "focal_gamma: float = MISSING\n", "after_fields"),
    in_yaml_section("configs/default.yaml", "optim",
                    "focal_gamma: 2.0             # focal loss: how much the easy images count less; 0 = cross entropy"),
]

EDITS = {
    "augmentation": [in_function("data.py", "build_transforms", "transforms.ColorJitter(0.4, 0.4, 0.4),\n",
                                 ("after_call", "RandomHorizontalFlip"))],
    # The gamma: one Criterion field named as the config key (build_criterion fills it) and the single-label
    # return replaced; the multi-label branch above it stays (a softmax over 0/1 rows would train silently).
    "focal_loss": CONFIG_KEY + [
        in_function("engine.py", "Criterion", "focal_gamma: float = 2.0\n", "after_fields"),
        in_function("engine.py", "Criterion.loss", """\
            ce = F.cross_entropy(logits, targets, weight=self.class_weight, label_smoothing=self.label_smoothing,
                                 reduction="none")
            focal = (1 - torch.exp(-ce)) ** self.focal_gamma * ce
            return focal.mean() if reduction == "mean" else focal
            """, "last")],
    "metric": [in_function("engine.py", "sample_metrics",
                           'metrics["val_top3"] = lambda logits, labels: top_k_hits(logits, labels, 3)\n',
                           "before_return")],
    "config_key": CONFIG_KEY,
}

# The tests of what each edit touches, run in the edited copy (its process: the edited modules).
TOUCHED = {
    "augmentation": ["tests/test_data.py", "tests/test_gpu_pipeline.py", "-k", "transform"],
    "focal_loss": ["tests/test_engine.py", "-k", "hand or nan"],
    "config_key": ["tests/test_config.py", "-k", "default or comment"],
}


def scratch_copy(dest):
    """The repository's files as git sees them (tracked, and untracked but not ignored), copied to dest."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    return dest


def apply(root, edits):
    for path, edit in edits:
        text = (root / path).read_text()
        edited = edit(text)
        assert edited != text
        compile(edited, path, "exec") if path.endswith(".py") else None  # the edit left valid code
        (root / path).write_text(edited)


MARK = "@@edits-call-exit "
# Several command lines of one test in one Python process of the edited copy, one after another:
# each process spends seconds importing torch before it does anything. A call is what follows
# `python`: a script and its arguments, "-c" and code, or "-m" and a module (pytest: put it last,
# after the runs, so nothing it leaves in the process reaches them).
DRIVER = """
import json, runpy, sys
for call in json.loads(sys.argv[1]):
    sys.argv = [call[1] if call[0] == "-m" else call[0], *call[2 if call[0] == "-m" else 1:]]
    try:
        if call[0] == "-c":
            exec(compile(call[1], "<string>", "exec"), {"__name__": "__main__"})
        elif call[0] == "-m":
            runpy.run_module(call[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(call[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush(); sys.stderr.flush()
    print("\\n" + MARK + str(code), flush=True)
""".replace("MARK", repr(MARK))


def run_calls(root, *calls, timeout=600):
    """Each call's (exit code, stdout and stderr as they came), run in one process by DRIVER."""
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps([list(map(str, c)) for c in calls])],
                          cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env={**os.environ, **ENV})
    pieces = re.split("\n" + re.escape(MARK) + r"(-?\d+)\n", proc.stdout)  # out, code, out, code, ..., ""
    assert proc.returncode == 0 and len(pieces) == 2 * len(calls) + 1, proc.stdout[-4000:]
    return [(int(code), out) for out, code in zip(pieces[0::2], pieces[1::2])]


def touched_tests(name):
    return ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *TOUCHED[name])


def assert_passed(result):
    rc, out = result
    assert rc == 0, out[-4000:]
    assert " passed" in out.strip().splitlines()[-1], out[-2000:]


@pytest.fixture
def edited(request, tmp_path):
    root = scratch_copy(tmp_path / "repo")
    apply(root, EDITS[request.param])
    return root, make_image_folder(tmp_path / "flowers")


def test_each_edit_finds_its_place_and_leaves_valid_code(tmp_path):
    """Every edit applies to this tree (one place each, valid Python afterwards), and the focal loss
    edit changes the single-label return of Criterion.loss alone: its docstring and multi-label branch stay."""
    for name, edits in EDITS.items():
        root = tmp_path / name
        for path, _ in edits:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text((REPO / path).read_text())
        apply(root, edits)
    focal = (tmp_path / "focal_loss" / "engine.py").read_text()
    assert focal.count("self.focal_gamma") == 1 and focal.count("focal_gamma: float = 2.0") == 1
    before = _node(ast.parse((REPO / "engine.py").read_text()), "Criterion.loss")
    after = _node(ast.parse(focal), "Criterion.loss")
    kept = len(before.body) - 1  # the docstring and the multi-label branch
    assert [ast.dump(n) for n in after.body[:kept]] == [ast.dump(n) for n in before.body[:kept]]
    assert "focal_gamma" in ast.unparse(after.body[kept:]) and "focal_gamma" not in ast.unparse(before)


@pytest.mark.parametrize("edited", ["augmentation"], indirect=True)
def test_an_added_augmentation_trains_on_the_pil_path_and_the_gpu_pipeline_says_why_not(edited, tmp_path):
    root, images = edited
    (rc, out), (gpu_rc, gpu_out), tests = run_calls(
        root, ("train.py", *FAST_ARGS, "--data-path", images, "--output-dir", tmp_path / "auto", "data.pipeline=auto"),
        ("train.py", *FAST_ARGS, "--data-path", images, "--output-dir", tmp_path / "gpu", "data.pipeline=gpu"),
        touched_tests("augmentation"))
    assert_passed(tests)
    assert rc == 0 and len(read_metrics(tmp_path / "auto")) == 1, out[-3000:]
    assert "gpu pipeline:" not in out  # auto on the CPU: the PIL loader, which applies the jitter
    errors = [line for line in gpu_out.splitlines() if line.startswith("error:")]
    assert gpu_rc == 2 and len(errors) == 1 and "ColorJitter" in errors[0], gpu_out[-3000:]
    assert not (tmp_path / "gpu").exists()


@pytest.mark.parametrize("edited", ["focal_loss"], indirect=True)
def test_a_focal_loss_with_a_gamma_key_trains_and_the_loop_tests_and_the_nan_fault_still_hold(edited, tmp_path):
    root, images = edited
    meadows = meadow.generate(tmp_path / "meadows", images=12, min_size=40, max_size=48)
    p = 1 / (1 + 2 * math.exp(-2))  # softmax probability of the true class of logits (2, 0, 0)
    (rc, out), (train_rc, train_out), (ml_rc, ml_out), tests, (nan_rc, nan_out) = run_calls(
        root, ("-c", "import torch, engine; from utils.config import load_config; "
                     "x, y, t = torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([0]), torch.tensor([[1.0, 0.0, 1.0]]); "
                     "print(engine.Criterion()(x, y).item(), "
                     "engine.build_criterion(load_config(['optim.focal_gamma=0.5']).optim)(x, y).item(), "
                     "engine.Criterion(multilabel=True)(x, t).item())"),
        ("train.py", *FAST_ARGS, "--data-path", images, "--output-dir", tmp_path / "run", "optim.focal_gamma=1.0"),
        ("train.py", *FAST_ARGS, "--data-path", meadows, f"data.labels={meadows / 'labels.csv'}",
         "--output-dir", tmp_path / "multi"),
        touched_tests("focal_loss"),
        # Last: tests/_faults.py patches engine.Criterion for the rest of the process.
        ("tests/_faults.py", "nan:0:1", "train.py", *FAST_ARGS, "--data-path", images, "--output-dir",
         tmp_path / "nan"))
    assert_passed(tests)
    assert rc == 0, out[-2000:]
    default, half, multi = map(float, out.split()[-3:])
    assert default == pytest.approx((1 - p) ** 2 * -math.log(p), rel=1e-5)
    assert half == pytest.approx((1 - p) ** 0.5 * -math.log(p), rel=1e-5)  # the key reaches the loss
    sigmoid = [1 / (1 + math.exp(-v)) for v in (2.0, 0.0, 0.0)]  # multi-label: still BCE per label, averaged
    assert multi == pytest.approx(-(math.log(sigmoid[0]) + math.log(1 - sigmoid[1]) + math.log(sigmoid[2])) / 3,
                                  rel=1e-5)
    assert train_rc == 0 and len(read_metrics(tmp_path / "run")) == 1, train_out[-3000:]
    assert ml_rc == 0 and "val_map" in read_metrics(tmp_path / "multi")[0], ml_out[-3000:]
    assert nan_rc != 0 and "loss is nan at epoch 1, step 1" in nan_out, nan_out[-3000:]  # the fault reaches it


@pytest.mark.parametrize("edited", ["metric"], indirect=True)
def test_a_new_metric_reaches_metrics_tensorboard_and_eval_json(edited, tmp_path):
    root, images = edited
    out_dir = tmp_path / "run"
    (rc, out), (eval_rc, eval_out) = run_calls(
        root, ("train.py", *FAST_ARGS, "--data-path", images, "--output-dir", out_dir),
        ("train.py", *FAST_ARGS, "--data-path", images, "--eval-only", "--resume", out_dir / "checkpoints" / "best.pt",
         "--output-dir", tmp_path / "eval"))
    assert rc == 0, out[-3000:]
    assert 0 <= read_metrics(out_dir)[0]["val_top3"] <= 1 and read_metrics(out_dir)[0]["val_top3"] >= read_metrics(out_dir)[0]["val_acc"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out_dir)).Reload()
    assert "val/top3" in events.Tags()["scalars"]
    assert eval_rc == 0, eval_out[-3000:]
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["val_top3"] == read_metrics(out_dir)[0]["val_top3"]


@pytest.mark.parametrize("edited", ["config_key"], indirect=True)
def test_a_new_config_key_is_checked_commented_and_overridable(edited):
    root, _ = edited
    (rc, out), (typo_rc, typo_out), tests = run_calls(
        root, ("-c", "from utils.config import load_config; "
                     "print(load_config([]).optim.focal_gamma, load_config(['optim.focal_gamma=0.5']).optim.focal_gamma)"),
        ("train.py", "optim.focal_gama=1"), touched_tests("config_key"))
    assert_passed(tests)
    assert rc == 0 and out.split()[-2:] == ["2.0", "0.5"], out[-2000:]
    assert typo_rc == 2 and "did you mean 'optim.focal_gamma'" in typo_out, typo_out[-2000:]
