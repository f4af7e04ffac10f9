"""Calibrated probabilities and "none of these" (single-label): a temperature, ECE, a rejection threshold, OOD scores.

A network's softmax is usually over-confident: of the images it gives 0.98, fewer than 98% are right.
One temperature T, fitted on validation by NLL (softmax(logits / T); Guo et al. 2017, "On Calibration of
Modern Neural Networks"), fixes most of it without changing a single prediction. ECE (expected calibration
error, 15 equal-width confidence bins, torchmetrics' MulticlassCalibrationError's definition) says how far
the confidences are from the accuracies, before and after. The rejection threshold is the calibrated top
probability that keeps KEEP (95%) of the validation images: predict.py --reject auto answers "unknown" under
it. OOD scores (eval.ood): the calibrated top probability and the energy, T * logsumexp(logits / T) (Liu et
al. 2020), each higher for an image of the classes; AUROC and the false-positive rate at 95% true positives
against validation say how well they tell the two apart.

Every function is called by every rank, each with its own shard's logits: the sums are all-reduced and the
per-image scores gathered, so the numbers are a single process's.
"""
import math

import torch
import torch.nn.functional as F

from utils.distributed_utils import gather_objects, reduce_sums

BINS = 15
KEEP = 0.95  # the share of validation images the automatic rejection threshold keeps
T_RANGE = (0.05, 20.0)  # the temperatures searched


def fit_temperature(logits, labels, rounds=4, points=33):
    """The T in T_RANGE minimising the NLL of softmax(logits / T) over every rank's images: a grid of
    `points` log-spaced temperatures, then `rounds` - 1 finer grids around the best (one all-reduce each;
    the last grid's step is under 1e-4 of T)."""
    logits, labels = logits.double(), labels.long()
    lo, hi = bounds = math.log(T_RANGE[0]), math.log(T_RANGE[1])
    best = 0.0
    for _ in range(rounds):
        grid = torch.linspace(lo, hi, points, dtype=torch.float64)
        nll = torch.stack([F.cross_entropy(logits / math.exp(g), labels, reduction="sum") for g in grid.tolist()])
        total = reduce_sums({"nll": nll.to(logits.device)})["nll"]
        if not total.any():  # no image on any rank (data.val_rate=0): nothing to fit
            return 1.0
        i = int(total.argmin())
        best, step = grid[i].item(), (hi - lo) / (points - 1)
        lo, hi = max(best - step, bounds[0]), min(best + step, bounds[1])
    return math.exp(best)


def ece(logits, labels, temperature=1.0, bins=BINS):
    """Expected calibration error of softmax(logits / temperature) over every rank's images: the
    count-weighted mean over equal-width confidence bins of |accuracy - mean confidence|."""
    return ece_of(reliability(logits, labels, temperature, bins))


def ece_of(table):
    """ECE from reliability's table."""
    count, conf, correct = (torch.as_tensor(row, dtype=torch.float64) for row in table)
    return (correct - conf).abs().sum().item() / max(count.sum().item(), 1)


def reliability(logits, labels, temperature=1.0, bins=BINS):
    """Per equal-width confidence bin, over every rank's images: [counts, sums of the top probability,
    numbers right] (three lists): the reliability diagram's data."""
    probs = (logits.double() / temperature).softmax(dim=1)
    conf, pred = probs.max(dim=1)
    # torchmetrics' binning: bucketize on the bin edges (right=True), the top edge in the last bin.
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64, device=conf.device)
    which = (torch.bucketize(conf, edges, right=True) - 1).clamp(0, bins - 1)
    sums = torch.zeros(3, bins, dtype=torch.float64, device=conf.device)
    sums[0].index_add_(0, which, torch.ones_like(conf))
    sums[1].index_add_(0, which, conf)
    sums[2].index_add_(0, which, (pred == labels).double())
    return reduce_sums({"bins": sums})["bins"].tolist()


def scores(logits, temperature):
    """Per image: (calibrated top probability, energy T * logsumexp(logits / T)), both higher for an
    image the model knows."""
    z = logits.double() / temperature
    return z.softmax(dim=1).max(dim=1).values, temperature * torch.logsumexp(z, dim=1)


def gathered(values):
    """A 1-D tensor of each rank's images -> all of them, on the CPU, on every rank (a collective)."""
    parts = gather_objects(values.detach().double().cpu())
    return torch.cat(parts) if parts else values.double().cpu()


def reject_threshold(confidences, keep=KEEP):
    """The confidence that keeps at least `keep` of these images (those at or above it)."""
    if not len(confidences):
        return 0.0
    ordered = confidences.sort().values
    return ordered[int(math.floor((1 - keep) * len(ordered)))].item()


def report(logits, labels, temperature=None, keep_scores=False):
    """Validation's calibration: ECE before and after, the temperature (fitted here when not given), the
    rejection threshold at it, the reliability diagram's bins (val_reliability) and, with keep_scores, every
    image's scores (val_scores, for eval.ood)."""
    t = fit_temperature(logits, labels) if temperature is None else float(temperature)
    confidence, energy = scores(logits, t)
    confidence, energy = gathered(confidence), gathered(energy)
    before, after = reliability(logits, labels), reliability(logits, labels, t)
    return {"val_ece": ece_of(before), "val_temperature": t, "val_ece_calibrated": ece_of(after),
            "val_reject_threshold": reject_threshold(confidence),
            "val_reliability": {"bins": BINS, "rows": ["images", "confidence sum", "right"],
                                "before": before, "after": after},
            **({"val_scores": (confidence, energy)} if keep_scores else {})}


def auroc(known, unknown):
    """The area under the ROC curve with the known images as positives (scikit-learn's roc_auc_score):
    the chance that a known image scores above an unknown one."""
    from sklearn.metrics import roc_auc_score
    if not len(known) or not len(unknown):
        return float("nan")
    truth = torch.cat([torch.ones(len(known)), torch.zeros(len(unknown))])
    return float(roc_auc_score(truth.numpy(), torch.cat([known, unknown]).double().numpy()))


def fpr_at_tpr(known, unknown, tpr=KEEP):
    """The share of unknown images at or above the score that keeps `tpr` of the known ones."""
    threshold = reject_threshold(known, tpr)
    return (unknown >= threshold).double().mean().item() if len(unknown) else float("nan")


def ood_report(known, unknown, reject):
    """eval.json's "ood": for each score, AUROC and FPR at 95% TPR of the unknown images against the known
    (validation); for the calibrated top probability also the share of unknown images under `reject`
    (those predict.py --reject auto answers "unknown"), and the share of known ones."""
    (conf_in, energy_in), (conf_out, energy_out) = known, unknown
    out = {"images": len(conf_out), "known_images": len(conf_in)}
    for name, a, b in (("max_prob", conf_in, conf_out), ("energy", energy_in, energy_out)):
        out[name] = {"auroc": auroc(a, b), "fpr_at_95_tpr": fpr_at_tpr(a, b)}
    out["max_prob"]["reject_threshold"] = reject
    out["max_prob"]["rejected"] = (conf_out < reject).double().mean().item() if len(conf_out) else float("nan")
    out["max_prob"]["known_rejected"] = (conf_in < reject).double().mean().item() if len(conf_in) else float("nan")
    return out
