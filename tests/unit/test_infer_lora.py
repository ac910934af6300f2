"""LoRA adapters served by the inference engine (infer/lora.py), on CPU: the batched per-token delta against a plain
per-token loop in float64 (base tokens exactly the base output, another slot's values never reach a token); the
engine's prefill and decode logits of adapter and base rows in one step against the merged models' forward (dense
GQA and MLA, whose kv_b is read absorbed and expanded); two adapters trained by `paraseek train --lora-rank`,
exported with --export-adapter, served in one engine with base requests give their merged exports' greedy tokens;
the prefix cache never serves one adapter's K/V to another or to the base; bad adapters and names cost one line."""

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from numerics import rel_error
from paraseek.cli import main
from paraseek.errors import UserError
from paraseek.infer.engine import Engine, EngineConfig
from paraseek.infer.linear import Linear
from paraseek.infer.lora import AdapterNotFound, LoRALinear, LoRASlots, Piece, read_adapter
from paraseek.infer.runner import HostBatch
from paraseek.infer.sampling import SamplingParams
from paraseek.models import build_model, load_pretrained, resolve_model, save_pretrained
from paraseek.models.lora import apply_lora, init_adapters, is_adapter, merge_state, save_peft_adapter
from paraseek.models.lora_spec import lora_spec

CFG = dict(block_size=8, num_kv_blocks=128, max_batched_tokens=128)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# tiny-dense: q|k|v fused over GQA, gate|up; tiny-moe: MLA (q_a|kv_a fused, q_b, kv_b absorbed), a dense first MLP.
# The routed and shared experts are not served (refused at load, below).
MODELS = {"tiny-dense": "", "tiny-moe": "attention,mlp"}


# ---- the batched delta ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_delta_equals_a_per_token_loop(dtype):
    """A fused projection of 3 pieces (as q|k|v), 4 slots of rank 8 holding adapters of ranks 2, 8 and 5 on
    different pieces (slot 2 empty), tokens of every slot and of the base in one call."""
    g = torch.Generator().manual_seed(0)
    I, rows, L, R = 24, (16, 8, 8), 4, 8
    w, bias = torch.randn(sum(rows), I, generator=g), torch.randn(sum(rows), generator=g)
    pieces = [Piece(f"p{k}", sum(rows[:k]), rows[k]) for k in range(3)]
    slots = LoRASlots(L, R, None, "cpu", dtype)
    lin = LoRALinear(Linear(w.to(dtype), bias.to(dtype)), slots, 0, pieces, I)
    ranks = {0: {0: 2, 1: 2, 2: 2}, 1: {1: 8}, 3: {0: 5, 2: 5}}  # slot -> piece -> rank
    weights = {s: {f"layers.0.p{k}": (torch.randn(r, I, generator=g), torch.randn(rows[k], r, generator=g) * 0.1)
                   for k, r in pk.items()} for s, pk in ranks.items()}
    for s, ws in weights.items():
        lin.load(s, ws)
    idx = torch.tensor([-1, 0, 1, 2, 3, 0, -1, 3, 1, 1])
    x = torch.randn(len(idx), I, generator=g)
    slots.begin(SimpleNamespace(lora=idx))
    got = lin(x.to(dtype))

    base = F.linear(x.to(dtype), w.to(dtype), bias.to(dtype))
    untouched = (idx < 0) | (idx == 2)  # the base, and an empty slot
    assert torch.equal(got[untouched], base[untouched])  # exactly, in any dtype
    if dtype == torch.float32:
        ref = x.double() @ w.double().T + bias.double()
        for t, s in enumerate(idx.tolist()):
            for name, (a, b) in weights.get(s, {}).items():
                p = pieces[int(name[-1])]
                ref[t, p.start:p.start + p.rows] += b.double() @ (a.double() @ x[t].double())
        assert rel_error(got, ref) < 1e-6
        assert rel_error(got[~untouched], base[~untouched]) > 1e-2  # the adapters matter

    # An adapter whose x A^T overflows (finite weights, inf products) reaches no other token: the zeros of other
    # slots' columns are selected, not multiplied in (0 x inf would be NaN).
    lin.load(2, {"layers.0.p0": (torch.full((1, I), 3e38), torch.ones(rows[0], 1))})
    slots.begin(SimpleNamespace(lora=idx))
    again = lin(x.to(dtype))
    assert torch.equal(again[idx != 2], got[idx != 2])


# ---- the engine against merged models ------------------------------------------------------------------------------
def _base(name):
    args, _, _ = resolve_model(name)
    torch.manual_seed(0)
    return build_model(args, "cpu", torch.float32).eval()


