"""The inference engine: paged KV cache, continuous batching, sampling, CUDA graphs, tensor parallel."""
