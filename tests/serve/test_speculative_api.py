"""A server with speculative decoding (`--speculative ngram`): completions, streamed or not, with log-probabilities,
equal `paraseek generate`'s without speculation, a step's several tokens stream as one event, and /metrics has
vLLM's spec_decode counters."""

import pytest
from serve_helpers import NAME, PROMPTS, Server, generate, token_strings

N = 24
LABEL = 'engine="0",model_name="tiny"'


@pytest.fixture(scope="module")
def spec_server(folder):
    # Single tokens looked up too: the random tiny model's tokens rarely continue a longer earlier n-gram.
    s = Server(folder, "--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "1")
    yield s
    s.stop()


def test_speculative_completions_equal_generate_and_the_metrics_count_the_drafts(spec_server, folder, tokenizer):
    prompts = [p + ". " + p + ". " + p for p in PROMPTS[:3]]  # passages repeated: prompt lookup finds drafts
    reference = generate(folder, prompts, N)
    client = spec_server.client()
    m0 = spec_server.metrics()
    per_event = []  # tokens of each streamed event (with logprobs every step's tokens come as one event)
    for ref in reference:
        r = client.completions.create(model=NAME, prompt=ref["prompt"], max_tokens=N, temperature=0, logprobs=0)
        assert r.choices[0].text == ref["text"] and r.usage.completion_tokens == ref["completion_tokens"]
        assert r.choices[0].logprobs.tokens == token_strings(tokenizer, ref["token_ids"])
        chunks = list(client.completions.create(model=NAME, prompt=ref["prompt"], max_tokens=N, temperature=0,
                                                logprobs=0, stream=True, stream_options={"include_usage": True}))
        *deltas, usage = chunks
        assert "".join(c.choices[0].text for c in deltas) == ref["text"]
        assert [t for c in deltas for t in c.choices[0].logprobs.tokens] == token_strings(tokenizer, ref["token_ids"])
        assert usage.usage.completion_tokens == ref["completion_tokens"]
        per_event += [len(c.choices[0].logprobs.tokens) for c in deltas]
    m1 = spec_server.metrics()
    delta = {k: v - m0.get(k, 0) for k, v in m1.items()}
    drafts, accepted = (delta[f"vllm:spec_decode_num_{n}_total{{{LABEL}}}"] for n in ("draft_tokens", "accepted_tokens"))
    assert drafts > 0 and 0 <= accepted <= drafts
    per_pos = [delta[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{LABEL},position="{p}"}}'] for p in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert accepted > 0 and max(per_event) > 1  # a step that accepted drafts streamed them with its own token
