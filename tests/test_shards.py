"""data.shards (utils/shards.py, tools/make_shards.py): shards made from folders or a label file train to the same
numbers as the folders (a bad image among them skipped and counted alike), from a local folder, over HTTP, from
S3 and under DDP; a shard that cannot be read stops the run naming it.

    python -m pytest tests/test_shards.py -q

The single-process runs (folders, local, HTTP, S3) are train.py's main() in this process, once for the module;
what is read of a process (its exit status, its error line, a kill) runs a real one.
"""
import contextlib
import functools
import http.server
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _faults import log_seen
from _resume_utils import load, run_main, single_thread
from conftest import FAST_ARGS, REPO, free_port, make_image_folder, run_entry
from test_global_batch import load_script

# The numbers a run from shards must reproduce exactly; the rest (times, speeds) differ run to run.
EXACT = ("epoch", "step", "train_loss", "val_loss", "val_acc", "val_top5", "val_count", "val_per_class_acc",
         "bad_images")


def metrics(run_dir):
    return [{k: row.get(k) for k in EXACT} for row in map(json.loads, (Path(run_dir) / "metrics.jsonl").open())]


def make_shards(src, out, *args):
    """tools/make_shards.py as a user runs it."""
    proc = run_entry("tools/make_shards.py", src, "--out", out, "--jobs", 2, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"data.shards={Path(out).resolve()}"
    return out


def make_shards_here(src, out, *args):
    """tools/make_shards.py's main() in this process (the data module is imported here anyway)."""
    from tools import make_shards as tool
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        tool.main([str(src), "--out", str(out), "--jobs", "1", *map(str, args)])
    assert printed.getvalue().strip().splitlines()[-1] == f"data.shards={Path(out).resolve()}"
    return out


class Server:
    """A plain HTTP server on localhost for `root`, in a thread: it counts the requests per path, and answers
    the next ones of a path in `faults` as listed there: "500" (an error) or "cut" (half of the file)."""

    def __init__(self, root):
        self.requests, self.faults = {}, {}
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests[self.path] = server.requests.get(self.path, 0) + 1
                fault = server.faults.get(self.path, [None]).pop(0) if server.faults.get(self.path) else None
                if fault == "500":
                    self.send_error(500)
                elif fault == "cut":
                    data = (Path(root) / self.path.lstrip("/")).read_bytes()[:1000]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    super().do_GET()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=root))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the module's folder, its class folders, their shards): 5 classes, 29 images, 24 train / 5 val by the
    seeded split (24: whole batches of 4 on 1, 2 and 3 processes), one of them not an image; 7 per shard."""
    root = tmp_path_factory.mktemp("shards")
    data = make_image_folder(root / "flowers", per_class=6)
    (data / "tulips" / "tulips_005.jpg").unlink()
    (data / "roses" / "roses_002.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    return root, data, make_shards_here(data, root / "flowers_shards", "--per-shard", 7)


@pytest.fixture(scope="module")
def served(folders):
    """The module's folder over HTTP: its shards at {url}/flowers_shards."""
    server = Server(folders[0])
    yield server
    server.close()


@pytest.fixture(scope="module")
def s3():
    """moto's standalone S3 server on localhost, in a process of its own: (a boto3 client of it, the
    environment that points boto3 at it)."""
    boto3 = pytest.importorskip("boto3")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-east-1")
    deadline = time.time() + 30
    while True:
        try:
            client.list_buckets()
            break
        except Exception:  # noqa: BLE001 - not listening yet
            assert time.time() < deadline and server.poll() is None, "moto's server did not start"
            time.sleep(0.2)
    yield client, env
    server.terminate()
    server.wait(10)


