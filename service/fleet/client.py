"""Token-in/token-out client for a fleet of vLLM servers, and weight reloads across it.

Light module (no FastAPI, no Celery): the trainer imports it to publish weights.
Session affinity keeps an episode on one server while that server is healthy, so its
prefix cache serves hundreds of turns; new sessions go to the least-loaded healthy server.

A completion, sent every turn of every episode, goes through aiohttp with its body in orjson
and an episode's prompt as a Context, whose JSON text grows with it; the rare control calls
(probes, versions, reloads) through httpx. Against httpx with its json= on the same stand-in
server, a request cost the worker 1.2 ms of CPU at a 1k-token prompt and 17 ms at 131k, the
whole prompt encoded by the json module every turn (bench/inference.py, 2026-12-07).
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, Protocol

import aiohttp
import httpx
import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)
RETRY_STATUSES = {429, 500, 502, 503, 504}
_JSON = {"Content-Type": "application/json"}


class ProviderError(Exception):
    """The fleet could not answer after retries (episode status provider_error)."""


class NotVLLM(ProviderError):
    """Every endpoint answers, but none as a vLLM server of the model asked for (a wrong URL,
    another OpenAI-compatible server, another model): waiting will not help."""


class ContextExceeded(Exception):
    """The prompt plus max_tokens would not fit the server's context (context_exhausted)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int):
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len
        super().__init__(f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceeds "
                         f"the context of {max_model_len} tokens")


class Context(list):
    """An episode's prompt: token ids that only grow (append, extend, +=), with the JSON text of
    those already encoded kept beside them, so a request encodes each token once, not the
    whole prompt every turn (at 131k tokens that was 1 ms of orjson's CPU, 12 ms of json's, a
    turn). It is a list for every reader; whatever would change or remove a token already in it
    raises TypeError, so the text kept can never go stale."""

    __slots__ = ("_json", "_encoded")

    def __init__(self, ids=()):
        super().__init__(ids)
        self._json = bytearray()
        self._encoded = 0

    def _frozen(self, *args, **kwargs):
        raise TypeError("a Context only grows: start a new one for another prompt")

    __setitem__ = __delitem__ = __imul__ = insert = pop = remove = clear = sort = reverse = _frozen

    def json_items(self) -> bytearray:
        """The ids as JSON array items (`1,2,3`, no brackets), encoding only those added since."""
        if self._encoded < len(self):
            if self._encoded:
                self._json += b","
            self._json += orjson.dumps(self[self._encoded:])[1:-1]
            self._encoded = len(self)
        return self._json


def _prompt_json(token_ids: list[int]) -> list:
    """A prompt as JSON, in pieces for one join: a Context's kept text, else the whole list's."""
    if isinstance(token_ids, Context):
        return [b"[", token_ids.json_items(), b"]"]
    return [orjson.dumps(token_ids)]


def _env_proxy(url: str) -> tuple[str | None, aiohttp.BasicAuth | None]:
    """The proxy HTTP(S)_PROXY and NO_PROXY name for a server, as httpx's calls find it, read
    once per server when the client is made: aiohttp's trust_env reads the environment on
    every request (0.2 ms)."""
    from yarl import URL

    try:
        proxy, auth = aiohttp.helpers.get_env_proxy_for_url(URL(url))
    except LookupError:
        return None, None
    return str(proxy), auth


_ECHO = b'"prompt_token_ids":['


def _drop_prompt_echo(answer: bytes) -> bytes:
    """A completion's answer without the prompt's ids, which vLLM echoes with return_token_ids
    (the output's own ids come with it): parsing them back cost 6 ms at a 130k-token prompt,
    every turn. The cut is exact: these bytes can only be that key (inside a JSON string the
    quote before the colon would be escaped), and an array of ints holds no `]` before its end."""
    at = answer.find(_ECHO)
    if at < 0:
        return answer
    end = answer.find(b"]", at + len(_ECHO))
    return answer if end < 0 else answer[:at] + b'"prompt_token_ids":null' + answer[end + 1:]


class _Refused(Exception):
    """A server answered a completion with an HTTP error status."""

    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}")


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    """-1: no top-k cut."""
    max_tokens: int = Field(2048, ge=1)
    """Most tokens sampled per turn."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the model's end-of-turn token."""
    seed: int | None = None


@dataclass(slots=True)
class Generation:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    policy_version: int
    """Version served when the request started."""
    policy_version_end: int
    """Version served when it ended (differs when weights were reloaded mid-request)."""
    routed_experts: np.ndarray | None = None
    """[tokens, layers, top_k] uint8/uint16 for the prompt delta and the output, when served."""
    server: str = ""
    prompt_tokens: int = 0
    latency_s: float = 0.0


