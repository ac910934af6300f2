"""paraseek: DeepSeek-family models on many GPUs, PyTorch-native."""

__version__ = "0.1.0"
