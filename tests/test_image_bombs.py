"""Image files whose header claims a huge size are refused before decoding (recipes and the CLI), naming the
file; ordinary images still load."""

from __future__ import annotations

import argparse
import io
import re
import struct
import sys
import tarfile
import zlib
from pathlib import Path

import pytest
import torch

from linearize.cli import main
from linearize.inputs import image_size

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(width: int = 12_000, height: int = 12_000) -> bytes:
    """A few KB of valid PNG whose header claims ``width x height`` RGB pixels (all zero rows, deflated)."""
    rows = zlib.compressobj(9)
    row = b"\0" * (1 + 3 * width)
    body = b"".join(rows.compress(row) for _ in range(64)) + rows.flush()  # truncated: decoding would still allocate
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", body) + _chunk(b"IEND", b""))


def small_png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_the_header_is_read_without_decoding():
    assert len(bomb_png()) < 64_000
    assert image_size(small_png(), "a.png") == (8, 8)
    with pytest.raises(ValueError, match=r"bomb.png is a 12000 x 12000 image \(144,000,000 pixels"):
        image_size(bomb_png(), "bomb.png")
    with pytest.raises(ValueError, match=r"junk.png is not an image"):
        image_size(b"not an image at all", "junk.png")


def test_the_cifar_recipe_refuses_a_bomb_in_its_data(tmp_path):
    import cifar

    archive = tmp_path / "data.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (("train/cat/0.png", small_png()), ("train/dog/0.png", bomb_png())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match=r"train/dog/0.png is a 12000 x 12000 image"):
        cifar.load_split(archive, "cifar10", "train", None, 8, tmp_path / "cache", show=False)
    folder = tmp_path / "tree"
    for name, data in (("train/cat/0.png", small_png()), ("train/dog/0.png", small_png())):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    out = cifar.load_split(folder, "cifar10", "train", None, 8, tmp_path / "cache", show=False)
    assert out["x"].shape == (2, 3, 8, 8) and torch.equal(out["x"][0, :, 0, 0], torch.tensor([10, 20, 30], dtype=torch.uint8))


def test_the_cli_refuses_a_bomb_in_its_data(tmp_path, cli_refusal):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "ok.png").write_bytes(small_png())
    (folder / "bomb.png").write_bytes(bomb_png())
    refusal = cli_refusal(["report", "resnet18", "--data", str(folder), "--output-dir", str(tmp_path / "out")])
    assert re.search(r"bomb.png is a 12000 x 12000 image", refusal)


