"""Fine-tuning's per-parameter learning rates: optim.head_lr_scale, optim.layer_decay and the body that
train.unfreeze_at holds at lr 0, as one lr scale per parameter name (utils/optim.py groups them).

    python train.py --config configs/finetune.yaml optim.head_lr_scale=10 optim.layer_decay=0.75

A parameter at depth d of D gets lr x layer_decay^(D - d); the head (model.find_head: the layer the
template resizes for your classes) sits at depth D and gets lr x head_lr_scale. The depth is the model's
own structure:
    timm models     timm's group_matcher(coarse=False), read as timm.optim.param_groups_layer_decay reads it
                    (a parameter it does not name sits with the head, at D)
    anything else   utils/fsdp.py's blocks (FSDP's units, activation checkpointing's, model.blocks), in
                    order: the stem before the first block at depth 0, block i at depth i (1-based), a part
                    between two blocks with the one before it, what follows the last block (a final norm)
                    and the head at depth D = blocks + 1
The run directory's param_groups.json lists each parameter's lr scale and weight decay.
"""
import torch

from utils import fsdp
from utils.errors import UserError


def _timm_model(model):
    """Is this one of timm's models? Known by its class's module (FSDP2 subclasses it, hence the MRO)."""
    return any(c.__module__.startswith("timm.") for c in type(model).__mro__)


def _timm_depths(model):
    """{name: layer id} and D of a timm model, as param_groups_layer_decay computes them; None without a
    group_matcher."""
    if not callable(getattr(model, "group_matcher", None)):
        return None
    from timm.models import group_parameters  # timm built this model, so it is installed
    layer_map = group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    top = max(layer_map.values())
    return {name: layer_map.get(name, top) for name, _ in model.named_parameters()}, top


def _block_depths(model, head_name, blocks=()):
    """{name: depth} and D from utils/fsdp.py's blocks (the head, and blocks inside it, left out)."""
    inside_head = (lambda n: n == head_name or n.startswith(head_name + ".")) if head_name else (lambda n: False)
    found = [n for n, _ in fsdp.find_blocks(model, blocks) if not inside_head(n)]
    top = len(found) + 1
    depths, current = {}, 0  # current: the last block met, in parameter order
    for name, _ in model.named_parameters():
        owner = next((i + 1 for i, b in enumerate(found) if name.startswith(b + ".")), None)
        current = owner or current
        if inside_head(name) or (owner is None and found and current == len(found)):
            depths[name] = top  # the head, and what follows the last block
        else:
            depths[name] = current  # a block's own depth; the stem 0; a part between blocks the one before
    return depths, top, len(found)


def lr_scales(model, optim_cfg, head_name, model_name, blocks=()):
    """{parameter name: lr scale} of optim.head_lr_scale and optim.layer_decay (1 everywhere when both are
    1). A key the model cannot take stops in one line that names the model."""
    layer_decay, head_scale = optim_cfg.layer_decay, optim_cfg.head_lr_scale
    names = [name for name, _ in model.named_parameters()]
    depths, top = {name: 0 for name in names}, 0
    if layer_decay != 1:
        timm_depths = _timm_depths(model) if _timm_model(model) else None
        if timm_depths is not None:
            depths, top = timm_depths
            count = top
        else:
            depths, top, count = _block_depths(model, head_name, blocks)
        if count < 1:
            raise UserError(f"optim.layer_decay={layer_decay}: model.name={model_name} has no block structure to "
                            "give depths to (no timm group_matcher, no blocks by utils/fsdp.py's rule); name its "
                            "blocks with model.blocks=[NAME, ...] or set optim.layer_decay=1", every_rank=True)
    scales = {name: layer_decay ** (top - depths[name]) for name in names}
    if head_scale != 1:
        for name in head_names(model, head_name):
            scales[name] *= head_scale
    return scales


def head_names(model, head_name):
    """The names of the head's parameters."""
    return {name for name, _ in model.named_parameters() if name.startswith(head_name + ".")} if head_name else set()


def require_head(found, model_name, keys):
    """The head's name; the keys that need one (head_lr_scale, unfreeze_at) stop here without it."""
    if found is None:
        raise UserError(f"{' and '.join(keys)}: no classifier head found in model.name={model_name} (a last Linear "
                        "or Conv2d with one output per class); set them to their defaults", every_rank=True)
    return found[0]


def table(model, optimizer):
    """param_groups.json: {parameter name: {"lr_scale": s, "weight_decay": w}} of what the optimizer trains."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: {"lr_scale": group.get("lr_scale", 1.0), "weight_decay": group["weight_decay"]}
            for group in optimizer.param_groups for p in group["params"]}


def body_norms(model, head_name):
    """The BatchNorm layers outside the head: train.unfreeze_at keeps them in eval mode (statistics as
    loaded) while the body's lr is 0."""
    return [m for name, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and not (head_name and (name == head_name or name.startswith(head_name + ".")))]
