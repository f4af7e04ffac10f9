"""Typed configuration: schema, YAML files, dotted overrides and the classic flags.

Precedence, later wins:
    schema defaults < configs/default.yaml < --config FILE < classic flags < dotted overrides

    python train.py --config configs/demo.yaml --epochs 3 optim.lr=0.05

The schema below holds each key's type; configs/default.yaml holds its
default value and its one-line comment, and nothing else holds either. A new
key is one line in each. Everything is validated before any work starts: an
unknown key, a value of the wrong type or a key without a default stops with
one line that names it.
"""
import contextlib
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from utils.cli import ArgumentParser
from utils.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


# Types only (MISSING: no value here). Each key's default and its comment: configs/default.yaml.

@dataclass
class DataConfig:
    path: str = MISSING
    labels: Optional[str] = MISSING
    task: str = MISSING
    channels: int = MISSING
    val_rate: float = MISSING
    split_seed: int = MISSING
    folds: int = MISSING
    fold: int = MISSING
    img_size: int = MISSING
    min_crop_scale: float = MISSING
    val_resize: int = MISSING
    num_workers: int = MISSING
    persistent_workers: bool = MISSING
    pin_memory: bool = MISSING
    pipeline: str = MISSING
    cache_size: int = MISSING
    cache_on_device: bool = MISSING
    gpu_decode: str = MISSING
    bad_image: str = MISSING
    verify: bool = MISSING
    max_image_pixels: int = MISSING
    sampler: str = MISSING
    mixup_alpha: float = MISSING
    cutmix_alpha: float = MISSING
    shards: Optional[str] = MISSING
    shard_cache: Optional[str] = MISSING
    shard_cache_gb: float = MISSING
    shard_retries: int = MISSING


@dataclass
class ModelConfig:
    name: str = MISSING
    pretrained: Optional[str] = MISSING
    weights: Optional[str] = MISSING
    zero_init_residual: bool = MISSING
    freeze_layers: bool = MISSING
    sync_bn: bool = MISSING
    channels_last: bool = MISSING
    bn_momentum: Optional[float] = MISSING
    activation_checkpointing: bool = MISSING
    blocks: List[str] = MISSING
    cam_layer: Optional[str] = MISSING
    drop_path: float = MISSING


@dataclass
class OptimConfig:
    name: str = MISSING
    lr: Any = MISSING  # a number; with train.linear_probe a list of them (checked in _check_ranges)
    lrf: float = MISSING
    momentum: float = MISSING
    weight_decay: float = MISSING
    warmup_epochs: float = MISSING
    scale_lr: bool = MISSING
    label_smoothing: float = MISSING
    clip_grad_norm: float = MISSING
    class_weights: Any = MISSING
    head_lr_scale: float = MISSING
    layer_decay: float = MISSING


@dataclass
class TrainConfig:
    epochs: int = MISSING
    batch_size: int = MISSING
    device: str = MISSING
    amp: str = MISSING
    seed: int = MISSING
    log_every: int = MISSING
    keep_last: int = MISSING
    save_every_steps: int = MISSING
    compile: bool = MISSING
    worst_images: int = MISSING
    figures: bool = MISSING
    accum_steps: int = MISSING
    global_batch: int = MISSING
    deterministic: bool = MISSING
    ema_decay: float = MISSING
    profile: int = MISSING
    profile_ranks: str = MISSING
    best_metric: str = MISSING
    best_mode: str = MISSING
    early_stop_patience: int = MISSING
    unfreeze_at: int = MISSING
    unfreeze_warmup: float = MISSING
    ema_warmup: bool = MISSING
    teacher: Optional[str] = MISSING
    kd_alpha: float = MISSING
    kd_temperature: float = MISSING
    linear_probe: bool = MISSING
    feature_cache: Optional[str] = MISSING


@dataclass
class DDPConfig:
    backend: str = MISSING
    bucket_cap_mb: int = MISSING
    gradient_as_bucket_view: bool = MISSING
    static_graph: bool = MISSING
    broadcast_buffers: bool = MISSING
    find_unused_parameters: bool = MISSING
    timeout_minutes: float = MISSING


@dataclass
class EvalConfig:
    threshold: float = MISSING
    tune_thresholds: bool = MISSING
    tta: str = MISSING
    ood: str = MISSING


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output_dir: Optional[str] = MISSING
    resume: Optional[str] = MISSING
    eval_only: bool = MISSING


