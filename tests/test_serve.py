"""serve.py as a user runs it: a real server process on a free port, real HTTP requests, the page in a browser.

    python -m pytest tests/test_serve.py -q

On the shared finished run (conftest.trained_run): POST /predict answers predict.py's row for the image
(its table and --out FILE.json), with the Grad-CAM overlay when asked; the exported .onnx, served in a
process where `import torch` fails, answers predict_onnx.py's rows, "unknown" under --reject included.
A corrupt image is 400, a body over --max-upload-mb 413, each one JSON line; concurrent requests of
different images each get their own answer; the default bind is 127.0.0.1 only; a mistake at the start
is one `error:` line before anything is loaded. The page, in headless Chromium driven by Selenium (skipped,
saying why, without chromium and chromedriver: apt-get install chromium chromium-driver), shows the bars
and the overlay for an uploaded image.

The screenshot of docs/after-training.md is this file's browser step on the demo run:

    python tests/test_serve.py runs/demo data/demo_flowers/roses/roses_0089.jpg docs/serve-page.png
"""
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

pytestmark = pytest.mark.slow

MAX_UPLOAD_MB = 0.05  # 50 kB: the test images are 1 kB, the oversized body 60 kB


def start(*args, env=None, log=None):
    """`python serve.py ARGS --port 0` -> (process, its base URL), once it prints the URL it serves on."""
    proc = subprocess.Popen([sys.executable, str(REPO / "serve.py"), *map(str, args), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=open(log, "w") if log else subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=REPO)
    line = proc.stdout.readline()  # the first line, or "" when it exits first
    if "http://" not in line:
        proc.kill()
        raise AssertionError(f"serve.py did not start: {line}{Path(log).read_text() if log else ''}")
    return proc, line.split("http://", 1)[1].split("/", 1)[0]


def stop(proc):
    proc.terminate()
    proc.wait(timeout=20)


def post(address, data, path="/predict", headers=None):
    """-> (status, the JSON answer, the raw body)."""
    req = urllib.request.Request(f"http://{address}{path}", data=data, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as reply:
            body = reply.read()
            return reply.status, json.loads(body), body
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, json.loads(body), body


@pytest.fixture(scope="module")
def served(trained_run, tmp_path_factory):
    """serve.py on the trained run's directory, as a user starts it (no --host): -> (address, log file)."""
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    proc, address = start(trained_run["run_dir"], "--device", "cpu", "--max-upload-mb", MAX_UPLOAD_MB, log=log)
    yield address, log
    stop(proc)


def images_of(trained_run, n_per_class=2):
    return [p for name in ("daisy", "dandelion", "roses", "sunflowers", "tulips")
            for p in sorted((trained_run["data"] / name).glob("*.jpg"))[:n_per_class]]


def test_an_answer_is_predict_pys_row_with_its_cam(served, trained_run, tmp_path, capsys):
    import predict
    address, _ = served
    image = sorted((trained_run["data"] / "roses").glob("*.jpg"))[0]
    status, answer, raw = post(address, image.read_bytes())
    assert status == 200 and raw.count(b"\n") == 1 and set(answer) == {"top"}
    out = tmp_path / "p.json"
    predict.main([str(trained_run["run_dir"]), str(image), "--device", "cpu", "--out", str(out),
                  "--cam", str(tmp_path / "cam")])
    table = capsys.readouterr().out.splitlines()[0]
    expected = json.loads(out.read_text())[0]
    assert answer == {"top": expected["top"]}  # predict.py's --out record (calibrated, 6 decimals)
    assert table.split()[1:] == [x for r in answer["top"] for x in (r["class"], f"{r['prob']:.3f}")]  # and its table
    # ?cam=1 (the page's call): the same row and predict.py --cam's overlay for the top class.
    status, with_cam, _ = post(address, image.read_bytes(), "/predict?cam=1")
    written = list((tmp_path / "cam").glob(f"*_cam_{answer['top'][0]['class']}.png"))
    assert status == 200 and with_cam["top"] == answer["top"] and len(written) == 1
    assert base64.b64decode(with_cam["cam"].removeprefix("data:image/png;base64,")) == written[0].read_bytes()


def test_a_corrupt_image_is_400_an_oversized_body_413(served, trained_run):
    address, _ = served
    for data, code, text in ((b"not an image at all", 400, "cannot decode the upload"),
                             (b"\xff\xd8\xff" + bytes(60_000), 413, "over the limit of 50000"),
                             (b"", 400, "the upload")):
        status, answer, raw = post(address, data)
        assert (status, list(answer), raw.count(b"\n")) == (code, ["error"], 1) and text in answer["error"], answer
    status, answer, _ = post(address, b"x", path="/elsewhere")
    assert status == 404 and "POST /predict" in answer["error"]
    # A form upload (curl -F image=@photo.jpg) is the same image.
    image = sorted((trained_run["data"] / "tulips").glob("*.jpg"))[0]
    form = (b"--XyZ\r\nContent-Disposition: form-data; name=\"image\"; filename=\"t.jpg\"\r\n"
            b"Content-Type: image/jpeg\r\n\r\n" + image.read_bytes() + b"\r\n--XyZ--\r\n")
    multipart = {"Content-Type": "multipart/form-data; boundary=XyZ"}
    assert post(address, form, headers=multipart)[:2] == post(address, image.read_bytes())[:2]
    no_file = b"--XyZ\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhello\r\n--XyZ--\r\n"
    status, answer, _ = post(address, no_file, headers=multipart)
    assert status == 400 and "no file part" in answer["error"]


def test_concurrent_requests_each_get_their_own_answer(served, trained_run):
    address, _ = served
    images = images_of(trained_run)
    alone = {p: post(address, p.read_bytes(), "/predict?cam=1")[1] for p in images}  # one at a time
    assert len({json.dumps(a["top"]) for a in alone.values()}) > 1  # different images, different answers
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: (p, post(address, p.read_bytes(), "/predict?cam=1")), images * 3))
    for p, (status, answer, _) in together:
        assert status == 200 and answer == alone[p], p


