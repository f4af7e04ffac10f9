"""The network: any torchvision classification model by name, one of timm's, or your own nn.Module.

    model.name=resnet34              # any name of torchvision.models.list_models(module=torchvision.models)
    model.name=timm/convnext_nano    # any timm.list_models() name (pip install timm: optional)
    model.name=my_net                # your own: add it to MODELS below
    model.pretrained=DEFAULT         # torchvision weights, read from the local torch hub cache only;
                                     # for timm/<name>: its default tag (or a tag, a1_in1k...), from the
                                     # local Hugging Face cache only

The scripts call `build_model`. The classifier head is found generically
(`find_head`): it is what gets sized to the dataset's classes, replaced after
pretrained weights, and the only part left trainable by freeze_layers. Nothing
is ever downloaded: weights come from local files (--weights) or the hub cache.
Grey images (data.channels=1): the first convolution, found generically too
(`find_first_conv`), reads one channel, its RGB kernels summed (`adapt_first_conv`).
"""
import difflib
import functools
import inspect
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn
from torchvision.ops import misc as tv_misc

from utils import run_dir as run_files
from utils.cam import find_target
from utils.checkpoint import best_weights, calibration_of, label_task, load_checkpoint, strip_wrapper_prefixes
from utils.config import register_check
from utils.errors import OUT_OF_MEMORY, RUNTIME_EXIT, UserError, allocation
from utils.fsdp import checkpoint_blocks

# Your own model: name -> constructor called as constructor(num_classes=N), returning an
# nn.Module whose last Linear (or Conv2d) with N outputs is the classifier head, e.g.
#     MODELS["tiny_cnn"] = lambda num_classes: nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(),
#         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))
# then train with model.name=tiny_cnn. Checkpoints record the name, as for torchvision models.
# A constructor that takes `in_chans` is called with in_chans=data.channels (3, or 1 for grey) and builds
# for it; one that does not gets its first Conv2d adapted to grey as a torchvision model does.
MODELS = {}

# Builder keywords that only some torchvision families take, and the value wanted where they do.
# aux_logits (GoogLeNet, Inception v3): off, so a training step returns one tensor of logits.
# zero_init_residual (ResNets, ResNeXt, Wide ResNet) is model.zero_init_residual, added per call.
_OPTIONAL_KWARGS = {"aux_logits": False}
# Families whose position embeddings fix the input size: the builder keyword that sets it.
_SIZE_KWARG = {"vit_": "image_size", "maxvit_": "input_size"}
# model.name=timm/<name>: timm.create_model(<name>). timm is imported only then (an optional dependency).
TIMM_PREFIX = "timm/"
# A timm model's weights in its Hugging Face repository, in the order timm itself tries them.
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def torchvision_names():
    return torchvision.models.list_models(module=torchvision.models)


def _size_kwarg(name):
    return next((kw for prefix, kw in _SIZE_KWARG.items() if name.startswith(prefix)), None)


def is_timm(name):
    return str(name).startswith(TIMM_PREFIX) and name not in MODELS


def _timm(name):
    """The timm package, imported for a timm/<name> model only: one error line where it is missing."""
    try:
        import timm
    except ImportError:
        raise UserError(f"model.name={name} is a timm model and timm is not installed: pip install timm") from None
    return timm


def _check_timm(name, pretrained):
    """timm/<name>: a timm architecture, its pretrained tag (after a dot, or model.pretrained) one that timm
    knows, and the weights in the cache."""
    timm = _timm(name)
    arch = name[len(TIMM_PREFIX):]
    if not timm.is_model(arch):
        guess = difflib.get_close_matches(arch, timm.list_models(), n=1)
        raise UserError(f"bad value for 'model.name': '{arch}' is no timm model (timm.list_models())"
                        + (f" (did you mean '{TIMM_PREFIX}{guess[0]}'?)" if guess else ""))
    if pretrained:
        timm_weights(name, pretrained)
    elif "." in arch:
        _timm_pretrained_cfg(timm, name, "DEFAULT")