@pytest.fixture(scope="module")
def single(folders, served, s3, tmp_path_factory):
    """{source: (run dir, its stderr)} of train.py's main() run in this process (one thread, as a child with
    OMP_NUM_THREADS=1) from the folders, the local shards, over HTTP and from S3; "requests": the HTTP
    server's count per path meanwhile; "cache": the HTTP run's shard cache."""
    _, data, shards = folders
    out = tmp_path_factory.mktemp("single")
    client, s3_env = s3
    client.create_bucket(Bucket="bucket")
    for f in Path(shards).iterdir():
        client.upload_file(str(f), "bucket", f"flowers_shards/{f.name}")
    sources = {"folders": ["--data-path", data], "local": [f"data.shards={shards}"],
               # A cache bound of a few bytes: it keeps only the shard fetched last, and the run still matches.
               "http": [f"data.shards={served.url}/flowers_shards", "data.shard_cache_gb=1e-9"],
               "s3": ["data.shards=s3://bucket/flowers_shards", f"data.shard_cache={out / 's3_cache'}"],
               # data.pipeline=gpu's per-batch decode (torchvision's decode_jpeg; nvJPEG on CUDA), here on the CPU.
               "folders_gpu": ["--data-path", data, "data.pipeline=gpu", "data.gpu_decode=per_batch"],
               "local_gpu": [f"data.shards={shards}", "data.pipeline=gpu", "data.gpu_decode=per_batch"]}
    served.requests.clear()
    runs = {}
    from utils import gpu_pipeline
    decoded, decode = [], gpu_pipeline._decode_jpegs

    def counted(parts, *args):  # the JPEGs the batch decoder got
        decoded.append(len(parts) if isinstance(parts, (list, tuple)) else 1)
        return decode(parts, *args)

    with pytest.MonkeyPatch.context() as mp, single_thread():
        for name, value in s3_env.items():
            mp.setenv(name, value)
        mp.setattr(gpu_pipeline, "_decode_jpegs", counted)
        train = load_script("train")
        for name, args in sources.items():
            decoded.clear()
            argv = [*FAST_ARGS, f"data.shard_cache={out / 'cache'}", *args, "--output-dir", out / name]
            with contextlib.redirect_stdout(io.StringIO()) as printed, contextlib.redirect_stderr(io.StringIO()) as err:
                rc = run_main(train, list(map(str, argv)), mp)
            assert rc == 0, (name, err.getvalue()[-3000:])
            runs[name] = (out / name, err.getvalue() + printed.getvalue())
            runs[name + " decoded"] = sum(decoded)
    return {**runs, "requests": dict(served.requests), "cache": out / "cache"}


@pytest.mark.slow  # the data module's imports, in this process
def test_the_split_from_shards_is_the_split_of_their_folders(folders):
    """The seeded split and each of data.folds' folds: the same images in the same order, from either."""
    from data import split_dataset
    from utils.config import load_config

    _, data, shards = folders
    for keys in ([], ["data.val_rate=0.5", "data.split_seed=3"], ["data.folds=3", "data.fold=1"]):
        from_folders = split_dataset(load_config([f"data.path={data}", *keys]).data)
        from_shards = split_dataset(load_config([f"data.shards={shards}", *keys]).data)
        for part in ("train", "val"):
            want = [(os.path.relpath(p, data), y) for p, y in getattr(from_folders, part)]
            assert list(getattr(from_shards, part)) == want, (keys, part)
            assert len(want)


@pytest.mark.slow
def test_an_image_is_read_at_its_place_in_the_shard_or_by_wids_for_shards_without_places(folders, tmp_path):
    """samples.jsonl's offset and size, and wids's own index of the tar (for shards made without them): the
    file's bytes either way; a place past a shard's end is that shard's one error."""
    from utils.shards import ShardError, ShardReader, read_index
    from data import _places
    _, data, shards = folders
    index, rows = read_index(shards)
    direct = ShardReader(shards, index, tmp_path / "a", 1 << 30, 1, _places(rows))
    by_wids = ShardReader(shards, index, tmp_path / "b", 1 << 30, 1)
    for row in (0, 6, 7, len(rows) - 1):  # a shard's first and last, the next shard's first, the last
        want = (data / rows[row]["path"]).read_bytes()
        assert direct.image(row)[1] == want and by_wids.image(row)[1] == want, row
    offsets, sizes = _places(rows)
    sizes[7] = 1 << 20
    with pytest.raises(ShardError, match="shard-000001.tar': .* of 1048576 bytes at .* [(]cut short[)]"):
        ShardReader(shards, index, tmp_path / "c", 1 << 30, 1, (offsets, sizes)).image(7)