# Classic flag -> dotted key. Values are handed to OmegaConf as text, so the
# schema does the type checking and "--syncBN False" becomes the bool False.
CLASSIC_FLAGS = {
    "--epochs": "train.epochs",
    "--batch-size": "train.batch_size",
    "--lr": "optim.lr",
    "--lrf": "optim.lrf",
    "--syncBN": "model.sync_bn",
    "--weights": "model.weights",
    "--freeze-layers": "model.freeze_layers",
    "--data-path": "data.path",
    "--device": "train.device",
    "--output-dir": "output_dir",
    "--resume": "resume",
    "--ood": "eval.ood",
}

CHOICES = {
    "optim.name": ("sgd", "adamw"),
    "train.amp": ("auto", "bf16", "fp16", "off"),
    "train.best_mode": ("auto", "max", "min"),
    "data.pipeline": ("pil", "gpu", "auto"),
    "data.gpu_decode": ("auto", "once", "per_batch"),
    "data.bad_image": ("warn", "error"),
    "data.sampler": ("shuffle", "balanced"),
    "data.task": ("auto", "single", "multi"),
    "data.channels": (1, 3),
    "eval.tta": ("none", "flip"),
    "ddp.backend": ("auto", "nccl", "gloo"),
    "train.profile_ranks": ("0", "all"),
}


# Checks that need code above utils/, which never imports data.py or model.py: model.py
# registers its model.name / model.pretrained check here when imported. Every entry script
# imports model.py, so the check runs at config time, before any data is read.
_REGISTERED_CHECKS = []


@contextlib.contextmanager
def schema_only():
    """load_config without the registered checks: the schema's keys, types and ranges only (tools/sweep.py
    checks a search space so, whatever modules its process has imported; a trial runs the full checks)."""
    saved = _REGISTERED_CHECKS[:]
    _REGISTERED_CHECKS.clear()
    try:
        yield
    finally:
        _REGISTERED_CHECKS[:] = saved


def register_check(fn):
    """fn(cfg) raises UserError for a value only code above utils/ can judge."""
    if fn not in _REGISTERED_CHECKS:
        _REGISTERED_CHECKS.append(fn)
    return fn


def build_arg_parser(description=""):
    p = ArgumentParser(description=description,
                       epilog="Any config key can also be set as key=value, e.g. optim.lr=0.05.")
    p.add_argument("--config", help="YAML recipe merged over configs/default.yaml")
    for flag, key in CLASSIC_FLAGS.items():
        p.add_argument(flag, dest=key.replace(".", "__"), metavar="VALUE", help=f"sets {key}")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate the --resume checkpoint (or --weights) and write eval.json; no training")
    # torch.distributed.launch (the launcher before torchrun) passes --local-rank=N, or --local_rank=N.
    p.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, metavar="N",
                   help="accepted from torch.distributed.launch; torchrun sets LOCAL_RANK instead")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    return p


def flatten(node, prefix=""):
    """A nested dict's leaves under dotted keys: {"optim": {"lr": 0.01}} -> {"optim.lr": 0.01}."""
    out = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _describe(e, schema, flags_used):
    """Turn an OmegaConf exception into one line that names the key (and the flag that set it)."""
    key = getattr(e, "full_key", None) or ""
    if isinstance(e, ConfigKeyError) or "not in" in str(e):
        tree = OmegaConf.to_container(schema)
        known = list(flatten(tree)) + list(tree)  # a misspelt section ("trian") is matched too
        guess = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean '{guess[0]}'?)" if guess else ""
        return f"unknown config key '{key}'{hint}"
    if isinstance(e, ValidationError):
        msg = str(e).splitlines()[0]
        via = f" (set by {flags_used[key]})" if key in flags_used else ""
        return f"bad value for '{key}'{via}: {msg}"
    return f"config: {str(e).splitlines()[0]}"


def _load_yaml(path):
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file '{path}' does not exist")
    try:
        # libyaml's parser where PyYAML has it (same SafeLoader rules): a tenth of the 0.1 s of the Python one
        data = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"config file '{path}'{where}: malformed YAML ({getattr(e, 'problem', e)})")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file '{path}' must hold a mapping of keys, not {type(data).__name__}")
    return data


