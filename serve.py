"""A small prediction service: POST an image, get its top classes as JSON; GET / is a page to drop one on.

    python serve.py runs/demo --port 8000                               # a run directory (its best.pt)
    python serve.py runs/demo/checkpoints/best.onnx --port 8000         # export.py's model: no torch needed
    curl --data-binary @photo.jpg http://127.0.0.1:8000/predict         # -> {"top": [{"class": ..., "prob": ...}, ...]}
    curl -F image=@photo.jpg http://127.0.0.1:8000/predict              # a form upload works too
    python serve.py runs/demo --reject auto --topk 3 --host 0.0.0.0     # "unknown" answers; reachable from other machines

POST /predict takes one image (the request's body, or the first file of a multipart form) and answers
the row predict.py (a run directory or .pt) or predict_onnx.py (an .onnx with its sidecar) prints for
it, through their own functions: the same decoding, preprocessing, calibrated probabilities (the run's
temperature), top-k, multi-label thresholds and --reject; the JSON is their --out FILE.json's record
without the path. /predict?cam=1 adds "cam", a PNG (data URL) of predict.py --cam's Grad-CAM overlay
for the top class; an .onnx model has no gradients to give one, and the page says so. GET / is that
page: drop an image, see the classes as bars and the overlay.

A body over --max-upload-mb is answered 413 before it is read into memory (and drained, so the client
reads the answer); an image that cannot be decoded (or is over data.max_image_pixels) 400; each error
is one JSON line, {"error": "..."}. Nothing but the model given at the start is ever read: there are no
paths in a request and no file is served. The service binds 127.0.0.1 unless --host says otherwise.

The standard library's ThreadingHTTPServer, not a web framework: two routes and one model need no
routing, templating or async machinery, and a framework (Flask, FastAPI + uvicorn) would be one more
dependency to install and keep, also beside predict_onnx.py on a server without torch. Put it behind
a reverse proxy (nginx, Caddy) for TLS or the open internet. Each request has its own thread and its
own temporary folder (the upload is written there, so that it is decoded by exactly predict.py's and
predict_onnx.py's path-taking functions); the model call runs under one lock: Grad-CAM hooks the
model's target layer, so two calls at once on one model would read each other's activations, and one
call already keeps every core busy (torch's and onnxruntime's intra-op threads), so a second model
copy or session per thread would add memory, not throughput. Reading the upload and writing the
answer run outside the lock; the image is decoded inside it (the reused functions decode and run in one call).
"""
import argparse
import base64
import email.parser
import email.policy
import html
import json
import sys
import tempfile
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import predict_onnx
from predict_onnx import BadImage, UserError
from utils import run_dir as run_files

DRAIN_LIMIT = 8  # an oversized body up to this many times --max-upload-mb is read and dropped before the 413


class OnnxModel:
    """An .onnx file with its sidecar, run by predict_onnx.py's functions in one onnxruntime session."""

    cam_note = ("Grad-CAM needs the PyTorch checkpoint (onnxruntime gives no gradients): serve the run directory "
                "to see it.")

    def __init__(self, path, topk, reject):
        self.path, self.spec = path, predict_onnx.read_sidecar(path)
        reject = predict_onnx.resolve_reject(reject, self.spec["activation"] == "sigmoid",
                                             self.spec.get("reject_threshold"), f"the sidecar of '{path}'")
        self.classes, self.reject = self.spec["classes"], reject or 0.0
        self.topk = min(topk, len(self.classes))

    def load(self):
        self.run = predict_onnx.run_model(self.path, self.spec)

    def __call__(self, image, workdir, cam):
        rows, bad = predict_onnx.predict(self.path, [str(image)], self.spec, self.topk, 1, self.reject, run=self.run)
        return rows, bad, None