@pytest.mark.slow
def test_training_from_shards_local_over_http_and_s3_gives_the_folders_numbers_bit_for_bit(single):
    for name in ("local", "http", "s3"):
        assert "skipping unreadable image: cannot decode 'roses/roses_002.jpg' in '" in single[name][1], name
    reference = metrics(single["folders"][0])
    assert len(reference) == 1 and reference[-1]["val_count"] == 5
    assert reference[-1]["bad_images"] == 1  # the broken file: skipped and counted, from the folders and the shards
    for name in ("local", "http", "s3"):
        assert metrics(single[name][0]) == reference, name
    record = [json.loads((single[n][0] / "run_record.json").read_text())["data"]
              for n in ("folders", "local", "http", "s3")]
    assert record[0] == record[1] == record[2] == record[3]  # the same images and labels, split alike
    assert single["requests"]["/flowers_shards/shard-000000.tar"] >= 1
    cached = [p for p in single["cache"].rglob("*.tar") if not p.is_symlink()]
    assert len(cached) == 1, cached


def seen(log):
    """tests/_faults.py's SEEN_LOG lines: [(attempt, rank, epoch, part, path)]."""
    rows = [line.split("\t") for line in Path(log).read_text().splitlines()]
    return [(int(a), int(r), int(e), part, path) for a, r, e, part, path in rows]


def paths_of(rows, **want):
    """The paths of `rows` (seen's) whose fields are `want`'s, in order."""
    names = ("attempt", "rank", "epoch", "part")
    return [row[-1] for row in rows if all(row[names.index(k)] == v for k, v in want.items())]


def once(paths):
    return sorted(paths) == sorted(set(paths))


@pytest.mark.slow
def test_ddp_from_shards_over_http_killed_mid_epoch_resumes_bit_for_bit_then_on_one_process_at_the_next_image(
        folders, tmp_path, served):
    """2 processes over HTTP, 2 epochs of 3 steps: rank 0 killed (kill -9) at epoch 1's 3rd step, torchrun
    restarts both and --resume auto continues from the step saved before: epoch 1 has the same losses as DDP
    from the folders straight, and validation counts each of the 5 images once (no padding to 6). Killed
    again at epoch 2's 2nd step, with no restart left; train.py (1 process) --resume auto then trains the
    16 images of epoch 2 that no process had trained: each of the 24 once in that epoch across the two."""
    _, data, shards = folders
    base = [*FAST_ARGS, "--resume", "auto", "train.save_every_steps=1", "train.log_every=1", "train.epochs=2",
            f"data.shard_cache={tmp_path / 'cache'}"]
    proc = run_entry("train_multi_gpu_ddp.py", *base, "--data-path", data, "--output-dir", tmp_path / "folders",
                     nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    http = [f"data.shards={served.url}/flowers_shards", "--output-dir", tmp_path / "http"]
    killed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
                             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
                             REPO / "tests/_faults.py", "kill:0:2:2", "train_multi_gpu_ddp.py", *map(str, base + http)],
                            capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "SEEN_LOG": str(tmp_path / "seen.log")})
    assert killed.returncode != 0, killed.stderr[-3000:]  # the second kill: no restart left
    resumed = [x for x in (killed.stdout + killed.stderr).splitlines() if "resumed from" in x]
    assert len(resumed) == 1 and resumed[0].endswith("global step 2)"), killed.stdout[-3000:] + killed.stderr[-5000:]
    assert metrics(tmp_path / "http") == metrics(tmp_path / "folders")[:1]
    assert metrics(tmp_path / "http")[0]["val_count"] == 5
    first = seen(tmp_path / "seen.log")
    val = paths_of(first, attempt=1, epoch=0, part="val")
    assert len(val) == 5 and once(val) and {paths_of(first, attempt=1, part="val", rank=r).__len__() for r in (0, 1)} \
        == {2, 3}
    # Epoch 2 on 2 processes: the batches last.pt holds (each rank's first), then one process for the rest.
    state = load(tmp_path / "http" / "checkpoints" / "last.pt")
    assert (state["epoch"], state["epoch_step"], state["data"]["world_size"]) == (1, 1, 2)
    trained = [p for r in (0, 1) for p in paths_of(first, attempt=1, epoch=1, part="train", rank=r)[:4]]
    with pytest.MonkeyPatch.context() as mp, single_thread():
        log_seen(tmp_path / "seen_1.log", mp.setattr)
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
            rc = run_main(load_script("train"), list(map(str, base + http)), mp)
    out = out.getvalue() + err.getvalue()
    assert rc == 0, out[-3000:]
    assert "at epoch 2 at image 9 of its order" in out, out[-3000:]
    assert "epoch 2 goes on from image 9 of its 24 in its order" in out, out[-3000:]
    trained += paths_of(seen(tmp_path / "seen_1.log"), epoch=1, part="train")
    from data import split_dataset
    from utils.config import load_config
    train = [path for path, _ in split_dataset(load_config([f"data.shards={shards}"]).data).train]
    assert sorted(trained) == sorted(train), "each training image once in the epoch of the restart"
    assert [m["epoch"] for m in metrics(tmp_path / "http")] == [1, 2]
    assert metrics(tmp_path / "http")[1]["val_count"] == 5


