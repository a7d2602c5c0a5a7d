"""Which codec a chunk gets under a compression mode (vramd.image.compression): the per-chunk trial, and `auto`.

Pure decisions, no I/O: the writer feeds in what it measured and asks per chunk.

The trial (choose): a few slices of the chunk (by default three of 16 KiB: its start,
middle and end; `sample_slices`) are compressed with each candidate codec, and the
one whose output is smallest wins, with the slices' ratio as the chunk's predicted
ratio (a planes candidate compresses each plane of the sample on its own: see
_trial_size).  When even the best predicted ratio (stored / raw) is >= RAW_ABOVE (0.97),
the chunk is stored raw without compressing it at all.  Three candidates on 48 KiB
cost about 3 x 48 KiB / 8 MiB = 1.8% of compressing an 8 MiB chunk once
(docs/codecs.md has the measured fraction).

The `auto` model (AutoPolicy).  For a chunk of R raw bytes, let
    S    the sink's throughput: bytes/s the data-file writes achieve (observe_sink),
    T_c  codec c's compression throughput on one core: raw bytes per CPU second,
         split included (observe_compress; seeded with conservative-to-optimistic
         defaults measured on a 2-core EPYC VM until observations arrive),
    P    the number of CPU workers compressing in parallel,
    r    the chunk's predicted ratio with c (the trial's).
Writing it raw costs R/S of sink time.  Compressing saves (1 - r)·R/S of sink time and
costs R/T_c of CPU time, which P workers spread to R/(P·T_c) of wall time.  The chunk
is compressed only if the saving beats that cost by the margin h:

    (1 - r) · R / S  >  (1 + h) · R / (P · T_c)     <=>     r  <  r* = 1 - (1 + h) · S / (P · T_c)

Adding the two costs rather than overlapping them is deliberately pessimistic: a
dump takes at most (CPU time)/P + (sink time), so if every compressed chunk passes
the inequality the dump is never slower than `none` under the model, whether or
not the writer overlaps compression with writing.  The price: when the stages do
overlap, compression could pay sooner (from P·T_c > S on), and `auto` leaves that
gain (at most a factor 1/r) unclaimed near the break-even point.

No flapping: S and T_c are byte-weighted exponentially decaying averages (half-life
64 MiB of observed bytes by default), so one slow write or one preempted chunk moves
them little; and the margin has hysteresis: h = ENTER_MARGIN (0.15) while the policy
is storing raw, h = STAY_MARGIN (0) once it compresses, so a chunk near the
break-even keeps the previous chunk's decision.  Both margins are >= 0, which keeps
the guarantee above.

The trial itself is CPU the chunk pays even when it ends raw.  To keep a fast sink
(e.g. /dev/shm) within a few percent of `none`, the trial is skipped when no
candidate could pay: at r* <= 0 (CPU-bound: even r = 0 would not pay), and when r*
lies well below the ratios recent trials found (the typical data would not pass);
then only every PROBE_EVERY-th chunk (16) runs a trial, to notice data that
compresses better.  A chunk no bigger than the trial's samples is trialed whole,
at ten times the cost of compressing it: after SMALL_SKIP_AFTER trials in a row
found nothing worth it, such chunks are stored raw untried, and probed once per
PROBE_SMALL_BYTES (4 MiB) of them.  All-zero chunks never get here: the writer
stores holes.

AutoPolicy is thread-safe: the CPU workers call decide() and observe_*() at once;
state changes happen under one lock, and the trial (the CPU part) runs outside it.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from . import planes

RAW_ABOVE = 0.97          # a predicted ratio at or above this: store raw, do not compress
SAMPLE_SIZE = 16 << 10    # bytes per trial slice
SAMPLES = 3               # trial slices per chunk: start, middle, end
ENTER_MARGIN = 0.15       # h while storing raw: compressing must save 15% more than it costs
STAY_MARGIN = 0.0         # h while compressing
PROBE_EVERY = 16          # with the trial skipped, still run it on every 16th chunk
SMALL_SKIP_AFTER = 8      # chunks trialed whole skip the trial after this many incompressible trials in a row
PROBE_SMALL_BYTES = 4 << 20  # ... and are then probed once per 4 MiB of them, not once per PROBE_EVERY chunks
HALFLIFE_BYTES = 64 << 20  # the averages forget half their weight every 64 MiB observed
LEVELS = (-7, 22)         # zstd's levels, as vramd accepts them

Mode = Literal["none", "zstd", "bplanes", "auto"]
Kind = Literal["raw", "zstd", "planes"]



@dataclass(frozen=True)
class Codec:
    """How one chunk is stored: raw, one zstd frame, or planes of `word` bytes in one zstd frame."""

    kind: Kind
    word: int = 0   # planes: 2 or 4
    level: int = 0  # zstd and planes

    def __post_init__(self) -> None:
        if (self.kind == "planes") != (self.word in planes.WORDS) or (self.kind != "planes" and self.word):
            raise ValueError(f"bad codec {self!r}")

    def __str__(self) -> str:
        return {"raw": "raw", "zstd": f"zstd:{self.level}", "planes": f"planes{self.word}:{self.level}"}[self.kind]

    def compress(self, src: memoryview) -> bytes:
        """The payload of `src` under this codec (raw: the bytes themselves)."""
        if self.kind == "zstd":
            return planes.compress_zstd(src, self.level)
        if self.kind == "planes":
            return planes.compress_planes(src, self.word, self.level)
        return bytes(src)


RAW = Codec("raw")


def candidates(mode: Mode, level: int) -> tuple[Codec, ...]:
    """The codecs the trial compares under a mode at a zstd level: none for 'none', plain zstd for 'zstd', all
    three otherwise."""
    if mode == "none":
        return ()
    if mode == "zstd":
        return (Codec("zstd", 0, level),)
    return (Codec("zstd", 0, level), Codec("planes", 2, level), Codec("planes", 4, level))


@dataclass(frozen=True)
class Choice:
    """A chunk's codec and its predicted ratio (stored / raw; 1.0 for RAW)."""

    codec: Codec
    ratio: float
    trial: tuple[tuple[Codec, float], ...] = ()  # each candidate's ratio on the sample (empty: no trial ran)
    reason: str = ""

    @property
    def best_ratio(self) -> float:
        """The smallest ratio the trial found, whether or not it was worth compressing (1.0: no trial)."""
        return min((r for _, r in self.trial), default=1.0)


