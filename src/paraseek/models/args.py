"""ModelArgs: one flat, typed description of every supported architecture, plus the presets and HF config I/O.

The presets are the published hub `config.json` files, kept verbatim under `presets/` so that "equals the published
config" is checkable by eye and by test; the tiny test models are written here as hub-style dicts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paraseek.errors import UserError, read_parsed

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "deepseek_v2", "deepseek_v3")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class ModelArgs:
    """Architecture hyper-parameters. Names follow DeepSeek's `inference/model.py`; `from_hf_config` maps the hub keys."""

    model_type: str = "llama"  # the HF model_type it round-trips to: llama | qwen2 | deepseek_v2 | deepseek_v3
    vocab_size: int = 102400
    dim: int = 4096  # hidden_size
    n_layers: int = 30
    n_heads: int = 32
    n_kv_heads: int = 32  # GQA when < n_heads; unused by MLA (every head has its own K/V from the latent)
    head_dim: int = 128  # MHA/GQA head size; MLA uses qk_nope_head_dim + qk_rope_head_dim and v_head_dim
    inter_dim: int = 11008  # dense SwiGLU width (dense models, and the first_k_dense_replace layers of MoE models)
    norm_eps: float = 1e-6
    max_seq_len: int = 4096  # max_position_embeddings
    tie_embeddings: bool = False  # lm_head shares the input embedding (small Qwen2 models)
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v but not on o
    o_bias: bool = False
    # RoPE. rope_type: default | linear | llama3 (R1-Distill-Llama) | yarn (DeepSeek-V2/V3).
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_seq_len: int = 0  # the pre-training context that llama3/yarn scaling extends
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_mscale: float = 1.0  # yarn: cos/sin scale numerator
    rope_mscale_all_dim: float = 0.0  # yarn: also enters DeepSeek's softmax scale (mscale^2)
    rope_interleave: bool = False  # DeepSeek MLA rotates adjacent pairs (x0,x1),(x2,x3); Llama/Qwen rotate halves
    # MLA (multi-head latent attention): on when kv_lora_rank > 0. q_lora_rank 0 = a plain q_proj (V2-Lite).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeekMoE: on when n_routed_experts > 0.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    n_activated_experts: int = 0  # num_experts_per_tok
    moe_inter_dim: int = 0  # width of one routed (and of one shared) expert
    first_k_dense_replace: int = 0  # the first k layers keep a dense MLP
    moe_layer_freq: int = 1
    score_func: str = "softmax"  # softmax (V2) | sigmoid (V3)
    topk_method: str = "greedy"  # greedy | group_limited_greedy (V2) | noaux_tc (V3, with e_score_correction_bias)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    aux_loss_alpha: float = 0.0  # V2's sequence-/batch-level balance loss weight (training only)
    seq_aux: bool = False
    n_mtp_layers: int = 0  # multi-token-prediction modules (num_nextn_predict_layers): V3's, or --mtp-layers' fresh ones
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    # ---- derived -------------------------------------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def attn_v_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json ----------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Read a config.json as the hub writes it (rope_scaling + rope_theta) or as transformers 5 writes it
        (rope_parameters). Raises UserError for architectures or options the model code does not implement."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"unsupported model_type {model_type!r}; paraseek runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UserError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu (SwiGLU) is implemented")
        if cfg.get("mlp_bias"):
            raise UserError("unsupported mlp_bias=true; no DeepSeek-family model uses MLP biases")
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise UserError("unsupported use_sliding_window=true; sliding-window attention is not implemented")

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise UserError(f"config.json lacks {key!r}, which a {model_type} model needs")
            return cfg[key]

        dim, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kw: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            dim=dim,
            n_layers=int(need("num_hidden_layers")),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            inter_dim=int(need("intermediate_size")),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id") if not isinstance(cfg.get("eos_token_id"), list) else None,
        )
        if model_type == "qwen2":
            kw.update(qkv_bias=True, o_bias=False)
        else:
            bias = bool(cfg.get("attention_bias", False))
            kw.update(qkv_bias=bias, o_bias=bias)
        kw.update(_rope_from_hf(cfg))
        if model_type in ("deepseek_v2", "deepseek_v3"):
            v3 = model_type == "deepseek_v3"
            kw.update(
                n_kv_heads=n_heads,
                head_dim=int(need("qk_nope_head_dim")) + int(need("qk_rope_head_dim")),  # transformers writes the rope dim here
                rope_interleave=bool(cfg.get("rope_interleave", True)),
                q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                kv_lora_rank=int(need("kv_lora_rank")),
                qk_nope_head_dim=int(need("qk_nope_head_dim")),
                qk_rope_head_dim=int(need("qk_rope_head_dim")),
                v_head_dim=int(need("v_head_dim")),
                n_routed_experts=int(cfg.get("n_routed_experts") or 0),
                n_shared_experts=int(cfg.get("n_shared_experts") or 0),
                n_activated_experts=int(cfg.get("num_experts_per_tok") or 0),
                moe_inter_dim=int(cfg.get("moe_intermediate_size") or 0),
                first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
                moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
                score_func=cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
                topk_method=cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
                n_group=int(cfg.get("n_group") or 1),
                topk_group=int(cfg.get("topk_group") or 1),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
                aux_loss_alpha=float(cfg.get("aux_loss_alpha") or 0.0),
                seq_aux=bool(cfg.get("seq_aux", False)),
            )
        # V3's key; a Llama or Qwen2 model trained with --mtp-layers carries it too (models/hf.py: V3's layout)
        kw["n_mtp_layers"] = int(cfg.get("num_nextn_predict_layers") or 0)
        args = cls(**kw)
        args.validate()
        return args

    def validate(self) -> None:
        """Shape rules the model code relies on, as readable errors."""
        if self.score_func not in ("softmax", "sigmoid"):
            raise UserError(f"unsupported scoring_func {self.score_func!r}; expected softmax or sigmoid")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise UserError(f"unsupported topk_method {self.topk_method!r}")
        if self.rope_type not in ("default", "linear", "llama3", "yarn"):
            raise UserError(f"unsupported rope type {self.rope_type!r}; expected default, linear, llama3 or yarn")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"num_attention_heads {self.n_heads} is not a multiple of num_key_value_heads {self.n_kv_heads}")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise UserError(f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}")
            if not 0 < self.n_activated_experts <= self.n_routed_experts:
                raise UserError(f"num_experts_per_tok {self.n_activated_experts} must be in 1..{self.n_routed_experts}")

    def to_hf_config(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A hub-style config.json (rope_scaling + rope_theta) that transformers' AutoConfig reads."""
        cfg: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.inter_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": _rope_to_hf(self),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": torch_dtype,
        }
        if self.model_type == "llama":
            cfg.update(attention_bias=self.qkv_bias, mlp_bias=False, head_dim=self.head_dim)
        if self.model_type == "qwen2":
            cfg.update(use_sliding_window=False)
        if self.model_type in ("deepseek_v2", "deepseek_v3"):
            cfg.update(
                attention_bias=False,
                q_lora_rank=self.q_lora_rank or None,
                kv_lora_rank=self.kv_lora_rank,
                qk_nope_head_dim=self.qk_nope_head_dim,
                qk_rope_head_dim=self.qk_rope_head_dim,
                v_head_dim=self.v_head_dim,
                n_routed_experts=self.n_routed_experts or None,
                n_shared_experts=self.n_shared_experts or None,
                num_experts_per_tok=self.n_activated_experts or None,
                moe_intermediate_size=self.moe_inter_dim,
                first_k_dense_replace=self.first_k_dense_replace,
                moe_layer_freq=self.moe_layer_freq,
                scoring_func=self.score_func,
                topk_method=self.topk_method,
                n_group=self.n_group,
                topk_group=self.topk_group,
                routed_scaling_factor=self.routed_scaling_factor,
                norm_topk_prob=self.norm_topk_prob,
                aux_loss_alpha=self.aux_loss_alpha,
                seq_aux=self.seq_aux,
                rope_interleave=self.rope_interleave,
            )
        if self.model_type == "deepseek_v3" or self.n_mtp_layers:
            cfg["num_nextn_predict_layers"] = self.n_mtp_layers
        return cfg


