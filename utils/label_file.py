"""data.labels: a CSV or JSON Lines file that lists the images and their labels, instead of class folders.

    path,label,split                       {"path": "a/1.jpg", "label": "cat", "split": "train"}
    a/1.jpg,cat,train                      {"path": "a/2.jpg", "label": ["cat", "dog"]}
    a/2.jpg,cat;dog,val                    (one JSON object per line)

`path` is relative to data.path (an absolute one is kept); `label` is a class name, several in CSV
separated by `;` (a JSON list in JSON Lines) make the row multi-label; `split` (train/val/test) is
optional and fixes the split; `group` is optional (a patient, a plant, a video: rows that must stay
together) and keeps its rows in one fold of data.folds (utils/splits.py). A file that cannot be read as
such is refused in one line that names the row. A million rows read in a few seconds: one pass of
plain Python over the rows, the result packed into a SampleList at once (utils/sample_list.py).
"""
import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from utils.errors import UserError
from utils.sample_list import SampleList
from utils.splits import SPLITS

SPLIT_CODES = {name: code for code, name in enumerate(SPLITS)}
SHOWN = 3  # rows named in an error about many rows


@dataclass
class LabelTable:
    samples: SampleList   # every row, in file order; multi-label (CSR) when any row names several labels
    classes: list         # index -> name, the sorted set of names
    split: np.ndarray     # int8 index into SPLITS per row, or None when the file has no split column
    groups: list          # the `group` column per row, or None
    lines: np.ndarray     # each row's line in the file, for messages
    multi_rows: int       # rows that name more than one label

    @property
    def multilabel(self):
        return self.samples.multilabel


def read_label_file(file, root):
    """FILE (CSV, or JSON Lines when it ends in .jsonl/.ndjson) -> LabelTable; paths joined to `root`."""
    file = Path(file)
    if not file.is_file():
        raise UserError(f"data.labels '{file}' does not exist or is not a file")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as spreadsheet programs write, is allowed
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"data.labels '{file}' is not UTF-8 text (line {line}, byte {e.start}: "
                        f"{raw[e.start:e.start + 1]!r}); save it as UTF-8") from None
    jsonl = file.suffix.lower() in (".jsonl", ".ndjson")
    rows = _jsonl_rows(text, file) if jsonl else _csv_rows(text, file)
    return _table(rows, file, str(Path(root)))


