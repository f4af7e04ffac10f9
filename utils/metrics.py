"""Validation metrics from a run's scores: per-class precision, recall and F1 from a confusion matrix,
and the multi-label ones from every image's probabilities (average precision, the per-label F1 thresholds,
micro/macro-F1, exact match). Pure functions of tensors: the loop (engine.py) gathers the scores; the
tests check these against scikit-learn's."""
import math

import torch


def classification_report(confusion):
    """Per-class precision, recall and F1, macro-F1 and the matrix itself from a confusion
    matrix (rows true, columns predicted); 0 where a class was never predicted or never present.
    Macro-F1 is the mean over the classes present in val or predicted, as scikit-learn's and
    torchmetrics' are: a class the val split lacks and the model never says does not count as 0."""
    confusion = confusion.double()
    tp = confusion.diag()
    predicted, actual = confusion.sum(dim=0), confusion.sum(dim=1)
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(actual > 0, tp / actual.clamp(min=1), torch.zeros_like(tp))
    both = precision + recall
    f1 = torch.where(both > 0, 2 * precision * recall / both.clamp(min=1e-12), torch.zeros_like(tp))
    return {"val_precision": precision.tolist(), "val_recall": recall.tolist(), "val_f1": f1.tolist(),
            "val_macro_f1": f1[(predicted > 0) | (actual > 0)].mean().nan_to_num(0.0).item(),
            "val_confusion": confusion.long().tolist()}


def top_k_hits(logits, labels, k):
    """Per image, whether its class is among the k highest logits. Ties are broken as top-1's argmax breaks
    them, the lower class index first, so a top-1 hit is always a top-k hit (logits.topk leaves the order
    of tied values unspecified)."""
    true = logits.gather(1, labels[:, None])
    index = torch.arange(logits.shape[1], device=logits.device)
    ahead = (logits > true) | ((logits == true) & (index[None, :] < labels[:, None]))
    return ahead.sum(dim=1) < k


def _ranked(probs, targets):
    """One label's scores sorted high to low (ties in dataset order), and at each distinct score
    (the last position of its run): the true positives and the images at or above it."""
    s, order = probs.sort(descending=True, stable=True)
    y = targets[order].double()
    last = torch.cat([s[1:] != s[:-1], s.new_ones(1, dtype=torch.bool)]).nonzero().flatten() if len(s) else \
        torch.zeros(0, dtype=torch.long)
    return s, y.cumsum(0)[last], (last + 1).double(), last


def average_precision(probs, targets):
    """Each label's average precision over all images, not binned: the sum over distinct scores of
    (recall gained) x (precision at that score), scikit-learn's average_precision_score; NaN for a
    label without a positive. probs, targets: (N, C)."""
    ap = []
    for c in range(probs.shape[1]):
        _, tp, seen, _ = _ranked(probs[:, c], targets[:, c])
        positives = targets[:, c].sum().item()
        if not positives:
            ap.append(math.nan)
            continue
        recall = tp / positives
        ap.append(((recall - torch.cat([recall.new_zeros(1), recall[:-1]])) * tp / seen).sum().item())
    return torch.tensor(ap, dtype=torch.float64)


def best_f1_thresholds(probs, targets, default):
    """Per label, the threshold that maximises its F1 on these scores: halfway between the score
    that scores best (the highest, on a tie) and the next lower one, or half the lowest score when
    that is the best: a threshold never sits on a score, where rounding would flip the label.
    A label whose best F1 is 0 (no positive) keeps its `default`."""
    out = default.clone()
    for c in range(probs.shape[1]):
        s, tp, seen, last = _ranked(probs[:, c], targets[:, c])
        positives = targets[:, c].sum().item()
        if not positives:
            continue
        f1 = 2 * tp / (seen + positives)
        best = int(f1.argmax())  # the first maximum: the highest such threshold
        if f1[best] > 0:
            nxt = last[best] + 1
            out[c] = (s[last[best]] + (s[nxt] if nxt < len(s) else 0)) / 2
    return out


def multilabel_report(probs, targets, thresholds):
    """Multi-label metrics from every image's probabilities (N, C) and 0/1 targets: per label
    precision, recall, F1 (a label is predicted at or above its threshold), AP and positives;
    micro-F1 (over all image-label pairs), macro-F1 (mean of the labels' F1), mAP (mean AP over the
    labels with a positive) and exact-match accuracy (the whole label set right). 0 where undefined."""
    pred = probs >= thresholds
    truth = targets.bool()
    tp = (pred & truth).sum(0).double()
    fp = (pred & ~truth).sum(0).double()
    fn = (~pred & truth).sum(0).double()

    def ratio(a, b):
        return torch.where(b > 0, a / b.clamp(min=1), torch.zeros_like(a))

    f1 = ratio(2 * tp, 2 * tp + fp + fn)
    ap = average_precision(probs, targets)
    has_positive = ~ap.isnan()
    micro = ratio(2 * tp.sum(), 2 * tp.sum() + fp.sum() + fn.sum())
    return {"val_map": ap[has_positive].mean().item() if has_positive.any() else 0.0,
            "val_micro_f1": micro.item(), "val_macro_f1": f1.mean().item(),
            "val_exact_match": (pred == truth).all(dim=1).double().mean().item() if len(pred) else 0.0,
            "val_count": len(pred),
            "val_precision": ratio(tp, tp + fp).tolist(), "val_recall": ratio(tp, tp + fn).tolist(),
            "val_f1": f1.tolist(), "val_ap": [None if math.isnan(a) else a for a in ap.tolist()],
            "val_positives": (tp + fn).long().tolist(), "val_threshold": thresholds.tolist()}
