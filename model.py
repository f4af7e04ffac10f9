"""The network: a torchvision ResNet with `num_classes` outputs.

Swap in your own model here; the scripts only need `create_model`. Weights come
only from local files (--weights), never from the internet.
"""
from pathlib import Path

import torch
import torchvision

from utils.checkpoint import load_checkpoint, strip_wrapper_prefixes
from utils.errors import UserError


def create_model(name="resnet34", num_classes=5):
    """A randomly initialised torchvision ResNet (`weights=None`: nothing is downloaded)."""
    builder = getattr(torchvision.models, name)
    # zero_init_residual: each residual block starts as the identity, which lets a network
    # trained from scratch take a large learning rate from the first steps (Goyal et al., 2017).
    return builder(weights=None, num_classes=num_classes, zero_init_residual=True)


def load_weights(model, path, map_location="cpu"):
    """Load every tensor of `path` whose name and shape fit `model`; return a short report.

    Accepts a plain state_dict or one of our checkpoints ({"model": ...}).
    `weights_only=True` means a file carrying pickled code is refused, not run.
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
    fits = {k: v for k, v in state.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    wrong_shape = sorted(k for k in state if k in own and k not in fits)
    unexpected = sorted(k for k in state if k not in own)
    missing = sorted(k for k in own if k not in fits)
    if not fits:
        raise UserError(f"weights file '{path}' has no tensor that fits {type(model).__name__} "
                        f"({len(unexpected)} unknown names, {len(wrong_shape)} of another shape); "
                        "is it for another architecture?")
    model.load_state_dict(fits, strict=False)
    report = [f"loaded {len(fits)}/{len(own)} tensors from {path}"]
    if wrong_shape:
        report.append("skipped (shape differs): " + ", ".join(
            f"{k} {tuple(state[k].shape)}->{tuple(own[k].shape)}" for k in wrong_shape[:6]))
    if unexpected:
        report.append(f"skipped (not in model): {len(unexpected)}, e.g. {', '.join(unexpected[:3])}")
    if missing:
        report.append(f"kept initial values: {len(missing)}, e.g. {', '.join(missing[:3])}")
    return "\n".join(report)


def freeze_all_but_head(model):
    """Train only the classifier (`fc`): the usual fine-tuning of a pretrained backbone."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("fc."))
    return model


def build_model(model_cfg, num_classes, device, verbose=True):
    """The config's model section -> a model on `device`, before any parallel wrapper."""
    model = create_model(model_cfg.name, num_classes=num_classes)
    if model_cfg.weights:
        report = load_weights(model, model_cfg.weights)
        if verbose:
            print(report)
    if model_cfg.freeze_layers:
        freeze_all_but_head(model)
    model.to(device)
    if model_cfg.channels_last and device.type == "cuda":
        model.to(memory_format=torch.channels_last)
    return model


def checkpoint_path(source):
    """A checkpoint file, or a run directory (its checkpoints/best.pt) -> the checkpoint's path."""
    path = Path(source)
    if path.is_dir():
        best = path / "checkpoints" / "best.pt"
        if not best.is_file():
            raise UserError(f"run directory '{path}' has no checkpoints/best.pt; pass a checkpoint file")
        return best
    if not path.is_file():
        raise UserError(f"checkpoint '{path}' does not exist (pass a run directory or a .pt file)")
    return path


def load_trained(source):
    """A run directory or checkpoint of train*.py -> (eval-mode CPU model, class names, its config dict).

    Everything comes from the checkpoint itself: architecture, classes, image sizes.
    EMA weights ("ema"), when the checkpoint holds them, are used instead of the raw ones.
    """
    path = checkpoint_path(source)
    state = load_checkpoint(path, map_location="cpu")  # weights_only: pickled code is refused
    config, classes = state.get("config") or {}, list(state.get("classes") or [])
    name = (config.get("model") or {}).get("name")
    if not name or not classes:
        raise UserError(f"checkpoint '{path}' holds no model name or class list; was it written by train*.py?")
    model = create_model(name, num_classes=len(classes))
    ema = state.get("ema")
    weights = ema if isinstance(ema, dict) and ema else state["model"]
    try:
        model.load_state_dict(strip_wrapper_prefixes(weights))
    except RuntimeError as e:
        raise UserError(f"checkpoint '{path}' does not fit a {name}: {str(e).splitlines()[0]}")
    return model.eval(), classes, config, path