# The fields that do not make two models' weights different: the special-token ids are the tokenizer's, and MTP
# modules ride beside the model (a run may add them: --mtp-layers).
NOT_ARCHITECTURE = ("bos_token_id", "eos_token_id", "n_mtp_layers")


def architecture_difference(a: ModelArgs, b: ModelArgs) -> str:
    """How two models differ in what makes their weights interchangeable -- every field but NOT_ARCHITECTURE -- as
    "FIELD A vs B" for the first field that differs, or "" when none does."""
    for f in dataclasses.fields(ModelArgs):
        if f.name not in NOT_ARCHITECTURE and getattr(a, f.name) != getattr(b, f.name):
            return f"{f.name} {getattr(a, f.name)} vs {getattr(b, f.name)}"
    return ""


def _rope_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 folds rope_theta into rope_parameters; the hub keeps rope_theta and rope_scaling apart.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = dict(rope_theta=float(theta), rope_type=rope_type)
    if rope_type == "default":
        return out
    out["rope_factor"] = float(params.get("factor", 1.0))
    out["rope_original_max_seq_len"] = int(
        params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096)
    )
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]), rope_high_freq_factor=float(params["high_freq_factor"]))
    if rope_type == "yarn":
        out.update(
            rope_beta_fast=float(params.get("beta_fast") or 32),
            rope_beta_slow=float(params.get("beta_slow") or 1),
            rope_mscale=float(params.get("mscale") or 1.0),
            rope_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        )
    return out