def _timm_pretrained_cfg(timm, name, pretrained):
    """timm/<arch>[.<tag>] and model.pretrained (DEFAULT: the name's tag, else timm's default one; or a
    tag: a1_in1k...) -> timm's pretrained config of those weights; one error line if timm has none."""
    arch, _, tag = name[len(TIMM_PREFIX):].partition(".")
    what = f"model.pretrained={pretrained}" if pretrained != "DEFAULT" or not tag else f"model.name={name}"
    tag = tag if pretrained == "DEFAULT" else pretrained
    tags = [n.partition(".")[2] for n in timm.list_pretrained(f"{arch}.*")]
    if not tags:
        raise UserError(f"{what}: timm has no pretrained weights for {arch}; use --weights FILE")
    if tag and tag not in tags:
        guess = difflib.get_close_matches(tag, tags, n=1)
        raise UserError(f"{what}: timm has no weights '{tag}' for {arch}" + (f" (did you mean '{guess[0]}'?)" if guess
                        else "") + f"; choose one of {', '.join(tags)}")
    return timm.models.get_pretrained_cfg(f"{arch}.{tag}" if tag else arch)


def timm_weights(name, pretrained):
    """timm/<name> with model.pretrained -> (<arch>.<tag>, its weights file in the local Hugging Face cache).
    Nothing is downloaded: a file not in the cache is one error line that names where it is looked for."""
    from huggingface_hub import constants, try_to_load_from_cache  # a dependency of timm's
    cfg = _timm_pretrained_cfg(_timm(name), name, pretrained)
    full = f"{cfg.architecture}.{cfg.tag}"
    if not cfg.hf_hub_id:
        raise UserError(f"model.pretrained: timm's weights {full} are not on the Hugging Face hub; on a machine "
                        f"with internet download {cfg.url} and pass it as --weights FILE")
    repo, _, revision = cfg.hf_hub_id.partition("@")
    files = (cfg.hf_hub_filename,) if cfg.hf_hub_filename else HF_WEIGHT_FILES
    for file in files:
        path = try_to_load_from_cache(repo, file, revision=revision or None)  # reads the cache folder only
        if isinstance(path, str):
            return full, Path(path)
    cache = Path(constants.HF_HUB_CACHE)  # $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
    folder = f"models--{repo.replace('/', '--')}"
    raise UserError(f"pretrained weights {TIMM_PREFIX}{full} are not in the local Hugging Face cache: expected "
                    f"{cache / folder / 'snapshots' / '<commit>' / files[0]} (nothing is downloaded here); on a "
                    f"machine with internet run `hf download {repo} {files[0]}` and copy the {folder} folder of "
                    f"its cache into {cache}")


def _weights(name, pretrained):
    """'DEFAULT' / 'IMAGENET1K_V1' ... -> the torchvision weights enum member, or one error line."""
    if name in MODELS:
        raise UserError(f"model.pretrained={pretrained}: '{name}' is your own model (model.MODELS); "
                        "torchvision weights apply to torchvision models only; use --weights FILE")
    enum = torchvision.models.get_model_weights(name)
    if pretrained not in enum.__members__:
        guess = difflib.get_close_matches(pretrained, list(enum.__members__), n=1)
        raise UserError(f"model.pretrained={pretrained}: {name} has no such weights"
                        + (f" (did you mean '{guess[0]}'?)" if guess else "")
                        + f"; choose one of {', '.join(enum.__members__)}")
    return enum[pretrained]


