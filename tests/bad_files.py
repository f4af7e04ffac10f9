"""Writers of the broken and unusual files real image folders hold (for the bad-input tests).

Each writes one small file; none needs a download or more than a few kilobytes.
"""
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def _img(size=(40, 32), colour=(30, 140, 60)):
    img = Image.new("RGB", size, colour)
    img.putpixel((1, 1), (255, 0, 0))
    return img


def zero_byte(path):
    Path(path).write_bytes(b"")


def truncated_jpeg(path):
    """A real JPEG cut in the middle of its scan data, as an interrupted download leaves it."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(path, quality=95)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


def text_named_jpg(path):
    Path(path).write_text("<html>404 Not Found</html>\n")


def bomb_png(path, width=100_000, height=100_000):
    """A valid PNG header declaring 10^10 pixels; the file itself is a few dozen bytes."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))
                           + chunk(b"IEND", b""))


# The stored pixels of an upright image that EXIF orientation o turns upright again: each transpose is its
# own inverse but for the two quarter turns (6 stores ROTATE_90's output, 8 ROTATE_270's).
_STORED = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
           5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_270}


def rotated_jpeg(path, upright, orientation, quality=95):
    """A phone photo: `upright` (a PIL image) stored as the sensor read it, with the EXIF orientation tag
    that turns it upright again (1: stored as it is, with the tag)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored = upright.transpose(_STORED[orientation]) if orientation in _STORED else upright
    stored.save(path, quality=quality, exif=exif)
    return path


def cmyk_jpeg(path):
    _img().convert("CMYK").save(path)


def rgba_png(path):
    img = _img().convert("RGBA")
    img.putpixel((0, 0), (0, 0, 0, 0))
    img.save(path)


def grayscale_png(path):
    _img().convert("L").save(path)


def palette_png(path):
    """A palette image with a transparent colour (PIL warns when such a one is converted naively)."""
    img = _img().convert("P", palette=Image.ADAPTIVE, colors=8)
    img.save(path, transparency=0)


def gray16_png(path, value=30000):
    """A 16-bit greyscale PNG of one mid-grey value (30000 / 65535 = 46% grey)."""
    Image.fromarray(np.full((32, 40), value, dtype=np.uint16)).save(path)


GOOD_MODES = {"cmyk.jpg": cmyk_jpeg, "rgba.png": rgba_png, "gray.png": grayscale_png,
              "palette.png": palette_png, "gray16.png": gray16_png}
BROKEN = {"zero.jpg": zero_byte, "truncated.jpg": truncated_jpeg, "text.jpg": text_named_jpg,
          "bomb.png": bomb_png}


# -- running an entry script's main() in this process ------------------------------------

import contextlib  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402

import torch  # noqa: E402


def call_main(main, args):
    """main(args) as the CLI runs it -> (exit code, stdout, stderr); 0 when it returns."""
    out, err = io.StringIO(), io.StringIO()
    code, threads = 0, torch.get_num_threads()
    torch.set_num_threads(1)  # as run_entry's OMP_NUM_THREADS=1: tiny models on a shared CPU
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
        finally:
            torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()


def tree_hash(root):
    """{relative path: (inode, size, mtime, sha256)} of every file under root: proof that a failed
    run touched nothing. Checkpoints (~90 MB) are fingerprinted by their stat alone, which any
    rewrite or atomic replace changes; smaller files by their content too."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if st.st_size < 2**20 else None
            out[str(p.relative_to(root))] = (st.st_ino, st.st_size, st.st_mtime_ns, digest)
    return out


def error_line(code, out, err, expected_code):
    """Assert the failure contract: the exit code, exactly one `error:` line, no traceback; return the line."""
    text = out + err
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == expected_code, f"exit code {code}, expected {expected_code}\n{text[-3000:]}"
    assert len(errors) == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    return errors[0]
