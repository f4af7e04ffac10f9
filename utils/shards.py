"""data.shards: images packed in WebDataset tar shards, on a local disk, at an http(s):// or s3:// URL, read by index.

    python tools/make_shards.py data/demo_flowers --out data/demo_shards       # prints the value below
    python train.py --config configs/demo.yaml data.shards=data/demo_shards
    python -m http.server 8000 -d data &                                       # any web server, or a bucket's URL
    python train.py --config configs/demo.yaml data.shards=http://localhost:8000/demo_shards
    AWS_ENDPOINT_URL=https://minio.example:9000 python train.py ... data.shards=s3://bucket/demo_shards   # boto3

A shard folder holds shard-000000.tar, ... (WebDataset's layout: per image KEY.jpg, the file's bytes as they were,
and KEY.json, its path, labels, split and group), index.json (wids's descriptor: each shard's name, sample count,
size and MD5, with the class names beside them) and samples.jsonl (one line per image in shard order: what the
split needs, so that no shard is read to make it). docs/shards.md compares the engines this was chosen from.

Image i is read by index, so the template's samplers (DistributedSampler, the unpadded ShardSampler of validation,
mid-epoch resume) apply unchanged: at the offset and size samples.jsonl gives for it, or, for shards without them,
through wids's ShardListDataset (webdataset's indexed reader), which indexes a shard by parsing its tar headers. A shard at a URL
is fetched whole into data.shard_cache by `Fetcher` (wids's own fetch runs curl once, without retries, and keeps
an error page as the shard), retried data.shard_retries times and checked against index.json's size; the cache
keeps the most recently fetched shards within data.shard_cache_gb. A local shard is read where it lies.
"""
import contextlib
import hashlib
import io
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import numpy as np

from utils.errors import RUNTIME_EXIT, UserError

INDEX = "index.json"
SAMPLES = "samples.jsonl"
OPEN_SHARDS = 64  # shards each process keeps open (wids's LRU): a miss re-reads a shard's tar headers


class ShardError(UserError):
    """A shard that cannot be read past its retries: a runtime failure. Raised in a DataLoader worker it
    reaches the main process rebuilt from its class and text alone, so the exit code is the class's."""

    def __init__(self, message, exit_code=RUNTIME_EXIT):
        super().__init__(message, exit_code)


def is_url(location):
    return urlparse(str(location)).scheme in ("http", "https", "s3")


_S3 = {}


def _open(url, timeout=60):
    """A readable stream of `url`'s bytes: http(s) by urllib; s3://BUCKET/KEY by boto3, its endpoint, keys and
    region from the usual AWS_* variables or ~/.aws (AWS_ENDPOINT_URL for an S3-compatible store)."""
    parts = urlparse(url)
    if parts.scheme != "s3":
        return urllib.request.urlopen(url, timeout=timeout)
    client = _S3.get(os.getpid())
    if client is None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise UserError(f"data.shards '{url}': s3:// needs boto3 (pip install boto3)") from None
        # One policy of retries, this module's: boto3's own would multiply them.
        client = _S3[os.getpid()] = boto3.client("s3", config=Config(
            retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=timeout, read_timeout=timeout))
    return contextlib.closing(client.get_object(Bucket=parts.netloc, Key=parts.path.lstrip("/"))["Body"])


def _tries(attempt):
    return f"{attempt + 1} {'try' if attempt == 0 else 'tries'}"


def _permanent(e):
    """A refusal that no retry changes: not found, forbidden (a server's or a network's failure is retried)."""
    code = getattr(e, "code", None) if isinstance(e, urllib.error.HTTPError) else None
    error = getattr(e, "response", None)
    if isinstance(error, dict) and "Error" in error:
        code = error["Error"].get("Code")
        code = int(code) if str(code).isdigit() else {"NoSuchKey": 404, "NoSuchBucket": 404, "AccessDenied": 403,
                                                        "InvalidAccessKeyId": 403, "SignatureDoesNotMatch": 403}.get(code)
    return code is not None and 400 <= code < 500 and code not in (408, 429)