def test_it_listens_on_localhost_only_by_default(served):
    address, _ = served
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1"
    listening = [ln.split() for ln in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if ln.split()[1].endswith(f":{int(port):04X}") and ln.split()[3] == "0A"]  # 0A: LISTEN
    assert [ln[1].split(":")[0] for ln in listening] == ["0100007F"]  # 127.0.0.1, not 0.0.0.0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # this machine's outward address (nothing is sent)
        try:
            s.connect(("10.255.255.255", 1))
            outward = s.getsockname()[0]
        except OSError:
            outward = None
    if outward and not outward.startswith("127."):
        with pytest.raises(ConnectionRefusedError), socket.create_connection((outward, int(port)), timeout=5):
            pass


NO_TORCH = '''import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision"):
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, _NoTorch())
'''


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    """PYTHONPATH for a process where `import torch` fails (a sitecustomize)."""
    block = tmp_path_factory.mktemp("no_torch")
    (block / "sitecustomize.py").write_text(NO_TORCH)
    return {"PYTHONPATH": str(block)}


def test_the_onnx_model_is_served_without_torch_with_reject(trained_run, tmp_path, no_torch):
    import export
    import predict_onnx
    from _resume_utils import single_thread
    model = tmp_path / "model.onnx"
    with single_thread():
        export.main([str(trained_run["run_dir"]), "--format", "onnx", "--out", str(model), "--speed-repeats", "0"])
    images = images_of(trained_run)
    plain = predict_onnx.main([str(model), *map(str, images), "--out", str(tmp_path / "plain.json")])
    reject = sorted(top[0][1] for _, top in plain)[len(plain) // 2]  # the median top probability: some under it
    expected = predict_onnx.main([str(model), *map(str, images), "--reject", str(reject),
                                  "--out", str(tmp_path / "p.json")])
    assert 0 < sum(top[0][0] == -1 for _, top in expected) < len(expected)  # some "unknown", some not
    records = json.loads((tmp_path / "p.json").read_text())
    proc, address = start(model, "--reject", reject, env=no_torch, log=tmp_path / "log")
    try:
        for image, record in zip(images, records):
            assert post(address, image.read_bytes())[1] == {"top": record["top"]}, image
        assert post(address, image.read_bytes(), "/predict?cam=1")[1] == {"top": record["top"]}  # no cam: no torch
        with urllib.request.urlopen(f"http://{address}/", timeout=30) as reply:
            assert "No Grad-CAM overlay: Grad-CAM needs the PyTorch checkpoint" in reply.read().decode()
    finally:
        stop(proc)


def test_a_mistake_at_the_start_is_one_error_line(trained_run, tmp_path, no_torch):
    """In a process that cannot import torch: each refusal comes before anything is loaded."""
    empty = tmp_path / "empty_run"
    empty.mkdir()
    cases = (([tmp_path / "nope"], "does not exist"), ([empty], "has no checkpoints/best.pt"),
             ([tmp_path / "nope.onnx"], "does not exist"), ([trained_run["run_dir"], "--reject", "2"], "--reject '2'"),
             ([trained_run["run_dir"], "--max-upload-mb", "0"], "--max-upload-mb above 0"))
    for args, text in cases:
        proc = subprocess.run([sys.executable, str(REPO / "serve.py"), *map(str, args)], capture_output=True,
                              text=True, env={**os.environ, **no_torch}, timeout=60)
        assert (proc.returncode, proc.stdout) == (2, ""), (args, proc.stderr)
        assert proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1 and text in proc.stderr


def browser():
    """A headless Chromium driven by Selenium through the system's chromedriver; pytest.skip, saying why, without."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -r requirements.txt)")
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no chromium and chromedriver found: apt-get install chromium chromium-driver")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager never downloads a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=900,760"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


# The file chosen in the page's input, dropped on its drop zone as a dragged file is (a DataTransfer holding it).
DROP = """const file = document.getElementById("file").files[0], moved = new DataTransfer();
moved.items.add(new File([file], "dropped.jpg", {type: file.type}));
document.getElementById("bars").innerHTML = ""; document.getElementById("cam").removeAttribute("src");
document.getElementById("drop").dispatchEvent(new DragEvent("drop", {dataTransfer: moved, bubbles: true}));"""


def show(address, image, screenshot=None):
    """Open the page, upload `image` through its file input, wait for the bars and the overlay, then drop
    the same file on the drop zone and wait again -> [(class, bar width in px)] each time, the overlay's
    natural width."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    page = browser()

    def shown():
        WebDriverWait(page, 30).until(lambda p: p.find_elements(By.CSS_SELECTOR, "#bars .bar")
                                      and p.execute_script("return document.getElementById('cam').naturalWidth"))
        return [(b.find_element(By.CLASS_NAME, "name").text, b.find_element(By.CLASS_NAME, "fill").size["width"])
                for b in page.find_elements(By.CSS_SELECTOR, "#bars .bar")]
    try:
        page.get(f"http://{address}/")
        page.find_element(By.ID, "file").send_keys(str(Path(image).resolve()))
        bars = shown()
        page.execute_script(DROP)
        assert shown() == bars  # the drop zone gives the same answer
        if screenshot:
            page.save_screenshot(str(screenshot))
        return bars, page.execute_script("return document.getElementById('cam').naturalWidth")
    finally:
        page.quit()


def test_the_page_shows_the_bars_and_the_overlay(served, trained_run):
    address, _ = served
    image = sorted((trained_run["data"] / "sunflowers").glob("*.jpg"))[0]
    bars, cam_width = show(address, image)
    top = post(address, image.read_bytes())[1]["top"]
    assert [name for name, _ in bars] == [r["class"] for r in top]
    widths = [w for _, w in bars]
    assert widths == sorted(widths, reverse=True) and widths[0] > 0 and cam_width > 0


if __name__ == "__main__":  # the screenshot: python tests/test_serve.py RUN_DIR IMAGE OUT.png
    run, image, out = sys.argv[1:4]
    server, address = start(run)
    try:
        print(show(address, image, out))
    finally:
        stop(server)
