"""model.py: the torchvision ResNet, loading a local --weights file, and --freeze-layers
through the real train.py.

    python -m pytest tests/test_model.py -q
"""
import pytest
import torch
import torchvision

from conftest import FAST_ARGS, make_image_folder, run_entry
from model import build_model, create_model, freeze_all_but_head, load_weights
from utils.config import load_config
from utils.errors import UserError


def test_resnet34_from_torchvision_with_num_classes():
    model = build_model(load_config([]).model, num_classes=7, device=torch.device("cpu"))
    assert isinstance(model, torchvision.models.ResNet)
    assert [len(model.layer1), len(model.layer2), len(model.layer3), len(model.layer4)] == [3, 4, 6, 3]
    assert model.fc.out_features == 7
    assert model.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, 7)
    assert all(p.requires_grad for p in model.parameters())


@pytest.fixture(scope="module")
def imagenet_resnet34(tmp_path_factory):
    """A 1000-class ResNet34 state_dict saved with torch.save, as a downloaded .pth would be."""
    torch.manual_seed(1)
    state = torchvision.models.resnet34(num_classes=1000).state_dict()
    path = tmp_path_factory.mktemp("weights") / "resnet34-imagenet.pth"
    torch.save(state, path)
    return path, state


def test_weights_load_all_that_fit_and_report_the_1000_class_fc(imagenet_resnet34):
    path, state = imagenet_resnet34
    torch.manual_seed(2)
    model = create_model("resnet34", num_classes=5)
    fc_before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("fc.")}
    report = load_weights(model, path)

    own = model.state_dict()
    assert f"loaded {len(own) - 2}/{len(own)} tensors" in report
    assert "fc.weight (1000, 512)->(5, 512)" in report and "fc.bias (1000,)->(5,)" in report
    for k, v in own.items():
        if k.startswith("fc."):
            assert torch.equal(v, fc_before[k]), f"{k} should keep its initial value"
        else:
            assert torch.equal(v, state[k]), f"{k} was not loaded"


@pytest.mark.parametrize("wrap", [
    lambda sd: {"module." + k: v for k, v in sd.items()},                 # DataParallel / DDP
    lambda sd: {"module._orig_mod." + k: v for k, v in sd.items()},       # compiled, then DDP
    lambda sd: {"model": {"module." + k: v for k, v in sd.items()}, "epoch": 3},  # one of our checkpoints
])
def test_weights_with_wrapper_prefixes_load(tmp_path, wrap):
    torch.manual_seed(3)
    source = create_model("resnet18", num_classes=5).state_dict()
    path = tmp_path / "w.pt"
    torch.save(wrap(source), path)
    torch.manual_seed(4)
    model = create_model("resnet18", num_classes=5)
    report = load_weights(model, path)
    assert f"loaded {len(source)}/{len(source)} tensors" in report
    assert all(torch.equal(v, source[k]) for k, v in model.state_dict().items())


def test_missing_weights_file_is_a_user_error(tmp_path):
    missing = tmp_path / "nope.pth"
    cfg = load_config(["model.name=resnet18", f"model.weights={missing}"]).model
    with pytest.raises(UserError, match="nope.pth.*does not exist"):
        build_model(cfg, num_classes=5, device=torch.device("cpu"))


def test_freeze_all_but_head_leaves_only_fc_trainable():
    model = freeze_all_but_head(create_model("resnet18", num_classes=5))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["fc.bias", "fc.weight"]


# --------------------------------------------------------------------------- --freeze-layers, real script

@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory):
    """train.py --weights W --freeze-layers True for one short epoch; W has a 5-class fc so it all loads."""
    tmp = tmp_path_factory.mktemp("frozen")
    root = make_image_folder(tmp / "flowers")
    torch.manual_seed(5)
    weights = create_model("resnet18", num_classes=5).state_dict()
    torch.save(weights, tmp / "w.pth")
    proc = run_entry("train.py", *FAST_ARGS, "--data-path", root, "--output-dir", tmp / "run",
                     "--weights", tmp / "w.pth", "--freeze-layers", "True", cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(tmp / "run" / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return proc, weights, ckpt


@pytest.mark.slow
def test_freeze_layers_changes_only_fc_parameters(frozen_run):
    proc, weights, ckpt = frozen_run
    assert f"loaded {len(weights)}/{len(weights)} tensors" in proc.stdout
    params = {n for n, _ in create_model("resnet18", num_classes=5).named_parameters()}
    after = ckpt["model"]
    assert set(after) == set(weights)
    changed = sorted(n for n in params if not torch.equal(after[n], weights[n]))
    assert changed == ["fc.bias", "fc.weight"]
    # The optimizer only ever held the head.
    assert [len(g["params"]) for g in ckpt["optimizer"]["param_groups"]] == [2]