def _check_ranges(cfg):
    """Values that type-check but cannot work; caught here, before any data is read."""
    def bad(key, why):
        raise UserError(f"bad value for '{key}': {why}")

    if cfg.train.epochs < 1:
        bad("train.epochs", f"{cfg.train.epochs}; need at least 1 epoch")
    if cfg.train.batch_size < 1:
        bad("train.batch_size", f"{cfg.train.batch_size}; need a batch of at least 1")
    if not 0.0 <= cfg.data.val_rate < 1.0:
        bad("data.val_rate", f"{cfg.data.val_rate}; must be in [0, 1)")
    if cfg.data.folds < 0 or cfg.data.folds == 1:
        bad("data.folds", f"{cfg.data.folds}; 0 (off) or at least 2 folds")
    if not 0 <= cfg.data.fold < max(cfg.data.folds, 1):
        bad("data.fold", f"{cfg.data.fold}; " + (f"must be in 0..{cfg.data.folds - 1} (data.folds={cfg.data.folds})"
                                                  if cfg.data.folds else "data.folds=K first (0 = no folds)"))
    if not 0.0 < cfg.data.min_crop_scale <= 1.0:
        bad("data.min_crop_scale", f"{cfg.data.min_crop_scale}; must be in (0, 1]")
    if cfg.data.img_size < 16 or cfg.data.val_resize < cfg.data.img_size:
        bad("data.img_size", "img_size must be >= 16 and val_resize >= img_size")
    if OmegaConf.is_list(cfg.optim.lr) and not cfg.train.linear_probe:
        bad("optim.lr", f"{list(cfg.optim.lr)}; a list trains one head per lr with train.linear_probe=true; "
                        "give one lr")
    if not all(lr > 0 for lr in learning_rates(cfg.optim)) or cfg.optim.lrf <= 0:
        bad("optim.lr", "lr and lrf must be positive")
    if cfg.train.linear_probe:
        _check_probe(cfg)
    if cfg.optim.warmup_epochs < 0 or cfg.optim.warmup_epochs > cfg.train.epochs:
        bad("optim.warmup_epochs", f"{cfg.optim.warmup_epochs}; must be between 0 and train.epochs")
    if cfg.train.log_every < 1:
        bad("train.log_every", "must be at least 1")
    if not 0.0 < cfg.eval.threshold < 1.0:
        bad("eval.threshold", f"{cfg.eval.threshold}; must be in (0, 1)")
    if cfg.data.cache_size < 0 or 0 < cfg.data.cache_size < cfg.data.img_size:
        bad("data.cache_size", f"{cfg.data.cache_size}; 0 (auto) or at least data.img_size")
    if cfg.ddp.bucket_cap_mb < 1:
        bad("ddp.bucket_cap_mb", "must be at least 1")
    if not cfg.ddp.timeout_minutes > 0:
        bad("ddp.timeout_minutes", f"{cfg.ddp.timeout_minutes}; must be more than 0")
    if cfg.train.keep_last < 0:
        bad("train.keep_last", "must be 0 or more")
    if cfg.train.worst_images < 0:
        bad("train.worst_images", "must be 0 (no picture) or more")
    if cfg.eval_only and not (cfg.resume or cfg.model.weights):
        raise UserError("--eval-only needs a model to evaluate: --resume CHECKPOINT or --weights FILE")
    if cfg.eval.ood and not cfg.eval_only:
        raise UserError(f"--ood '{cfg.eval.ood}' scores images of no class with --eval-only; add --eval-only --resume CHECKPOINT")
    if cfg.eval.ood and not Path(cfg.eval.ood).is_dir():
        raise UserError(f"--ood '{cfg.eval.ood}' is not a folder (of images of none of the classes)")
    if cfg.train.save_every_steps < 0:
        bad("train.save_every_steps", "must be 0 (epoch ends only) or more")
    if not 0.0 <= cfg.optim.label_smoothing < 1.0:
        bad("optim.label_smoothing", f"{cfg.optim.label_smoothing}; must be in [0, 1)")
    if cfg.optim.clip_grad_norm < 0:
        bad("optim.clip_grad_norm", f"{cfg.optim.clip_grad_norm}; 0 (off) or a positive norm")
    if cfg.train.accum_steps < 1:
        bad("train.accum_steps", f"{cfg.train.accum_steps}; 1 (no accumulation) or more micro-batches per step")
    if cfg.train.profile < 0:
        bad("train.profile", f"{cfg.train.profile}; 0 (off) or the number of steps to record")
    if cfg.train.global_batch < 0:
        bad("train.global_batch", f"{cfg.train.global_batch}; 0 (off) or the images per optimizer step")
    if cfg.train.global_batch and cfg.train.accum_steps != 1:
        raise UserError(f"train.global_batch={cfg.train.global_batch} sets the accumulation itself (global batch / "
                        f"(batch size x processes)); drop train.accum_steps={cfg.train.accum_steps}")
    if not 0.0 <= cfg.train.ema_decay < 1.0:
        bad("train.ema_decay", f"{cfg.train.ema_decay}; 0 (off) or in (0, 1), e.g. 0.999")
    if not 0.0 <= cfg.model.drop_path < 1.0:
        bad("model.drop_path", f"{cfg.model.drop_path}; in [0, 1), e.g. 0.1 (0 = off)")
    if not cfg.optim.head_lr_scale > 0:
        bad("optim.head_lr_scale", f"{cfg.optim.head_lr_scale}; the head's lr over the body's, more than 0 "
                                   "(1 = the same)")
    if not 0.0 < cfg.optim.layer_decay <= 1.0:
        bad("optim.layer_decay", f"{cfg.optim.layer_decay}; in (0, 1], e.g. 0.75 (1 = off)")
    if not 0 <= cfg.train.unfreeze_at < cfg.train.epochs:
        bad("train.unfreeze_at", f"{cfg.train.unfreeze_at}; 0 (off) or an epoch before train.epochs={cfg.train.epochs}")
    if cfg.train.unfreeze_warmup < 0:
        bad("train.unfreeze_warmup", f"{cfg.train.unfreeze_warmup}; 0 (at once) or a number of epochs")
    if cfg.train.ema_warmup and not cfg.train.ema_decay:
        bad("train.ema_warmup", "warms up train.ema_decay's average; set train.ema_decay too (e.g. 0.999)")
    if not 0.0 < cfg.train.kd_alpha <= 1.0:
        bad("train.kd_alpha", f"{cfg.train.kd_alpha}; the distillation term's weight, in (0, 1]")
    if not cfg.train.kd_temperature > 0:
        bad("train.kd_temperature", f"{cfg.train.kd_temperature}; more than 0 (1 = the outputs as they are)")
    if cfg.train.unfreeze_at and cfg.model.freeze_layers:
        raise UserError("train.unfreeze_at holds the body at lr 0 for some epochs, model.freeze_layers for all of "
                        "them; set one of the two")
    if cfg.train.early_stop_patience < 0:
        bad("train.early_stop_patience", f"{cfg.train.early_stop_patience}; 0 (off) or a number of epochs")
    for key in ("data.mixup_alpha", "data.cutmix_alpha"):
        if OmegaConf.select(cfg, key) < 0:
            bad(key, f"{OmegaConf.select(cfg, key)}; 0 (off) or a positive Beta(alpha, alpha) parameter")
    if cfg.model.bn_momentum is not None and not 0.0 < cfg.model.bn_momentum <= 1.0:
        bad("model.bn_momentum", f"{cfg.model.bn_momentum}; null (the architecture's own) or in (0, 1]")
    weights = cfg.optim.class_weights
    if OmegaConf.is_list(weights):
        if not weights or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0
                                  for w in weights):
            bad("optim.class_weights", f"{list(weights)}; a list needs one positive number per class")
    elif weights not in ("none", "auto"):
        bad("optim.class_weights", f"'{weights}'; choose none, auto, or a list of one weight per class")
    if cfg.train.compile and cfg.model.activation_checkpointing:
        # dynamo cannot trace the context_fn that keeps BatchNorm's statistics to one update per step.
        raise UserError("train.compile=true cannot compile model.activation_checkpointing=true's blocks; "
                        "set train.compile=false to keep the memory saving, or "
                        "model.activation_checkpointing=false to compile")
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            bad(key, f"'{value}'; choose one of {', '.join(map(str, allowed))}")
    for check in _REGISTERED_CHECKS:
        check(cfg)