def _adapter(base, name, folder, seed):
    """A LoRA of rank 4 (alpha 8) on `base` with trained-looking adapters (B != 0), written as a PEFT folder; returns
    the merged model."""
    spec = lora_spec(4, 8.0, MODELS[name], base.args, name)
    model = copy.deepcopy(base)
    apply_lora(model, spec)
    init_adapters(model, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    state = model.state_dict()
    save_peft_adapter({n: t for n, t in state.items() if is_adapter(n)}, base.args, spec, folder, base_model="base",
                      dtype=torch.float32)
    merged = copy.deepcopy(base)
    merged.load_state_dict(merge_state(state, spec))
    return merged


def _step_logits(engine, prompts, slots):
    """Every prompt but its last token as one prefill chunk each, in one step, then one decode step of the last
    tokens, each row on its adapter slot (-1: the base): (logits at the chunks' ends, the decode logits)."""
    bs = engine.cfg.block_size
    tables = [list(range(1 + 8 * j, 9 + 8 * j)) for j in range(len(prompts))]
    at = lambda j, p: tables[j][p // bs] * bs + p % bs  # noqa: E731
    ids, pos, where, lens, last, lora = [], [], [], [], [], []
    for j, p in enumerate(prompts):
        n = len(p) - 1
        ids += p[:-1]
        pos += range(n)
        where += [at(j, i) for i in range(n)]
        lens.append((n, n))
        last.append(len(ids) - 1)
        lora += [slots[j]] * n
    A = np.asarray
    pre = engine.runner.run(HostBatch(A(ids), A(pos), A(where), 0, np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                                      lens, A(where), A(last), A(lora)))
    n = [len(p) - 1 for p in prompts]
    dec = engine.runner.run(HostBatch(A([p[-1] for p in prompts]), A(n), A([at(j, k) for j, k in enumerate(n)]),
                                      len(prompts), A(tables, dtype=np.int32), A([k + 1 for k in n], dtype=np.int32), [],
                                      np.zeros(0, np.int64), np.arange(len(prompts)), A(slots)))
    return pre, dec


@pytest.mark.parametrize("name", sorted(MODELS))
def test_adapter_rows_equal_the_merged_models_forward(name, tmp_path):
    """Two adapters and the base in the same prefill step and the same decode step: each row's logits are its own
    merged model's (1e-5 relative, the absorbed-decode tolerance of test_infer_engine.py)."""
    base = _base(name)
    merged = [_adapter(base, name, tmp_path / f"ad{i}", seed=i + 1) for i in range(2)]
    engine = Engine(copy.deepcopy(base), EngineConfig(**CFG, max_loras=3, max_lora_rank=8), log=lambda *_: None,
                    lora_modules={"a": str(tmp_path / "ad0"), "b": str(tmp_path / "ad1")})
    slot = {n: engine.loras.by_name[n].slot for n in "ab"}
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 2048, (k,), generator=g).tolist() for k in (19, 30, 11, 24)]
    runs = [slot["a"], -1, slot["b"], slot["a"]]
    pre, dec = _step_logits(engine, prompts, runs)
    models = {slot["a"]: merged[0], slot["b"]: merged[1], -1: base}
    with torch.no_grad():
        for j, (p, s) in enumerate(zip(prompts, runs)):
            ref = models[s](torch.tensor([p]))[0]
            assert rel_error(pre[j], ref[-2]) < 1e-5, (j, s)
            assert rel_error(dec[j], ref[-1]) < 1e-5, (j, s)
        assert rel_error(merged[0](torch.tensor([prompts[0]]))[0, -1], base(torch.tensor([prompts[0]]))[0, -1]) > 1e-2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_peft_saved_adapter_gives_peft_models_logits(tmp_path):
    """An adapter saved by PEFT itself on transformers' model (per-module ranks and alphas, rsLoRA's alpha / sqrt(r)
    scaling): the engine's rows on it have the PEFT model's logits, beside base rows in the same steps."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    save_pretrained(_base("tiny-dense"), tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    config = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                             rank_pattern={"o_proj": 2, "layers.1.mlp.up_proj": 6}, alpha_pattern={"down_proj": 3})
    torch.manual_seed(3)
    model = peft.get_peft_model(copy.deepcopy(hf), config).eval()
    model.save_pretrained(tmp_path / "peft")
    engine = Engine(load_pretrained(tmp_path / "base", dtype=torch.float32).eval(),
                    EngineConfig(**CFG, max_loras=2, max_lora_rank=8), log=lambda *_: None,
                    lora_modules={"p": str(tmp_path / "peft")})
    assert engine.loras.by_name["p"].rank == 6
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 2048, (k,), generator=g).tolist() for k in (21, 13)]
    runs = [engine.loras.by_name["p"].slot, -1]
    pre, dec = _step_logits(engine, prompts, runs)
    with torch.no_grad():
        for j, (p, ref_model) in enumerate(zip(prompts, (model, hf))):
            ref = ref_model(input_ids=torch.tensor([p])).logits[0]
            assert rel_error(pre[j], ref[-2]) < 1e-5 and rel_error(dec[j], ref[-1]) < 1e-5, j
        assert rel_error(model(input_ids=torch.tensor([prompts[0]])).logits[0, -1],
                         hf(input_ids=torch.tensor([prompts[0]])).logits[0, -1]) > 1e-2


# ---- trained adapters, exported --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tiny-moe (MLA) and two LoRA runs of 3 steps on different data (synthetic, seeds 1 and 2), each exported as a
    PEFT adapter folder and as a merged HF folder."""
    root = tmp_path_factory.mktemp("trained")
    save_pretrained(_base("tiny-moe"), root / "init")
    out = {}
    for seed in (1, 2):
        ck = root / f"ck{seed}"
        assert main(["train", "--init-from", str(root / "init"), "--device", "cpu", "--nproc", "1", "--precision",
                     "fp32", "--lr", "0.02", "--lr-schedule", "constant", "--warmup-steps", "0", "--data", "synthetic",
                     "--seq-len", "32", "--global-batch-size", "4", "--micro-batch-size", "4", "--steps", "3",
                     "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", MODELS["tiny-moe"],
                     "--checkpoint-dir", str(ck), "--seed", str(seed), "--log-every", "100"]) == 0
        assert main(["export", str(ck), str(root / f"adapter{seed}"), "--export-adapter", "--dtype", "float32"]) == 0
        assert main(["export", str(ck), str(root / f"merged{seed}"), "--merge-lora", "--dtype", "float32"]) == 0
        out[seed] = (root / f"adapter{seed}", root / f"merged{seed}")
    return root, out