def _gzip_bomb(path: Path, member_bytes: int) -> None:
    """A .tar.gz of one ordinary PNG and one "PNG" of ``member_bytes`` zeros (gzip shrinks it ~1000x)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in (("test/cat/0.png", small_png()), ("test/dog/0.png", b"\0" * member_bytes)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("reader", ["recipe", "cli"])
def test_a_tar_member_larger_than_any_image_is_refused_before_it_is_read(tmp_path, monkeypatch, cli_refusal,
                                                                           reader):
    """The member's size from its tar header, against the largest file an image of at most MAX_IMAGE_PIXELS
    can be (lowered here, so the archive stays small): refused naming the member, never read."""
    import cifar
    import linearize.inputs

    monkeypatch.setattr(linearize.inputs, "MAX_IMAGE_BYTES", 100_000)
    archive = tmp_path / "data.tar.gz"
    _gzip_bomb(archive, 100_001)
    read = []
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda self, m, _f=tarfile.TarFile.extractfile:
                        read.append(getattr(m, "name", m)) or _f(self, m))
    refused = r"data.tar.gz:test/dog/0.png is 100,001 bytes, more than any image file"
    if reader == "recipe":
        with pytest.raises(ValueError, match=refused):
            cifar.load_split(archive, "cifar10", "test", None, 8, tmp_path / "cache", show=False)
    else:
        assert re.search(refused, cli_refusal(["report", "resnet18", "--data", str(archive), "--output-dir",
                                               str(tmp_path / "out")]))
    assert "test/dog/0.png" not in read
    _gzip_bomb(archive, 100_000)  # at the cap: read (then refused as no image, a different error)
    with pytest.raises(ValueError, match=r"test/dog/0.png is not an image"):
        cifar.load_split(archive, "cifar10", "test", None, 8, tmp_path / "cache2", show=False)


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE])
def test_a_link_member_is_refused_not_read_through_to_its_target(tmp_path, monkeypatch, kind):
    """A link (declared size 0) to a member larger than any image: tarfile would read the target in full."""
    import linearize.inputs

    monkeypatch.setattr(linearize.inputs, "MAX_IMAGE_BYTES", 100_000)
    archive = tmp_path / "data.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        big = tarfile.TarInfo("blob.bin")
        big.size = 200_000
        tar.addfile(big, io.BytesIO(b"\0" * big.size))
        link = tarfile.TarInfo("test/cat/0.png")
        link.type, link.linkname = kind, ("../../blob.bin" if kind == tarfile.SYMTYPE else "blob.bin")
        tar.addfile(link)
    with tarfile.open(archive) as tar:
        member = tar.getmember("test/cat/0.png")
        assert member.size == 0 and len(tar.extractfile(member).read()) == 200_000  # what tarfile itself does
        with pytest.raises(ValueError, match=r"x.tar.gz:test/cat/0.png is a link, not an image file"):
            linearize.inputs.read_tar_image(tar, member, "x.tar.gz:test/cat/0.png")


def test_the_cli_refuses_images_that_decode_to_too_many_pixels_together_before_decoding(tmp_path, monkeypatch,
                                                                                      cli_refusal):
    """Three PNG headers of 5000 x 5000 (each under MAX_IMAGE_PIXELS) in a few KB of archive: together
    3 * 5000 * 5000 = 75,000,000 pixels, over MAX_TOTAL_PIXELS (2**26): refused from the headers, naming the
    archive, the total, the cap and the flags, before any image is decoded."""
    from PIL import ImageFile

    archive = tmp_path / "agg.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for i in range(3):
            data = bomb_png(5000, 5000)
            info = tarfile.TarInfo(f"test/cat/{i}.png")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert archive.stat().st_size < 64_000
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self) or pytest.fail("decoded"))
    refusal = cli_refusal(["report", "resnet18", "--data", str(archive), "--output-dir", str(tmp_path / "out")])
    assert re.search(rf"--data {re.escape(str(archive))}: its 3 images of 5000 x 5000 would decode "
                     r"to 75,000,000 pixels together \(0.8 GiB as float32 RGB\), more than the "
                     r"67,108,864 .*pass --image-size .*or --num-samples 2 or fewer", refusal)
    assert not decoded


def _png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def _data_args(*flags: str) -> argparse.Namespace:
    from linearize.cli import build_parser

    return build_parser().parse_args(["report", "m", *flags])


def test_the_total_pixel_cap_counts_the_size_asked_and_what_fits_decodes_exactly(tmp_path, monkeypatch):
    """With the cap lowered to 1,000 pixels: three 20 x 20 images (1,200) are refused, resized to 16 x 16 (768)
    they load, to 40 x 40 (4,800) they are refused again; the loaded values are the colours by hand, normalized
    with the ImageNet statistics in float64. Mixed sizes are refused from the headers, naming two of them."""
    from linearize.cli import readers

    monkeypatch.setattr(readers, "MAX_TOTAL_PIXELS", 1000)
    folder = tmp_path / "images"
    folder.mkdir()
    colors = [(0, 128, 255), (10, 20, 30), (255, 255, 0)]
    for i, c in enumerate(colors):
        (folder / f"{i}.png").write_bytes(_png(20, 20, c))
    with pytest.raises(ValueError, match=r"its 3 images of 20 x 20 would decode to 1,200 pixels .* more than the 1,000 "
                                         r".*pass --image-size .*or --num-samples 2 or fewer"):
        readers.load_data(_data_args("--data", str(folder)), None, None)
    with pytest.raises(ValueError, match=r"3 images of 40 x 40 would decode to 4,800 pixels .*pass a smaller "
                                         r"--image-size \(each image is resized as it is decoded; e.g. --image-size 224\)$"):
        readers.load_data(_data_args("--data", str(folder), "--image-size", "40"), None, None)
    x = readers.load_data(_data_args("--data", str(folder), "--image-size", "16"), None, None)
    mean, std = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64), torch.tensor([0.229, 0.224, 0.225],
                                                                                       dtype=torch.float64)
    by_hand = (torch.tensor(colors, dtype=torch.float64) / 255 - mean) / std
    assert x.shape == (3, 3, 16, 16) and x.dtype == torch.float32
    torch.testing.assert_close(x.double(), by_hand[:, :, None, None].expand(3, 3, 16, 16), rtol=0, atol=1e-6)
    (folder / "3.png").write_bytes(_png(9, 8, (0, 0, 0)))
    with pytest.raises(ValueError, match=r"images have different sizes \(.*0.png is 20 x 20, .*3.png is 9 x 8\): "
                                         "pass --image-size"):
        readers.load_data(_data_args("--data", str(folder), "--num-samples", "4"), None, None)


@pytest.mark.parametrize("reader", ["recipe", "cli"])
@pytest.mark.parametrize("kind", ["large", "link-to-large", "fifo"])
def test_an_image_folder_file_that_no_image_can_be_is_refused_before_it_is_read(tmp_path, monkeypatch, capsys, reader,
                                                                               kind):
    """The folder twin of the tar checks: a file over MAX_IMAGE_BYTES (lowered here), a symbolic link to one,
    or a FIFO (a plain read would wait for a writer forever) is refused naming the file, without reading it."""
    import os
    import threading

    import cifar
    import linearize.inputs

    monkeypatch.setattr(linearize.inputs, "MAX_IMAGE_BYTES", 100_000)
    folder = tmp_path / "tree"
    (folder / "test/cat").mkdir(parents=True)
    (folder / "test/cat/0.png").write_bytes(small_png())
    bad = folder / "test/cat/1.png"
    if kind == "large":
        bad.write_bytes(b"\0" * 100_001)
    elif kind == "link-to-large":
        (tmp_path / "blob.bin").write_bytes(b"\0" * 100_001)
        bad.symlink_to(tmp_path / "blob.bin")
    else:
        os.mkfifo(bad)
    expected = r"is not a regular file" if kind == "fifo" else r"is 100,001 bytes, more than any image file"
    result: list = []

    def run():
        try:
            if reader == "recipe":
                cifar.load_split(folder, "cifar10", "test", None, 8, tmp_path / "cache", show=False)
            else:  # the command line prints the refusal, exit status 2
                result.append(main(["report", "resnet18", "--data", str(folder / "test"), "--output-dir",
                                    str(tmp_path / "out")]))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "reading the folder blocked"
    if reader == "cli":
        assert result == [2]
        refusal = capsys.readouterr().err
    else:
        assert len(result) == 1 and isinstance(result[0], ValueError), result
        refusal = str(result[0])
    assert re.search(expected, refusal) and "1.png" in refusal
    if kind == "large":  # at the cap it is read (then refused as no image, a different error)
        bad.write_bytes(b"\0" * 100_000)
        with pytest.raises(ValueError, match=r"1.png is not an image"):
            cifar.load_split(folder, "cifar10", "test", None, 8, tmp_path / "cache2", show=False)


@pytest.mark.parametrize("reader", ["recipe", "cli"])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_truncated_image_among_good_ones_is_named_with_the_fix(tmp_path, capsys, reader, fmt):
    """One image of a folder cut short (its header intact, as an interrupted copy leaves it): the recipe raised
    torchvision's decoder error naming no file, the command line named only the folder; both name the file, that
    it is damaged, and the fix."""
    from PIL import Image

    import cifar

    folder = tmp_path / "tree"
    (folder / "test/cat").mkdir(parents=True)
    for i in range(4):
        buf = io.BytesIO()
        Image.effect_noise((64, 64), 60 + i).convert("RGB").save(buf, fmt)
        (folder / f"test/cat/{i}.{fmt.lower()}").write_bytes(buf.getvalue())
    bad = folder / f"test/cat/2.{fmt.lower()}"
    bad.write_bytes(bad.read_bytes()[:len(bad.read_bytes()) // 2])  # its header whole: only decoding fails
    if reader == "recipe":
        with pytest.raises(ValueError) as err:
            cifar.load_split(folder, "cifar10", "test", None, 8, tmp_path / "cache", show=False)
        refusal = str(err.value)
    else:
        assert main(["report", "resnet18", "--data", str(folder / "test"), "--output-dir", str(tmp_path / "out")]) == 2
        refusal = capsys.readouterr().err
    assert f"{bad}: damaged image, it cannot be decoded (" in refusal and "replace it or remove it" in refusal, refusal
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["directory", "socket"])
def test_a_directory_or_socket_named_like_an_image_is_refused_by_name_and_leaks_no_descriptor(tmp_path, kind):
    import os
    import socket

    from linearize.inputs import read_image_file

    path = tmp_path / "cats.png"
    server = None
    if kind == "directory":
        path.mkdir()
    else:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    try:
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            with pytest.raises(ValueError, match=rf"cats.png is {'a directory' if kind == 'directory' else 'not a regular file'}"):
                read_image_file(path)
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        if server is not None:
            server.close()


@pytest.mark.parametrize("source", ["folder", "archive"])
def test_the_sampled_files_together_are_capped_in_bytes_before_any_is_read(tmp_path, monkeypatch, cli_refusal,
                                                                          source):
    """Files each under MAX_IMAGE_BYTES but together over MAX_TOTAL_BYTES (both lowered here; sparse files or
    padded metadata take no pixels): refused from their sizes, naming the data and the fix, nothing read."""
    import linearize.cli.readers as readers
    import linearize.inputs

    monkeypatch.setattr(linearize.inputs, "MAX_IMAGE_BYTES", 100_000)
    monkeypatch.setattr(linearize.inputs, "MAX_TOTAL_BYTES", 250_000)
    blobs = {f"test/cat/{i}.png": small_png() + b"\0" * 90_000 for i in range(3)}
    if source == "folder":
        data = tmp_path / "tree"
        for name, blob in blobs.items():
            (data / name).parent.mkdir(parents=True, exist_ok=True)
            (data / name).write_bytes(blob)
    else:
        data = tmp_path / "data.tar.gz"
        with tarfile.open(data, "w:gz") as tar:
            for name, blob in blobs.items():
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    read = []
    monkeypatch.setattr(readers, "read_image_file", lambda p: read.append(p))
    monkeypatch.setattr(readers, "read_tar_image", lambda *a: read.append(a))
    refusal = cli_refusal(["report", "resnet18", "--data", str(data), "--output-dir", str(tmp_path / "out")])
    assert re.search(rf"the 3 image files sampled hold {3 * len(blobs['test/cat/0.png']):,} "
                     r"bytes together, more than 250,000.*--num-samples", refusal)
    assert not read


def test_a_small_image_file_is_read_without_allocating_the_cap(tmp_path):
    """Asking a buffered file for MAX_IMAGE_BYTES allocates that much first (192 MiB per 3 KB file); the read asks
    for the file's size and a byte, and a file that grows after its check is still read to the cap at most."""
    import tracemalloc

    from linearize.inputs import read_image_file

    path = tmp_path / "a.png"
    path.write_bytes(small_png())
    tracemalloc.start()
    try:
        assert read_image_file(path) == small_png()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20