class TorchModel:
    """A run directory or checkpoint, run by predict.py's functions (and its Grad-CAM, predict.py --cam's)."""

    def __init__(self, source, topk, reject, device):
        self.source, self.topk, self.reject, self.device = source, topk, reject, device

    def load(self):
        # torch is imported here only: an .onnx model is served without it.
        import predict  # noqa: F401 - imported now, not by the first request
        from data import build_transforms, trained_data_config
        from model import load_trained
        from utils.cam import find_target
        from utils.decoding import MODES
        from utils.distributed_utils import resolve_device
        from utils.errors import UserError as TorchUserError
        try:
            self.device = resolve_device(self.device)
            model, self.classes, config, path = load_trained(self.source)
        except TorchUserError as e:
            raise UserError(str(e), e.exit_code) from None
        self.reject = predict_onnx.resolve_reject(self.reject, getattr(model, "multilabel", False),
                                                  model.reject_threshold, f"checkpoint '{path}'")
        self.model, self.reject = model.to(self.device), self.reject or 0.0
        self.topk = min(self.topk, len(self.classes))
        data = trained_data_config(config)
        self.size, self.channels = int(data["img_size"]), int(data["channels"])
        self.transform = build_transforms(self.size, int(data["val_resize"]), channels=self.channels)[1]
        self.max_pixels, self.mode = int(data["max_image_pixels"]), MODES[self.channels]
        self.thresholds = model.thresholds if getattr(model, "multilabel", False) else None
        try:
            self.target, self.cam_note = find_target(model, (config.get("model") or {}).get("cam_layer")), ""
        except TorchUserError as e:  # the predictions are still served, without the overlay
            self.target, self.cam_note = None, str(e)

    def __call__(self, image, workdir, cam):
        import predict
        rows, bad = predict.predict(self.model, [str(image)], self.transform, self.size, self.device, self.topk, 1, 0,
                                    self.max_pixels, self.mode, self.thresholds, getattr(self.model, "temperature", 1.0),
                                    self.reject)
        png = None
        if rows and cam and self.target is not None and rows[0][1] and rows[0][1][0][0] >= 0:
            written = predict.write_cams(self.model, self.target, rows[:1], self.classes, Path(workdir), None,
                                         self.transform, self.size, self.device, 1, self.max_pixels, self.mode)
            png = written[0].read_bytes() if written else None
        return rows, bad, png


def open_model(source, topk, reject, device):
    """Everything a user can get wrong at the start, checked before torch or onnxruntime is loaded."""
    path = Path(source)
    if path.suffix.lower() == ".onnx":
        if not path.is_file():
            raise UserError(f"model '{source}' does not exist")
        return OnnxModel(path, topk, reject)
    if path.is_dir():
        if not run_files.best(path).is_file():
            raise UserError(f"run directory '{source}' has no checkpoints/best.pt; pass a checkpoint file or an .onnx")
    elif not path.is_file():
        raise UserError(f"'{source}' does not exist (pass a run directory, a .pt checkpoint or an .onnx model)")
    return TorchModel(path, topk, reject, device)


def image_of(body, content_type):
    """The upload's bytes: the body itself, or the first file part of a multipart/form-data body."""
    if not content_type.startswith("multipart/form-data"):
        return body
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    for part in message.iter_parts():
        if part.get_filename() is not None or part.get_content_maintype() == "image":
            return part.get_payload(decode=True) or b""
    raise BadImage("the form holds no file part (send the image as a file field, e.g. curl -F image=@photo.jpg)")


