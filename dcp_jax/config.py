"""Model configuration read from a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3 families)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from dcp_jax.errors import UserError

# architecture -> (qkv bias, q/k norm)
FAMILIES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def inv_freq(self, head_dim: int, max_seq_len: int) -> np.ndarray:
        """Inverse frequencies [head_dim/2] (float64), with the configured scaling applied.

        `dynamic` (NTK) scaling follows transformers: no change up to the original context; beyond it
        the base grows for the longest sequence the cache holds (`max_seq_len`), fixed for a run.
        """
        theta = self.theta
        if self.type == "dynamic" and self.original_max_position_embeddings:
            orig = self.original_max_position_embeddings
            if max_seq_len > orig:
                theta = theta * ((self.factor * max_seq_len / orig) - (self.factor - 1)) ** (
                    head_dim / (head_dim - 2))
        inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        if self.type == "linear":
            inv = inv / self.factor
        elif self.type == "llama3":
            orig = self.original_max_position_embeddings
            low_wavelen = orig / self.low_freq_factor
            high_wavelen = orig / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            smooth = (orig / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(mid, (1 - smooth) * inv / self.factor + smooth * inv, scaled)
        return inv


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            raise UserError(
                f"unsupported architecture {archs or d.get('model_type')!r}; supported: {', '.join(FAMILIES)}")
        qkv_bias, qk_norm = FAMILIES[arch]
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            cfg = cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=_rope(d),
                tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=bool(d.get("attention_bias", qkv_bias)) or qkv_bias,
                qk_norm=qk_norm,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                sliding_window=_sliding_window(d),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=_ids(d.get("eos_token_id")),
                hf_config=dict(d),
            )
        except KeyError as e:
            raise UserError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise UserError(f"config.json has a malformed field: {e}") from None
        if cfg.num_heads % cfg.num_kv_heads:
            raise UserError(
                f"config.json: num_attention_heads ({cfg.num_heads}) is not a multiple of "
                f"num_key_value_heads ({cfg.num_kv_heads})")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path} not found: a model directory needs config.json")
        try:
            d = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {path}: {e}") from None
        if not isinstance(d, dict):
            raise UserError(f"{path} is not a JSON object")
        return cls.from_dict(d)


def _ids(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(int(i) for i in (x if isinstance(x, (list, tuple)) else [x]))


def _sliding_window(d: dict) -> int | None:
    if d.get("use_sliding_window") is False:
        return None
    w = d.get("sliding_window")
    return int(w) if w else None


def _rope(d: dict) -> RopeConfig:
    """Both config styles: `rope_theta` + `rope_scaling` (older) or `rope_parameters` (newer)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = dict(params or d.get("rope_scaling") or {})
    theta = float(scaling.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UserError(f"unsupported rope scaling {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    orig = scaling.get("original_max_position_embeddings")
    if rope_type == "dynamic" and orig is None:
        orig = d.get("max_position_embeddings")
    if rope_type == "llama3" and orig is None:
        raise UserError("llama3 rope scaling needs original_max_position_embeddings in config.json")
    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig else None,
    )
