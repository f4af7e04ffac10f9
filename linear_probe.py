"""The linear probe (train.linear_probe=true): linear heads on a frozen body's features, encoded once.

    python train.py --config configs/linear_probe.yaml --data-path DATA --weights BODY.pth
    python train.py --config configs/linear_probe.yaml --data-path DATA 'optim.lr=[0.001,0.01,0.1]'
    torchrun --nproc_per_node=2 train_multi_gpu_ddp.py --config configs/linear_probe.yaml --data-path DATA

run.py's fit hands a run with train.linear_probe to `probe` (after --eval-only, which takes a probe's
checkpoint as any other). Top to bottom:
  1. Features. The network, in eval mode, encodes each split once with the validation transform (no
     augmentation): the input of its head (model.find_head, a Linear) for every image. Each rank encodes
     the exact, unpadded shard evaluation uses (utils/samplers.py ShardSampler) and the rows are gathered
     in dataset order, so each image is encoded once whatever the number of processes. Rank 0 caches them
     in train.feature_cache (default RUN/features/) as train.pt and val.pt, each with a digest of what
     they depend on: the body's weights, model.name, the validation transform (image sizes, normalisation),
     the split's images and labels, the autocast dtype. A run that finds a file of the same digest reads it
     instead (a resume; a sweep's trials sharing one train.feature_cache); another digest is encoded again.
  2. Heads. One linear head per value of optim.lr, each starting from the model's own head, trains at
     once with the others (one batched matmul per step) for train.epochs on the cached train features:
     optim.name's optimizer, weight decay, warm-up and cosine schedule, batches of train.batch_size per
     process. After every epoch each head is scored on the val features (metrics.jsonl: probe_val_*).
  3. The kept head. The best (head, epoch) on val by train.best_metric (val_acc or val_loss; val_map
     multi-label), as DINOv2's eval/linear.py keeps the best of its grid, goes into the network's head;
     engine.evaluate scores it once more on the val features (the temperature and rejection threshold
     predict.py uses), and checkpoints/best.pt and last.pt hold the network in the usual format:
     predict.py, --eval-only and export.py take them unchanged.
A resumed probe (--resume auto) reads the cache and trains its heads again: they take seconds.
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from types import SimpleNamespace

import torch
from torch import nn

from engine import EvalSettings, compute_settings, evaluate, seed_for
from data import make_loader
from model import find_head
from utils import checkpoint as ckpt
from utils import fsdp, run_record
from utils import run_dir as run_files
from utils.config import config_to_dict, learning_rates
from utils.distributed_utils import broadcast_object, gather_objects
from utils.errors import UserError
from utils.metrics import multilabel_report
from utils.normalization import model_input, normalization_of
from utils.optim import WarmupCosine, build_scaler, scaled_lr
from utils.samplers import ShardSampler

# The numbers a head is chosen by (train.best_metric), single-label and multi-label.
METRICS = {False: ["val_acc", "val_loss"], True: ["val_map", "val_loss"]}
CACHE_VERSION = 1  # part of the digest: a change of the file's layout makes old caches stale


def probe(cfg, model, train_loader, val_loader, classes, dist_info, run_dir, logger, run_state, resumed, record):
    """Encode (or read) the features, train one head per optim.lr, keep the best on val in the network and
    write best.pt and last.pt; returns run_state (best score, epoch, calibration). Every rank calls it."""
    net, device = ckpt.unwrap(model), dist_info.device
    if fsdp.is_sharded(net):
        raise UserError("train.linear_probe keeps the body whole on every process; run it with train.py, "
                        "train_multi_gpu_dp.py or train_multi_gpu_ddp.py", every_rank=True)
    found = find_head(net, len(classes))
    if found is None or not isinstance(found[1], nn.Linear):
        raise UserError(f"train.linear_probe trains a linear head, and {cfg.model.name} has none with "
                        f"{len(classes)} outputs (model.find_head)", every_rank=True)
    head_name, head = found
    settings = EvalSettings(*compute_settings(cfg, device, multilabel=run_state.multilabel))
    logger.info("note: train.linear_probe: no augmentation; each split is encoded once, as validation reads it "
                f"(resize {cfg.data.val_resize}, centre crop {cfg.data.img_size})"
                + ("; resumed: the heads train again from the cached features" if resumed else ""))

    # -- 1. features: from the cache where its digest matches, else encoded, each rank its shard --
    folder = run_files.features(run_dir, cfg.train.feature_cache)
    splits = {"train": _unaugmented(train_loader.dataset, val_loader.dataset), "val": val_loader.dataset}
    features = {name: _features(name, dataset, net, head_name, head, cfg, classes, settings, dist_info, folder, logger)
                for name, dataset in splits.items()}

    # -- 2. heads: one per lr, trained together on the cached train features --
    lrs = learning_rates(cfg.optim)
    heads, best = _train_heads(cfg, head, features, lrs, settings, dist_info, logger, run_state)

    # -- 3. the kept head into the network; scored once more on val (every rank: its shard); saved --
    k, epoch, weight, bias = best
    with torch.no_grad():
        head.weight.copy_(weight)
        if head.bias is not None:
            head.bias.copy_(bias)
    val = _final_evaluation(cfg, head, features["val"], len(classes), settings, dist_info)
    run_state.best_epoch, run_state.epoch = epoch, cfg.train.epochs
    run_state.best_score = val[run_state.best_metric]
    if run_state.multilabel:
        run_state.thresholds = val["val_threshold"]
    else:
        run_state.temperature, run_state.reject_threshold = val["val_temperature"], val["val_reject_threshold"]
    logger.info(f"linear probe: kept the head of lr {lrs[k]:g} (of {len(lrs)}) at epoch {epoch}: "
                + "  ".join(f"{m} {val[m]:.4f}" for m in METRICS[run_state.multilabel]))
    if dist_info.rank == 0:
        optimizer, scheduler = heads
        state = ckpt.make_state(net, optimizer, scheduler, build_scaler(None, device), run_state, config_to_dict(cfg),
                                classes, record={**record, "linear_probe": {"lrs": lrs, "kept_lr": lrs[k],
                                                                            "epoch": epoch}})
        ckpt.save_checkpoint(state, run_files.checkpoints(run_dir), is_best=True)
    return run_state


# --------------------------------------------------------------------------- 1. features

def _unaugmented(train_set, val_set):
    """The training images read as validation reads its own: the same dataset, the val transform."""
    dataset = copy.copy(train_set)
    dataset.transform, dataset.train_transform = val_set.transform, train_set.transform
    return dataset


def _features(split, dataset, net, head_name, head, cfg, classes, settings, dist_info, folder, logger):
    """{"features": (N, D) float32, "labels": (N,) or (N, C), "index": (N,)} of a split, on every rank."""
    path = folder / f"{split}.pt"
    cached = None
    if dist_info.rank == 0:  # rank 0 alone reads the run directory (nodes need not share it)
        digest = feature_digest(net, head_name, cfg, dataset, classes, split, settings.amp_dtype)
        cached = _read_cache(path, digest)
    cached = broadcast_object(cached)  # every rank: the cache's rows, or None
    if cached is not None:
        logger.info(f"linear probe: {split} features read from the cache {path} ({len(cached['index'])} images, "
                    f"{cached['features'].shape[1]} features, digest {cached['digest'][:12]})")
        return cached
    start = time.perf_counter()
    loader = make_loader(dataset, cfg.train.batch_size, ShardSampler(dataset, dist_info.world_size, dist_info.rank),
                         cfg.data, dist_info.device, train=False, channels_last=cfg.model.channels_last)
    parts = gather_objects(_encode(net, head, loader, dist_info.device, settings, logger, split))
    index, feats, labels = (torch.cat([part[i] for part in parts]) for i in range(3))
    order = index.argsort()
    rows = {"index": index[order], "features": feats[order], "labels": labels[order]}
    logger.info(f"linear probe: encoded {split}: {len(index)} images once on {dist_info.world_size} process(es) "
                f"({' + '.join(str(len(part[0])) for part in parts)}), {feats.shape[1]} features each, "
                f"{time.perf_counter() - start:.1f}s -> {path}")
    if dist_info.rank == 0:
        rows["digest"] = digest
        folder.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_save(rows, path)
    return rows


@torch.no_grad()
def _encode(net, head, loader, device, settings, logger, split):
    """This rank's shard: (dataset indices, the head's inputs (n, D) float32, labels), on the CPU."""
    captured, labels = [], []
    hook = head.register_forward_hook(
        lambda module, inputs, output: captured.append(inputs[0].float().flatten(1).cpu()))
    net.eval()
    norm = normalization_of(loader.dataset, device)
    try:
        for images, targets in logger.progress_bar(loader, len(loader), f"encode {split}"):
            images = model_input(images, device, norm, settings.channels_last)
            with torch.autocast(device.type, dtype=settings.amp_dtype, enabled=settings.amp_dtype is not None):
                net(images)
            labels.append(targets.cpu())
    finally:
        hook.remove()
    index = torch.tensor(list(loader.sampler), dtype=torch.long)
    width = head.in_features
    return (index, torch.cat(captured) if captured else torch.zeros(0, width),
            torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long))


def feature_digest(net, head_name, cfg, dataset, classes, split, amp_dtype):
    """SHA-256 of what a split's features depend on: every body tensor (not the head's), the model's name, the
    validation transform, the split's images and labels (utils/run_record.py's digest) and the autocast dtype."""
    h = hashlib.sha256()
    for name, tensor in sorted(net.state_dict().items()):
        if name == head_name or name.startswith(head_name + "."):
            continue
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    data = run_record.data_digest(cfg.data.path, {split: dataset}, classes)
    h.update(json.dumps({"version": CACHE_VERSION, "model": cfg.model.name, "transform": repr(dataset.transform),
                         "channels": cfg.data.channels, "data": data, "amp": str(amp_dtype)}, sort_keys=True).encode())
    return h.hexdigest()


def _read_cache(path, digest):
    """The cached rows at `path` when their digest is `digest`, else None (absent, stale or unreadable)."""
    if not path.is_file():
        return None
    try:
        rows = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a damaged file is encoded again, as a stale one is
        return None
    return rows if isinstance(rows, dict) and rows.get("digest") == digest else None


# --------------------------------------------------------------------------- 2. heads

def _train_heads(cfg, head, features, lrs, settings, dist_info, logger, run_state):
    """Train one copy of `head` per lr on the train features; each epoch score all on val. Returns
    ((optimizer, scheduler), (head k, epoch, weight, bias) of the best score)."""
    device, criterion, multilabel = dist_info.device, settings.criterion, run_state.multilabel
    x, y = features["train"]["features"].to(device), features["train"]["labels"].to(device)
    vx, vy = features["val"]["features"].to(device), features["val"]["labels"].to(device)
    weights = [nn.Parameter(head.weight.detach().clone()) for _ in lrs]  # (C, D) each
    biases = [nn.Parameter(head.bias.detach().clone() if head.bias is not None else  # a head without one: 0, kept
                           torch.zeros(head.out_features, device=device), requires_grad=head.bias is not None)
              for _ in lrs]
    decay = cfg.optim.weight_decay
    peaks = [scaled_lr(SimpleNamespace(lr=lr, scale_lr=cfg.optim.scale_lr), dist_info.world_size) for lr in lrs]
    groups = [{"params": [w], "lr": peak, "weight_decay": decay} for w, peak in zip(weights, peaks)]
    groups += [{"params": [b], "lr": g["lr"], "weight_decay": decay if cfg.optim.name == "sgd" else 0.0}
               for b, g in zip(biases, groups)]  # adamw: no decay on biases, as build_optimizer
    optimizer = torch.optim.SGD(groups, momentum=cfg.optim.momentum) if cfg.optim.name == "sgd" else \
        torch.optim.AdamW(groups)
    batch = cfg.train.batch_size * dist_info.world_size  # the run's global batch: scale_lr's
    steps = max(len(x) // batch, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine.for_run(cfg.optim, cfg.train.epochs, steps))
    best = None
    for epoch in range(cfg.train.epochs):
        start = time.perf_counter()
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed_for(cfg.train.seed, epoch, 0)))
        loss_sum = torch.zeros(len(lrs), device=device, dtype=torch.float64)
        for i in range(steps):
            rows = order[i * batch:(i + 1) * batch].to(device)
            logits = _heads_forward(x[rows], weights, biases)  # (K, n, C)
            losses = torch.stack([criterion(logits[k], y[rows]) for k in range(len(lrs))])
            optimizer.zero_grad(set_to_none=True)
            losses.sum().backward()  # each head's gradient is its own loss's
            optimizer.step()
            scheduler.step()
            loss_sum += losses.detach().double()
        scores = _score_heads(_heads_forward(vx, weights, biases).detach(), vy, criterion, multilabel)
        for k, score in enumerate(scores):
            if run_state.better(score[run_state.best_metric], best and best[0]):
                best = (score[run_state.best_metric], k, epoch + 1, weights[k].detach().clone(),
                        biases[k].detach().clone())
        lead = max(range(len(lrs)), key=lambda k: scores[k][run_state.best_metric] *
                   (1 if run_state.best_mode == "max" else -1))
        line = {"epoch": epoch + 1, "step": (epoch + 1) * steps, "train_loss": loss_sum[lead].item() / steps,
                **scores[lead], "lr": lrs[lead], "probe_lrs": lrs,
                "probe_train_loss": [v / steps for v in loss_sum.tolist()],
                **{f"probe_{m}": [s[m] for s in scores] for m in scores[0]},
                f"best_{run_state.best_metric[4:]}": best[0], "epoch_seconds": time.perf_counter() - start}
        logger.epoch(line)
        logger.info(f"epoch {epoch + 1}/{cfg.train.epochs}  " + "  ".join(
            f"lr {lr:g}: " + " ".join(f"{m} {s[m]:.4f}" for m in s) for lr, s in zip(lrs, scores)))
    _, k, epoch, weight, bias = best
    return (optimizer, scheduler), (k, epoch, weight, bias)


def _heads_forward(x, weights, biases):
    """Every head's logits at once: (K, n, C)."""
    return torch.einsum("nd,kcd->knc", x, torch.stack(weights)) + torch.stack(biases)[:, None, :]