def _engine(folder, **kw):
    return Engine(load_pretrained(folder, dtype=torch.float32, device="cpu").eval(), EngineConfig(**{**CFG, **kw}),
                  log=lambda *_: None)


def test_trained_adapters_served_together_give_their_merged_exports_tokens(trained):
    root, out = trained
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 2048, (k,), generator=g).tolist() for k in (5, 17, 33, 9)]
    ref = {name: [r.output_ids for r in _engine(folder).generate(prompts, GREEDY)]
           for name, folder in (("one", out[1][1]), ("two", out[2][1]), (None, root / "init"))}
    assert ref["one"] != ref[None] and ref["two"] != ref[None] and ref["one"] != ref["two"]  # the adapters matter
    engine = _engine(root / "init", max_loras=2, max_lora_rank=4, max_batched_tokens=48)
    engine.load_lora("one", str(out[1][0]))
    engine.load_lora("two", str(out[2][0]))
    names = ["one", None, "two"] * len(prompts)
    # Every prompt on each adapter and on the base, interleaved: one mixed batch, prefills chunked across steps.
    got = engine.generate([p for p in prompts for _ in range(3)], GREEDY, loras=names)
    for i, r in enumerate(got):
        assert r.output_ids == ref[names[i]][i // 3], (i, names[i])
    assert all(one.running == 0 for one in engine.loras.by_name.values())


def test_prefix_cache_keeps_each_adapters_blocks_to_itself(trained):
    root, out = trained
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 2048, (37,), generator=g).tolist()  # 4 full blocks of 8
    alone = {name: _engine(folder, enable_prefix_caching=False).generate([prompt], GREEDY)[0].output_ids
             for name, folder in (("one", out[1][1]), ("two", out[2][1]), (None, root / "init"))}
    engine = _engine(root / "init", max_loras=2, max_lora_rank=4)
    engine.load_lora("one", str(out[1][0]))
    engine.load_lora("two", str(out[2][0]))

    def run(name):
        hits = engine.pool.hits
        tokens = engine.generate([prompt], GREEDY, loras=[name])[0].output_ids
        assert tokens == alone[name], name
        return engine.pool.hits - hits

    assert run("one") == 0
    assert run("two") == 0 and run(None) == 0  # the same tokens under another adapter, or none: no hit
    assert run("one") >= 4 and run(None) >= 4  # the same adapter: its own blocks
    engine.unload_lora("one")
    engine.load_lora("one", str(out[1][0]))
    assert run("one") == 0  # a reloaded adapter (maybe another folder under the name) starts afresh


# ---- refusals ----------------------------------------------------------------------------------------------------
def _one_line(fn, *message):
    with pytest.raises(UserError) as e:
        fn()
    text = str(e.value)
    assert all(m in text for m in message) and "\n" not in text, text
    return e.value


