"""The handoff's wire format between a prefill and a decode instance: what each side says of itself
when they pair (`describe`, refused by `check_pairing` when the two cannot exchange KV), the decode
placement every request carries, and the pieces of one request's staged KV (`PieceSpec`, `Offer`).

Plain data, JSON-able; the transfers themselves are `dcp_jax.disagg.transfer`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from dcp_jax import mesh as mesh_lib
from dcp_jax.errors import UserError
from dcp_jax.layout import PagedLayout, kv_head_ranges


# --- identity and the pairing handshake ------------------------------------------------------------


def config_hash(cfg) -> str:
    """A short hash of a model's architecture and sizes (`ModelConfig` without the raw HF dict)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "hf_config"}
    return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]


# The handoff's wire format (what `describe`, `Offer` and `PieceSpec` carry). Both sides of a pair must
# speak the same one: the handshake refuses another. Raise it whenever that format changes.
PROTOCOL = 4


def describe(engine, role: str, address: str) -> dict:
    """What one side tells the other when they pair (JSON-able): identity, cache geometry, placement."""
    model = engine.model
    cfg = model.config
    lay = engine.layout
    return dict(role=role, protocol=PROTOCOL, config_hash=config_hash(cfg), architecture=cfg.architecture,
                dtype=str(np.dtype(engine.dtype)), kv_cache_dtype=engine.config.kv_cache_dtype,
                kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                mla=cfg.mla is not None, num_layers=cfg.num_layers, stored_kv_heads=model.kv_heads,
                kv_replication=model.kv_replication, tp=engine.mesh.shape[mesh_lib.TP],
                dcp=engine.mesh.shape[mesh_lib.DCP], num_shards=lay.num_shards, interleave=lay.interleave,
                page_size=lay.page_size, head_shards=mesh_lib.axis_size(engine.mesh, model.head_axes),
                max_model_len=engine.config.max_model_len,
                transfer_address=address)


def check_model(engine) -> None:
    """Refuse, with one line, a model whose KV the handoff does not move yet."""
    if engine.runner.model.config.indexer is not None:
        raise UserError("prefill/decode disaggregation does not move DeepSeek-V3.2's indexer cache "
                        "yet: serve the model on one instance (drop --role / DisaggregatedLLM)")


def check_pairing(prefill: dict, decode: dict) -> None:
    """Refuse a pair that could not exchange KV, with one line naming both sides' values."""
    if prefill.get("role") != "prefill":
        raise UserError(f"the instance to pair with is a {prefill.get('role') or 'non-disaggregated'} instance, "
                        "not a prefill one: start it with --role prefill")
    if prefill.get("protocol") != decode.get("protocol"):
        raise UserError(f"cannot pair: the prefill instance speaks handoff protocol {prefill.get('protocol')} but this "
                        f"decode instance speaks {decode.get('protocol')}; run the same dcp_jax version on both")
    for key, what in (("config_hash", "model (config hash)"), ("dtype", "KV dtype"), ("kv_heads", "KV heads"),
                      ("head_dim", "KV head dim"), ("num_layers", "layers"), ("kv_cache_dtype", "KV page format")):
        if prefill.get(key, "auto") != decode.get(key, "auto"):
            raise UserError(f"cannot pair: the prefill instance has {what} {prefill.get(key)} but this decode instance "
                            f"has {decode.get(key)}; start both with the same model, --dtype and --kv-cache-dtype")
    if prefill["max_model_len"] < decode["max_model_len"] - 1:
        raise UserError(f"cannot pair: the prefill instance takes prompts up to {prefill['max_model_len'] - 1} "
                        f"tokens but this decode instance admits up to {decode['max_model_len'] - 1}; give both the "
                        "same --max-model-len")


def src_layout(info: dict) -> PagedLayout:
    """The paged placement a `describe` dict names (either side's)."""
    return PagedLayout(info["num_shards"], info["interleave"], info["page_size"])


PLACEMENT_KEYS = ("num_shards", "interleave", "page_size", "tp", "stored_kv_heads", "kv_replication", "head_shards")


def placement(info: dict) -> dict:
    """What the decode side tells the prefill side with every request (JSON-able, from its `describe`):
    its paged placement and how its cache heads split, so the source cuts the pieces it wants."""
    out = {k: int(info[k]) for k in PLACEMENT_KEYS}
    if "processes" in info:  # which decode process keeps which pieces (`process_groups`)
        out["processes"] = [[int(r), int(lo), int(hi), [int(p) for p in ps]] for r, lo, hi, ps in info["processes"]]
    return out


def head_ranges(info: dict) -> list[tuple[int, int]]:
    """The model's kv heads [lo, hi) of each head shard of the side `info` describes."""
    return kv_head_ranges(info["stored_kv_heads"], info["kv_replication"], info["head_shards"])