class InferenceClient(Protocol):
    async def generate(self, token_ids: list[int], sampling: SamplingParams, *,
                       session: str | None = None, keep_experts_from: int = 0) -> Generation:
        """Continue token_ids. Raises ContextExceeded or ProviderError."""
        ...


class FleetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["vllm"] = "vllm"
    endpoints: list[str] = Field(min_length=1)
    """Base URLs of vLLM servers, e.g. http://10.0.0.5:8000."""
    model: str | None = None
    """Served model name. None: whatever the first server lists."""
    request_timeout_s: float = Field(600.0, gt=0)
    max_retries: int = Field(6, ge=0)
    backoff_s: float = Field(0.5, gt=0)
    """First retry delay; doubles each try, with jitter, up to 30 s."""
    health_interval_s: float = Field(10.0, gt=0)
    probe_timeout_s: float = Field(5.0, gt=0)
    """How long a health probe may take before its server counts as down (a server busy on few
    cores answers slowly; a trainer that must reach it waits longer)."""
    version_poll_s: float = Field(1.0, gt=0)
    """How often the served policy version of every server is read (a trainer elsewhere reloads
    them); a new session reads its server's version before its first request too."""
    reload_method: str = "swerve_reload_weights"
    """collective_rpc method for reload(): our worker extension's (repacks MoE experts on CPU);
    "reload_weights" for servers started without it."""
    pause_mode: Literal["keep", "wait", "abort"] = "keep"
    """How in-flight requests ride through a reload (vLLM /pause mode)."""


@dataclass
class Endpoint:
    url: str
    healthy: bool = True
    inflight: int = 0
    version: int = 0
    max_model_len: int = 0
    model: str = ""
    failures: int = 0
    sessions: set[str] = field(default_factory=set)
    wrong: str | None = None
    """Set when the server answered, but not as the vLLM server asked for (why)."""
    error: str = ""
    """Why it was last marked unhealthy."""
    proxy: tuple = (None, None)
    """(proxy URL or None, its credentials) for completions and version reads (_env_proxy)."""