def test_bad_adapters_and_names_cost_one_line(trained, tmp_path):
    root, out = trained
    args, _, _ = resolve_model(str(root / "init"))
    good = out[1][0]
    _one_line(lambda: read_adapter(tmp_path / "nothing", args, 8), "no such adapter folder")
    assert isinstance(_one_line(lambda: read_adapter(tmp_path / "nothing", args, 8)), AdapterNotFound)
    _one_line(lambda: read_adapter(tmp_path, args, 8), "not a PEFT adapter folder")
    _one_line(lambda: read_adapter(good, args, 2), "rank 4", "above --max-lora-rank 2")

    def variant(name, config=None, tensors=None):
        import shutil

        from safetensors.torch import load_file, save_file

        d = tmp_path / name
        shutil.copytree(good, d)
        if config:
            cfg = json.loads((d / "adapter_config.json").read_text())
            (d / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
        if tensors:
            save_file(tensors(load_file(str(d / "adapter_model.safetensors"))), str(d / "adapter_model.safetensors"))
        return d

    _one_line(lambda: read_adapter(variant("dora", {"use_dora": True}), args, 8), "DoRA")
    _one_line(lambda: read_adapter(variant("ia3", {"peft_type": "IA3"}), args, 8), "not LORA")
    nan = variant("nan", tensors=lambda t: {k: v.fill_(float("nan")) if ".lora_B." in k else v for k, v in t.items()})
    _one_line(lambda: read_adapter(nan, args, 8), "not finite")
    head = variant("head", tensors=lambda t: {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})
    _one_line(lambda: read_adapter(head, args, 8), "lm_head", "not embeddings or the head")
    dense, _, _ = resolve_model("tiny-dense")
    _one_line(lambda: read_adapter(good, dense, 8), "not a module of this model")

    # The routed experts' adapters (tiny-moe's default targets include them): refused, with what serves instead.
    base = _base("tiny-moe")
    spec = lora_spec(4, 8.0, "", base.args, "tiny-moe")
    model = copy.deepcopy(base)
    apply_lora(model, spec)
    save_peft_adapter({n: t for n, t in model.state_dict().items() if is_adapter(n)}, base.args, spec,
                      tmp_path / "experts", base_model="base", dtype=torch.float32)
    _one_line(lambda: read_adapter(tmp_path / "experts", args, 8), "experts", "not served", "--merge-lora")

    engine = _engine(root / "init", max_loras=1, max_lora_rank=4)
    engine.load_lora("one", str(good))
    _one_line(lambda: engine.load_lora("one", str(out[2][0])), "already loaded")
    _one_line(lambda: engine.load_lora("two", str(out[2][0])), "all 1 adapter slots", "unload one first")
    assert isinstance(_one_line(lambda: engine.add_request("r", [1, 2, 3], GREEDY, lora="two"), "no LoRA adapter "
                                "named 'two'"), AdapterNotFound)
    _one_line(lambda: engine.unload_lora("two"), "no LoRA adapter named 'two'")
    engine.add_request("r", [1, 2, 3], GREEDY, lora="one")
    _one_line(lambda: engine.unload_lora("one"), "1 unfinished request")  # refused while it runs...
    while engine.has_work():
        engine.step()
    engine.unload_lora("one")  # ...and done once it finished
    _one_line(lambda: _engine(root / "init").add_request("r", [1, 2], GREEDY, lora="one"), "serves none")


def test_generate_lora_flags(trained, tmp_path, capsys):
    """`paraseek generate --lora`: a row's lora field picks the adapter, a bare PATH is every other prompt's; the
    tokens are the merged export's; mistakes are one line and exit code 2."""
    root, out = trained
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt_token_ids": [5, 9, 200, 31]}, {"prompt_token_ids": [7, 7, 1000], "lora": "two"},
            {"prompt_token_ids": [5, 9, 200, 31], "lora": None}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["generate", str(root / "init"), "--device", "cpu", "--json", "--quiet", "--temperature", "0",
              "--max-new-tokens", "6", "--ignore-eos", "--num-kv-blocks", "64"]
    capsys.readouterr()
    assert main([*common, "--prompts", str(prompts), "--lora", str(out[1][0]), "--lora", f"two={out[2][0]}"]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["lora"] for r in got] == [out[1][0].name, "two", None]
    ref = [_engine(f).generate([r["prompt_token_ids"]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[
        0].output_ids for f, r in zip((out[1][1], out[2][1], root / "init"), rows)]
    assert [r["token_ids"] for r in got] == ref
    for argv, message in [(["--prompts", str(prompts)], "lora 'two' is not an adapter given with --lora"),
                          (["--prompt", "x", "--lora", "a=" + str(tmp_path / "none")], "no such adapter folder"),
                          (["--prompt", "x", "--lora", "a="], "give NAME=PATH"),
                          (["--prompt", "x", "--lora", f"a={out[1][0]}", "--max-lora-rank", "2"], "above --max-lora-rank"),
                          (["--prompt", "x", "--lora", f"a={out[1][0]}", "--lora", f"b={out[2][0]}", "--max-loras", "1"],
                           "raise --max-loras")]:
        assert main([*common, *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (argv, err)