def sample_slices(chunk: memoryview, samples: int = SAMPLES, size: int = SAMPLE_SIZE,
                  align: int = 64) -> list[memoryview]:
    """`samples` slices of `size` bytes spread evenly over the chunk from its start to its end.

    Slice starts are multiples of `align` (keep it a multiple of 4, so plane words
    line up).  A chunk no larger than samples x size is its own, single sample.
    """
    n = chunk.nbytes
    if samples < 1 or size < 1 or n <= samples * size:
        return [chunk]
    if samples == 1:
        return [chunk[:size]]
    last = (n - size) // align * align
    starts = [last * i // (samples - 1) // align * align for i in range(samples)]
    return [chunk[s:s + size] for s in starts]


def choose(sample_views: Sequence[memoryview], candidates: Sequence[Codec],
           raw_above: float = RAW_ABOVE) -> Choice:
    """Compress the sample with each candidate; the smallest output wins, unless no ratio is below `raw_above`.

    Keep each view's length a multiple of 4 (sample_slices does) so that the
    planes of the joined sample line up with the chunk's words.
    """
    sample = memoryview(b"".join(sample_views))
    total = sample.nbytes
    if not candidates or not total:
        return Choice(RAW, 1.0, reason="no candidates" if not candidates else "empty sample")
    trial = tuple((c, _trial_size(c, sample) / total) for c in candidates)
    best, ratio = min(trial, key=lambda cr: cr[1])  # ties: the first (plain zstd is listed first)
    if ratio >= raw_above:
        return Choice(RAW, 1.0, trial, f"best trial ratio {ratio:.3f} >= {raw_above}")
    return Choice(best, ratio, trial, "smallest on the trial")


def _trial_size(codec: Codec, sample: memoryview) -> int:
    """What `codec` would store for the sample, as it would fare in a whole chunk.

    For planes, each plane of the sample is compressed on its own: in a whole chunk
    the planes are far longer than zstd's 128 KiB blocks, so almost every block holds
    one plane and gets its own literal (Huffman) table, which is where the planes
    gain.  Compressed as one short frame, the sample's planes would share one block
    and one table, whose size does not depend on the order of the bytes: the trial
    would then see no gain at all.
    """
    if codec.kind != "planes":
        return len(codec.compress(sample))
    split = planes.split_planes(sample, codec.word)
    w = len(split) // codec.word
    sizes = [len(planes.compress_zstd(memoryview(split)[k * w:(k + 1) * w], codec.level)) for k in range(codec.word)]
    return sum(sizes) + (len(split) - w * codec.word)


class _Rate:
    """A byte-weighted, exponentially decaying throughput: bytes over seconds, both decayed per byte observed."""

    def __init__(self, seed_rate: float, seed_bytes: float, halflife: float):
        self.halflife = halflife
        self.bytes = seed_bytes
        self.seconds = seed_bytes / seed_rate

    def add(self, nbytes: float, seconds: float) -> None:
        if nbytes <= 0 or seconds < 0:
            return
        decay: float = 0.5 ** (nbytes / self.halflife)
        self.bytes = self.bytes * decay + nbytes
        self.seconds = self.seconds * decay + seconds

    @property
    def rate(self) -> float:
        return self.bytes / max(self.seconds, 1e-12)


class _Mean:
    """A byte-weighted, exponentially decaying mean (of ratios)."""

    def __init__(self, seed: float, seed_bytes: float, halflife: float):
        self.halflife = halflife
        self.weight = seed_bytes
        self.total = seed * seed_bytes

    def add(self, value: float, nbytes: float) -> None:
        if nbytes <= 0:
            return
        decay: float = 0.5 ** (nbytes / self.halflife)
        self.weight = self.weight * decay + nbytes
        self.total = self.total * decay + value * nbytes

    @property
    def mean(self) -> float:
        return self.total / self.weight


# Seeds before any observation: single-core compression throughput (raw bytes per CPU
# second) at zstd level 1, measured on float data on a 2-core EPYC VM (docs/codecs.md),
# scaled down for higher levels.  The sink seed is a local NVMe's.  Optimistic seeds cost
# a few compressed chunks before the observations correct them; pessimistic ones would
# never be corrected (a raw chunk teaches nothing about T_c), so they lean high.
SEED_THROUGHPUT: Mapping[Kind, float] = {"zstd": 500e6, "planes": 500e6}
SEED_SINK = 2e9
SEED_BYTES = 8 << 20  # the seeds weigh as much as one 8 MiB observation
SEED_RATIO = 0.8      # the typical best trial ratio assumed before any trial


def _seed_throughput(codec: Codec) -> float:
    base = SEED_THROUGHPUT.get(codec.kind, 500e6)
    return base if codec.level <= 1 else base / (1 + 0.3 * (codec.level - 1))


@dataclass
class _State:
    sink: _Rate
    ratio: _Mean
    compress: dict[Codec, _Rate] = field(default_factory=dict)
    compressing: bool = False
    chunks: int = 0
    incompressible: int = 0  # trials in a row that found no codec worth it (ratio >= raw_above)
    small_untried: int = 0   # bytes of small chunks stored raw untried since the last trial


class AutoPolicy:
    """The `auto` mode: per chunk, the trial's codec if compressing it pays at the sink's speed, else RAW.

    See the module docstring for the model.  `workers`: the CPU workers that
    compress in parallel (at most the cores they may use); set_workers changes it.
    """

    def __init__(self, level: int = 1, workers: int = 1, *, codecs: Sequence[Codec] | None = None,
                 samples: int = SAMPLES, sample_size: int = SAMPLE_SIZE, raw_above: float = RAW_ABOVE,
                 enter_margin: float = ENTER_MARGIN, stay_margin: float = STAY_MARGIN,
                 probe_every: int = PROBE_EVERY, probe_small_bytes: int = PROBE_SMALL_BYTES,
                 halflife_bytes: int = HALFLIFE_BYTES,
                 seed_sink: float = SEED_SINK, seed_compress: Mapping[Codec, float] | None = None):
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if not 0 <= stay_margin <= enter_margin:
            raise ValueError("margins must satisfy 0 <= stay_margin <= enter_margin")
        self.codecs = tuple(codecs) if codecs is not None else candidates("auto", level)
        if not self.codecs or RAW in self.codecs:
            raise ValueError("AutoPolicy needs compressing candidate codecs")
        self.samples, self.sample_size, self.raw_above = samples, sample_size, raw_above
        self.enter_margin, self.stay_margin, self.probe_every = enter_margin, stay_margin, max(1, probe_every)
        self.probe_small_bytes = probe_small_bytes
        self._halflife = float(halflife_bytes)
        self._workers = workers
        self._lock = threading.Lock()
        seeds = dict(seed_compress or {})
        self._state = _State(sink=_Rate(seed_sink, SEED_BYTES, self._halflife),
                             compress={c: _Rate(seeds.get(c) or _seed_throughput(c), SEED_BYTES, self._halflife)
                                       for c in self.codecs},
                             ratio=_Mean(SEED_RATIO, SEED_BYTES, self._halflife))
        self._rates = [self._state.compress[c] for c in self.codecs]  # the candidates' (kept for good)

    # --- what the writer and the workers feed back --------------------------

    def observe_sink(self, nbytes: int, seconds: float) -> None:
        """`nbytes` of records reached the data file in `seconds` of write time."""
        with self._lock:
            self._state.sink.add(nbytes, seconds)

    def observe_compress(self, codec: Codec, raw_bytes: int, out_bytes: int, cpu_seconds: float) -> None:
        """Compressing `raw_bytes` with `codec` gave `out_bytes` in `cpu_seconds` of this thread's CPU time."""
        if codec.kind == "raw":
            return
        with self._lock:
            rate = self._state.compress.get(codec)
            if rate is None:
                rate = self._state.compress[codec] = _Rate(_seed_throughput(codec), SEED_BYTES, self._halflife)
            rate.add(raw_bytes, cpu_seconds)

    def set_workers(self, workers: int) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        with self._lock:
            self._workers = workers

    # --- the model ----------------------------------------------------------

    def sink_throughput(self) -> float:
        with self._lock:
            return self._state.sink.rate

    def compress_throughput(self, codec: Codec) -> float:
        with self._lock:
            rate = self._state.compress.get(codec)
            return rate.rate if rate is not None else _seed_throughput(codec)

    @property
    def compressing(self) -> bool:
        """The hysteresis state: True while the last decided chunk was compressed."""
        with self._lock:
            return self._state.compressing

    def breakeven_ratio(self, codec: Codec, margin: float | None = None) -> float:
        """r* = 1 - (1 + h)·S / (P·T_c): a chunk pays with `codec` when its ratio is below this (<= 0: never)."""
        with self._lock:
            return self._breakeven(codec, self._margin() if margin is None else margin)

    def _margin(self) -> float:
        return self.stay_margin if self._state.compressing else self.enter_margin

    def _breakeven(self, codec: Codec, margin: float) -> float:
        rate = self._state.compress.get(codec)
        t_c = rate.rate if rate is not None else _seed_throughput(codec)
        return 1.0 - (1.0 + margin) * self._state.sink.rate / (self._workers * t_c)

    def decide(self, chunk: memoryview) -> Choice:
        """The codec for this (not all-zero) chunk; RAW when compressing it would not make the dump faster."""
        n = chunk.nbytes
        with self._lock:
            st = self._state
            st.chunks += 1
            if st.incompressible >= SMALL_SKIP_AFTER and n <= self.samples * self.sample_size:
                # A chunk this small is trialed whole, once per candidate and plane: ~80 µs for 4 KiB here, ten
                # times what compressing it once with zstd costs.  Where nothing lately paid, such chunks are
                # stored raw untried, with one probe per probe_small_bytes of them (one per PROBE_EVERY chunks
                # cost 4 KiB chunks ~5 µs each on average, as much as copying and hashing them).
                st.small_untried += n
                if st.small_untried < self.probe_small_bytes:
                    st.compressing = False
                    return _SMALL_SKIPPED
                probe, st.small_untried = True, 0  # this chunk is the probe, whether or not r* lets it trial
            else:
                probe = st.chunks % self.probe_every == 0
            # the best r* of the candidates: the fastest one's (r* falls as T_c does)
            t_c = max(rate.rate for rate in self._rates)
            best = 1.0 - (1.0 + self._margin()) * st.sink.rate / (self._workers * t_c)
            if best <= 0 or (best < st.ratio.mean - 0.1 and not probe):
                st.compressing = False
                return _CPU_BOUND if best <= 0 else _NO_TRIAL
        choice = choose(sample_slices(chunk, self.samples, self.sample_size), self.codecs, self.raw_above)
        sampled = min(n, self.samples * self.sample_size)
        with self._lock:
            st = self._state
            if choice.trial:
                st.ratio.add(choice.best_ratio, sampled)
                st.incompressible = st.incompressible + 1 if choice.best_ratio >= self.raw_above else 0
                st.small_untried = 0
            if choice.codec.kind == "raw":
                st.compressing = False
                return choice
            r_star = self._breakeven(choice.codec, self._margin())
            if choice.ratio < r_star:
                st.compressing = True
                return Choice(choice.codec, choice.ratio, choice.trial,
                              f"ratio {choice.ratio:.3f} < r* = {r_star:.3f}")
            st.compressing = False
        return Choice(RAW, 1.0, choice.trial, f"ratio {choice.ratio:.3f} >= r* = {r_star:.3f}: does not pay")


_CPU_BOUND = Choice(RAW, 1.0, (), "CPU-bound: r* <= 0, no ratio pays")
_NO_TRIAL = Choice(RAW, 1.0, (), "r* well below the typical ratio recent trials found: trial skipped")
_SMALL_SKIPPED = Choice(RAW, 1.0, (), f"the last {SMALL_SKIP_AFTER}+ trials found nothing to gain: small chunk's "
                       "trial skipped")


def describe(choices: Iterable[Choice]) -> dict[str, int]:
    """How many chunks went to each codec (for logs and tests)."""
    counts: dict[str, int] = {}
    for c in choices:
        counts[str(c.codec)] = counts.get(str(c.codec), 0) + 1
    return counts


__all__ = ["RAW", "RAW_ABOVE", "AutoPolicy", "Choice", "Codec", "candidates", "choose", "describe",
           "sample_slices"]
