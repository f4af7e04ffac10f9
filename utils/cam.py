"""Grad-CAM (Selvaraju et al., 2017): where in the image the evidence for a class lies.

    python predict.py runs/demo data/demo_flowers/daisy --cam runs/demo/cam            # the top class
    python predict.py runs/demo photo.jpg --cam cam/ --cam-class tulips               # a class by name
    python train.py ... model.cam_layer=features.7                                    # your own model

The map of class c at a target layer with activations A (C channels on an H x W grid) is
relu(sum_k w_k A_k), w_k the mean over the grid of d logit_c / d A_k. The target layer is the last one
that still has a spatial grid: TARGETS gives it per torchvision family, with the reshape its output
needs to be (N, C, H, W) (ViT's tokens, Swin's channels-last maps); `model.cam_layer` names it for
any other model; a timm transformer takes its last block's first norm (as torchvision's ViT), any
other timm model its own `feature_info`'s last module. Where the layout is not known from the table,
a 4-D output is channels-last when its last axis, not its second, is as wide as the head's input (the
first Linear after the layer): timm's Swin maps are (N, H, W, C).

The activation is kept as the layer returned it: the forward goes on with a copy, so an in-place op
that follows (torchvision DenseNet's ReLU after `features`) changes the copy only. Each map is scaled
by its own range, however small; a map that is zero everywhere (no part of the image raises the
class's score at that layer) stays zero, drawn dark, and is said once per process.

The gradient is torch.autograd.grad with respect to the activation alone: nothing is accumulated in
any parameter's .grad and no optimizer or DDP hook sees it, so a training run with the maps on trains
bit for bit as one without them. The model runs in eval mode (BatchNorm's running statistics are
used and left as they are) and its mode is restored after. The forward is the bare module's (callers
unwrap DDP): no collective runs.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

from utils.errors import UserError

_NOTED = set()  # the notes and warnings said once per process

# torchvision class -> (target layer, the reshape of its output). "nchw": a map already; "nhwc":
# channels last (Swin); "tokens": (N, 1 + h*w, D) with the class token first (ViT).
# ViT: the last block's first LayerNorm, not the encoder's output: only the class token reaches the
# head from there, so the patch tokens' gradient would be zero (pytorch-grad-cam's choice too).
TARGETS = {
    "ResNet": ("layer4", "nchw"),            # resnet*, resnext*, wide_resnet*
    "RegNet": ("trunk_output", "nchw"),
    "DenseNet": ("features", "nchw"),        # ends in norm5; the head's relu and pooling follow
    "VGG": ("features", "nchw"),
    "AlexNet": ("features", "nchw"),
    "SqueezeNet": ("features", "nchw"),
    "MobileNetV2": ("features", "nchw"),
    "MobileNetV3": ("features", "nchw"),
    "MNASNet": ("layers", "nchw"),
    "ShuffleNetV2": ("conv5", "nchw"),
    "EfficientNet": ("features", "nchw"),    # efficientnet_b*, efficientnet_v2_*
    "ConvNeXt": ("features", "nchw"),
    "GoogLeNet": ("inception5b", "nchw"),
    "Inception3": ("Mixed_7c", "nchw"),
    "VisionTransformer": ("encoder.layers.{last}.ln_1", "tokens"),  # {last}: the container's last child
    "SwinTransformer": ("norm", "nhwc"),     # swin_t/s/b, swin_v2_*: before the head's permute
    "MaxVit": ("blocks.{last}", "nchw"),     # blocks is a ModuleList, looped over: its last block
}


def _timm_layer(model):
    """timm's own answer: the module of its last feature map (feature_info), if the model has one."""
    info = getattr(model, "feature_info", None)
    try:
        return info[-1]["module"] if info else None
    except (TypeError, KeyError, IndexError):
        return None


