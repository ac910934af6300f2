"""The inference model's projections: y = x W^T (+ b) over one tp rank's weight [out, in].

Every matrix the inference model multiplies activations by goes through a `Linear`, so that a weight format other
than a plain bf16/fp16/fp32 matrix, or an adapter added to the product, plugs in here and nowhere else in the
model. MLA's kv_b (read as its W_UK / W_UV views), the stacked experts (read by the fused-MoE kernels) and the
output head (written into the CUDA graphs' shared logits buffer) are the exceptions: each is read in a form of its
own, kept beside its layer.

With the Triton kernels on, a decode-sized product (x of 1-16 rows) whose shape has a measured config in
gemv_configs.json runs gemv.py's kernel, which reads W at closer to the HBM rate than cuBLAS there; F.linear
otherwise (gemv.dispatch_config says which).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paraseek.infer import ops


class Linear:
    def __init__(self, w_OI: torch.Tensor, b_O: torch.Tensor | None = None):
        self.w, self.b = w_OI, b_O

    def __call__(self, x_NI: torch.Tensor) -> torch.Tensor:
        if ops.kernels_on():
            from paraseek.infer import gemv  # imports triton: only with the kernels on

            cfg = gemv.dispatch_config(x_NI, self.w, self.b)
            if cfg is not None:
                return gemv.gemv(x_NI, self.w, self.b, cfg)
        return F.linear(x_NI, self.w, self.b)

    @property
    def out_features(self) -> int:
        return self.w.shape[0]

    def nbytes(self) -> int:
        """Bytes a step reads: the weight (and bias), each element once."""
        return sum(t.numel() * t.element_size() for t in (self.w, self.b) if t is not None)