def hub_file(weights):
    """Where torchvision keeps `weights` once downloaded: <torch hub dir>/checkpoints/<url's file name>."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(weights.url).path)


@register_check
def check_model_config(cfg):
    """Run by utils/config.py at config time, before any data is read."""
    check_model(cfg.model.name, cfg.model.pretrained, cfg.data.img_size)
    if cfg.data.channels != 3 and not is_timm(cfg.model.name):  # timm builds for in_chans itself
        try:  # the structure alone, on the meta device: no memory, no initialisation, no weights read
            with torch.device("meta"):
                create_model(cfg.model.name, num_classes=2, img_size=cfg.data.img_size, channels=cfg.data.channels)
        except UserError:
            raise
        except Exception:  # noqa: BLE001 - a model that cannot be built on meta is checked when it is built
            pass


@register_check
def check_teacher(cfg):
    """train.teacher names a run directory or checkpoint that is there, or a timm model whose weights are in the
    local cache: checked at config time (eval-only and prediction do not read it)."""
    source = cfg.train.teacher
    if source and not cfg.eval_only:
        if is_timm(source):
            check_model(source, "DEFAULT", cfg.data.img_size)
        else:
            checkpoint_path(source)


@register_check
def check_cam_layer(cfg):
    """model.cam_layer names a module of the model: checked on its structure alone (the meta device)."""
    if cfg.model.cam_layer:
        with torch.device("meta"):
            find_target(create_model(cfg.model.name, num_classes=2, img_size=cfg.data.img_size,
                                     channels=cfg.data.channels), cfg.model.cam_layer)


def check_model(name, pretrained=None, size=None):
    """The model name, the pretrained weights and their cached file, and the input size of
    ViT-like models: one error line each, before anything is built."""
    if is_timm(name):
        return _check_timm(name, pretrained)
    known = list(MODELS) + torchvision_names()
    if name not in known:
        guess = difflib.get_close_matches(name, known, n=1)
        raise UserError(f"bad value for 'model.name': '{name}' is no torchvision classification model "
                        "nor one of model.MODELS" + (f" (did you mean '{guess[0]}'?)" if guess else ""))
    patch = re.search(r"_(\d+)$", name)
    if size and _size_kwarg(name) == "image_size" and patch and size % int(patch.group(1)):
        raise UserError(f"model.name={name} cuts images into {patch.group(1)} px patches: data.img_size={size} "
                        f"must be a multiple of {patch.group(1)}")
    if pretrained:
        weights = _weights(name, pretrained)
        fixed = weights.meta.get("min_size", (0,))[0]
        if size and _size_kwarg(name) and size != fixed:
            raise UserError(f"model.name={name} with pretrained weights {weights} needs data.img_size={fixed} "
                            f"(its position embeddings are for that size), not {size}")
        path = hub_file(weights)
        if not path.is_file():
            raise UserError(f"pretrained weights {weights} are not in the local torch hub cache: put "
                            f"{path.name} in {path.parent} (nothing is downloaded here); on a machine with "
                            f"internet fetch it with: curl -L -o {path.name} {weights.url}")


def _call_builder(builder, kwargs, optional=_OPTIONAL_KWARGS):
    """builder(**kwargs) plus each of `optional` the builder's model class accepts."""
    optional = dict(optional)
    while True:
        try:
            return builder(**kwargs, **optional)
        except TypeError as e:  # raised at the class's call, before any weight is made or read
            bad = next((k for k in optional if f"'{k}'" in str(e)), None)
            if bad is None:
                raise
            del optional[bad]


def find_head(model, num_classes=None):
    """(qualified name, module) of the classifier: what a timm model's get_classifier() names, else the
    last Linear with `num_classes` outputs, else the last such Conv2d (SqueezeNet); without
    `num_classes`, the last Linear. None if absent."""
    if callable(getattr(model, "get_classifier", None)):
        head = model.get_classifier()
        named = next(((n, m) for n, m in model.named_modules() if n and m is head), None)
        if named and any(True for _ in head.parameters()):  # not nn.Identity (num_classes=0)
            return named
    found = {nn.Linear: None, nn.Conv2d: None}
    for name, module in model.named_modules():
        outputs = getattr(module, "out_features", getattr(module, "out_channels", None))
        if type(module) in found and (num_classes is None or outputs == num_classes):
            found[type(module)] = (name, module)
    return found[nn.Linear] or (found[nn.Conv2d] if num_classes is not None else None)


def _replace_head(model, old_classes, num_classes):
    """A fresh classifier for `num_classes` in place of the pretrained one (ImageNet's 1000)."""
    name, old = find_head(model, old_classes) or (None, None)
    if old is None:
        raise UserError(f"cannot find the classifier head of {type(model).__name__} to resize it")
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
    else:
        new = nn.Conv2d(old.in_channels, num_classes, old.kernel_size, old.stride, old.padding,
                        bias=old.bias is not None)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)
    return name, old


def find_first_conv(model):
    """(qualified name, module) of the convolution that reads the image: the first nn.Conv2d the model
    registers, which in torchvision is the first one applied (ResNet's conv1, VGG's and AlexNet's
    features.0, MobileNet's, EfficientNet's, ConvNeXt's and Swin's features.0.0, ViT's conv_proj,
    RegNet's stem.0, DenseNet's features.conv0). None without one."""
    return next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)


