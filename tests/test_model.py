"""model.py: torchvision models by name (one of each family at 32 px) and your own in MODELS,
pretrained weights from the local hub cache only, loading a local --weights file, and
--freeze-layers (the head alone trains, BatchNorm statistics frozen) through the real train.py
and under DDP.

    python -m pytest tests/test_model.py -q
"""
import json
import math

import pytest
import torch
import torchvision

import train
from bad_files import call_main
from conftest import FAST_ARGS, REPO, make_image_folder, run_entry
import model as model_module
from model import build_model, create_model, find_head, freeze_all_but_head, load_weights, sync_bn_wanted
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
    model = create_model("resnet18", num_classes=5)
    assert freeze_all_but_head(model, 5) == "fc"
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["fc.bias", "fc.weight"]


# --------------------------------------------------------------------------- torchvision families

# (name, head found by find_head): one of each family, the smallest variant, at 32 px.
FAMILIES = [("resnet18", "fc"), ("mobilenet_v3_small", "classifier.3"), ("efficientnet_b0", "classifier.1"),
            ("regnet_y_400mf", "fc"), ("vit_b_32", "heads.head"), ("squeezenet1_1", "classifier.1")]


def batchnorm_buffers(model):
    return {n: b.clone() for n, b in model.named_buffers() if "running_" in n or "num_batches" in n}


@pytest.mark.parametrize("name, head", FAMILIES)
def test_family_trains_and_freezes_to_its_head(name, head):
    """Forward + backward at 32 px, batch 2; then freeze_layers: one SGD step in train mode changes
    the head and nothing else, no parameter and no BatchNorm statistic of the backbone."""
    torch.manual_seed(0)
    model = create_model(name, num_classes=3, img_size=32).train()
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters()), "every tensor trains unfrozen"

    model.zero_grad(set_to_none=True)
    assert freeze_all_but_head(model, 3) == head
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = batchnorm_buffers(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        model.train()  # the loop calls this every epoch: frozen statistics must stay frozen
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, params[n])}
    assert changed == {f"{head}.weight", f"{head}.bias"}
    assert all(torch.equal(b, stats[n]) for n, b in batchnorm_buffers(model).items())
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def last_bn_gammas(model):
    """Each residual block's last BatchNorm weight (BasicBlock: bn2, Bottleneck: bn3), by block name."""
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, (torchvision.models.resnet.BasicBlock,
                                                                       torchvision.models.resnet.Bottleneck))}
    return {n: (b.bn3 if hasattr(b, "bn3") else b.bn2).weight for n, b in blocks.items()}


@pytest.mark.parametrize("name, blocks", [("resnet18", 8), ("resnet50", 16)])
def test_zero_init_residual_key_reaches_the_builder(name, blocks):
    """model.zero_init_residual (BENCHMARKS.md, section "Initialisation"): on, every block's last BatchNorm
    starts at 0 (the block is the identity); off, at torchvision's 1; the default is the config's."""
    gammas = {}
    for value in ("true", "false", None):
        cfg = load_config([f"model.name={name}"] + ([f"model.zero_init_residual={value}"] if value else []))
        torch.manual_seed(0)
        gammas[value] = last_bn_gammas(build_model(cfg.model, 5, torch.device("cpu"), verbose=False))
        assert len(gammas[value]) == blocks
    assert all(not w.any() for w in gammas["true"].values())
    assert all(torch.equal(w, torch.ones_like(w)) for w in gammas["false"].values())
    default = "true" if load_config([]).model.zero_init_residual else "false"
    assert all(torch.equal(w, gammas[default][n]) for n, w in gammas[None].items())


def test_zero_init_residual_is_left_out_of_builders_without_it():
    """A family whose builder takes no zero_init_residual builds with the key on (the keyword is dropped)."""
    cfg = load_config(["model.name=regnet_y_400mf", "model.zero_init_residual=true"])
    assert build_model(cfg.model, 3, torch.device("cpu"), verbose=False, img_size=32).fc.out_features == 3


def test_unknown_model_name_gets_one_line_with_did_you_mean():
    with pytest.raises(UserError, match=r"'resnet19' is no torchvision.*did you mean 'resnet18'"):
        load_config(["model.name=resnet19"])  # config time: model.py's check is registered
    assert load_config(["model.name=convnext_tiny"]).model.name == "convnext_tiny"