def _why(e):
    """Why a fetch failed, in a few words."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    error = getattr(e, "response", None)
    if isinstance(error, dict) and "Error" in error:  # botocore's ClientError
        return f"S3 {error['Error'].get('Code')} {error['Error'].get('Message', '')}".strip()
    return str(getattr(e, "reason", None) or e)


def join(base, name):
    return f"{str(base).rstrip('/')}/{name}" if is_url(base) else os.path.join(base, name)


def read_bytes(location, retries=3, timeout=60):
    """A file's bytes from a path or an http(s) URL, tried `retries` times (a pause that doubles between)."""
    if not is_url(location):
        try:
            with open(location, "rb") as f:
                return f.read()
        except OSError as e:
            raise ShardError(f"cannot read '{location}': {e.strerror or e}") from None
    why = None
    for attempt in range(max(retries, 1)):
        if attempt:
            time.sleep(min(0.5 * 2 ** (attempt - 1), 10))
        try:
            with _open(location, timeout) as response:
                return response.read()
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - the network's and the server's failures alike are retried
            why = _why(e)
            if _permanent(e):
                break
    raise ShardError(f"cannot read '{location}' after {_tries(attempt)}: {why}")


def read_index(location, retries=3):
    """(index.json as a dict, the rows of samples.jsonl as dicts) of the shards at `location` (a folder or URL)."""
    if not is_url(location) and not os.path.isfile(os.path.join(location, INDEX)):
        raise UserError(f"data.shards '{location}' holds no {INDEX}; make shards with "
                        "python tools/make_shards.py SRC --out DIR and set data.shards=DIR")
    try:
        index = json.loads(read_bytes(join(location, INDEX), retries))
        lines = read_bytes(join(location, SAMPLES), retries).splitlines()
        rows = json.loads(b"[" + b",".join(line for line in lines if line.strip()) + b"]")  # one parse, not one a row
    except ShardError as e:
        raise UserError(f"data.shards: {e}") from None
    except ValueError as e:
        raise UserError(f"data.shards '{location}': {INDEX} or {SAMPLES} is not JSON ({e})") from None
    if len(rows) != sum(s["nsamples"] for s in index["shardlist"]):
        raise UserError(f"data.shards '{location}': {SAMPLES} lists {len(rows)} images, the shards "
                        f"{sum(s['nsamples'] for s in index['shardlist'])}; make the shards again")
    return index, rows