def sum_rgb_kernels(weight):
    """A (O, 3, kH, kW) kernel -> (O, 1, kH, kW): its three input channels summed (timm's adapt_input_conv).
    A convolution is linear in its input, so on a grey image g the summed kernel gives exactly what the
    RGB one gives on (g, g, g): the pretrained features stay what they were on a grey photo."""
    return weight.float().sum(dim=1, keepdim=True).to(weight.dtype)


def adapt_first_conv(model, name, channels=1):
    """The model reads `channels` (1) input channels: its first convolution (find_first_conv), if it reads
    3, takes 1, its kernels summed (sum_rgb_kernels), pretrained or not: the grey model is then the RGB
    one on the grey image repeated in R, G and B. -> the convolution's name; one error line without one."""
    found = find_first_conv(model)
    if found is not None and found[1].in_channels == channels:
        return found[0]  # built for it (a MODELS constructor's in_chans)
    if found is None or found[1].in_channels != 3 or found[1].groups != 1:
        what = "has no nn.Conv2d" if found is None else (
            f"reads the image first with '{found[0]}', a Conv2d of {found[1].in_channels} input channels"
            + (f" in {found[1].groups} groups" if found[1].groups != 1 else ""))
        fix = ("give its MODELS constructor an in_chans argument and build it for in_chans channels"
               if name in MODELS else "adapt it in model.py's adapt_first_conv")
        raise UserError(f"data.channels={channels}: model.name={name} {what}, not one of 3 to sum into "
                        f"{channels}; {fix}, or set data.channels=3", every_rank=True)
    conv_name, conv = found
    conv.weight = nn.Parameter(sum_rgb_kernels(conv.weight.detach()), requires_grad=conv.weight.requires_grad)
    conv.in_channels = channels
    if getattr(model, "transform_input", False):
        # GoogLeNet and Inception v3 with pretrained weights re-normalise R, G and B each for their
        # original training; a grey input has one channel to re-normalise, left as it is.
        model.transform_input = False
    return conv_name


def _takes(constructor, keyword):
    try:
        params = inspect.signature(constructor).parameters.values()
    except (TypeError, ValueError):  # a builtin or C-implemented callable: no signature to read
        return False
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in params)


def create_model(name="resnet34", num_classes=5, img_size=None, pretrained=None, log=None, channels=3,
                 zero_init_residual=False, drop_path=0.0):
    """A model with `num_classes` outputs: your own from MODELS, or torchvision's `name`, randomly
    initialised or with the pretrained weights `pretrained` from the local hub cache (head replaced).
    `img_size` sets the input size of models that fix it (ViT, MaxViT). channels=1 (data.channels):
    the model reads grey images (adapt_first_conv). zero_init_residual (model.zero_init_residual): the
    builders that take it start each residual block's last BatchNorm at 0 (torchvision's own default: off).
    drop_path (model.drop_path): timm's drop_path_rate, torchvision's stochastic_depth_prob (ConvNeXt, Swin,
    EfficientNet, MaxViT...); a model that takes neither stops in one line."""
    check_model(name, pretrained, img_size)  # also here for callers that skip the config (tests, tools)
    try:
        model = _create(name, num_classes, img_size, pretrained, log, channels, zero_init_residual, drop_path)
    except TypeError as e:
        if drop_path and any(k in str(e) for k in ("drop_path_rate", "stochastic_depth_prob")):
            raise UserError(f"model.drop_path={drop_path}: model.name={name} has no drop path (stochastic depth) to "
                            "set; set model.drop_path=0", every_rank=True) from None
        raise
    if channels != 3:  # timm builds for in_chans itself (and sums pretrained RGB kernels as we do)
        conv = model.pretrained_cfg.get("first_conv") if is_timm(name) else adapt_first_conv(model, name, channels)
        if log:
            log(f"data.channels={channels}: the first convolution '{conv}' of {name} reads {channels} channel"
                + (" (its pretrained RGB kernels summed)" if pretrained else ""))
    return model


