"""`paraseek generate`: offline batch generation through the engine (flags: infer/flags.py, one process per GPU:
infer/ranks.py, the engine: infer/build.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from paraseek.errors import UserError
from paraseek.infer.build import build_engine, check_lora_modules, check_speculative
from paraseek.infer.flags import (add_engine_arguments, add_sampling_arguments, engine_config, generation_defaults,
                                  lora_modules, parse_lora_modules, resolve_offline_defaults, sampling_params)
from paraseek.infer.load import load_tokenizer
from paraseek.infer.ranks import WORKER_ENV, check_parallel, device_for, finish, place, relaunch, replica_gpus


@dataclass
class Prompt:
    index: int
    id: str
    text: str | None  # as given (None for token-id prompts)
    token_ids: list[int]
    overrides: dict[str, Any]
    where: str  # "prompt 2" (the second --prompt) or "FILE.jsonl:7" (its line), for messages
    lora: str | None = None  # the LoRA adapter it runs on (--lora); None: the base model


def read_prompts(ns: argparse.Namespace, tokenizer, vocab_size: int) -> list[Prompt]:
    rows: list[tuple[str, dict[str, Any]]] = [(f"prompt {i + 1}", {"prompt": t}) for i, t in enumerate(ns.prompt or [])]
    if ns.prompts:
        from paraseek.errors import read_jsonl_objects

        rows += [(f"{ns.prompts}:{n}", row)
                 for n, row in read_jsonl_objects(ns.prompts, "prompt, prompt_token_ids or messages")]
    if not rows:
        raise UserError("nothing to generate: give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    from paraseek.infer.sampling import SamplingParams

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    out = []
    for i, (where, row) in enumerate(rows):
        overrides = {k: v for k, v in row.items() if k in fields}
        if "max_new_tokens" in row:
            overrides["max_tokens"] = row["max_new_tokens"]
        unknown = set(row) - fields - {"prompt", "prompt_token_ids", "messages", "id", "max_new_tokens", "lora"}
        if unknown:
            raise UserError(f"{where}: unknown field {sorted(unknown)[0]!r} (prompt, prompt_token_ids, messages, id, "
                            f"lora, or a sampling field such as max_tokens, temperature)")
        lora = row.get("lora", getattr(ns, "lora_default", None))
        if lora is not None and lora not in lora_modules(ns):
            given = ", ".join(lora_modules(ns)) or "none"
            raise UserError(f"{where}: lora {lora!r} is not an adapter given with --lora NAME=PATH (given: {given})")
        if "prompt_token_ids" in row:
            ids = row["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise UserError(f"{where}: prompt_token_ids must be a list of integers")
            text = None
        else:
            if tokenizer is None:
                raise UserError(f"{where}: text prompts need a tokenizer and this model has none; give --tokenizer, "
                                f"or prompt_token_ids rows")
            if "messages" in row or ns.chat:
                messages = row.get("messages") or [{"role": "user", "content": row.get("prompt", "")}]
                try:
                    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                except UserError as e:
                    raise UserError(f"{where}: {e}") from None
            else:
                text = row.get("prompt")
                if not isinstance(text, str):
                    raise UserError(f"{where}: prompt must be a string")
                ids = tokenizer.encode(text)
        if not ids:
            raise UserError(f"{where}: the prompt is empty (no token to start from)")
        if bad := [t for t in ids if not 0 <= t < vocab_size]:
            raise UserError(f"{where}: token id {bad[0]} is not in the model's vocabulary (0 to {vocab_size - 1})")
        out.append(Prompt(i, str(row.get("id", i)), text, ids, overrides, where, lora))
    return out


def _generate_loras(ns: argparse.Namespace) -> None:
    """--lora NAME=PATH (repeatable) -> ns.lora_modules; a bare --lora PATH (named after its folder) is also the
    adapter of every prompt that names none (ns.lora_default)."""
    from pathlib import Path

    items, ns.lora_default = [], None
    for item in ns.lora or []:
        if "=" not in item:
            if ns.lora_default is not None:
                raise UserError(f"--lora {item}: only one adapter can be every prompt's (a bare PATH); name the "
                                "others (--lora NAME=PATH) and pick them with a prompt row's lora field")
            ns.lora_default = Path(item).name or item
            item = f"{ns.lora_default}={item}"
        items.append(item)
    ns.lora_modules = parse_lora_modules(items, "--lora")


def _json_schema(path: str, tokenizer) -> dict:
    """--json-schema FILE: a JSON schema object, compiled once here so that a bad one is one line."""
    from paraseek.infer import structured

    structured.require()
    if tokenizer is None:
        raise UserError("--json-schema needs the model's tokenizer; this model has none")
    try:
        schema = json.loads(open(path, encoding="utf-8").read())
    except OSError as e:
        raise UserError(f"--json-schema {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--json-schema {path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(schema, (dict, bool)):
        raise UserError(f"--json-schema {path}: a JSON schema is an object")
    structured.Backend(tokenizer, tokenizer.vocab_size, []).compile({"type": "json_schema", "schema": schema})
    return schema


def cmd_generate(ns: argparse.Namespace) -> int:
    from paraseek.infer.load import resolve_source

    src = resolve_source(ns.model, random_weights=ns.random_weights, tokenizer=ns.tokenizer)
    device = device_for(ns)
    check_parallel(ns, src.args, device)
    batch_line = resolve_offline_defaults(ns, device)
    _generate_loras(ns)
    check_lora_modules(ns, src.args, "--lora")
    tokenizer = load_tokenizer(src)
    cfg = engine_config(ns)
    check_speculative(ns, src)
    defaults, why = generation_defaults(src)
    base = sampling_params(ns, defaults)
    given = [f"{k.replace('_', ' ')} {getattr(ns, k)}" for k in ("temperature", "top_p", "top_k") if getattr(ns, k) is not None]
    if given:  # the flags win over the folder's defaults: say what runs
        why = ("greedy" if base.greedy else ", ".join(given)) + " (flags)"
    prompts = read_prompts(ns, tokenizer, src.args.vocab_size)
    if ns.json_schema and ns.speculative:  # every prompt constrained: none would draft
        raise UserError("--speculative with --json-schema: a grammar-constrained output does not draft (its mask "
                        "follows each token it accepts); leave one of them out")
    schema = _json_schema(ns.json_schema, tokenizer) if ns.json_schema else None
    params = []
    max_len = cfg.context_length(src.args)
    for p in prompts:
        try:
            sp = dataclasses.replace(base, **p.overrides).validate()
        except (TypeError, UserError) as e:  # a row's own sampling field
            raise UserError(f"{p.where}: {e}") from None
        if ns.sampling_seed is not None and "seed" not in p.overrides:
            sp.seed = ns.sampling_seed + p.index
        if schema is not None:
            if sp.ignore_eos or sp.min_tokens:
                raise UserError(f"{p.where}: --json-schema ends each output where the JSON ends: leave out "
                                f"--ignore-eos and --min-tokens")
            sp.structured = {"type": "json_schema", "schema": schema,
                             "reasoning": bool(p.text and p.text.rstrip().endswith("<think>"))}
        if len(p.token_ids) + sp.max_tokens > max_len:
            raise UserError(f"{p.where} has {len(p.token_ids)} tokens; with {sp.max_tokens} new tokens that "
                            f"exceeds the context of {max_len} (--max-model-len, --max-new-tokens)")
        params.append(sp)
    world = replica_gpus(ns) * ns.dp
    if world > 1 and os.environ.get(WORKER_ENV) != "1":
        return relaunch(world, sys.argv[1:] if ns.argv is None else ns.argv)
    pl = place(ns, device)
    say = print if pl.rank == 0 else (lambda *a, **k: None)
    say(f"generate: {src.spec} ({src.kind}), tokenizer: {src.tokenizer_why}; sampling: {why}; "
        f"{len(prompts)} prompt{'s' if len(prompts) != 1 else ''}, tp {ns.tp}{f' ep {ns.ep}' if ns.ep > 1 else ''}"
        f"{' dp-attention' if ns.dp_attention else ''} x dp {ns.dp} on {device}\n{batch_line}",
        file=sys.stderr, flush=True)
    engine = build_engine(ns, src, pl, log=lambda *a, **k: say(*a, file=sys.stderr, **k))
    if pl.rank == 0:
        print(engine.report.line(), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if pl.driver or ns.dp_attention:  # dp-attention: every rank drives its own share of the prompts
        drivers, me = (pl.world, pl.rank) if ns.dp_attention else (ns.dp, pl.replica)
        mine = [p for p in prompts if p.index % drivers == me]
        reqs = engine.generate([p.token_ids for p in mine], [params[p.index] for p in mine],
                               progress=pl.rank == 0 and not ns.quiet, ids=[p.id + f"#{p.index}" for p in mine],
                               loras=[p.lora for p in mine])
        engine.shutdown()
        results = [_result(p, r, tokenizer, engine.drafter is not None) for p, r in zip(mine, reqs)]
    else:
        from paraseek.infer.engine import serve_worker

        serve_worker(engine.runner, pl.meta_group)
        results = []
    wall = time.perf_counter() - t0
    if pl.world > 1:
        import torch.distributed as dist

        gathered: list | None = [None] * pl.world if pl.rank == 0 else None
        dist.gather_object(results, gathered, dst=0, group=pl.world_gloo)
        if pl.rank != 0:
            return finish(0, pl)
        results = sorted((x for part in gathered if part for x in part), key=lambda x: x["index"])
    n_out = sum(r["completion_tokens"] for r in results)
    for r in results:
        if ns.json:
            print(json.dumps(r, ensure_ascii=False), flush=True)
        else:
            head = r["prompt"] if r["prompt"] is not None else f"<{r['prompt_tokens']} token ids>"
            print(f"--- {r['id']}: {head!r}\n{r['text'] if r['text'] is not None else r['token_ids']}\n", flush=True)
    print(f"generate: {len(results)} prompts, {n_out:,} new tokens in {wall:.2f} s ({n_out / wall:,.1f} tokens/s"
          f"{', replica 0' if ns.dp > 1 else ''}); preemptions {engine.scheduler.num_preemptions}", file=sys.stderr)
    if engine.drafter is not None:
        print(f"generate: {spec_line(engine.drafter.stats.summary())}{' (replica 0)' if ns.dp > 1 else ''}",
              file=sys.stderr)
    return finish(0, pl)


def spec_line(s: dict) -> str:
    """The accepted drafts of speculative decoding in one line (infer/spec.SpecStats.summary)."""
    plain = (f"; {s['plain_steps']:,} plain steps (more requests ran than --speculative-max-batch)"
             if s.get("plain_steps") else "")
    if not s["draft_tokens"]:
        return "speculative decoding: no drafts proposed" + plain
    per = ", ".join(f"{a:.0%}" if a is not None else "-" for a in s["accepted_per_position"])
    return (f"speculative decoding: {s['accepted_tokens']:,} of {s['draft_tokens']:,} drafts accepted "
            f"({s['accept_rate']:.1%}; by position {per}), {s['mean_accepted_length']:.2f} tokens per "
            f"verification step" + plain)


def _result(p: Prompt, r, tokenizer, speculative: bool = False) -> dict[str, Any]:
    if r.stream is not None:
        text = r.stream.text
    else:
        # Without stop strings "stop" is an end token, which has no text of its own (the engine's TextStream and the
        # server leave it out too); token_ids keep it.
        ids = r.output_ids[:-1] if r.finish_reason == "stop" else r.output_ids
        text = tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens) if tokenizer else None
    out = {"index": p.index, "id": p.id, "lora": p.lora, "prompt": p.text, "text": text, "token_ids": r.output_ids,
           "finish_reason": r.finish_reason, "prompt_tokens": r.num_prompt, "completion_tokens": r.num_output,
           "cached_prompt_tokens": r.num_cached_tokens, "preemptions": r.num_preemptions,
           "time_to_first_token_s": (r.first_token_time - r.arrival) if r.first_token_time else None,
           "latency_s": (r.finish_time - r.arrival) if r.finish_time else None}
    if speculative:
        out["draft_tokens"], out["accepted_draft_tokens"] = r.num_draft_tokens, r.num_accepted_tokens
    if r.params.logprobs is not None:
        out["logprobs"] = r.logprobs
        out["top_logprobs"] = [[[t, lp] for t, lp in row] for row in r.top_logprobs]
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="offline batch generation through the inference engine (paged KV cache, continuous batching)",
        description="Generate for every prompt with the engine `paraseek serve` runs: paged KV cache sized from free "
        "memory, continuous batching with chunked prefill, prefix caching, CUDA graphs for decode steps, tensor "
        "parallel (--tp) and replicas (--dp). Prints each prompt's text, or with --json one JSON object per prompt "
        "(text, token_ids, finish_reason, token counts, timing).")
    add_engine_arguments(p, offline=True)
    add_sampling_arguments(p)
    src = p.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts", metavar="FILE.jsonl", help="one object per line: prompt (text), prompt_token_ids, or "
                     "messages (a chat), plus optional id, lora (an adapter's name) and sampling fields (max_tokens, "
                     "temperature, ...)")
    src.add_argument("--chat", action="store_true", help="render --prompt texts as user messages with the model's "
                     "chat template")
    src.add_argument("--lora", action="append", metavar="NAME=PATH", help="a LoRA adapter (a PEFT folder, as `paraseek "
                     "export --export-adapter` writes) that --prompts rows run on with \"lora\": NAME (repeatable; "
                     "the others run on the base model); a bare PATH: the adapter of every prompt that names none")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_generate, argv=None)