class VLLMClient:
    """Use `await VLLMClient(cfg).start()` (or `async with`)."""

    def __init__(self, cfg: FleetConfig):
        self.cfg = cfg
        self.endpoints = [Endpoint(url.rstrip("/"), proxy=_env_proxy(url)) for url in cfg.endpoints]
        self._affinity: OrderedDict[str, Endpoint] = OrderedDict()
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=5.0),
                                       limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self._completions: aiohttp.ClientSession | None = None
        """Completions and version reads; made on the running loop at the first (_call): an
        aiohttp session is bound to its loop."""
        self._health_task: asyncio.Task | None = None
        self._version_task: asyncio.Task | None = None

    async def __aenter__(self) -> VLLMClient:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> VLLMClient:
        await asyncio.gather(*(self._probe(ep) for ep in self.endpoints))
        if not any(ep.healthy for ep in self.endpoints):
            await self.close()  # the caller gets no client to close
            why = "; ".join(f"{e.url}: {e.wrong or e.error}" for e in self.endpoints)
            if all(ep.wrong for ep in self.endpoints):
                raise NotVLLM(f"no endpoint answers as a vLLM server of model {self.cfg.model or '(any)'}: {why}")
            raise ProviderError(f"no healthy inference server: {why}")
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        self._version_task = asyncio.get_running_loop().create_task(self._version_loop())
        return self

    async def close(self) -> None:
        for task in (self._health_task, self._version_task):
            if task is not None:
                task.cancel()
        await self._http.aclose()
        if self._completions is not None:
            await self._completions.close()

    def _call(self, ep: Endpoint, method: str, path: str, **kwargs):
        """A request to a server on the completions' session (made here on the running loop at
        the first call), through the proxy the environment named for it when the client was made."""
        if self._completions is None or self._completions.closed:
            timeout = self.cfg.request_timeout_s  # as httpx's: between two reads, and for a free connection
            self._completions = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=5.0, sock_read=timeout))
        return self._completions.request(method, f"{ep.url}{path}", proxy=ep.proxy[0], proxy_auth=ep.proxy[1],
                                         allow_redirects=False, **kwargs)  # as httpx: a redirect is an answer

    @property
    def version(self) -> int:
        healthy = [ep.version for ep in self.endpoints if ep.healthy]
        return min(healthy) if healthy else -1

    async def _probe(self, ep: Endpoint) -> None:
        try:
            timeout = self.cfg.probe_timeout_s
            models = (await self._http.get(f"{ep.url}/v1/models", timeout=timeout)).raise_for_status().json()
            info = await self._http.get(f"{ep.url}/weight_info", timeout=timeout)
        except (httpx.HTTPError, ValueError) as e:
            self._mark_down(ep, f"probe failed: {e}")
            return
        served = served_models(models)
        if isinstance(served, str):
            ep.wrong = f"/v1/models answered {served}: not a vLLM server (is the URL the server's base URL?)"
            self._mark_down(ep, ep.wrong)
            return
        match = next((m for m in served if self.cfg.model in (None, m["id"])), None)
        if match is None:
            ep.wrong = f"serves {[m['id'] for m in served]}, not {self.cfg.model}"
            self._mark_down(ep, ep.wrong)
            return
        try:
            version = _parse_version(info.json().get("weight_version")) if info.status_code == 200 else 0
        except (ValueError, AttributeError) as e:
            ep.wrong = f"/weight_info answered {info.text[:200]!r} ({e}): not swerve's vLLM server"
            self._mark_down(ep, ep.wrong)
            return
        ep.model, ep.max_model_len, ep.version = match["id"], int(match["max_model_len"]), version
        ep.healthy, ep.failures, ep.wrong = True, 0, None

    async def _version_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.version_poll_s)
            await self.refresh_versions()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            for ep in self.endpoints:
                if not ep.healthy:
                    await self._probe(ep)

    def _mark_down(self, ep: Endpoint, why: str) -> None:
        ep.error = why
        if ep.healthy:
            logger.warning("inference server %s marked unhealthy: %s", ep.url, why)
        ep.healthy = False
        for session in list(ep.sessions):
            self._affinity.pop(session, None)
        ep.sessions.clear()

    def _pick(self, session: str | None) -> Endpoint:
        if session is not None and (ep := self._affinity.get(session)) is not None and ep.healthy:
            return ep
        healthy = [ep for ep in self.endpoints if ep.healthy]
        if not healthy:
            raise ProviderError("no healthy inference server")
        ep = min(healthy, key=lambda e: (e.inflight, len(e.sessions)))
        if session is not None:
            self._affinity[session] = ep
            ep.sessions.add(session)
        return ep

    def end_session(self, session: str) -> None:
        """Forget an episode's server (call when the episode ends)."""
        if (ep := self._affinity.pop(session, None)) is not None:
            ep.sessions.discard(session)

    async def generate(self, token_ids: list[int], sampling: SamplingParams, *,
                       session: str | None = None, keep_experts_from: int = 0) -> Generation:
        delay = self.cfg.backoff_s
        last_error = ""
        for attempt in range(self.cfg.max_retries + 1):
            new_session = session is not None and session not in self._affinity
            try:
                ep = self._pick(session)
            except ProviderError as e:  # every server is down: one may come back within the retries
                last_error = last_error or str(e)
                if attempt < self.cfg.max_retries:
                    await asyncio.gather(*(self._probe(ep) for ep in self.endpoints if not ep.healthy))
                    await asyncio.sleep(min(30.0, delay) * (0.5 + random.random()))
                    delay *= 2
                continue
            if new_session:  # the version of an episode's first turn is read, not polled
                await self._check_version(ep)
            if ep.max_model_len and len(token_ids) + sampling.max_tokens > ep.max_model_len:
                raise ContextExceeded(len(token_ids), sampling.max_tokens, ep.max_model_len)
            try:
                return await self._complete(ep, token_ids, sampling, keep_experts_from)
            except _Refused as e:
                if e.status not in RETRY_STATUSES:
                    raise ProviderError(f"{ep.url} refused the request: {e.status} "
                                        f"{e.body[:500].decode(errors='replace')}") from e
                last_error = f"{ep.url}: HTTP {e.status}"
                ep.failures += 1
            except (aiohttp.ClientError, TimeoutError) as e:
                # A dropped connection is not yet a dead server (a pooled keep-alive connection
                # the server closed as it was reused, a restart): it is down if it does not answer
                # a probe now, and a request of its sessions moves on.
                last_error = f"{ep.url}: {type(e).__name__}: {e}"
                await self._probe(ep)
                if ep.healthy:
                    ep.failures += 1
                    logger.info("inference server %s dropped a request and answers a probe: retrying (%s)",
                                ep.url, last_error)
                    continue
                self._mark_down(ep, last_error)
            if attempt < self.cfg.max_retries:
                await asyncio.sleep(min(30.0, delay) * (0.5 + random.random()))
                delay *= 2
        raise ProviderError(f"no answer after {self.cfg.max_retries + 1} tries; last: {last_error}")

    async def _complete(self, ep: Endpoint, token_ids: list[int], sampling: SamplingParams,
                        keep_experts_from: int) -> Generation:  # fmt: skip
        body = {
            "model": ep.model, "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
            "include_stop_str_in_output": True, "spaces_between_special_tokens": False,
        }  # fmt: skip
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        # the prompt goes last, its text joined in without decoding it: {"model": ..., "prompt": [...]}
        data = b"".join([orjson.dumps(body)[:-1], b',"prompt":', *_prompt_json(token_ids), b"}"])
        version, started = ep.version, time.perf_counter()
        ep.inflight += 1
        try:
            async with self._call(ep, "POST", "/v1/completions", data=data, headers=_JSON) as response:
                answer = await response.read()
                if response.status >= 300:
                    raise _Refused(response.status, answer)
        finally:
            ep.inflight -= 1
        try:
            choice = orjson.loads(_drop_prompt_echo(answer))["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ProviderError(f"{ep.url} answered a completion with no choice in JSON ({type(e).__name__}: "
                                f"{e}): {answer[:200].decode(errors='replace')!r}") from e
        output_ids = list(choice["token_ids"])
        logprobs = list(choice["logprobs"]["token_logprobs"]) if choice.get("logprobs") else []
        if len(logprobs) != len(output_ids):
            raise ProviderError(f"{ep.url} returned {len(output_ids)} tokens but {len(logprobs)} logprobs")
        experts = decode_routed_experts(choice.get("routed_experts"))
        if experts is not None:
            experts = experts[keep_experts_from:]
        return Generation(output_ids=output_ids, output_logprobs=logprobs,
                          finish_reason=choice.get("finish_reason") or "stop", policy_version=version,
                          policy_version_end=ep.version, routed_experts=experts, server=ep.url,
                          prompt_tokens=len(token_ids), latency_s=time.perf_counter() - started)

    async def _check_version(self, ep: Endpoint) -> None:
        """Learn the version a server serves now (a trainer elsewhere may have reloaded it). On
        the completions' session: every episode asks at its first turn, and the poll every second."""
        try:
            async with self._call(ep, "GET", "/weight_info", timeout=aiohttp.ClientTimeout(total=5.0)) as info:
                status, text = info.status, await info.read()
        except (aiohttp.ClientError, TimeoutError):
            return  # the next request finds out whether the server is gone
        if status == 200:
            try:
                ep.version = _parse_version(orjson.loads(text).get("weight_version"))
            except (ValueError, AttributeError) as e:
                self._mark_down(ep, f"/weight_info answered {text[:200].decode(errors='replace')!r}: {e}")

    async def refresh_versions(self) -> int:
        """Ask every healthy server its version; return the oldest (what a new episode may get)."""
        await asyncio.gather(*(self._check_version(ep) for ep in self.endpoints if ep.healthy))
        return self.version

    async def reload(self, weights_dir: str, version: int) -> list[str]:
        """Make every healthy server serve `weights_dir` as `version`; return the servers that
        did. A server that fails is marked unhealthy (taken out), never left on old weights."""
        results = await asyncio.gather(*(self._reload_one(ep, weights_dir, version)
                                         for ep in self.endpoints if ep.healthy))
        return [url for url in results if url]

    async def _reload_one(self, ep: Endpoint, weights_dir: str, version: int) -> str | None:
        try:
            await self._post(ep, "/pause", params={"mode": self.cfg.pause_mode})
            try:
                await self._post(ep, "/collective_rpc", json={
                    "method": self.cfg.reload_method, "kwargs": {"weights_path": weights_dir}})
                await self._post(ep, "/update_weight_version", json={"new_version": str(version)})
            finally:
                await self._post(ep, "/resume")
            served = (await self._http.get(f"{ep.url}/weight_info", timeout=30)).raise_for_status().json()
        except httpx.HTTPError as e:
            self._mark_down(ep, f"reload to version {version} failed: {e}")
            return None
        if _parse_version(served.get("weight_version")) != version:
            self._mark_down(ep, f"reports version {served.get('weight_version')} after reload to {version}")
            return None
        ep.version = version
        logger.info("inference server %s now serves policy version %d", ep.url, version)
        return ep.url

    async def _post(self, ep: Endpoint, path: str, **kwargs) -> httpx.Response:
        response = await self._http.post(f"{ep.url}{path}", timeout=600, **kwargs)
        return response.raise_for_status()


def _parse_version(raw) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0  # a server that was never given a version serves the initial weights


def decode_routed_experts(raw) -> np.ndarray | None:
    """vLLM returns routed experts as base64 of an .npy array [tokens, layers, top_k]."""
    if raw is None:
        return None
    if isinstance(raw, str):
        arr = np.load(io.BytesIO(base64.b64decode(raw)), allow_pickle=False)
    else:
        arr = np.asarray(raw)
    if arr.ndim != 3:
        raise ProviderError(f"routed_experts must be [tokens, layers, top_k], got shape {arr.shape}")
    return arr.astype(np.uint8 if arr.size == 0 or arr.max() < 256 else np.uint16)


def served_models(answer) -> list[dict] | str:
    """The models a /v1/models answer lists (each with `id` and `max_model_len`, as vLLM
    lists them), or what is wrong with the answer."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return f"{str(answer)[:200]!r} (no list under `data`)"
    for m in data:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str) or not isinstance(m.get("max_model_len"), int):
            return f"a model without `id` and `max_model_len` ({str(m)[:200]!r})"
    return data


_TOKENIZER_LOAD = threading.Lock()


def load_tokenizer(path: str, wait_s: float | None = None):
    """The tokenizer and chat template of a model folder (the one the fleet serves), cached.
    Loaded one at a time: concurrent first loads of one folder (the episode viewer shades
    several turns at once after a restart) could fail, and a failure is not cached. With
    `wait_s`, TimeoutError when another load holds the turn that long. Only a local folder:
    a name that is not one is never looked up on a hub."""
    if not _TOKENIZER_LOAD.acquire(timeout=-1 if wait_s is None else wait_s):
        raise TimeoutError(f"another tokenizer is still loading; {path} was not loaded")
    try:
        return _load_tokenizer(path)
    finally:
        _TOKENIZER_LOAD.release()


_ENCODE_PROBE = ("<|im_start|>user\nfix `f(x) <= 1`: café, 数字, \t tabs  and  spaces\n<|im_end|>\n"
                 "<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"ls -la\"}}\n</tool_call>"
                 "<|endoftext|> \u00a0\r\n\x00")


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """`tokenizer.encode(text, add_special_tokens=False)` as a function, straight on the Rust
    tokenizer when the tokenizer is a fast one: the same ids without transformers' batch
    wrapping around each call (a third of the time of encoding a 750-character observation, in a
    probe on the tiny model's tokenizer). Checked once on a probe with special tokens, unicode
    and odd whitespace against the tokenizer's own encode; any difference (or truncation or padding set on the Rust tokenizer, which
    transformers' encode turns off), and the tokenizer's own encode is used."""
    def slow(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode") or getattr(backend, "truncation", None) is not None \
            or getattr(backend, "padding", None) is not None:
        return slow  # truncation or padding set in tokenizer.json: transformers turns them off per call

    def fast(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    try:
        same = fast(_ENCODE_PROBE) == slow(_ENCODE_PROBE) and fast("") == slow("")
    except Exception:  # noqa: BLE001 - a backend that cannot encode the probe: the tokenizer's own encode
        same = False
    return fast if same else slow


_DECODE_PROBES = ("Hello , world . It 's n't do not ? ! a  b", " \u00e9t\u00e9 \u6570\u5b57 \U0001f600 x",
                  "<|im_start|>assistant\n<think>\nok</think>\n<tool_call>{}</tool_call><|im_end|>\n")


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=False)` as a function, straight on the Rust
    tokenizer when the tokenizer is a fast one: transformers' decode first converts the ids
    through a generic walk of the list (a fifteenth of the agent loop's CPU at 11-turn episodes,
    2026-12-06). Checked once on probes (special tokens, spaces before punctuation that a
    tokenizer's clean-up would join, unicode, token by token so that partial characters are
    decoded too) against the tokenizer's own decode; any difference, and that one is used."""
    def slow(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return slow

    def fast(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=False)

    try:
        probes = [tokenizer.encode(text, add_special_tokens=False) for text in _DECODE_PROBES]
        probes += [ids[:k] for ids in probes for k in range(len(ids))] + [[]]
        same = all(fast(ids) == slow(ids) for ids in probes)
    except Exception:  # noqa: BLE001 - a backend that cannot decode the probes: the tokenizer's own decode
        same = False
    return fast if same else slow


@lru_cache(maxsize=8)
def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