class Handler(BaseHTTPRequestHandler):
    server_version = "serve.py"
    timeout = 60  # a client that stops sending frees its thread

    def answer(self, status, body, content_type="application/json"):
        data = body if isinstance(body, bytes) else (json.dumps(body, ensure_ascii=False) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type + "; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def error(self, status, message):
        self.answer(status, {"error": message})

    def do_GET(self):
        if urlsplit(self.path).path != "/":
            return self.error(404, "no such page: GET / (the page) or POST /predict (an image)")
        self.answer(200, self.server.page, "text/html")

    def do_POST(self):
        url = urlsplit(self.path)
        if url.path != "/predict":
            return self.error(404, "no such endpoint: POST /predict with an image")
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            self.close_connection = True
            return self.error(411, "send the image with a Content-Length (chunked uploads are not taken)")
        length, cap = int(length), self.server.max_upload
        if length > cap:
            left = length if length <= DRAIN_LIMIT * cap else 0
            while left > 0:  # read and dropped in pieces, so that the client reads the 413
                left -= len(self.rfile.read(min(1 << 16, left))) or left
            self.close_connection = True
            return self.error(413, f"the upload is {length} bytes, over the limit of "
                                   f"{cap} (serve.py --max-upload-mb)")
        body = self.rfile.read(length)
        cam = parse_qs(url.query).get("cam", ["0"])[0] == "1"
        with tempfile.TemporaryDirectory(prefix="serve-") as workdir:
            image = Path(workdir) / "upload"
            try:
                image.write_bytes(image_of(body, self.headers.get("Content-Type", "")))
                with self.server.lock:
                    rows, bad, png = self.server.model(image, workdir, cam)
            except BadImage as e:
                return self.error(400, str(e))
            except Exception as e:  # noqa: BLE001 - the service stays up; the log has the traceback
                traceback.print_exc()
                return self.error(500, f"{type(e).__name__}: {e}")
        if bad:  # predict's own words, the temporary path named as what it is
            return self.error(400, bad[0][1].replace(f"'{image}'", "the upload"))
        record = predict_onnx.records(rows, self.server.model.classes)[0]
        del record["path"]
        if png is not None:
            record["cam"] = "data:image/png;base64," + base64.b64encode(png).decode()
        self.answer(200, record)


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 15px system-ui, sans-serif; margin: 2em auto; max-width: 46em; color: #222; }}
#drop {{ display: block; border: 2px dashed #888; border-radius: 8px; padding: 2em; text-align: center; }}
#drop.over {{ background: #eef; }}
#result {{ display: flex; gap: 1.5em; margin-top: 1.5em; align-items: flex-start; }}
#shown {{ width: 10em; image-rendering: pixelated; }}
#bars {{ flex: 1; }}
.bar {{ display: flex; align-items: center; margin: .3em 0; }}
.bar .name {{ width: 9em; overflow: hidden; text-overflow: ellipsis; }}
.bar .fill {{ background: #4a7bd0; height: 1.1em; margin-right: .5em; }}
.bar.unknown .fill {{ background: #999; }}
#cam {{ display: block; margin-top: 1em; max-width: 100%; image-rendering: pixelated; }}
.note, #error {{ color: #a33; }}
</style></head>
<body>
<h1>{title}</h1>
<p>{classes} classes{cam_line}</p>
<label id="drop">Drop an image here, or choose one: <input type="file" id="file" accept="image/*"></label>
<p id="error"></p>
<div id="result"><img id="shown" alt="" hidden><div id="bars"></div></div>
<img id="cam" alt="Grad-CAM overlay" hidden>
<script>
const CAM = {cam};
const $ = id => document.getElementById(id);
async function send(file) {{
  $("error").textContent = ""; $("bars").innerHTML = ""; $("cam").hidden = true;
  $("shown").src = URL.createObjectURL(file); $("shown").hidden = false;
  const reply = await fetch("/predict" + (CAM ? "?cam=1" : ""), {{method: "POST", body: file}});
  const answer = await reply.json();
  if (!reply.ok) {{ $("error").textContent = answer.error; return; }}
  // single-label: the top-k; multi-label: every label, most probable first, those predicted in bold
  const on = new Set((answer.labels || []).map(l => l.class));
  const rows = answer.top || Object.entries(answer.probs).map(([c, p]) => ({{class: c, prob: p}}))
                                   .sort((a, b) => b.prob - a.prob);
  for (const row of rows) {{
    const bar = document.createElement("div");
    bar.className = "bar" + (row.class === "unknown" ? " unknown" : "");
    const name = document.createElement(on.has(row.class) ? "b" : "span");
    name.className = "name"; name.textContent = row.class;
    const fill = document.createElement("span");
    fill.className = "fill"; fill.style.width = (row.prob * 20) + "em";
    bar.append(name, fill, (row.prob * 100).toFixed(1) + " %");
    $("bars").append(bar);
  }}
  if (answer.cam) {{ $("cam").src = answer.cam; $("cam").hidden = false; }}
}}
const drop = $("drop");
drop.addEventListener("dragover", e => {{ e.preventDefault(); drop.classList.add("over"); }});
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", e => {{ e.preventDefault(); drop.classList.remove("over"); send(e.dataTransfer.files[0]); }});
$("file").addEventListener("change", () => send($("file").files[0]));
</script>
</body></html>
"""


def page(model, source):
    cam = isinstance(model, TorchModel) and model.target is not None
    note = "" if cam else f'<br><span class="note">No Grad-CAM overlay: {html.escape(model.cam_note)}</span>'
    return PAGE.format(title=html.escape(f"serve.py: {Path(source).name}"), classes=len(model.classes),
                       cam="true" if cam else "false",
                       cam_line=(", with the Grad-CAM overlay of the top class" if cam else "") + note).encode()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="run directory (its checkpoints/best.pt), checkpoint file, or .onnx from export.py")
    ap.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free one (printed)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                    "0.0.0.0: every interface)")
    ap.add_argument("--topk", type=int, default=5, help="classes per answer (default 5)")
    ap.add_argument("--reject", metavar="auto|P", help='answer "unknown" when the calibrated top probability is '
                    "under P; auto: the model's threshold, which keeps 95%% of validation images")
    ap.add_argument("--max-upload-mb", type=float, default=20.0, help="largest upload taken, in MB (default 20); "
                    "a larger one is answered 413")
    ap.add_argument("--device", default="auto", help="a run directory's device: auto, cpu, cuda or cuda:N")
    args = ap.parse_args(argv)
    try:
        if args.topk < 1 or args.max_upload_mb <= 0 or not 0 <= args.port <= 65535:
            raise UserError("--topk must be at least 1, --max-upload-mb above 0, --port within 0-65535")
        reject = predict_onnx.parse_reject(args.reject)
        model = open_model(args.source, args.topk, reject, args.device)
        try:  # bound before the model is loaded: a port in use is said at once
            server = ThreadingHTTPServer((args.host, args.port), Handler)
        except OSError as e:
            raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        model.load()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    server.daemon_threads = True
    server.model, server.lock, server.max_upload = model, threading.Lock(), int(args.max_upload_mb * 1e6)
    server.page = page(model, args.source)
    host, port = server.server_address[:2]
    print(f"serving {args.source} ({len(model.classes)} classes) on http://{host}:{port}/ (POST /predict; "
          "Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main(sys.argv[1:])