def _score_heads(logits, labels, criterion, multilabel):
    """Each head's val_loss and val_acc (val_map multi-label) on all the val features."""
    out = []
    for head_logits in logits:
        loss = criterion.per_image(head_logits, labels).double().mean().item() if len(labels) else 0.0
        if multilabel:
            probs = head_logits.double().sigmoid()
            score = multilabel_report(probs, labels > 0.5, torch.full((probs.shape[1],), 0.5, dtype=torch.float64))
            out.append({"val_loss": loss, "val_map": score["val_map"]})
        else:
            out.append({"val_loss": loss, "val_acc": (head_logits.argmax(1) == labels).double().mean().item()
                        if len(labels) else 0.0})
    return out


# --------------------------------------------------------------------------- 3. the kept head

class _Rows(torch.utils.data.Dataset):
    """Cached features as a dataset: (feature row, label); `multilabel` as data.py's datasets say it."""

    def __init__(self, rows, multilabel):
        self.rows, self.multilabel = rows, multilabel

    def __len__(self):
        return len(self.rows["index"])

    def __getitem__(self, i):
        return self.rows["features"][i], self.rows["labels"][i]


def _final_evaluation(cfg, head, rows, num_classes, settings, dist_info):
    """engine.evaluate of the kept head on the val features, each rank its ShardSampler shard: the numbers
    and the calibration of a training epoch's validation."""
    dataset = _Rows(rows, bool(rows["labels"].ndim == 2))
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.train.batch_size,
                                         sampler=ShardSampler(dataset, dist_info.world_size, dist_info.rank))
    plain = EvalSettings(settings.criterion, amp_dtype=None, channels_last=False)  # fp32 rows, not images
    return evaluate(head, loader, dist_info.device, num_classes, plain, threshold=cfg.eval.threshold,
                    tune_thresholds=cfg.eval.tune_thresholds)
