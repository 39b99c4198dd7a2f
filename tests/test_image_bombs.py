"""Image files whose header claims a huge size are refused before decoding (recipes and the CLI), naming the
file; ordinary images still load."""

from __future__ import annotations

import io
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


def test_the_cli_refuses_a_bomb_in_its_data(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "ok.png").write_bytes(small_png())
    (folder / "bomb.png").write_bytes(bomb_png())
    with pytest.raises(ValueError, match=r"bomb.png is a 12000 x 12000 image"):
        main(["report", "resnet18", "--data", str(folder), "--output-dir", str(tmp_path / "out")])


def _gzip_bomb(path: Path, member_bytes: int) -> None:
    """A .tar.gz of one ordinary PNG and one "PNG" of ``member_bytes`` zeros (gzip shrinks it ~1000x)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in (("test/cat/0.png", small_png()), ("test/dog/0.png", b"\0" * member_bytes)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("reader", ["recipe", "cli"])
def test_a_tar_member_larger_than_any_image_is_refused_before_it_is_read(tmp_path, monkeypatch, reader):
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
    with pytest.raises(ValueError, match=r"data.tar.gz:test/dog/0.png is 100,001 bytes, more than any image file"):
        if reader == "recipe":
            cifar.load_split(archive, "cifar10", "test", None, 8, tmp_path / "cache", show=False)
        else:
            main(["report", "resnet18", "--data", str(archive), "--output-dir", str(tmp_path / "out")])
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