@pytest.mark.slow
@pytest.mark.parametrize("script, nproc, val_shares", [("train_multi_gpu_ddp.py", 3, [1, 2, 2]),
                                                        ("train_multi_gpu_fsdp.py", 2, [2, 3])])
def test_ddp_and_fsdp_from_shards_see_each_image_once_an_epoch_and_validate_exactly(folders, tmp_path, script,
                                                                                     nproc, val_shares):
    """24 training images, an equal share per rank (DDP on 3: 2 batches of 4 each; FSDP on 2: 3 batches); the
    5 validation images split unpadded over the ranks, none twice."""
    _, _, shards = folders
    proc = run_entry("tests/_faults.py", "none", script, *FAST_ARGS, f"data.shards={shards}",
                     f"data.shard_cache={tmp_path / 'cache'}", "--output-dir", tmp_path / "run", nproc=nproc,
                     env={"SEEN_LOG": str(tmp_path / "seen.log")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = seen(tmp_path / "seen.log")
    train, val = paths_of(rows, part="train"), paths_of(rows, part="val")
    assert len(train) == 24 and once(train)
    assert [len(paths_of(rows, part="train", rank=r)) for r in range(nproc)] == [24 // nproc] * nproc
    assert len(val) == 5 and once(val)
    assert sorted(len(paths_of(rows, part="val", rank=r)) for r in range(nproc)) == val_shares
    [line] = metrics(tmp_path / "run")
    assert line["val_count"] == 5 and line["bad_images"] == 1


@pytest.mark.slow
def test_the_gpu_pipeline_decodes_the_jpegs_of_shards_as_those_of_files(single):
    """data.pipeline=gpu with data.gpu_decode=per_batch: the shards' bytes, decoded batch by batch (on the CPU
    here), give the folders' numbers, the bad image skipped and counted alike."""
    for name in ("folders_gpu", "local_gpu"):
        assert "gpu pipeline: 24 train images, JPEGs decoded on cpu every batch" in single[name][1], name
    assert metrics(single["local_gpu"][0]) == metrics(single["folders_gpu"][0])
    assert single["local_gpu decoded"] == single["folders_gpu decoded"] >= 23  # every readable training JPEG
    assert metrics(single["local_gpu"][0])[0]["bad_images"] == 1


@pytest.mark.slow
def test_a_shard_that_fails_past_its_retries_stops_the_run_in_one_line_naming_it(served, tmp_path):
    """A shard that answers 500, then comes cut short: both retried, then one line naming it and the last why."""
    shard, url = "/flowers_shards/shard-000001.tar", f"{served.url}/flowers_shards"
    served.requests.clear()
    served.faults[shard] = ["500", "cut"]
    proc = run_entry("train.py", *FAST_ARGS, f"data.shards={url}", "data.shard_retries=2",
                     f"data.shard_cache={tmp_path / 'cache'}", "--output-dir", tmp_path / "run")
    served.faults.clear()
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"shard '{served.url}{shard}' after 2 tries" in errors[0], proc.stderr
    assert "index.json says" in errors[0] and "(cut short)" in errors[0]
    assert served.requests[shard] == 2  # the 500 was tried again
    # A URL that is not there is not retried: one request, one line, the usage's exit status.
    served.requests.clear()
    proc = run_entry("train.py", *FAST_ARGS, f"data.shards={served.url}/shardz", "data.shard_retries=2",
                     "--output-dir", tmp_path / "typo")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == [f"error: data.shards: cannot read '{served.url}/shardz/index.json' "
                                               "after 1 try: HTTP 404 File not found"], proc.stderr[-3000:]
    assert served.requests == {"/shardz/index.json": 1}


@pytest.mark.slow
def test_make_shards_packs_a_multilabel_label_file_with_its_split_and_groups_and_resumes(tmp_path):
    data = make_image_folder(tmp_path / "imgs", per_class=3, classes=("a", "b"))
    rows = ["path,label,split,group", "a/a_000.jpg,cat;dog,train,g1", "a/a_001.jpg,cat,train,g1",
            "a/a_002.jpg,dog,val,g2", "b/b_000.jpg,dog;bird,train,g3", "b/b_001.jpg,bird,val,", "b/b_002.jpg,cat,test,"]
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    out = make_shards(data, tmp_path / "shards", "--labels", tmp_path / "labels.csv", "--per-shard", 4)
    index = json.loads((out / "index.json").read_text())
    assert index["classes"] == ["bird", "cat", "dog"] and index["multilabel"]
    assert [s["nsamples"] for s in index["shardlist"]] == [4, 2]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    place = {k: samples[0].pop(k) for k in ("offset", "size")}
    assert samples[0] == {"path": "a/a_000.jpg", "label": [1, 2], "split": "train", "group": "g1"}
    assert [s["split"] for s in samples] == ["train", "train", "val", "train", "val", "test"]
    # The image's bytes as they were, beside its row, and where samples.jsonl says they are (the last shard's too).
    import tarfile
    with tarfile.open(out / "shard-000000.tar") as tar:
        assert tar.extractfile("000000000.jpg").read() == (data / "a" / "a_000.jpg").read_bytes()
    for shard, row, path in (("shard-000000.tar", place, "a/a_000.jpg"), ("shard-000001.tar", samples[5], "b/b_002.jpg")):
        with open(out / shard, "rb") as f:
            f.seek(row["offset"])
            assert f.read(row["size"]) == (data / path).read_bytes()
    # Started again after a stop: the finished shard is kept, the missing one written again, alike.
    first = (out / "shard-000000.tar").stat().st_mtime_ns
    (out / "shard-000001.tar").unlink()
    make_shards_here(data, out, "--labels", tmp_path / "labels.csv", "--per-shard", 4)
    assert (out / "shard-000000.tar").stat().st_mtime_ns == first
    assert json.loads((out / "index.json").read_text()) == index


@pytest.mark.slow
def test_data_verify_or_a_label_file_with_shards_is_refused_in_one_line(folders, tmp_path):
    _, _, shards = folders
    for key, said in (("data.verify=true", "error: data.verify=true decodes image files"),
                      ("data.labels=labels.csv", "error: data.shards and data.labels both name the data")):
        proc = run_entry("train.py", *FAST_ARGS, f"data.shards={shards}", key, "--output-dir", tmp_path / "run")
        assert proc.returncode == 2
        assert [x for x in proc.stderr.splitlines() if x.startswith("error:")][0].startswith(said), proc.stderr
