"""utils/metrics.py's single-label rules against scikit-learn: macro-F1 over the classes present in val or
predicted, and top-k with ties broken as top-1 breaks them (docs/after-training.md, "Metric rules").

    python -m pytest tests/test_metrics.py -q
"""
import pytest
import torch
from sklearn.metrics import f1_score, precision_recall_fscore_support, top_k_accuracy_score

from utils.metrics import classification_report, top_k_hits


def confusion_of(y_true, y_pred, num_classes):
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)
    for t, p in zip(y_true, y_pred):
        confusion[t, p] += 1
    return confusion


@pytest.mark.parametrize("y_true, y_pred", [
    ([0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 2, 0]),          # every class present
    ([0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 2, 3]),          # class 3 predicted, never true: counts (F1 0)
    ([0, 0, 1, 1, 1, 2], [0, 0, 1, 2, 1, 2]),          # classes 3 and 4 neither: left out
    ([4, 4, 4, 4], [4, 4, 0, 4]),                      # one class in val, one more predicted
])
def test_macro_f1_and_per_class_scores_are_scikit_learns(y_true, y_pred):
    report = classification_report(confusion_of(y_true, y_pred, 5))
    assert report["val_macro_f1"] == pytest.approx(f1_score(y_true, y_pred, average="macro"), abs=1e-12)
    p, r, f, _ = precision_recall_fscore_support(y_true, y_pred, labels=range(5), zero_division=0)
    assert report["val_precision"] == pytest.approx(p.tolist())
    assert report["val_recall"] == pytest.approx(r.tolist())
    assert report["val_f1"] == pytest.approx(f.tolist())


def test_top_k_is_scikit_learns_without_ties():
    torch.manual_seed(0)
    logits, labels = torch.randn(500, 7), torch.randint(0, 7, (500,))
    for k in (1, 2, 5):
        ours = top_k_hits(logits, labels, k).double().mean().item()
        assert ours == pytest.approx(top_k_accuracy_score(labels, logits, k=k, labels=range(7)), abs=1e-12)
    assert torch.equal(top_k_hits(logits, labels, 1), logits.argmax(dim=1) == labels)


def test_under_ties_top_k_agrees_with_top_1():
    """All logits equal (a dead network) or tied in blocks: top-1's argmax takes the lowest index, and top-k
    the k lowest of a tie, so every top-1 hit is a top-k hit and top-k >= top-1 image by image."""
    labels = torch.arange(8).repeat(4)
    flat = torch.zeros(len(labels), 8)
    assert torch.equal(top_k_hits(flat, labels, 1), labels == 0)
    assert torch.equal(top_k_hits(flat, labels, 5), labels < 5)
    torch.manual_seed(1)
    blocks = torch.randint(0, 3, (len(labels), 8)).float()  # many ties
    top1 = blocks.argmax(dim=1) == labels
    for k in (1, 2, 5, 8):
        hits = top_k_hits(blocks, labels, k)
        assert torch.equal(hits | top1, hits)  # a top-1 hit is a top-k hit
        # exactly k classes count as "in the top k" for every image: the ranking is a total order
        ranked = [int(top_k_hits(blocks, torch.full_like(labels, c), k)[0]) for c in range(8)]
        assert sum(ranked) == k
    assert torch.equal(top_k_hits(blocks, labels, 1), top1)
