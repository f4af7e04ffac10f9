"""A dataset's samples as forked loader workers share them: the (path, label) pairs, and which files are bad.

SampleList stores the pairs in three numpy arrays that a worker reads without copying them;
BadStatus names the per-file codes a dataset keeps in shared memory, so that what a worker
finds reaches the main process. verify_images (data.verify) finds the bad files up front.
"""
import enum
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from utils.decoding import BadImage, load_rgb
from utils.distributed_utils import gather_objects, get_rank, get_world_size


class SampleList:
    """(path, label) pairs packed into three numpy arrays: every path's bytes end to end, where each
    starts, and the labels. Indexing and iterating give (path, label) tuples, as the list did.

    A Python list of tuples is two objects per image, and a forked DataLoader worker that merely
    reads one writes its reference count, so every worker slowly copies the whole list
    (pytorch/pytorch#13246): gigabytes at a million images, 8 workers and 8 ranks. Three arrays
    are three objects, and reading them writes nothing (BENCHMARKS.md measures both)."""

    def __init__(self, samples=()):
        encoded, labels = [], []
        for path, label in samples:
            encoded.append(os.fsencode(path))  # fsencode: a name that is not valid UTF-8 round-trips
            labels.append(label)
        self.paths = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in encoded], out=self.offsets[1:])
        self.labels = np.array(labels, dtype=np.int64)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        index %= len(self)
        start, end = self.offsets[index], self.offsets[index + 1]
        return os.fsdecode(self.paths[start:end].tobytes()), int(self.labels[index])

    def __iter__(self):
        return (self[i] for i in range(len(self)))


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
