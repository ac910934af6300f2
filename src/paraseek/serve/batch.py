"""`paraseek serve MODEL --batch-file IN.jsonl --output OUT.jsonl`: OpenAI's batch format, run offline through the
same routes as the server (in process, no socket), as vLLM's `run_batch`.

Each input line: {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}. Each output line, in input order: {"id": "batch_req_...", "custom_id": ..., "response":
{"status_code": 200, "request_id": ..., "body": <the route's answer>}, "error": null}; a request the route refuses
keeps its status and OpenAI error body in `response`, and `error` says {code, message} too. The file is checked
whole before the model loads (one line naming the first bad row); requests run concurrently, at most --max-queue at
a time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid

from paraseek.errors import UserError, read_jsonl_objects

URLS = ("/v1/chat/completions", "/v1/completions")


def read_batch(path: str) -> list[dict]:
    rows, seen = [], set()
    for n, row in read_jsonl_objects(path, "an OpenAI batch request (custom_id, method, url, body)"):
        cid = row.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise UserError(f"{path}:{n}: custom_id must be a non-empty string")
        if cid in seen:
            raise UserError(f"{path}:{n}: custom_id {cid!r} appears twice")
        seen.add(cid)
        if row.get("method", "POST") != "POST":
            raise UserError(f"{path}:{n}: method must be POST")
        if row.get("url") not in URLS:
            raise UserError(f"{path}:{n}: url must be one of {', '.join(URLS)}, got {row.get('url')!r}")
        if not isinstance(row.get("body"), dict):
            raise UserError(f"{path}:{n}: body must be a JSON object")
        if row["body"].get("stream"):
            raise UserError(f"{path}:{n}: a batch request cannot stream")
        rows.append(row)
    if not rows:
        raise UserError(f"--batch-file {path}: no requests in the file")
    return rows


async def _run_rows(app, rows: list[dict], served_name: str, concurrency: int) -> list[dict]:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=app)

    async def one(client, row) -> dict:
        body = dict(row["body"])
        body.setdefault("model", served_name)
        async with limit:
            r = await client.post(row["url"], json=body)
        answer = r.json()
        out = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": row["custom_id"],
               "response": {"status_code": r.status_code, "request_id": answer.get("id"), "body": answer},
               "error": None}
        if r.status_code != 200:
            err = answer.get("error") or {}
            out["error"] = {"code": err.get("type"), "message": err.get("message")}
        return out

    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
        return list(await asyncio.gather(*(one(client, row) for row in rows)))


def run_batch(ns, state, engine, loop_cls, metrics=None) -> int:
    """Serve the file's rows through the app of `state` with `engine` (already built, on this thread) and write
    the answers."""
    from paraseek.serve.api import build_app

    rows = read_batch(ns.batch_file)
    loop = loop_cls(engine, metrics)
    state.loop = loop
    t = threading.Thread(target=loop.run, name="paraseek-engine", daemon=True)
    t.start()
    t0 = time.perf_counter()
    try:
        results = asyncio.run(_run_rows(build_app(state, ns.max_body_bytes), rows, state.served_name, ns.max_queue))
    finally:
        loop.stop()
        t.join(30)
    if loop.error is not None:
        raise RuntimeError(f"the engine stopped: {type(loop.error).__name__}: {loop.error}")
    with open(ns.output, "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    failed = sum(r["error"] is not None for r in results)
    print(f"serve: batch of {len(results)} requests ({len(results) - failed} ok, {failed} refused) in "
          f"{time.perf_counter() - t0:.1f} s -> {ns.output}", file=sys.stderr, flush=True)
    return 0
