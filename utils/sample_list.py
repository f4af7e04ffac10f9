"""A dataset's samples as forked loader workers share them: the (path, label) pairs, and which files are bad.

SampleList stores the pairs in a few numpy arrays that a worker reads without copying them;
BadStatus names the per-file codes a dataset keeps in shared memory, so that what a worker
finds reaches the main process. verify_images (data.verify) finds the bad files up front.
"""
import enum
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from utils.decoding import BadImage, load_rgb
from utils.distributed_utils import gather_objects, get_rank, get_world_size


class SampleList:
    """(path, label) pairs packed into numpy arrays: every path's bytes end to end, where each
    starts, and the labels. Indexing and iterating give (path, label) tuples, as the list did.

    A Python list of tuples is two objects per image, and a forked DataLoader worker that merely
    reads one writes its reference count, so every worker slowly copies the whole list
    (pytorch/pytorch#13246): gigabytes at a million images, 8 workers and 8 ranks. A few arrays
    are a few objects, and reading them writes nothing (BENCHMARKS.md measures both).

    Single-label: `labels`, int64 (N,), and a sample is (path, class index). Multi-label
    (`multilabel`, when a label is a tuple or multilabel=True): the labels in CSR form,
    `label_offsets` int64 (N+1,) and `label_values` int64, and a sample is (path, sorted tuple of
    class indices); numpy.bincount(label_values) counts each label's positives."""

    def __init__(self, samples=(), multilabel=None):
        encoded, labels = [], []
        for path, label in samples:
            encoded.append(os.fsencode(path))  # fsencode: a name that is not valid UTF-8 round-trips
            labels.append(label)
        if multilabel is None:
            multilabel = any(isinstance(label, (tuple, list)) for label in labels)
        if multilabel:
            rows = [sorted(set(label)) if isinstance(label, (tuple, list)) else [label] for label in labels]
            offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([len(r) for r in rows], out=offsets[1:])
            values = np.fromiter((v for r in rows for v in r), dtype=np.int64, count=int(offsets[-1]))
            self._set(encoded, label_offsets=offsets, label_values=values)
        else:
            self._set(encoded, labels=np.array(labels, dtype=np.int64))

    @classmethod
    def from_arrays(cls, paths, labels=None, label_offsets=None, label_values=None):
        """A SampleList from paths (str) and the label arrays themselves: no tuple per sample is made."""
        self = cls.__new__(cls)
        # One encode of all the paths, NUL-separated (no path holds a NUL): the separators give the offsets.
        blob = np.frombuffer(("\0".join(paths) + "\0").encode(sys.getfilesystemencoding(), "surrogateescape"),
                             dtype=np.uint8)
        ends = np.flatnonzero(blob == 0)
        offsets = np.zeros(len(ends) + 1, dtype=np.int64)
        offsets[1:] = ends - np.arange(len(ends))
        self._set(None, labels, label_offsets, label_values, paths=blob[blob != 0], offsets=offsets)
        return self

    def _set(self, encoded, labels=None, label_offsets=None, label_values=None, paths=None, offsets=None):
        if paths is None:
            paths = np.frombuffer(b"".join(encoded), dtype=np.uint8)
            offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
            np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=offsets[1:])
        self.paths, self.offsets = paths, offsets
        self.multilabel = labels is None
        if self.multilabel:
            self.label_offsets = np.asarray(label_offsets, dtype=np.int64)
            self.label_values = np.asarray(label_values, dtype=np.int64)
        else:
            self.labels = np.asarray(labels, dtype=np.int64)

    def take(self, indices):
        """The samples at `indices` (in that order) as a new SampleList, gathered array-wise."""
        indices = np.asarray(indices, dtype=np.int64)
        out = SampleList.__new__(SampleList)
        paths, offsets = _gather(self.paths, self.offsets, indices)
        if self.multilabel:
            values, label_offsets = _gather(self.label_values, self.label_offsets, indices)
            out._set(None, label_offsets=label_offsets, label_values=values, paths=paths, offsets=offsets)
        else:
            out._set(None, labels=self.labels[indices], paths=paths, offsets=offsets)
        return out

    def as_multilabel(self):
        """The same samples as multi-label ones: each class index becomes a one-label tuple (data.task=multi)."""
        if self.multilabel:
            return self
        out = SampleList.__new__(SampleList)
        out._set(None, label_offsets=np.arange(len(self) + 1), label_values=self.labels, paths=self.paths,
                 offsets=self.offsets)
        return out

    def label_tuples(self):
        """Each sample's labels as a tuple of class indices (a one-tuple for a single-label list)."""
        if not self.multilabel:
            return [(v,) for v in self.labels.tolist()]
        values = self.label_values.tolist()
        bounds = self.label_offsets.tolist()
        return [tuple(values[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        index %= len(self)
        start, end = self.offsets[index], self.offsets[index + 1]
        path = os.fsdecode(self.paths[start:end].tobytes())
        if self.multilabel:
            return path, tuple(self.label_values[self.label_offsets[index]:self.label_offsets[index + 1]].tolist())
        return path, int(self.labels[index])

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _gather(flat, offsets, indices):
    """Rows `indices` of a CSR pair (flat values, row offsets) -> (their values end to end, new offsets)."""
    lengths = offsets[indices + 1] - offsets[indices]
    new_offsets = np.zeros(len(indices) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    at = np.repeat(offsets[indices] - new_offsets[:-1], lengths) + np.arange(new_offsets[-1], dtype=np.int64)
    return flat[at], new_offsets


class BadStatus(enum.IntEnum):
    """What a dataset's bad_status holds for each file (one uint8 per sample)."""
    NOT_KNOWN = 0   # not known to be bad: it decoded, or was not read yet
    FOUND = 1       # failed to decode, and rank 0 has not warned about it yet
    REPORTED = 2    # failed to decode, and rank 0 has warned about it


def _check_file(path, max_pixels):
    try:
        load_rgb(path, max_pixels)
        return None
    except BadImage as e:
        return path, str(e)


def verify_images(paths, max_pixels):
    """Decode every image once (data.verify); return (path, why) of the unreadable ones.

    Each rank checks a disjoint share with a few threads (PIL releases the GIL
    while decoding) and all ranks get the full list.
    """
    mine = paths[get_rank()::get_world_size()]
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        bad = [m for m in pool.map(_check_file, mine, [max_pixels] * len(mine)) if m]
    return sorted(m for part in gather_objects(bad) for m in part)
