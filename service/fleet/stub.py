"""An instant vLLM stand-in speaking the same HTTP API (completions with token ids and
logprobs, routed experts, weight version, pause/resume, collective_rpc).

For measuring client overhead and for client paths vLLM on CPU cannot produce (routed
experts). Never used where a real server is the thing under test.

    python -m service.fleet.stub PORT ['{"max_model_len": 1048576, ...}']   # create_stub's arguments as JSON
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response


def create_stub(model: str = "stub", max_model_len: int = 32768, layers: int = 0,
                top_k: int = 0, tokens: int = 8, reload: str = "ok", root: str | None = None,
                refuse: tuple[int, ...] = (), script: list[list[int]] | None = None, turn_token: int | None = None,
                latency_s: float = 0.0) -> FastAPI:  # fmt: skip
    """layers/top_k > 0: return routed experts for prompt + output tokens, as vLLM GPU does.
    reload: "ok", "fail" (collective_rpc answers 500) or "stale" (version never changes).
    root: the model folder /v1/models names (vLLM: the path it loaded; default `model`).
    refuse: HTTP statuses the first completions are answered with, in turn. The last prompt
    received is kept in `app.state.stub["prompt"]`.
    script: the ids of an episode's answers (bench/rollouts.py --sampler stub), each ending
    its turn ("stop"): a prompt holding `turn_token` k times (a tool response's opening token)
    gets answer k, the last one past the end; each answer after `latency_s`."""
    app = FastAPI()
    state = {"version": "default", "paused": False, "calls": 0, "prompt": None}
    refusals = list(refuse)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": model, "root": model if root is None else root, "max_model_len": max_model_len}]}

    @app.get("/weight_info")
    async def weight_info() -> dict:
        return {"weight_version": state["version"]}

    @app.post("/update_weight_version")
    async def update(request: Request) -> dict:
        if reload != "stale":
            state["version"] = (await request.json())["new_version"]
        return {"success": True}

    @app.post("/pause")
    async def pause() -> dict:
        state["paused"] = True
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict:
        state["paused"] = False
        return {"status": "resumed"}

    @app.post("/collective_rpc")
    async def rpc(request: Request):
        body = await request.json()
        if reload == "fail":
            return JSONResponse({"error": "cannot load weights"}, status_code=500)
        return {"results": [body.get("kwargs", {}).get("weights_path")]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = orjson.loads(await request.body())  # a long prompt's ids: the json module took ms
        state["calls"] += 1
        if refusals:
            return JSONResponse({"error": "refused as asked"}, status_code=refusals.pop(0))
        prompt = state["prompt"] = body["prompt"]
        if latency_s:
            await asyncio.sleep(latency_s)
        if script:
            out, finish = script[min(prompt.count(turn_token), len(script) - 1)], "stop"
        else:
            n = min(tokens, body.get("max_tokens", tokens))
            out, finish = [(prompt[-1] + i + 1) % 1000 for i in range(n)] if prompt else list(range(n)), "length"
        n = len(out)
        choice = {"index": 0, "text": "", "token_ids": out, "finish_reason": finish,
                  "logprobs": {"token_logprobs": [-0.5] * n}, "routed_experts": None,
                  # vLLM echoes the prompt's ids with return_token_ids, and a client parses them
                  "prompt_token_ids": prompt if body.get("return_token_ids") else None}
        if layers and top_k:
            ids = (np.arange((len(prompt) + n) * layers * top_k) % 97).astype(np.int32)
            buf = io.BytesIO()
            np.save(buf, ids.reshape(len(prompt) + n, layers, top_k))
            choice["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
        answer = {"choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n}}
        return Response(orjson.dumps(answer), media_type="application/json")

    app.state.stub = state
    return app


@contextlib.contextmanager
def in_process(port: int, **kwargs) -> Iterator[str]:
    """The stub (create_stub's arguments) in a process of its own, whose CPU is not the
    caller's; its URL once it answers, until the block ends."""
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "service.fleet.stub", str(port), json.dumps(kwargs)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(f"{url}/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if proc.poll() is not None:
                    raise RuntimeError(f"the stub exited with {proc.returncode}") from None
                time.sleep(0.1)
        else:
            raise RuntimeError("the stub did not answer within 30 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(create_stub(**(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})), host="127.0.0.1",
                port=int(sys.argv[1]), log_level="warning", access_log=False)
