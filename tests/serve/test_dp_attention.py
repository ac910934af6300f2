"""`paraseek serve --ep 2 --dp-attention` (two gloo processes on CPU): each rank runs its own requests behind the
one server, routed as replicas are, its MoE layers shared with the other rank's; the tokens equal `paraseek
generate`'s in one process, both ranks get requests, and SIGTERM stops both."""

import concurrent.futures

import pytest
from fp8_models import TINY_V3, write_source
from serve_helpers import NAME, PROMPTS, Server, add_tokenizer, generate

# The V3-shaped model of tests/dist/test_infer_ep.py, with the test tokenizer's 2,112 ids.
V3 = dict(TINY_V3, num_nextn_predict_layers=0, vocab_size=2112)
N = 12


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-v3")
    folder = write_source(root / "v3", V3)
    add_tokenizer(folder, root)
    return folder


def test_dp_attention_ranks_share_the_work_and_give_one_process_tokens(v3):
    want = [r["text"] for r in generate(v3, PROMPTS, N, "--ignore-eos")]
    s = Server(v3, "--ep", "2", "--dp-attention", ready_timeout=240)
    try:
        assert "on each of the 2 dp-attention ranks" in s.stderr()

        def ask(prompt):
            r = s.client().completions.create(model=NAME, prompt=prompt, max_tokens=N, temperature=0,
                                              extra_body={"ignore_eos": True})
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, PROMPTS))
        assert got == want
        assert ask(PROMPTS[0]) == want[0]  # one request alone: the other rank runs padding steps
        m = s.metrics()
        routed = [m.get(f'paraseek_replica_requests_total{{replica="{i}"}}', 0) for i in (0, 1)]
        assert sum(routed) == len(PROMPTS) + 1 and min(routed) > 0
        assert s.wait_metric("paraseek_kv_blocks_used", 0) == 0
        s.terminate()
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