def _create(name, num_classes, img_size, pretrained, log, channels, zero_init_residual=False, drop_path=0.0):
    if name in MODELS and drop_path:
        raise TypeError("unexpected keyword argument 'drop_path_rate'")  # your own model: set it in MODELS
    if name in MODELS:
        constructor = MODELS[name]
        if _takes(constructor, "in_chans"):
            return constructor(num_classes=num_classes, in_chans=channels)
        return constructor(num_classes=num_classes)
    if is_timm(name):
        return _create_timm(name, num_classes, img_size, pretrained, log, channels, drop_path)
    builder = torchvision.models.get_model_builder(name)
    kwargs = {"stochastic_depth_prob": drop_path} if drop_path else {}
    if img_size and _size_kwarg(name):
        kwargs[_size_kwarg(name)] = img_size if _size_kwarg(name) == "image_size" else (img_size, img_size)
    optional = {**_OPTIONAL_KWARGS, "zero_init_residual": bool(zero_init_residual)}
    if not pretrained:
        return _call_builder(builder, {"weights": None, "num_classes": num_classes, **kwargs}, optional)
    weights = _weights(name, pretrained)
    path = hub_file(weights)  # check_model saw it there: torchvision's builder will not download
    try:  # torchvision's own builder reads the cached file (its key fixes and arguments included)
        model = _call_builder(builder, {"weights": weights, **kwargs}, optional)
    except (RuntimeError, ValueError, EOFError, OSError) as e:
        raise UserError(f"cannot load pretrained weights {weights} from {path}: {str(e).splitlines()[0]}")
    head, old = _replace_head(model, len(weights.meta.get("categories") or ()) or None, num_classes)
    if log:
        loaded = len(model.state_dict()) - len(list(old.state_dict()))
        log(f"pretrained {name} {weights} from {path}: {loaded} tensors loaded; head '{head}' replaced "
            f"({getattr(old, 'out_features', getattr(old, 'out_channels', '?'))} -> {num_classes} classes, "
            "freshly initialised)")
    return model


def _create_timm(name, num_classes, img_size, pretrained, log, channels, drop_path=0.0):
    """timm.create_model for data.channels (in_chans) and data.img_size (img_size, for the models that take
    it: ViT, Swin...). Pretrained: the cached file (timm_weights) through timm's own loader, which leaves
    out a classifier of another class count and sums RGB kernels for one channel."""
    arch = name[len(TIMM_PREFIX):]
    kwargs = {"pretrained": False, "num_classes": num_classes, "in_chans": channels,
              **({"drop_path_rate": drop_path} if drop_path else {})}
    if pretrained:
        arch, path = timm_weights(name, pretrained)
        kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(path)})  # timm reads this file only
    builder = functools.partial(_timm(name).create_model, arch)
    try:
        model = _call_builder(builder, kwargs, {"img_size": img_size} if img_size else {})
    except (RuntimeError, ValueError, EOFError, OSError) as e:
        if not pretrained:
            raise
        raise UserError(f"cannot load pretrained weights {TIMM_PREFIX}{arch} from {path}: {str(e).splitlines()[0]}")
    if pretrained and log:
        head, _ = find_head(model)
        kept = model.pretrained_cfg.get("num_classes") == num_classes
        log(f"pretrained {TIMM_PREFIX}{arch} from {path}; head '{head}' "
            + ("loaded" if kept else f"freshly initialised for {num_classes} classes"))
    return model


