"""The DeepSeek model family: args/presets, the model math, HF checkpoint I/O and exact counts.

The names that need torch load on first use, so that `paraseek --help`, the planner and the tokenizer do not
import it (models/args.py and models/tokenizer.py are pure Python)."""

from paraseek.models.args import ModelArgs, preset_config, preset_names, resolve_model

_LAZY = {
    "Transformer": "paraseek.models.deepseek", "build_model": "paraseek.models.deepseek",
    "load_pretrained": "paraseek.models.hf", "save_pretrained": "paraseek.models.hf",
    "flops_per_token": "paraseek.models.stats", "param_counts": "paraseek.models.stats",
}

__all__ = ["ModelArgs", "preset_config", "preset_names", "resolve_model", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paraseek.models' has no attribute {name!r}")
