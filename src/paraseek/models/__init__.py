"""The DeepSeek model family: args/presets, the model math, HF checkpoint I/O and exact counts."""

from paraseek.models.args import ModelArgs, preset_config, preset_names, resolve_model
from paraseek.models.deepseek import Transformer, build_model
from paraseek.models.hf import load_pretrained, save_pretrained
from paraseek.models.stats import flops_per_token, param_counts

__all__ = [
    "ModelArgs", "Transformer", "build_model", "load_pretrained", "save_pretrained", "preset_config",
    "preset_names", "resolve_model", "param_counts", "flops_per_token",
]