def find_target(model, name=None):
    """(module name, reshape) of the layer to take the map at: `name` (model.cam_layer) if given, else
    the family's entry of TARGETS, else a timm model's last feature module; one error line otherwise."""
    modules = dict(model.named_modules())
    if name:
        if name not in modules:
            raise UserError(f"model.cam_layer={name}: {type(model).__name__} has no module of that name; "
                            f"it has e.g. {', '.join(candidates(model)) or '(none)'}")
        return name, "auto"
    for cls in type(model).__mro__:  # a subclass of a torchvision family is that family
        if cls.__name__ in TARGETS and cls.__module__.startswith("torchvision."):
            layer, reshape = TARGETS[cls.__name__]
            if "{last}" in layer:
                container = model.get_submodule(layer.split(".{last}")[0])
                layer = layer.format(last=list(container.named_children())[-1][0])
            return layer, reshape
    if type(model).__module__.startswith("timm."):
        # A timm transformer (ViT, DeiT, BEiT, EVA, ...): as for torchvision's ViT, the last block's output
        # reaches the head through the class token alone, so its patch tokens' gradient is zero.
        blocks = getattr(model, "blocks", None)
        if isinstance(blocks, (nn.Sequential, nn.ModuleList)) and len(blocks) and hasattr(blocks[-1], "norm1"):
            return f"blocks.{list(blocks.named_children())[-1][0]}.norm1", "auto"
    timm = _timm_layer(model)
    if timm in modules:
        return timm, "auto"
    raise UserError(f"Grad-CAM: no target layer known for {type(model).__name__}; set model.cam_layer to the "
                    f"name of its last layer with a spatial grid, e.g. one of: {', '.join(candidates(model))}")


def candidates(model, n=6):
    """The names of the model's last few direct-child-level modules that are not the head: a hint."""
    names = [name for name, m in model.named_modules() if name and not isinstance(m, (nn.Linear, nn.Dropout))
             and "." not in name]
    return names[-n:]


def head_width(model, layer):
    """The input width of the first Linear registered after `layer` and outside it (the head's, or the next
    block's after a channels-last layer), else a timm model's num_features; None without either."""
    after = False
    for name, m in model.named_modules():
        if after and isinstance(m, nn.Linear) and not name.startswith(layer + "."):
            return m.in_features
        after = after or name == layer
    width = getattr(model, "num_features", None)
    return width if isinstance(width, int) else None


def to_map(t, reshape, width=None):
    """A target layer's output -> (N, C, H, W). "auto": a 3-D output is tokens, the leading ones beyond a
    square grid (class or distillation tokens) dropped; a 4-D one is channels-last when its last axis,
    and not its second, is `width` wide (the head's input: head_width), else channels-first."""
    channels_last = t.dim() == 4 and width is not None and t.shape[-1] == width and t.shape[1] != width
    if reshape == "nhwc" or (reshape == "auto" and channels_last):
        return t.permute(0, 3, 1, 2)
    if reshape in ("tokens", "auto") and t.dim() == 3:
        n, count, dim = t.shape
        side = int(count ** 0.5)
        return t[:, count - side * side:].reshape(n, side, side, dim).permute(0, 3, 1, 2)
    if t.dim() != 4:
        raise UserError(f"Grad-CAM: the target layer's output has shape {tuple(t.shape)}, no (N, C, H, W) map; "
                        "set model.cam_layer to a layer with a spatial grid")
    return t


def scaled(cam, layer):
    """(N, H, W) maps scaled by their own range to [0, 1]. A flat map is 1 where positive (one grid cell,
    or the same evidence everywhere) and 0 where zero; a zero map is said once per process."""
    low = cam.amin(dim=(1, 2), keepdim=True)
    span = cam.amax(dim=(1, 2), keepdim=True) - low
    flat = span == 0
    if (flat & (low == 0)).any() and "zero" not in _NOTED:
        _NOTED.add("zero")
        print(f"warning: Grad-CAM: a map at layer {layer} is zero everywhere (no part of the image raises the "
              "class's score there) and is drawn dark; later ones are not reported", file=sys.stderr, flush=True)
    return torch.where(flat, (cam > 0).to(cam.dtype), (cam - low) / torch.where(flat, 1.0, span))


