"""Model configuration read from a Hugging Face `config.json`.

Families: Llama, Mistral, Qwen2, Qwen3 (grouped-query attention), DeepSeek-V2/V3 (multi-head latent
attention, dense and mixture-of-experts layers), DeepSeek-V3.2 (V3 with DeepSeek Sparse Attention's
lightning indexer: `IndexerConfig`).
"""

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
    "DeepseekV2ForCausalLM": (False, False),
    "DeepseekV3ForCausalLM": (False, False),
    "DeepseekV32ForCausalLM": (False, False),
}
MLA_FAMILIES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
V3_ROUTERS = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")  # sigmoid scores, noaux_tc
DSA_FAMILIES = ("DeepseekV32ForCausalLM",)  # MLA + the lightning indexer
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def cos_sin_factor(self) -> float:
        """The factor yarn applies to cos/sin (so to q·k's rotary part squared); 1 otherwise."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_scale_factor(self) -> float:
        """DeepSeek's correction of the softmax scale under scaled RoPE: mscale(factor, mscale_all_dim)^2."""
        if self.type == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def inv_freq(self, head_dim: int, max_seq_len: int) -> np.ndarray:
        """Inverse frequencies [head_dim/2] (float64), with the configured scaling applied.

        `dynamic` (NTK) scaling is transformers' formula for a sequence of `max_seq_len` tokens: no
        change up to the original context (max_position_embeddings, or the rope dict's
        original_max_position_embeddings); beyond it the base grows for the longest sequence the
        cache holds (the engine's max_model_len; a dense run's max_seq_len as its layout rounds it),
        fixed for a run. Transformers recomputes the base in each forward from the longest position
        so far (older cached keys keep older bases); the two agree exactly once its rotary state has
        grown to `max_seq_len` (scripts/make_fixtures.py, DYNAMIC_SEQ_LEN).
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
        elif self.type == "yarn":
            inv = self._yarn(inv, head_dim)
        return inv

    def _yarn(self, inv: np.ndarray, dim: int) -> np.ndarray:
        """YaRN: interpolate low frequencies by `factor`, keep high ones, blend linearly in between."""
        orig = self.original_max_position_embeddings

        def correction_dim(rotations):
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
        return inv / self.factor * (1 - keep) + inv * keep


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): one latent of kv_lora_rank + qk_rope_head_dim per token."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        """Width of the cached latent (the key of absorbed attention); its first kv_lora_rank are the value."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2): a lightning indexer scores every cached token for
    each query, `Σ_h w_h · relu(q_h · k_t · head_dim^-0.5)` over `num_heads` index heads of
    `head_dim` (one cached key of `head_dim` per token, beside the latent), and the query attends
    only the `topk` best-scoring visible tokens (every visible token when it sees fewer)."""

    topk: int
    num_heads: int
    head_dim: int

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """DeepSeek mixture of experts: routed experts picked per token, plus always-on shared experts."""

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared: int
    first_dense: int  # layers [0, first_dense) are dense
    layer_freq: int
    scoring: str  # "sigmoid" (V3) or "softmax" (V2)
    topk_method: str  # "noaux_tc" (V3: group score = sum of top-2, bias-corrected), "greedy", "group_limited_greedy"
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_dense and index % self.layer_freq == 0


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
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    indexer: IndexerConfig | None = None  # DeepSeek-V3.2's sparse attention
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
            mla = _mla(d) if arch in MLA_FAMILIES else None
            cfg = cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                # MLA caches one latent per token: one "kv head" of the latent's width
                num_kv_heads=1 if mla else int(d.get("num_key_value_heads") or heads),
                head_dim=mla.latent_dim if mla else int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=_rope(d),
                tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=bool(d.get("attention_bias", qkv_bias)) or qkv_bias,
                qk_norm=qk_norm,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                sliding_window=_sliding_window(d),
                mla=mla,
                moe=_moe(d, arch) if mla else None,
                indexer=_indexer(d, mla) if arch in DSA_FAMILIES else None,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=_ids(d.get("eos_token_id")),
                hf_config=dict(d),
            )
        except UserError:
            raise
        except KeyError as e:
            raise UserError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise UserError(f"config.json has a malformed field: {e}") from None
        if d.get("hidden_act", "silu") != "silu":
            raise UserError(f"config.json: hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
        if cfg.num_heads % cfg.num_kv_heads:
            raise UserError(
                f"config.json: num_attention_heads ({cfg.num_heads}) is not a multiple of "
                f"num_key_value_heads ({cfg.num_kv_heads})")
        return cfg

    @property
    def rope_dim(self) -> int:
        """Width of the rotary part of q and k."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    def check_context(self, length: int, flag: str = "max_model_len") -> None:
        """UserError when a context of `length` tokens needs the sliding window dcp_jax does not implement."""
        if self.sliding_window and length > self.sliding_window:
            raise UserError(f"the model uses a {self.sliding_window}-token sliding window, which dcp_jax does not "
                            f"implement; keep {flag} <= {self.sliding_window}")

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(q·k width); for MLA with DeepSeek's mscale correction under scaled RoPE (the Llama family
        has none: there YaRN only scales cos/sin)."""
        if self.mla:
            return self.mla.qk_head_dim ** -0.5 * self.rope.softmax_scale_factor()
        return self.head_dim ** -0.5

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


def _mla(d: dict) -> MLAConfig:
    q_lora = d.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        rope_interleave=bool(d.get("rope_interleave", True)),
    )


def _moe(d: dict, arch: str) -> MoEConfig | None:
    experts = d.get("n_routed_experts")
    if not experts:
        return None
    v3 = arch in V3_ROUTERS
    method = "noaux_tc" if v3 else (d.get("topk_method") or "greedy")
    if method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise UserError(f"config.json: topk_method {method!r} is not supported")
    if not v3 and d.get("norm_topk_prob"):
        # transformers ignores it for V2; DeepSeek's own V2 code then skips routed_scaling_factor
        raise UserError("config.json: DeepSeek-V2 with norm_topk_prob=true is not supported (implementations "
                        "disagree on it; the published V2 models use false)")
    grouped = method != "greedy"
    moe = MoEConfig(
        num_experts=int(experts),
        top_k=int(d["num_experts_per_tok"]),
        intermediate_size=int(d["moe_intermediate_size"]),
        num_shared=int(d.get("n_shared_experts") or 0),
        first_dense=int(d.get("first_k_dense_replace") or 0),
        layer_freq=int(d.get("moe_layer_freq") or 1),
        scoring="sigmoid" if v3 else "softmax",
        topk_method=method,
        num_groups=int(d.get("n_group") or 1) if grouped else 1,
        topk_groups=int(d.get("topk_group") or 1) if grouped else 1,
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
    )
    if moe.num_experts % moe.num_groups or not 1 <= moe.topk_groups <= moe.num_groups:
        raise UserError(f"config.json: {moe.num_experts} experts do not split into n_group={moe.num_groups} "
                        f"groups with topk_group={moe.topk_groups}")
    if moe.top_k > moe.num_experts:
        raise UserError(f"config.json: num_experts_per_tok={moe.top_k} exceeds n_routed_experts={moe.num_experts}")
    kinds = d.get("mlp_layer_types")
    if kinds is not None:
        layers = range(int(d["num_hidden_layers"]))
        ours = ["sparse" if moe.is_moe_layer(i) else "dense" for i in layers]
        if list(kinds) != ours:
            raise UserError(f"config.json: mlp_layer_types {list(kinds)} is not what "
                            f"first_k_dense_replace and moe_layer_freq give ({ours}); dcp_jax "
                            "reads only those two")
    return moe


def _indexer(d: dict, mla: MLAConfig) -> IndexerConfig:
    """DeepSeek-V3.2's lightning indexer (its queries come from MLA's q_lora path)."""
    if not mla.q_lora_rank:
        raise UserError("config.json: DeepSeek-V3.2's indexer reads the query's low-rank "
                        "projection; give q_lora_rank")
    cfg = IndexerConfig(topk=int(d.get("index_topk", 2048)),
                        num_heads=int(d.get("index_n_heads", 64)),
                        head_dim=int(d.get("index_head_dim", 128)))
    if cfg.topk < 1 or cfg.num_heads < 1 or cfg.head_dim < mla.qk_rope_head_dim:
        raise UserError(f"config.json: index_topk ({cfg.topk}) and index_n_heads ({cfg.num_heads}) "
                        f"must be >= 1 and index_head_dim ({cfg.head_dim}) at least "
                        f"qk_rope_head_dim ({mla.qk_rope_head_dim})")
    return cfg


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
    if rope_type in ("llama3", "yarn") and orig is None:
        raise UserError(f"{rope_type} rope scaling needs original_max_position_embeddings in config.json")

    def opt(name):
        return None if scaling.get(name) is None else float(scaling[name])

    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig else None,
        beta_fast=opt("beta_fast") or 32.0,
        beta_slow=opt("beta_slow") or 1.0,
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor"),
        truncate=bool(scaling.get("truncate", True)),
    )