def load_weights(model, path, map_location="cpu"):
    """Load every tensor of `path` whose name and shape fit `model`; return a short report.

    Accepts a plain state_dict or one of our checkpoints ({"model": ...}).
    `weights_only=True` means a file carrying pickled code is refused, not run.
    A grey model (data.channels=1) takes an RGB file's first-convolution kernels summed (sum_rgb_kernels).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"weights file '{path}' does not exist")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is the file's fault
        raise UserError(f"cannot load weights '{path}': {str(e).splitlines()[0]}")
    state = obj.get("model", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict):
        raise UserError(f"weights file '{path}' holds no state_dict")
    state = strip_wrapper_prefixes(state)
    own = model.state_dict()
    first = find_first_conv(model)
    key, summed = first and f"{first[0]}.weight", None
    if key in state and key in own and own[key].dim() == 4 and own[key].shape[1] == 1 and (
            tuple(state[key].shape) == (own[key].shape[0], 3, *own[key].shape[2:])):
        state, summed = {**state, key: sum_rgb_kernels(state[key])}, key
    fits = {k: v for k, v in state.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    wrong_shape = sorted(k for k in state if k in own and k not in fits)
    unexpected = sorted(k for k in state if k not in own)
    missing = sorted(k for k in own if k not in fits)
    if not fits:
        raise UserError(f"weights file '{path}' has no tensor that fits {type(model).__name__} "
                        f"({len(unexpected)} unknown names, {len(wrong_shape)} of another shape); "
                        "is it for another architecture?")
    model.load_state_dict(fits, strict=False)
    report = [f"loaded {len(fits)}/{len(own)} tensors from {path}"
              + (f" ({summed}: its 3 input channels summed into 1, data.channels=1)" if summed else "")]
    if wrong_shape:
        report.append("skipped (shape differs): " + ", ".join(
            f"{k} {tuple(state[k].shape)}->{tuple(own[k].shape)}" for k in wrong_shape[:6]))
    if unexpected:
        report.append(f"skipped (not in model): {len(unexpected)}, e.g. {', '.join(unexpected[:3])}")
    if missing:
        report.append(f"kept initial values: {len(missing)}, e.g. {', '.join(missing[:3])}")
    return "\n".join(report)


class FrozenBatchNorm2d(tv_misc.FrozenBatchNorm2d):
    """torchvision's FrozenBatchNorm2d (same buffers and state_dict), returning the input's dtype.

    Its forward multiplies by its fp32 buffers, and autocast leaves elementwise ops alone, so a
    bf16/fp16 activation came out fp32: every frozen layer doubled its traffic and the next layer
    cast it back. The scale and shift are computed in fp32 (C values), then applied in x's dtype.
    """

    def forward(self, x):
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.to(x.dtype).reshape(1, -1, 1, 1) + shift.to(x.dtype).reshape(1, -1, 1, 1)


class FrozenBatchNormAct2d(FrozenBatchNorm2d):
    """timm's BatchNormAct2d (EfficientNet, RegNet...) frozen: the normalisation above, then the layer's own
    dropout and activation, kept as they were (so the state_dict's names are the layer's)."""

    def __init__(self, num_features, eps, drop, act):
        super().__init__(num_features, eps=eps)
        self.drop, self.act = drop, act

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


def _frozen(module):
    """A frozen copy of a BatchNorm2d (or of timm's BatchNormAct2d) with its weights and statistics;
    None for any other module."""
    timm_layers = sys.modules.get("timm.layers")  # imported where a timm model was built, else none is here
    if type(module) is nn.BatchNorm2d:
        frozen = FrozenBatchNorm2d(module.num_features, eps=module.eps)
    elif timm_layers is not None and type(module) is timm_layers.BatchNormAct2d:
        frozen = FrozenBatchNormAct2d(module.num_features, module.eps, module.drop, module.act)
    else:
        return None
    for key in ("weight", "bias", "running_mean", "running_var"):
        getattr(frozen, key).copy_(getattr(module, key).detach())
    return frozen


def freeze_all_but_head(model, num_classes=None):
    """Train only the classifier head (find_head); returns its name.

    Every other parameter stops training, and every BatchNorm outside the head becomes a
    FrozenBatchNorm2d: a frozen BatchNorm left in train mode would still normalise with batch
    statistics and update its running mean and var, so the "frozen" backbone would drift.
    FrozenBatchNorm2d uses the stored statistics in any mode, also after model.train(); timm's
    BatchNormAct2d becomes a FrozenBatchNormAct2d.
    """
    found = find_head(model, num_classes)
    if found is None or not any(True for _ in found[1].parameters()):
        raise UserError(f"model.freeze_layers: no classifier head found in {type(model).__name__} (a last Linear "
                        f"or Conv2d with {num_classes or 'N'} outputs), so nothing would train; "
                        "set model.freeze_layers=false", every_rank=True)  # the same on every rank: printed once
    head_name, head = found
    for p in model.parameters():
        p.requires_grad_(False)
    for p in head.parameters():
        p.requires_grad_(True)
    in_head = {id(m) for m in head.modules()}
    for name, module in list(model.named_modules()):
        frozen = (_frozen(module) if id(module) not in in_head and getattr(module, "affine", False)
                  and getattr(module, "track_running_stats", False) else None)
        if frozen is not None:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, frozen)
    return head_name


def trains_batchnorm(model):
    """Does any BatchNorm still learn its statistics (not a FrozenBatchNorm2d)?"""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def sync_bn_wanted(model, sync_bn, verbose=True):
    """--syncBN matters only where BatchNorm trains; with freeze_layers none does: one note, no conversion."""
    if sync_bn and not trains_batchnorm(model):
        if verbose:
            print("note: --syncBN True skipped: no BatchNorm layer of this model trains "
                  "(model.freeze_layers keeps their statistics fixed)")
        return False
    return sync_bn


def _probe(model, name, img_size, device, channels=3):
    """One eval-mode forward at the training size: a model that cannot take it stops here in one
    line, not mid-epoch with a traceback. Zeros, no grad: no random draw, no statistic changes.
    On `device`, where the model already is: on the CPU a ViT-L-sized forward takes seconds per process."""
    training = model.training
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, channels, img_size, img_size, device=device))
    except OUT_OF_MEMORY as e:  # the model does not fit, which is not the size's fault
        raise UserError(f"out of memory on {device} in the start-up forward of model.name={name} (one image of "
                        f"{img_size} px, no gradients){allocation(e)}: a smaller model or data.img_size, or "
                        "train_multi_gpu_fsdp.py, which shards the model over the GPUs", RUNTIME_EXIT, every_rank=True)
    except (RuntimeError, ValueError, AssertionError, IndexError) as e:
        raise UserError(f"model.name={name} does not run at data.img_size={img_size}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}", every_rank=True)
    finally:
        model.train(training)


def use_channels_last(requested, device):
    """model.channels_last holds on CUDA only: NHWC feeds the tensor cores' convolutions there,
    while on the CPU it slows most convolutions down."""
    return bool(requested) and device.type == "cuda"


def build_model(model_cfg, num_classes, device, verbose=True, img_size=None, channels=3):
    """The config's model section -> a model on `device`, before any parallel wrapper.
    `img_size` (data.img_size): the input size of ViT-like models, and of the probe forward.
    `channels` (data.channels): 3, or 1 for grey images (adapt_first_conv)."""
    model = create_model(model_cfg.name, num_classes=num_classes, img_size=img_size,
                         pretrained=model_cfg.pretrained, log=print if verbose else None, channels=channels,
                         zero_init_residual=model_cfg.zero_init_residual, drop_path=model_cfg.drop_path)
    if model_cfg.weights:
        report = load_weights(model, model_cfg.weights)
        if verbose:
            print(report)
    if model_cfg.bn_momentum is not None:
        # MobileNetV3 and EfficientNet use 0.01, tuned for ImageNet's long schedules: after a few
        # hundred steps their running statistics still lag the weights, and evaluation suffers.
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.momentum = model_cfg.bn_momentum
    if model_cfg.freeze_layers:
        head = freeze_all_but_head(model, num_classes)
        if verbose:
            trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
            print(f"freeze_layers: only the head '{head}' trains ({trained} parameters); "
                  "BatchNorm statistics are frozen")
    if model_cfg.activation_checkpointing:
        blocks = checkpoint_blocks(model, model_cfg.blocks)
        if not blocks:
            raise UserError(f"model.activation_checkpointing: no blocks found in {model_cfg.name}; name them "
                            "with model.blocks=[NAME, ...]", every_rank=True)
        if verbose:
            print(f"activation checkpointing: {len(blocks)} blocks ({', '.join(blocks[:4])}"
                  f"{', ...' if len(blocks) > 4 else ''}) recompute their forward in the backward")
    model.to(device)
    if use_channels_last(model_cfg.channels_last, device):
        model.to(memory_format=torch.channels_last)
    if img_size:
        _probe(model, model_cfg.name, img_size, device, channels)
    return model


def checkpoint_path(source):
    """A checkpoint file, or a run directory (its checkpoints/best.pt) -> the checkpoint's path."""
    path = Path(source)
    if path.is_dir():
        best = run_files.best(path)
        if not best.is_file():
            raise UserError(f"run directory '{path}' has no checkpoints/best.pt; pass a checkpoint file")
        return best
    if not path.is_file():
        raise UserError(f"checkpoint '{path}' does not exist (pass a run directory or a .pt file)")
    return path


def load_trained(source):
    """A run directory or checkpoint of train*.py -> (eval-mode CPU model, class names, its config dict).

    Everything comes from the checkpoint itself: architecture, classes, image sizes, channels (data.channels;
    a checkpoint without it was trained on RGB).
    The EMA weights ("ema") are used when they made the checkpoint's best accuracy ("best_weights").
    A multi-label checkpoint's model has .multilabel True and .thresholds (one per label); a single-label
    one .temperature (1.0 where the run fitted none) and .reject_threshold (None where it fitted none).
    """
    path = checkpoint_path(source)
    state = load_checkpoint(path, map_location="cpu")  # weights_only: pickled code is refused
    config, classes = state.get("config") or {}, list(state.get("classes") or [])
    name = (config.get("model") or {}).get("name")
    if not name or not classes:
        raise UserError(f"checkpoint '{path}' holds no model name or class list; was it written by train*.py?")
    data = config.get("data") or {}
    model = create_model(name, num_classes=len(classes), img_size=data.get("img_size"),
                         channels=int(data.get("channels", 3)))
    weights = best_weights(state)
    try:
        model.load_state_dict(strip_wrapper_prefixes(weights))
    except RuntimeError as e:
        raise UserError(f"checkpoint '{path}' does not fit a {name}: {str(e).splitlines()[0]}")
    model.multilabel, model.thresholds = label_task(state)  # how predict.py and export.py read its outputs
    temperature, model.reject_threshold = calibration_of(state)
    model.temperature = temperature or 1.0  # softmax(logits / temperature): calibrated where the run fitted it
    return model.eval(), classes, config, path


def load_teacher(source, classes, multilabel, img_size, channels, device, channels_last=False):
    """train.teacher -> (eval-mode teacher on `device` without gradients, {"source", "path", "sha256"}).

    RUN_DIR or CHECKPOINT: a run of this template (load_trained: its architecture, its best weights), whose
    class list and task must be this data's. timm/<name>[.<tag>]: timm's weights from the local Hugging
    Face cache only (timm_weights), whose classifier must already have one output per class here. Its
    forward must take data.img_size; each mismatch is one error line before any training."""
    import hashlib

    if is_timm(source):
        arch, path = timm_weights(source, "DEFAULT")
        teacher = create_model(source, num_classes=len(classes), img_size=img_size, pretrained="DEFAULT",
                               channels=channels)
        theirs = teacher.pretrained_cfg.get("num_classes")
        if theirs != len(classes):
            raise UserError(f"train.teacher={source}: its weights ({TIMM_PREFIX}{arch}) have {theirs} classes, the "
                            f"data {len(classes)}; fine-tune it on this data first (train.py --config "
                            "configs/finetune.yaml ...) and pass that run directory", every_rank=True)
        task = False
    else:
        teacher, theirs, _, path = load_trained(source)
        if theirs != list(classes):
            raise UserError(f"train.teacher={source}: its classes {theirs[:5]}{'...' if len(theirs) > 5 else ''} "
                            f"are not this data's {list(classes)[:5]}{'...' if len(classes) > 5 else ''}; a "
                            "teacher must be trained on the same class list", every_rank=True)
        task = bool(teacher.multilabel)
    if task != bool(multilabel):
        kind = {True: "multi-label", False: "single-label"}
        raise UserError(f"train.teacher={source} is {kind[task]}, the data is {kind[bool(multilabel)]}",
                        every_rank=True)
    teacher = teacher.eval().requires_grad_(False).to(device)
    if use_channels_last(channels_last, device):
        teacher.to(memory_format=torch.channels_last)
    try:
        with torch.no_grad():
            teacher(torch.zeros(1, channels, img_size, img_size, device=device))
    except (RuntimeError, ValueError, AssertionError, IndexError) as e:
        raise UserError(f"train.teacher={source} does not run at data.img_size={img_size}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}", every_rank=True)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return teacher, {"source": str(source), "path": str(Path(path).resolve()), "sha256": digest.hexdigest()}
