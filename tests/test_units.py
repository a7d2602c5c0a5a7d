import pytest

from vramd.image.codec import Compression
from vramd.pb import image_pb2 as pb
from vramd.units import parse_size


@pytest.mark.parametrize("text,value", [("4096", 4096), ("0x1000", 4096), ("8M", 8 << 20), ("1GiB", 1 << 30),
                                        ("2k", 2048), ("0x10K", 16 << 10), (" 3 G ", 3 << 30)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1", "1.5G", "12Q"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_compression_parse():
    assert Compression.parse("none").codec == pb.CODEC_RAW
    assert Compression.parse("zstd") == Compression("zstd", 1)
    assert Compression.parse("zstd:9").level == 9
    assert Compression.parse("bplanes:3").to_pb() == pb.Compression(codec=pb.CODEC_PLANES, level=3)
    assert Compression.parse("auto").to_pb().automatic
    for bad in ("lz4", "zstd:99", "none:3", "bplanes:x", "auto:"):
        with pytest.raises(ValueError):
            Compression.parse(bad)