def learning_rates(optim_cfg):
    """optim.lr as a list: [lr], or train.linear_probe's several (one head each)."""
    return list(optim_cfg.lr) if OmegaConf.is_list(optim_cfg.lr) else [optim_cfg.lr]


def _as_lr(value):
    """An optim.lr value as a float: YAML reads 1e-3 (no dot) as text, which a float field would convert."""
    try:
        return float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


# The linear probe trains a head on features encoded once without augmentation: these keys, set
# otherwise than to this value, have no meaning there and are refused by name.
PROBE_OFF = {"train.teacher": None, "train.unfreeze_at": 0, "train.ema_decay": 0.0, "data.mixup_alpha": 0.0,
             "data.cutmix_alpha": 0.0, "data.sampler": "shuffle", "optim.head_lr_scale": 1.0,
             "optim.layer_decay": 1.0, "model.drop_path": 0.0, "train.accum_steps": 1, "train.global_batch": 0,
             "train.save_every_steps": 0, "train.compile": False, "model.activation_checkpointing": False,
             "train.profile": 0}


def _check_probe(cfg):
    for key, off in PROBE_OFF.items():
        value = OmegaConf.select(cfg, key)
        if value != off:
            raise UserError(f"{key}={value} does not apply to train.linear_probe=true (a head trained on features "
                            f"encoded once, without augmentation); set it to {off} or train.linear_probe=false")


