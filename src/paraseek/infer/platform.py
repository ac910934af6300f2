"""Which kernels and dtype the engine runs on this device, chosen once from its compute capability and printed once.

  sm90 (H100, H200)  bf16; the Triton kernels (paged decode, norms, RoPE, fused MoE); FlashAttention-2 prefill;
                     torch._grouped_mm for MoE prefill and large batches (its fast kernels are Hopper-only);
                     CUDA graphs for decode.
  sm80, sm89 (A100, L40S, RTX 4090)  the same but the grouped GEMM: MoE runs the fused Triton kernels at every
                     batch size (the alternative is a per-expert loop, which needs the counts on the host).
  sm75 (T4)          fp16 (no bf16 arithmetic); the plain-torch ops (Triton's supported GPUs start at sm80:
                     triton-lang/triton's README) and SDPA prefill (FlashAttention-2 needs sm80); eager decode, since
                     the plain-torch paged attention reads the longest context on the host.
  sm70 (V100)        as sm75.
  CPU                fp32, the plain-torch ops, eager.
The choice is a pure function of the capability (`for_capability`), so it is tested on CPU for every GPU above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paraseek.errors import UserError


@dataclass(frozen=True)
class Platform:
    name: str
    capability: tuple[int, int] | None  # None: CPU
    dtype: torch.dtype  # the engine's dtype under --dtype auto
    triton_kernels: bool  # ops.use_kernels: paged decode, norms, RoPE, fused MoE
    flash_prefill: bool  # FlashAttention-2 varlen prefill (else SDPA per chunk)
    grouped_gemm: bool  # torch._grouped_mm (bf16) for MoE beyond the fused kernels' range (models.deepseek decides)
    cuda_graphs: bool  # decode steps captured (needs kernels without host syncs)

    def line(self) -> str:
        if self.capability is None:
            return "platform: CPU: float32, plain-torch ops, eager"
        cc = f"sm{self.capability[0]}{self.capability[1]}"
        parts = [str(self.dtype).removeprefix("torch."),
                 "Triton kernels" if self.triton_kernels else "plain-torch ops (Triton needs sm80+)",
                 "FlashAttention-2 prefill" if self.flash_prefill else "SDPA prefill (FlashAttention-2 needs sm80+)",
                 "MoE: fused kernels, grouped GEMM for large bf16 batches" if self.grouped_gemm
                 else ("MoE: fused kernels at every batch size" if self.triton_kernels else "MoE: per-expert loop"),
                 "CUDA graphs" if self.cuda_graphs else "eager decode"]
        return f"platform: {self.name} ({cc}): " + ", ".join(parts)

    def check_dtype(self, dtype: torch.dtype) -> None:
        """A dtype this device cannot compute in: one line that names the one it can."""
        if dtype == torch.bfloat16 and self.capability is not None and self.capability < (8, 0):
            raise UserError(f"--dtype bfloat16: {self.name} (sm{self.capability[0]}{self.capability[1]}) has no "
                            f"bfloat16 arithmetic; use --dtype float16 (or auto)")


def for_capability(capability: tuple[int, int] | None, name: str = "GPU") -> Platform:
    if capability is None:
        return Platform("CPU", None, torch.float32, False, False, False, False)
    modern = capability >= (8, 0)
    return Platform(name, tuple(capability), torch.bfloat16 if modern else torch.float16, triton_kernels=modern,
                    flash_prefill=modern, grouped_gemm=capability[0] >= 9, cuda_graphs=modern)


def for_device(device) -> Platform:
    device = torch.device(device)
    if device.type != "cuda":
        return for_capability(None)
    return for_capability(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