def grad_cam(model, images, classes, layer, reshape="nchw"):
    """Maps (N, H, W) in [0, 1] at the images' size, one per (image, class) pair: classes[i] is the class
    of images[i]. `images` are the model's input (normalised); each map is scaled by its own range."""
    target = model.get_submodule(layer)
    seen = []

    def keep(module, args, out):
        seen.append(out)
        # The forward goes on with a copy, so an in-place op after the layer (DenseNet's ReLU after
        # `features`) changes the copy and not the activation kept (Captum's hooks do the same).
        return out.clone() if torch.is_tensor(out) else None

    handle = target.register_forward_hook(keep)
    training = model.training
    try:
        model.eval()
        with torch.enable_grad():
            # The input asks for a gradient, so the graph exists even where no parameter trains
            # (model.freeze_layers); autograd.grad below computes the activation's gradient alone.
            logits = model(images.detach().float().requires_grad_(True)).float()
            score = logits.gather(1, torch.as_tensor(classes, device=logits.device).view(-1, 1)).sum()
            if not seen:
                raise UserError(f"Grad-CAM: the target layer '{layer}' never ran in the forward; set model.cam_layer "
                                "to a module the forward calls")
            activation = seen[-1]
            grad, = torch.autograd.grad(score, activation)
    finally:
        handle.remove()
        model.train(training)
    width = head_width(model, layer) if reshape == "auto" else None
    activation, grad = to_map(activation.detach().float(), reshape, width), to_map(grad.float(), reshape, width)
    cam = (grad.mean(dim=(2, 3), keepdim=True) * activation).sum(dim=1, keepdim=True).relu()
    cam = F.interpolate(cam, size=images.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
    return scaled(cam, layer).cpu()


def maps_for(model, images, pairs, layer, reshape, chunk=16):
    """Grad-CAM maps for (image index, class) pairs, `chunk` pairs per forward: (len(pairs), H, W)."""
    out = []
    for start in range(0, len(pairs), chunk):
        part = pairs[start:start + chunk]
        index = torch.tensor([i for i, _ in part], device=images.device)
        out.append(grad_cam(model, images[index], [c for _, c in part], layer, reshape))
    return torch.cat(out) if out else torch.zeros(0, *images.shape[-2:])


# A perceptual colour scale for the maps: matplotlib's "inferno" at 9 stops (dark: no evidence, yellow: most).
_INFERNO = torch.tensor([[0, 0, 4], [31, 12, 72], [85, 15, 109], [136, 34, 106], [186, 54, 85],
                         [227, 89, 51], [249, 140, 10], [249, 201, 50], [252, 255, 164]], dtype=torch.float32) / 255


def overlay(images, cams, alpha=0.5):
    """Images in [0, 1] (N, 3 or 1, H, W) and maps (N, H, W) in [0, 1] -> (N, 3, H, W) in [0, 1]."""
    x = cams.clamp(0, 1) * (len(_INFERNO) - 1)
    low = x.floor().long().clamp(max=len(_INFERNO) - 2)
    t = (x - low)[..., None]
    colour = (_INFERNO[low] * (1 - t) + _INFERNO[low + 1] * t).permute(0, 3, 1, 2)
    return (images.expand(-1, 3, -1, -1) * (1 - alpha) + colour * alpha).clamp(0, 1)


class Explainer:
    """A bare model (DDP, DataParallel and torch.compile unwrapped) and its target layer."""

    def __init__(self, model, cam_layer=None):
        self.model = model
        self.layer, self.reshape = find_target(model, cam_layer)
        self.device = next(model.parameters()).device

    def maps(self, images, pairs):
        return maps_for(self.model, images, pairs, self.layer, self.reshape)



def gallery_explainer(bare, cam_layer, sharded=False):
    """The worst-mistakes gallery's Explainer of the bare model, or None (one note per reason, once):
    FSDP keeps its maps off (a forward on rank 0 alone would wait for the other ranks' shards), and
    a model of no known family without model.cam_layer is pictured without maps."""
    if sharded:
        reason = "note: FSDP: the worst-mistakes gallery has no Grad-CAM maps (rank 0 cannot run the sharded model alone)"
    else:
        try:
            return Explainer(bare, cam_layer)
        except UserError as e:
            if cam_layer:
                raise
            reason = f"note: the worst-mistakes gallery has no Grad-CAM maps: {e}"
    if reason not in _NOTED:
        _NOTED.add(reason)
        print(reason, flush=True)
    return None