def _take_local_rank(local_rank):
    """--local-rank N: the old launcher's way of naming this process's GPU. LOCAL_RANK from the
    environment (which that launcher sets too, as torchrun does) wins; else it becomes LOCAL_RANK."""
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    if os.environ.get("RANK", "0") == "0":
        print("note: --local-rank is torch.distributed.launch's; torchrun is the launcher to use "
              "(it passes LOCAL_RANK in the environment)", flush=True)


def load_config(argv=None, description=""):
    """Parse argv into a validated, read-only DictConfig.

    Every rank parses the same command line and files, so a config error is the
    same everywhere: it is marked every_rank and printed once, by rank 0.
    """
    try:
        return _load_config(argv, description)
    except UserError as e:
        e.every_rank = True
        raise


def _load_config(argv, description):
    # Intermixed: key=value overrides may sit before, between or after the flags.
    args = build_arg_parser(description).parse_intermixed_args(argv)
    schema = OmegaConf.structured(Config)
    dotlist, flags_used = [], {}
    for flag, key in CLASSIC_FLAGS.items():
        value = getattr(args, key.replace(".", "__"))
        if value is not None:
            dotlist.append(f"{key}={value}")
            flags_used[key] = f"{flag} {value}"
    for item in args.overrides:
        if "=" not in item:
            raise UserError(f"'{item}' is not a key=value override (e.g. optim.lr=0.05)")
        dotlist.append(item)
    if args.eval_only:
        dotlist.append("eval_only=true")
    if args.local_rank is not None:
        _take_local_rank(args.local_rank)
    try:
        layers = [schema, OmegaConf.create(_load_yaml(DEFAULT_CONFIG))]
        if args.config:
            layers.append(OmegaConf.create(_load_yaml(args.config)))
        layers.append(OmegaConf.from_dotlist(dotlist))
        cfg = OmegaConf.merge(*layers)
    except OmegaConfBaseException as e:
        raise UserError(_describe(e, schema, flags_used)) from None
    missing = OmegaConf.missing_keys(cfg)
    if missing:
        raise UserError(f"config key '{sorted(missing)[0]}' has no value; give it its default and a "
                        f"one-line comment in {DEFAULT_CONFIG}")
    # YAML 1.1 reads a bare `off` (train.amp=off, or `amp: off` in a file) as the bool false,
    # which the str field then holds as "False"; both spellings mean no autocast.
    if cfg.train.amp == "False":
        cfg.train.amp = "off"
    lrs = [_as_lr(v) for v in learning_rates(cfg.optim)]
    if None in lrs or not lrs:
        raise UserError(f"bad value for 'optim.lr': {cfg.optim.lr}; a number"
                        + (" or a list of numbers (train.linear_probe)" if cfg.train.linear_probe else ""))
    cfg.optim.lr = lrs if OmegaConf.is_list(cfg.optim.lr) else lrs[0]
    _check_ranges(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def save_config(cfg, path):
    Path(path).write_text(OmegaConf.to_yaml(cfg))


def config_to_dict(cfg):
    return OmegaConf.to_container(cfg, resolve=True)
