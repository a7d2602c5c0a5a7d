"""Codec choice (vramd/image/policy.py): --compression forms (vramd/image/compression.py), the trial, and the auto
model."""
import array
import random
import threading

import pytest

from vramd.image import planes, policy
from vramd.image.compression import Compression, compression_name
from vramd.image.policy import RAW, AutoPolicy, Codec, choose, sample_slices
from vramd.pb import image_pb2 as pb

MiB = 1 << 20


def fp32(n: int, seed: int = 1) -> bytes:
    rnd = random.Random(seed)
    return array.array("f", (rnd.gauss(0.0, 0.02) for _ in range(n))).tobytes()


def bf16(n: int, seed: int = 2) -> bytes:
    raw = fp32(n, seed)
    out = bytearray(2 * n)  # the top two bytes of each little-endian fp32
    out[0::2] = raw[2::4]
    out[1::2] = raw[3::4]
    return bytes(out)


@pytest.fixture(scope="module")
def chunks():
    """1 MiB chunks: fp32 and bf16 weights, random bytes."""
    return {"fp32": memoryview(fp32(MiB // 4)), "bf16": memoryview(bf16(MiB // 2)),
            "random": memoryview(random.Random(3).randbytes(MiB))}


# --- Compression.parse -----------------------------------------------------------

@pytest.mark.parametrize("text, spec", [
    ("none", Compression()),
    ("zstd", Compression("zstd", 1)),
    ("zstd:3", Compression("zstd", 3)),
    ("zstd:-7", Compression("zstd", -7)),
    ("zstd:22", Compression("zstd", 22)),
    ("bplanes", Compression("bplanes", 1)),
    ("bplanes:5", Compression("bplanes", 5)),
    ("auto", Compression("auto", 1)),
    ("auto:3", Compression("auto", 3)),
])
def test_parse_accepts(text, spec):
    assert Compression.parse(text) == spec
    assert Compression.parse(str(spec)) == spec
    assert Compression.from_pb(spec.to_pb()) == spec  # what the manifest records reads back as the same value
    assert compression_name(spec.to_pb()) == str(spec)


def test_a_manifest_names_its_compression_as_the_cli_takes_it():
    assert compression_name(pb.Compression(codec=pb.CODEC_RAW)) == "none"
    assert compression_name(pb.Compression(codec=pb.CODEC_ZSTD, level=3)) == "zstd:3"
    assert compression_name(pb.Compression(codec=pb.CODEC_PLANES, level=2)) == "bplanes:2"
    assert compression_name(pb.Compression(codec=pb.CODEC_PLANES, level=5, automatic=True)) == "auto:5"
    assert compression_name(pb.Compression(codec=pb.CODEC_PLANES, automatic=True)) == "auto"  # no level recorded


@pytest.mark.parametrize("text, level", [("zstd:0", 1), ("bplanes:0", 1), ("auto:0", 1)])
def test_parse_level_0_is_the_default_level(text, level):
    """A level of 0 (zstd's "its default") asks for vramd's default, 1, as it always has: the image records 1."""
    c = Compression.parse(text)
    assert c.level == level
    assert compression_name(c.to_pb()) == f"{text.split(':')[0]}:{level}"


@pytest.mark.parametrize("text", ["", "None", "zstd:", "zstd:23", "zstd:-8", "zstd:x", "zstd:+3", "zstd: 3",
                                  "zstd:3:4", "none:1", "bplanes:", "planes", "auto:abc", "lz4", " zstd", "zstd:1_0"])
def test_parse_rejects(text):
    with pytest.raises(ValueError, match=r"none, zstd|out of range"):
        Compression.parse(text)


def test_candidates():
    assert policy.candidates("none", 0) == ()
    assert policy.candidates("zstd", 4) == (Codec("zstd", 0, 4),)
    assert policy.candidates("bplanes", 2) == policy.candidates("auto", 2) == (
        Codec("zstd", 0, 2), Codec("planes", 2, 2), Codec("planes", 4, 2))
    with pytest.raises(ValueError):
        Codec("planes", 3, 1)
    with pytest.raises(ValueError):
        Codec("zstd", 2, 1)


# --- the trial ------------------------------------------------------------------

def test_sample_slices():
    chunk = memoryview(bytes(8 * MiB + 3))
    s = sample_slices(chunk)
    assert [v.nbytes for v in s] == [16 << 10] * 3
    assert all(v.obj is chunk.obj for v in s)  # views of the chunk, not copies
    small = memoryview(bytes(48 << 10))
    assert sample_slices(small) == [small]  # no larger than the sample: the chunk is its own sample
    assert len(sample_slices(chunk, 5, 4096)) == 5
    assert [v.nbytes for v in sample_slices(chunk, 1, 4096)] == [4096]


def test_sample_positions():
    n = 1 << 20
    data = memoryview(bytearray(n))
    s = sample_slices(data, 3, 16 << 10, 64)
    # recover each slice's offset from markers written after slicing
    for i in range(0, n, 64):
        data[i:i + 4] = i.to_bytes(4, "little")
    offs = [int.from_bytes(v[:4], "little") for v in s]
    assert offs[0] == 0 and offs[-1] + (16 << 10) <= n and offs[-1] >= n - (16 << 10) - 64
    assert abs(offs[1] - (n - (16 << 10)) // 2) <= 64
    assert all(o % 64 == 0 for o in offs)


@pytest.mark.parametrize("level", [1, 3])
def test_choose_picks_planes_on_floats(chunks, level):
    cands = policy.candidates("bplanes", level)
    c16 = choose(sample_slices(chunks["bf16"]), cands)
    assert c16.codec.kind == "planes" and c16.ratio < 0.8
    c32 = choose(sample_slices(chunks["fp32"]), cands)
    assert c32.codec == Codec("planes", 4, level) and c32.ratio < 0.9
    # the prediction is close to what the whole chunk gets
    for name, c in (("bf16", c16), ("fp32", c32)):
        whole = len(c.codec.compress(chunks[name])) / chunks[name].nbytes
        assert abs(whole - c.ratio) < 0.03, name


def test_choose_raw_on_random_bytes(chunks):
    c = choose(sample_slices(chunks["random"]), policy.candidates("bplanes", 1))
    assert c.codec == RAW and c.ratio == 1.0 and c.best_ratio >= policy.RAW_ABOVE
    assert len(c.trial) == 3


def test_choose_zstd_on_unaligned_repeats():
    """Byte strings of 3..9 bytes from a small vocabulary: matches zstd finds, that planes cut apart."""
    rnd = random.Random(5)
    words = [rnd.randbytes(rnd.randint(3, 9)) for _ in range(300)]
    data = memoryview(b"".join(rnd.choice(words) for _ in range(200000)))
    c = choose(sample_slices(data), policy.candidates("bplanes", 1))
    assert c.codec == Codec("zstd", 0, 1) and c.ratio < 0.6


def test_choose_without_candidates(chunks):
    assert choose(sample_slices(chunks["fp32"]), ()).codec == RAW


# --- AutoPolicy ------------------------------------------------------------------

def set_sink(p: AutoPolicy, rate: float) -> None:
    """Observations heavy enough that the averages forget everything before."""
    p.observe_sink(1 << 40, (1 << 40) / rate)


def set_compress(p: AutoPolicy, rate: float) -> None:
    for c in p.codecs:
        p.observe_compress(c, 1 << 40, 1 << 39, (1 << 40) / rate)


def test_raw_when_the_sink_is_much_faster_than_compression(chunks):
    p = AutoPolicy(1, workers=2)
    set_sink(p, 10e9)     # /dev/shm
    set_compress(p, 0.5e9)
    for name in ("bf16", "fp32", "random"):
        c = p.decide(chunks[name])
        assert c.codec == RAW and not c.trial, name  # raw, and the trial was skipped
    assert p.breakeven_ratio(p.codecs[0]) < 0


def test_compresses_when_the_sink_is_slow(chunks):
    p = AutoPolicy(1, workers=2)
    set_sink(p, 100e6)    # a network filesystem
    set_compress(p, 0.5e9)
    assert p.decide(chunks["bf16"]).codec.kind == "planes"
    assert p.decide(chunks["fp32"]).codec == Codec("planes", 4, 1)
    assert p.decide(chunks["random"]).codec == RAW  # trial ratio ~1
    assert p.compressing is False


def test_inequality_and_parallelism(chunks):
    p = AutoPolicy(1, workers=1)
    c = choose(sample_slices(chunks["bf16"]), p.codecs)
    r, t_c = c.ratio, 0.5e9
    set_compress(p, t_c)
    # (1 - r)·P·T_c / S is the gain: 1.5 compresses even from the raw state, 0.8 never does
    set_sink(p, (1 - r) * t_c / 1.5)
    assert p.decide(chunks["bf16"]).codec == c.codec
    set_sink(p, (1 - r) * t_c / 0.8)
    assert p.decide(chunks["bf16"]).codec == RAW
    p.set_workers(2)  # twice the workers: the same sink is now slow enough
    assert p.decide(chunks["bf16"]).codec == c.codec


def test_hysteresis(chunks):
    c = choose(sample_slices(chunks["bf16"]), policy.candidates("auto", 1))
    t_c = 0.5e9
    gain = 1.07  # between STAY_MARGIN and ENTER_MARGIN
    borderline = (1 - c.ratio) * t_c / gain

    compressing = AutoPolicy(1, workers=1)
    set_compress(compressing, t_c)
    set_sink(compressing, borderline / 4)
    assert compressing.decide(chunks["bf16"]).codec.kind == "planes"
    set_sink(compressing, borderline)
    for _ in range(3):  # stays
        assert compressing.decide(chunks["bf16"]).codec.kind == "planes"

    raw = AutoPolicy(1, workers=1)
    set_compress(raw, t_c)
    set_sink(raw, borderline)
    for _ in range(3):  # does not enter
        assert raw.decide(chunks["bf16"]).codec == RAW
    # a raw chunk (random bytes) drops the compressing one back to the raw state, where it stays
    assert compressing.decide(chunks["random"]).codec == RAW
    assert compressing.decide(chunks["bf16"]).codec == RAW


def test_trial_skipped_when_typical_data_cannot_pay_but_probed(chunks):
    p = AutoPolicy(1, workers=1, probe_every=8)
    t_c = 0.5e9
    set_compress(p, t_c)
    # r* = 0.5: random bytes (ratio 1) never pay; after a few trials their ratio is typical
    set_sink(p, 0.5 * t_c / (1 + policy.ENTER_MARGIN))
    trials = sum(bool(p.decide(chunks["random"]).trial) for _ in range(32))
    assert trials == 4  # chunks 8, 16, 24, 32: the seeded typical ratio (0.8) already skips the rest
    assert abs(p.breakeven_ratio(p.codecs[0]) - 0.5) < 1e-9


def test_small_incompressible_chunks_stop_being_trialed_but_are_probed(chunks):
    """A chunk no bigger than the trial's samples is compressed whole by every candidate to be judged: after
    SMALL_SKIP_AFTER trials in a row found nothing, such chunks are stored raw untried, probed once per
    probe_small_bytes of them, and one probe that finds a gain starts trying them all again."""
    import os
    p = AutoPolicy(1, workers=2, probe_every=16, probe_small_bytes=20 * 4096)
    set_sink(p, 100e6)    # slow: compressing pays wherever the data compresses, so every chunk is tried
    set_compress(p, 0.5e9)
    random_small = memoryview(os.urandom(4096))
    after = policy.SMALL_SKIP_AFTER
    tried = [bool(p.decide(random_small).trial) for _ in range(after + 60)]
    assert all(tried[:after])
    assert [i + 1 for i, t in enumerate(tried) if t][after:] == [after + 20, after + 40, after + 60]  # the probes
    assert p.decide(chunks["random"]).trial  # a big chunk is still tried (its trial is a sample of it)
    text_small = memoryview((b"the quick brown fox " * 300)[:4096])
    while not (c := p.decide(text_small)).trial:  # the next probe
        assert c.codec == RAW
    assert c.codec != RAW
    assert all(p.decide(text_small).trial for _ in range(4))  # trying every chunk again


def test_observations_move_the_averages_gradually():
    p = AutoPolicy(1, workers=1, halflife_bytes=64 * MiB)
    set_sink(p, 1e9)
    p.observe_sink(8 * MiB, 8 * MiB / 1e6)  # one very slow write: the average moves, but not to 1 MB/s
    assert 1e6 * 10 < p.sink_throughput() < 1e9
    p.observe_sink(0, 1.0)   # nothing written: ignored
    p.observe_sink(10, -1)   # nonsense: ignored
    codec = p.codecs[1]
    before = p.compress_throughput(codec)
    p.observe_compress(RAW, 1 << 30, 1 << 30, 100.0)  # raw is not a compressor: ignored
    assert p.compress_throughput(codec) == before
    p.observe_compress(Codec("zstd", 0, 9), 8 * MiB, MiB, 0.1)  # a codec not among the candidates: tracked
    assert p.compress_throughput(Codec("zstd", 0, 9)) > 0


def test_policy_arguments():
    with pytest.raises(ValueError):
        AutoPolicy(1, workers=0)
    with pytest.raises(ValueError):
        AutoPolicy(1, codecs=[RAW])
    with pytest.raises(ValueError):
        AutoPolicy(1, enter_margin=0.0, stay_margin=0.1)


def test_thread_safety_smoke(chunks):
    p = AutoPolicy(1, workers=4)
    set_compress(p, 0.5e9)
    errors: list[BaseException] = []
    picks: list[str] = []
    small = {k: v[:64 << 10] for k, v in chunks.items()}

    def worker(i: int) -> None:
        try:
            rnd = random.Random(i)
            for j in range(40):
                c = p.decide(small[("bf16", "fp32", "random")[j % 3]])
                picks.append(c.codec.kind)
                p.observe_sink(MiB, MiB / rnd.choice((50e6, 20e9)))
                p.observe_compress(p.codecs[j % 3], MiB, MiB // 2, MiB / 0.5e9)
                p.set_workers(rnd.randint(1, 4))
        except BaseException as e:  # collected for the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(picks) == 240
    assert 0 < p.sink_throughput() < float("inf")


def test_codec_compress_round_trips(chunks):
    src = chunks["bf16"][:4096 + 3]
    for c in policy.candidates("bplanes", 1):
        payload = c.compress(src)
        out = bytearray(src.nbytes)
        if c.kind == "planes":
            planes.decompress_planes(payload, c.word, src.nbytes, memoryview(out))
        else:
            out[:] = planes.zstd_decompressor().decompress(payload)
        assert out == src
    assert RAW.compress(src) == src.tobytes()
    assert str(Codec("planes", 4, 3)) == "planes4:3" and str(RAW) == "raw"
