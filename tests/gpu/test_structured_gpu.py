"""Grammar masks on the GPU: the step's pinned mask buffer (structured.StepMasks) applied by apply_masks (one
non-blocking copy, xgrammar's Triton kernel) equals the CPU's plain unpack; greedy json_schema outputs of the engine
on the GPU with the batched masks equal those with each row's own matcher."""

import copy

import pytest
import torch

pytest.importorskip("xgrammar")

from paraseek.bench.serve import STRUCTURED_SCHEMA  # noqa: E402
from paraseek.infer import structured  # noqa: E402
from paraseek.infer.engine import Engine, EngineConfig  # noqa: E402
from paraseek.infer.sampling import SampleRow, SamplingParams, apply_masks, unpack_bitmask  # noqa: E402
from paraseek.models import ModelArgs, build_model, preset_config  # noqa: E402
from paraseek.models.tokenizer import BUNDLED_TOKENIZER, load_text_tokenizer  # noqa: E402

from grammar_reference import PerRowMasks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SPEC = {"type": "json_schema", "schema": STRUCTURED_SCHEMA}


def test_pinned_masks_on_the_gpu_equal_a_plain_unpack():
    g = torch.Generator().manual_seed(0)
    B, V = 32, 128256
    W = (V + 31) // 32
    masks = structured.StepMasks(rows=64, words=W, pin=True)
    assert masks.words_BW.is_pinned()
    words_BW = masks.words_BW[:B]
    words_BW.copy_(torch.randint(-2**31, 2**31 - 1, (B, W), generator=g, dtype=torch.int32))
    x_BV = torch.randn(B, V, generator=g)
    want_BV = x_BV.masked_fill(~unpack_bitmask(words_BW, V), float("-inf"))
    rows = [SampleRow(SamplingParams(), [], []) for _ in range(B)]
    got_BV = apply_masks(x_BV.cuda(), rows, words_BW)
    assert torch.equal(got_BV.cpu(), want_BV)



def test_engine_greedy_json_outputs_on_the_gpu_equal_the_synchronous_per_row_masks():
    tok = load_text_tokenizer(BUNDLED_TOKENIZER)
    cfg = preset_config("tiny-dense")
    cfg["vocab_size"] = 128256
    torch.manual_seed(0)
    model = build_model(ModelArgs.from_hf_config(cfg), "cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    prompts = [tok.encode(f"Record {i}:") for i in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0, structured=SPEC)
    outs = []
    for cls in (Engine, PerRowMasks):
        engine = cls(copy.deepcopy(model), EngineConfig(num_kv_blocks=512), tokenizer=tok, log=lambda *_: None)
        outs.append([(r.output_ids, r.finish_reason) for r in engine.generate(prompts, params)])
    assert outs[0] == outs[1]