class Fetcher:
    """wids's `localname`: a shard's URL -> a local file wids opens. A URL is fetched into `cache_dir` (once per
    node: a lock file), retried, checked against the size index.json gives, and the least recently fetched
    shards are removed past `cache_bytes` (a process that still reads one keeps it: the file is only unlinked).
    A local shard is linked into the cache, where wids puts its lock files, and read where it lies."""

    def __init__(self, cache_dir, cache_bytes, retries, sizes):
        self.cache_dir, self.cache_bytes, self.retries, self.sizes = cache_dir, cache_bytes, retries, sizes

    def __call__(self, url):
        os.makedirs(self.cache_dir, exist_ok=True)
        local = os.path.join(self.cache_dir, os.path.basename(urlparse(url).path))
        if not is_url(url):
            if not os.path.islink(local):
                with contextlib.suppress(FileExistsError):
                    os.symlink(os.path.abspath(url), local)
            if not os.path.isfile(url):
                raise ShardError(f"cannot read shard '{url}': no such file")
            return local
        import fcntl  # here: POSIX only, and data.py (which imports this module) also runs on Windows
        with open(local + ".fetch", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per node; the others wait and find it
            if not os.path.isfile(local):
                self._fetch(url, local)
        self._evict(keep=local)
        return local

    def _fetch(self, url, local):
        want, why = self.sizes.get(url), None
        for attempt in range(max(self.retries, 1)):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 10))
            fd, tmp = tempfile.mkstemp(dir=self.cache_dir, suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out, _open(url) as response:
                    while chunk := response.read(1 << 20):
                        out.write(chunk)
                got = os.path.getsize(tmp)
                if want is not None and got != want:
                    why = f"{got} bytes where index.json says {want} (cut short)"
                    continue
                os.replace(tmp, local)
                return
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - as in read_bytes
                why = _why(e)
                if _permanent(e):
                    break
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        raise ShardError(f"cannot read shard '{url}' after {_tries(attempt)}: {why}; when it is "
                         "back, continue with --resume auto")

    def _evict(self, keep):
        files = []
        for entry in os.scandir(self.cache_dir):
            if entry.name.endswith(".tar") and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    stat = entry.stat(follow_symlinks=False)
                    files.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.cache_bytes:
                break
            if path != keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                total -= size


class ShardReader:
    """Image `row` of the shards -> (a name for messages, the image file's bytes). Where samples.jsonl gives each
    image's offset and size in its shard (`places`, as tools/make_shards.py writes them), they are read from
    there; otherwise through wids's ShardListDataset, which parses every tar header of a shard when it opens it
    (0.1 s per 1,000 images; for each shard a loader's first batch touches, in every worker, and again for
    each shard its LRU of OPEN_SHARDS dropped). Shards are opened in each process that reads (a forked loader
    worker opens its own)."""

    def __init__(self, location, index, cache_dir, cache_bytes, retries, places=None):
        self.location = str(location)
        self.places = places  # (offsets, sizes) per row, int64 arrays; None: wids finds them
        self.shards = [{"url": join(location, s["url"]), "nsamples": s["nsamples"]} for s in index["shardlist"]]
        sizes = {join(location, s["url"]): s.get("filesize") for s in index["shardlist"]}
        # One cache folder per set of shards and place: shards of the same name elsewhere do not meet.
        key = hashlib.sha256(f"{index.get('digest')}\n{self.location}".encode()).hexdigest()[:16]
        self.fetcher = Fetcher(os.path.join(cache_dir, key), cache_bytes, retries, sizes)
        self.ends = np.cumsum([s["nsamples"] for s in self.shards])
        self._wids, self._pid, self._files = None, None, {}

    def __getstate__(self):
        return {**self.__dict__, "_wids": None, "_pid": None, "_files": {}}

    def _dataset(self):
        if self._wids is None or self._pid != os.getpid():
            import wids  # here: only data.shards needs it
            # wids prints a summary line on each opening; one per worker is noise.
            with contextlib.redirect_stderr(io.StringIO()):
                self._wids = wids.ShardListDataset(self.shards, localname=self.fetcher, transformations=[],
                                                   lru_size=min(len(self.shards), OPEN_SHARDS))
            self._wids.check_cache_misses = lambda: None  # its "miss rate" line: random order misses by design
            self._pid = os.getpid()
        return self._wids

    def shard_of(self, row):
        return self.shards[int(np.searchsorted(self.ends, row, side="right"))]["url"]

    def _read(self, row):
        """Image `row`'s bytes at their place in its shard; the last OPEN_SHARDS shards stay open (a shard the
        cache has since removed is still read through its open file)."""
        if self._pid != os.getpid():
            self._files, self._pid = {}, os.getpid()
        url = self.shard_of(row)
        f = self._files.pop(url, None)
        if f is None:
            f = open(self.fetcher(url), "rb")
            if len(self._files) >= OPEN_SHARDS:
                self._files.pop(next(iter(self._files))).close()
        self._files[url] = f  # last: the most recently used
        offset, size = int(self.places[0][row]), int(self.places[1][row])
        f.seek(offset)
        data = f.read(size)
        if len(data) != size:
            raise ShardError(f"cannot read shard '{url}': {len(data)} of {size} bytes at {offset} (cut short)")
        return url, data

    def image(self, row):
        """(the shard's URL, the bytes of image `row`'s file)."""
        if self.places is not None:
            return self._read(row)
        try:
            sample = self._dataset()[row]
        except ShardError:
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or garbled tar: the shard's fault, named
            raise ShardError(f"cannot read shard '{self.shard_of(row)}': {type(e).__name__}: {e}") from None
        data = next((v for k, v in sample.items() if k != ".json" and not k.startswith("__")), b"")
        return sample["__shard__"], data.getvalue() if hasattr(data, "getvalue") else data