@pytest.mark.filterwarnings("ignore:The default weight initialization of inception_v3")
def test_vit_takes_data_img_size_or_refuses_it_in_one_line():
    assert create_model("vit_b_32", num_classes=3, img_size=64).image_size == 64
    with pytest.raises(UserError, match="vit_b_32 cuts images into 32 px patches: data.img_size=40"):
        load_config(["model.name=vit_b_32", "data.img_size=40", "data.val_resize=46"])
    with pytest.raises(UserError, match=r"inception_v3 does not run at data.img_size=32"):
        build_model(load_config(["model.name=inception_v3"]).model, 3, torch.device("cpu"), img_size=32)


def test_your_own_module_in_MODELS(monkeypatch):
    def tiny_cnn(num_classes):
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, num_classes))

    monkeypatch.setitem(model_module.MODELS, "tiny_cnn", tiny_cnn)
    cfg = load_config(["model.name=tiny_cnn", "model.freeze_layers=true"])
    model = build_model(cfg.model, 4, torch.device("cpu"), img_size=32)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["5.weight", "5.bias"]
    with pytest.raises(UserError, match="your own model.*use --weights FILE"):
        load_config(["model.name=tiny_cnn", "model.pretrained=DEFAULT"])


def test_frozen_batchnorm_keeps_the_autocast_dtype():
    """--freeze-layers under bf16 autocast: a frozen layer's output is bf16 like its input (it was
    fp32: its fp32 buffers promoted it), within bf16 rounding of the fp32 result; fp32 is unchanged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 4))
    bn = model[1]
    with torch.no_grad():  # statistics far from the identity, so scale and shift both matter
        for t in (bn.weight, bn.bias, bn.running_mean):
            t.normal_()
        bn.running_var.uniform_(0.1, 2.0)
    freeze_all_but_head(model, 4)
    frozen = model[1]
    assert isinstance(frozen, torchvision.ops.misc.FrozenBatchNorm2d)  # its state_dict and checks still hold
    seen = {}
    frozen.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 3, 10, 10))
    x, out = seen["x"], seen["out"]
    assert x.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    ref = torchvision.ops.misc.FrozenBatchNorm2d.forward(frozen, x.float())  # torchvision's own, in fp32
    assert torch.equal(frozen(x.float()), ref)
    scale = (frozen.weight * (frozen.running_var + frozen.eps).rsqrt()).view(1, -1, 1, 1)
    shift = (frozen.bias - frozen.running_mean * scale.flatten()).view(1, -1, 1, 1)
    # Rounded four times (scale, shift, product, sum), each within 2^-8 of its value.
    bound = 3 * 2**-8 * ((x.float() * scale).abs() + shift.abs())
    assert ((out.float() - ref).abs() <= bound).all()


def test_the_probe_forward_runs_on_the_target_device(monkeypatch):
    """build_model's probe forward (the size check) runs once the model is on `device`, in eval mode
    and without grad, and leaves train mode on. The meta device stands in for a GPU."""
    calls = []

    class Recorder(torch.nn.Module):
        def __init__(self, num_classes):
            super().__init__()
            self.fc = torch.nn.Linear(3, num_classes)

        def forward(self, x):
            calls.append((x.device.type, self.fc.weight.device.type, self.training, torch.is_grad_enabled()))
            return self.fc(x.mean((2, 3)))

    monkeypatch.setitem(model_module.MODELS, "recorder", Recorder)
    model = build_model(load_config(["model.name=recorder"]).model, 3, torch.device("meta"), img_size=32)
    assert calls == [("meta", "meta", False, False)]
    assert model.training and model.fc.weight.is_meta


def test_head_is_the_last_layer_with_the_class_count():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 3))
    assert find_head(model, 3)[0] == "2"


def test_freeze_refuses_when_nothing_would_train():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    with pytest.raises(UserError, match="no classifier head found.*nothing would train"):
        freeze_all_but_head(model, 5)


def test_sync_bn_is_skipped_where_no_batchnorm_trains(capsys):
    model = create_model("resnet18", num_classes=3)
    assert sync_bn_wanted(model, True) is True
    freeze_all_but_head(model, 3)
    assert sync_bn_wanted(model, True) is False
    assert capsys.readouterr().out.count("note: --syncBN True skipped") == 1


# --------------------------------------------------------------------------- model.pretrained, hub cache only

@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A temporary TORCH_HOME holding resnet18's IMAGENET1K_V1 file (a seeded 1000-class state_dict);
    any download attempt fails the test."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))

    def no_network(*a, **k):
        raise AssertionError("tried to download")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    torch.manual_seed(7)
    state = torchvision.models.resnet18(num_classes=1000).state_dict()
    path = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"  # the name torchvision uses
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return path, state


@pytest.mark.parametrize("weights", ["IMAGENET1K_V1", "DEFAULT"])
def test_pretrained_loads_from_the_hub_cache_and_replaces_the_head(hub_cache, weights):
    path, state = hub_cache
    cfg = load_config(["model.name=resnet18", f"model.pretrained={weights}", "model.freeze_layers=true"])
    report = []
    model = create_model("resnet18", 5, img_size=32, pretrained=weights, log=report.append)
    assert report == [f"pretrained resnet18 ResNet18_Weights.IMAGENET1K_V1 from {path}: {len(state) - 2} tensors "
                      "loaded; head 'fc' replaced (1000 -> 5 classes, freshly initialised)"]
    own = model.state_dict()
    assert own["fc.weight"].shape == (5, 512)
    assert all(torch.equal(v, state[k]) for k, v in own.items() if not k.startswith("fc."))
    frozen = build_model(cfg.model, 5, torch.device("cpu"), img_size=32, verbose=False)
    assert torch.equal(frozen.bn1.running_mean, state["bn1.running_mean"])  # frozen with the loaded statistics


def test_pretrained_missing_from_the_cache_is_one_line_before_any_data(tmp_path, monkeypatch):
    """train.py's main() in this process (the error line and what is left behind are the point)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.chdir(tmp_path)
    code, _, stderr = call_main(train.main, ["--data-path", tmp_path / "no-such-folder", "model.name=resnet18",
                                             "model.pretrained=DEFAULT"])
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    assert code == 2, stderr
    assert stderr.strip() == (
        "error: pretrained weights ResNet18_Weights.IMAGENET1K_V1 are not in the local torch hub cache: put "
        f"resnet18-f37072fd.pth in {cache} (nothing is downloaded here); on a machine with internet fetch it "
        "with: curl -L -o resnet18-f37072fd.pth https://download.pytorch.org/models/resnet18-f37072fd.pth")
    assert not cache.exists() and not (tmp_path / "runs").exists()