def piece_head_ranges(source: dict, dest: dict) -> list[tuple[int, int]]:
    """The model's kv heads [lo, hi) of the pieces a source (`describe`) cuts for a destination: each
    destination head shard's heads, split where the source's head shards split them, each range once
    (a head replicated over either side's tp ranks is one piece)."""
    out = {(max(lo, a), min(hi, b)) for lo, hi in head_ranges(dest) for a, b in head_ranges(source)}
    return sorted((lo, hi) for lo, hi in out if lo < hi)


def chunks(n: int) -> list[tuple[int, int]]:
    """(offset, size) of the power-of-two chunks a piece of `n` tokens travels in: its binary
    decomposition, largest first (13 -> (0, 8), (8, 4), (12, 1)). Exact (no padding), and the decode
    side's write programs, compiled per chunk size, number O(log max length) instead of one per length."""
    out, offset = [], 0
    for bit in reversed(range(max(n, 1).bit_length())):
        if n >> bit & 1:
            out.append((offset, 1 << bit))
            offset += 1 << bit
    return out


# --- the pieces of one request's staged KV ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PieceSpec:
    """One single-device piece [T, L, heads, D] of a request's KV: layer stack `stack`, array `kind`
    (0 = k, 1 = v; MLA: 0 = latent), T tokens from `offset` on of those that source context rank `rank`
    holds and destination context rank `dst_rank` owns (`ReshardPlan.piece_positions()[rank][dst_rank]`,
    in that order; T a power of two, `chunks`), the model's kv heads [head0, head0 + shape[2]) (those
    one destination head shard keeps)."""

    stack: int
    kind: int
    rank: int
    dst_rank: int
    head0: int
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "PieceSpec":
        return cls(int(d["stack"]), int(d["kind"]), int(d["rank"]), int(d["dst_rank"]), int(d["head0"]),
                   int(d["offset"]), tuple(int(x) for x in d["shape"]), str(d["dtype"]))


def process_groups(specs: list[PieceSpec], dest: dict) -> dict[int, list[int]]:
    """Which decode process pulls which pieces: process -> indices into `specs`. `dest` (the decode
    placement) names, per (destination rank, kv heads [lo, hi)) of a piece, the processes whose devices
    keep it (`processes`: [[rank, lo, hi, [process, ...]], ...]; a decode instance on one process names
    only 0). A piece two processes keep (heads replicated over tp ranks on both) is in both groups."""
    if "processes" not in dest:  # (a placement from this process: one group)
        return {0: list(range(len(specs)))}
    keeps = {(int(r), int(lo), int(hi)): [int(p) for p in ps] for r, lo, hi, ps in dest["processes"]}
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(specs):
        who = keeps.get((s.dst_rank, s.head0, s.head0 + s.shape[2]))
        if not who:
            raise ValueError(f"the decode placement names no process keeping rank {s.dst_rank}'s kv heads "
                             f"{s.head0}..{s.head0 + s.shape[2] - 1}")
        for p in who:
            groups.setdefault(p, []).append(i)
    return groups


@dataclasses.dataclass
class Offer:
    """What the prefill side answers for one request: its first sampled token and where its KV waits:
    `parts`, one offer per decode process that keeps any of the pieces ((process, uuid, indices into
    `pieces`)), each pulled by that process alone (a pull takes a whole offer)."""

    request_id: str
    parts: list[tuple[int, int, list[int]]]
    length: int  # prompt tokens whose KV is offered
    first_token: int
    first_logprob: float
    pieces: list[PieceSpec]
    prefill_s: float = 0.0
    first_top: list = dataclasses.field(default_factory=list)  # the first token's [id, logprob] alternatives

    def part(self, process: int) -> tuple[int | None, list[PieceSpec]]:
        """(uuid, pieces) of what `process` pulls; (None, []) when it keeps none of the prompt."""
        for p, uuid, idx in self.parts:
            if p == process:
                return uuid, [self.pieces[i] for i in idx]
        return None, []

    def to_json(self) -> dict:
        return dict(request_id=self.request_id, parts=[[p, u, list(idx)] for p, u, idx in self.parts],
                    length=self.length, first_token=self.first_token, first_logprob=self.first_logprob,
                    pieces=[p.to_json() for p in self.pieces], prefill_s=self.prefill_s,
                    first_top=[[int(i), float(x)] for i, x in self.first_top])

    @classmethod
    def from_json(cls, d: dict) -> "Offer":
        return cls(str(d["request_id"]), [(int(p), int(u), [int(i) for i in idx]) for p, u, idx in d["parts"]],
                   int(d["length"]), int(d["first_token"]), float(d["first_logprob"]),
                   [PieceSpec.from_json(p) for p in d["pieces"]], float(d.get("prefill_s", 0.0)),
                   [(int(i), float(x)) for i, x in d.get("first_top", [])])


def new_uuid() -> int:
    """A random 63-bit transfer id."""
    return int.from_bytes(np.random.default_rng().bytes(8), "little") >> 1