def _csv_rows(text, file):
    """-> (line, path, label names, split, group) per data row."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    columns = [c.strip().lower() for c in header or ()]
    if "path" not in columns or "label" not in columns:
        raise UserError(f"data.labels '{file}' has no header row naming a 'path' and a 'label' column "
                        f"(first line: {','.join(header or [])!r}); its first line must be e.g. path,label,split")
    pi, li = columns.index("path"), columns.index("label")
    si = columns.index("split") if "split" in columns else None
    gi = columns.index("group") if "group" in columns else None
    width = len(columns)
    for row in reader:
        if not row:
            continue  # a blank line
        if len(row) < width:
            raise UserError(f"data.labels '{file}' line {reader.line_num} has {len(row)} field(s), "
                            f"the header {width}")
        label = row[li]
        # One name is a str, several a list: the common single-label row makes no list.
        names = [n.strip() for n in label.split(";")] if ";" in label else label.strip()
        yield (reader.line_num, row[pi], names, None if si is None else row[si].strip(),
               None if gi is None else row[gi])


def _jsonl_rows(text, file):
    for line, entry in enumerate(text.splitlines(), start=1):
        if not entry.strip():
            continue
        try:
            obj = json.loads(entry)
        except ValueError as e:
            raise UserError(f"data.labels '{file}' line {line} is not JSON ({e})") from None
        if not isinstance(obj, dict) or "path" not in obj or "label" not in obj:
            raise UserError(f"data.labels '{file}' line {line} is not an object with a \"path\" and a \"label\"")
        label = obj["label"]
        names = [str(n).strip() for n in label] if isinstance(label, list) else str(label).strip()
        split = obj.get("split")
        yield line, str(obj["path"]), names, None if split is None else str(split).strip(), obj.get("group")


def _table(rows, file, root):
    paths, lines, counts, values, splits, groups = [], [], [], [], [], []
    ids, first_row, repeated, empty, unknown = {}, {}, [], [], []
    prefix, absolute = os.path.join(root, ""), tuple(filter(None, (os.sep, os.altsep)))
    has_split = None
    for line, path, names, split, group in rows:
        if has_split is None:
            has_split = split is not None
        row = len(paths)
        if not path or not names or not all(names):
            empty.append(line)
        if type(names) is str:  # one label
            label = ids.get(names)
            if label is None:
                label = ids[names] = len(ids)
            values.append(label)
            counts.append(1)
        else:
            label_ids = sorted({ids.setdefault(n, len(ids)) for n in names})
            values.extend(label_ids)
            counts.append(len(label_ids))
        if has_split:
            code = SPLIT_CODES.get(split)
            if code is None:
                unknown.append((line, split))
            splits.append(code or 0)
        full = path if path.startswith(absolute) else prefix + path
        if first_row.setdefault(full, row) != row:
            repeated.append(row)
        paths.append(full)
        lines.append(line)
        groups.append(group)  # a JSON Lines row may have a group where the first row has none
    if empty:
        raise UserError(f"data.labels '{file}': {len(empty)} row(s) have an empty path or label, e.g. line "
                        f"{', '.join(map(str, empty[:SHOWN]))}; give every row an image and at least one label")
    if unknown:
        line, split = unknown[0]
        raise UserError(f"data.labels '{file}' line {line}: unknown split {split!r} ({len(unknown)} row(s) "
                        f"like it); the split column takes {', '.join(SPLITS)}")
    counts = np.array(counts, dtype=np.int64)
    offsets = np.zeros(len(paths) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    labels_of = lambda row: values[offsets[row]:offsets[row + 1]]  # noqa: E731 (provisional ids, sorted)
    duplicates = [(row, first_row[paths[row]]) for row in repeated
                  if labels_of(row) != labels_of(first_row[paths[row]])]
    if duplicates:
        row, first = duplicates[0]
        line, path, seen = lines[row], paths[row], lines[first]
        raise UserError(f"data.labels '{file}' lists '{path}' on line {seen} and again on line {line} with "
                        f"other labels ({len(duplicates)} such row(s)); give each image one set of labels")
    if not paths:
        raise UserError(f"data.labels '{file}' lists no images")
    missing = _missing(paths)
    if missing:
        named = ", ".join(f"line {lines[i]} '{paths[i]}'" for i in missing[:SHOWN])
        raise UserError(f"data.labels '{file}': {len(missing)} of {len(paths)} row(s) name an image that does "
                        f"not exist (paths are relative to data.path '{root}'), e.g. {named}")
    # Ids were given in order of appearance; the classes are the sorted names, as for folders.
    classes = sorted(ids)
    rank = np.empty(len(ids), dtype=np.int64)
    rank[[ids[c] for c in classes]] = np.arange(len(classes))
    values = rank[np.array(values, dtype=np.int64)]
    multi_rows = int((counts > 1).sum())
    if multi_rows:
        # Sort each row's ids again after the renumbering: by row, then by id.
        values = values[np.lexsort((values, np.repeat(np.arange(len(paths)), counts)))]
        samples = SampleList.from_arrays(paths, label_offsets=offsets, label_values=values)
    else:
        samples = SampleList.from_arrays(paths, labels=values)
    return LabelTable(samples, classes, np.array(splits, dtype=np.int8) if has_split else None,
                      groups if any(g is not None for g in groups) else None,
                      np.array(lines, dtype=np.int64), multi_rows)


def _missing(paths):
    """Indices of the paths that do not exist: one listing per folder, not one stat per image."""
    listed, missing = {}, []
    for i, path in enumerate(paths):
        folder, _, name = path.rpartition(os.sep)
        names = listed.get(folder)
        if names is None:
            try:
                names = listed[folder] = set(os.listdir(folder or "."))
            except OSError:
                names = listed[folder] = set()
        if name not in names:
            missing.append(i)
    return missing
