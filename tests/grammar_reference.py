"""The engine as it ran grammar-constrained requests before the batched masks: the synchronous step path, each row's
mask made by its own matcher (structured.Constraint.advance, bitmask_W). The reference the batched, overlapped path
is compared with (tests/unit/test_structured_batch.py on CPU, tests/gpu/test_structured_gpu.py on CUDA)."""

from paraseek.infer.engine import Engine


class PerRowMasks(Engine):
    def add_request(self, *a, **kw):
        req = super().add_request(*a, **kw)
        if req.grammar is not None and req.device_sampled:
            req.device_sampled = False
            self._host_sampled += 1
        return req

    def _masks(self, reqs):
        return None

    def _sample_row(self, req, mask=True):
        return super()._sample_row(req, mask=True)
