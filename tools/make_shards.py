"""Pack class folders or a label file into WebDataset tar shards that data.shards reads (utils/shards.py).

    python tools/make_shards.py data/demo_flowers --out data/demo_shards
    python tools/make_shards.py data/photos --labels data/photos/labels.csv --out /big/photo_shards --per-shard 5000
    python train.py --config configs/demo.yaml data.shards=data/demo_shards        # the line it prints at the end

SRC is read as data.path is: class folders, a root with train/ val/ [test/] (the split goes into the shards), or
with --labels a CSV or JSON Lines label file (utils/label_file.py: several labels per row, a split and a group
column). Each image's file goes in as its bytes, not re-encoded, with KEY.json beside it: its path relative to
SRC, its label (a class index, or a list of them), split and group. index.json (wids's descriptor, with the class
names and a digest of every shard's MD5) and samples.jsonl (the same rows, for the split, with the offset and
size of each image's bytes in its shard) are written last.

Shards are written in parallel (--jobs, default every core), each to a temporary name that is renamed when
complete: run again after a stop, it keeps the finished shards and writes the rest. Serve the folder as it is
(any web server, or copy it to a bucket) and set data.shards to its URL.
"""
import argparse
import hashlib
import json
import os
import sys
import tarfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data import all_samples  # noqa: E402
from utils.cli import cli_entry  # noqa: E402
from utils.errors import UserError  # noqa: E402
from utils.shards import INDEX, SAMPLES  # noqa: E402
from utils.splits import SPLITS  # noqa: E402


def shard_name(i):
    return f"shard-{i:06d}.tar"


def write_shard(out, i, rows):
    """Shard i holding `rows` ((key, file, meta) each), written under a temporary name and renamed when
    complete; one already there is kept. -> (name, samples, bytes, MD5, each row's image (offset, size) in it)."""
    import webdataset as wds  # its TarWriter: the layout every WebDataset reader takes

    final = Path(out) / shard_name(i)
    if not final.exists():
        tmp = final.with_suffix(".tar.part")
        # mtime fixed and no encoding: the same images give the same bytes, so the same MD5s and digest.
        with wds.TarWriter(str(tmp), encoder=False, mtime=0) as sink:
            for key, path, meta in rows:
                ext = Path(path).suffix.lower().lstrip(".") or "img"
                sink.write({"__key__": key, ext: Path(path).read_bytes(), "json": json.dumps(meta).encode()})
        os.replace(tmp, final)
    digest = hashlib.md5()
    with open(final, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    # Where each image's bytes lie in the tar: a reader goes straight there, without parsing the tar's headers.
    with tarfile.open(final) as tar:
        places = {m.name.rsplit(".", 1)[0]: (m.offset_data, m.size) for m in tar if not m.name.endswith(".json")}
    return final.name, len(rows), final.stat().st_size, digest.hexdigest(), [places[key] for key, _, _ in rows]


@cli_entry
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="class folders, a root with train/ val/, or the root of --labels' paths")
    parser.add_argument("--out", required=True, help="folder the shards go to")
    parser.add_argument("--labels", help="a CSV or JSON Lines label file (as data.labels)")
    parser.add_argument("--per-shard", type=int, default=10000, help="images per shard (default 10000)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="shards written at once")
    args = parser.parse_args(argv)
    if args.per_shard < 1 or args.jobs < 1:
        raise UserError("--per-shard and --jobs take a positive number")
    samples, classes, codes, groups = all_samples(args.src, args.labels)
    root = os.path.join(str(Path(args.src)), "")
    rows = []
    for i, (path, label) in enumerate(samples):
        meta = {"path": path[len(root):] if path.startswith(root) else path,
                "label": list(label) if samples.multilabel else label,
                "split": SPLITS[codes[i]] if codes[i] >= 0 else None,
                "group": groups[i] if groups is not None else None}
        rows.append((f"{i:09d}", path, meta))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # What goes where: a run started again keeps its finished shards only if they hold these same images.
    plan = hashlib.sha256(json.dumps([args.per_shard, [meta for _, _, meta in rows]]).encode()).hexdigest()
    planned = out / "plan.sha256"
    if planned.exists() and planned.read_text().strip() != plan:
        raise UserError(f"'{out}' holds shards of other images (or another --per-shard); give another --out")
    planned.write_text(plan + "\n")
    chunks = [rows[a:a + args.per_shard] for a in range(0, len(rows), args.per_shard)]
    with ProcessPoolExecutor(min(args.jobs, len(chunks))) as pool:
        done = list(pool.map(write_shard, [out] * len(chunks), range(len(chunks)), chunks))
    shardlist = [{"url": name, "nsamples": n, "filesize": size, "md5sum": md5} for name, n, size, md5, _ in done]
    places = [place for *_, shard_places in done for place in shard_places]
    lines = "".join(json.dumps({**meta, "offset": offset, "size": size}) + "\n"
                    for (_, _, meta), (offset, size) in zip(rows, places))
    digest = hashlib.sha256(lines.encode())
    for shard in shardlist:
        digest.update(shard["md5sum"].encode())
    index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": Path(args.src).name,
             "shardlist": shardlist, "classes": classes, "multilabel": bool(samples.multilabel),
             "source": "labels" if args.labels else "folders", "digest": digest.hexdigest()}
    (out / SAMPLES).write_text(lines)
    tmp = out / (INDEX + ".part")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX)  # last: a folder with index.json is complete
    print(f"{len(rows)} images, {len(classes)} classes in {len(shardlist)} shard(s) under '{out}', "
          f"digest {index['digest'][:16]}")
    print(f"data.shards={out.resolve()}")


if __name__ == "__main__":
    main()