def test_finetune_recipe_states_only_what_differs(hub_cache):
    cfg = load_config(["--config", str(REPO / "configs" / "finetune.yaml"), "model.name=resnet18"])
    assert (cfg.model.pretrained, cfg.optim.name, cfg.optim.label_smoothing, cfg.optim.head_lr_scale) == \
        ("DEFAULT", "adamw", 0.1, 10.0)
    assert cfg.optim.lr < load_config([]).optim.lr


def test_unknown_weights_name_gets_did_you_mean(hub_cache):
    with pytest.raises(UserError, match="resnet18 has no such weights \\(did you mean 'IMAGENET1K_V1'\\?\\)"):
        load_config(["model.name=resnet18", "model.pretrained=IMAGENET1K_V2"])


# --------------------------------------------------------------------------- --freeze-layers, real script

@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory):
    """train.py --weights W --freeze-layers True for one short epoch; W has a 5-class fc so it all loads.
    Its main() runs in this process: the test is about its output lines and checkpoint."""
    tmp = tmp_path_factory.mktemp("frozen")
    root = make_image_folder(tmp / "flowers")
    torch.manual_seed(5)
    weights = create_model("resnet18", num_classes=5).state_dict()
    torch.save(weights, tmp / "w.pth")
    code, stdout, stderr = call_main(train.main, [*FAST_ARGS, "--data-path", root, "--output-dir", tmp / "run",
                                                  "--weights", tmp / "w.pth", "--freeze-layers", "True"])
    assert code == 0, stderr[-3000:]
    ckpt = torch.load(tmp / "run" / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return stdout, weights, ckpt


def frozen_backbone_unchanged(before, after, head):
    """No parameter and no BatchNorm buffer outside `head` differs; the head did train.
    FrozenBatchNorm2d keeps no num_batches_tracked, so those keys are absent from `after`."""
    assert set(before) - set(after) == {k for k in before if k.endswith("num_batches_tracked")}
    changed = sorted(k for k in after if not torch.equal(after[k], before[k]))
    assert changed == [f"{head}.bias", f"{head}.weight"]


@pytest.mark.slow
def test_freeze_layers_changes_only_fc_parameters(frozen_run):
    stdout, weights, ckpt = frozen_run
    assert f"loaded {len(weights)}/{len(weights)} tensors" in stdout
    assert "freeze_layers: only the head 'fc' trains" in stdout
    frozen_backbone_unchanged(weights, ckpt["model"], "fc")
    # The optimizer only ever held the head.
    assert [len(g["params"]) for g in ckpt["optimizer"]["param_groups"]] == [2]
    # A frozen run's checkpoint still loads, strictly, into the plain (unfrozen) model.
    create_model("resnet18", num_classes=5).load_state_dict(ckpt["model"])


@pytest.mark.slow
def test_freeze_layers_under_ddp_keeps_the_backbone_and_skips_sync_bn(tmp_path):
    """torchrun, 2 gloo processes, mobilenet_v3_small (head classifier.3) with --syncBN True: one
    note, no conversion, and after an epoch no backbone parameter or BatchNorm buffer has moved."""
    root = make_image_folder(tmp_path / "flowers")
    torch.manual_seed(6)
    weights = create_model("mobilenet_v3_small", num_classes=5).state_dict()
    torch.save(weights, tmp_path / "w.pth")
    proc = run_entry("train_multi_gpu_ddp.py", *FAST_ARGS, "model.name=mobilenet_v3_small", "--data-path", root,
                     "--output-dir", tmp_path / "run", "--weights", tmp_path / "w.pth", "--freeze-layers", "True",
                     "--syncBN", "True", nproc=2, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("note: --syncBN True skipped") == 1 and "SyncBatchNorm" not in proc.stdout
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    frozen_backbone_unchanged(weights, ckpt["model"], "classifier.3")


@pytest.mark.slow
def test_mobilenet_v3_small_trains_with_adamw_smoothing_and_clipping(tmp_path):
    """Another family trains the demo (a small set from demo/flowers.py, configs/demo.yaml) through
    train.py for an epoch, every new optim key on: every tensor moves, the optimizer is AdamW with
    its no-decay group, the loss is finite. Its main() runs in this process (outputs are the point)."""
    from demo.flowers import generate
    root = generate(tmp_path / "demo_flowers", images_per_class=8, min_size=80, max_size=100)
    torch.manual_seed(8)
    start = create_model("mobilenet_v3_small", num_classes=5).state_dict()
    torch.save(start, tmp_path / "w.pth")
    code, _, stderr = call_main(train.main, [
        "--config", REPO / "configs" / "demo.yaml", "--device", "cpu", "train.epochs=1", "data.num_workers=0",
        "train.figures=false", "model.name=mobilenet_v3_small", "--data-path", root, "--output-dir", tmp_path / "run",
        "--weights", tmp_path / "w.pth", "optim.name=adamw", "optim.lr=0.001", "optim.weight_decay=0.05",
        "optim.label_smoothing=0.1", "optim.clip_grad_norm=1.0"])
    assert code == 0, stderr[-3000:]
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert [g["weight_decay"] for g in ckpt["optimizer"]["param_groups"]] == [0.05, 0.0]
    params = [n for n, _ in create_model("mobilenet_v3_small", 5).named_parameters()]
    assert [n for n in params if not torch.equal(ckpt["model"][n], start[n])] == params
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(metrics[-1]["train_loss"]) and metrics[-1]["val_count"] == 5 * 2  # 8 per class, 20% held out


def test_bn_momentum_sets_every_batchnorm_and_null_keeps_the_architectures():
    """model.bn_momentum=0.1 on MobileNetV3 (its own is 0.01): the running mean moves 10 x as far
    after one training forward; null leaves the builder's value."""
    moved = {}
    for value in ("null", "0.1"):
        torch.manual_seed(0)
        model = build_model(load_config(["model.name=mobilenet_v3_small", f"model.bn_momentum={value}"]).model,
                            5, torch.device("cpu"), verbose=False)
        norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        assert {m.momentum for m in norms} == {0.01 if value == "null" else 0.1}
        model.train()(3 + torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)))
        moved[value] = norms[0].running_mean.clone()
    assert torch.allclose(moved["0.1"], 10 * moved["null"], rtol=1e-4, atol=1e-7)
    assert moved["null"].abs().max() > 1e-3