def _rope_to_hf(args: ModelArgs) -> dict[str, Any] | None:
    if args.rope_type == "default":
        return None
    out: dict[str, Any] = {"type": args.rope_type, "rope_type": args.rope_type, "factor": args.rope_factor,
                           "original_max_position_embeddings": args.rope_original_max_seq_len}
    if args.rope_type == "llama3":
        out.update(low_freq_factor=args.rope_low_freq_factor, high_freq_factor=args.rope_high_freq_factor)
    if args.rope_type == "yarn":
        out.update(beta_fast=args.rope_beta_fast, beta_slow=args.rope_beta_slow, mscale=args.rope_mscale,
                   mscale_all_dim=args.rope_mscale_all_dim)
    return out


# ---- presets ---------------------------------------------------------------------------------------------------------
# Tiny models for multi-process CPU tests, written as hub config.json dicts (so they go through from_hf_config too).
# tiny-moe is V3-shaped: MLA with q_lora, sigmoid routing with groups and a bias (noaux_tc), shared experts,
# a first dense layer, YaRN.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-dense": {
        "model_type": "llama", "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    "tiny-moe": {
        "model_type": "deepseek_v3", "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 176,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json")) + sorted(TINY_CONFIGS)


def preset_config(name: str) -> dict[str, Any]:
    """The hub config.json dict of a preset."""
    if name in TINY_CONFIGS:
        return dict(TINY_CONFIGS[name])
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise UserError(f"unknown model {name!r}: not a preset ({', '.join(preset_names())}) nor a folder with config.json")
    return json.loads(path.read_text())


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder)
    if not path.is_dir():
        raise UserError(f"{path}: no such folder")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{path}: no config.json in this folder (expected an HF model folder)")
    cfg = read_parsed(cfg_path, str(cfg_path), "valid JSON")
    if not isinstance(cfg, dict):
        raise UserError(f"{cfg_path}: expected a JSON object of the model's settings, found {type(cfg).__name__}")
    return cfg


def resolve_model(spec: str) -> tuple[ModelArgs, dict[str, Any], Path | None]:
    """A preset name or an HF folder -> (args, its config.json dict, the folder or None)."""
    if Path(spec).is_dir() or "/" in spec or spec.startswith("."):
        cfg = read_hf_config(spec)
        try:
            return ModelArgs.from_hf_config(cfg), cfg, Path(spec)
        except (TypeError, ValueError, ArithmeticError) as e:  # "hidden_size": "big", num_key_value_heads 0
            raise UserError(f"{Path(spec) / 'config.json'}: a setting of the wrong type or value ({e})") from None
    cfg = preset_config(spec)
    return ModelArgs.from_hf_config(cfg), cfg, None
