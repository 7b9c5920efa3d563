"""Generation through a vLLM server (server mode) with the length filter: one seeded, streamed request per
completion, and the streams of a group's completions closed once the filter is certain to drop them.

TRL's server mode sends the unique prompts of the global batch in one `/v1/completions` request with
`n=num_generations` from the main process (`VLLMClient.generate`), waits for every completion, and broadcasts them
to the other processes. For one generation call GFPO puts `ServerGroupGeneration.generate` in the place of that
method on the main process's client (generation_paths.ServerPath): each completion becomes its own `/v1/completions`
request (`n=1`, its own seed, the rest of TRL's sampling parameters unchanged), all of them in flight at once so the
server batches them. With the rule on they are streamed (one token delta per server step), and the rule reads the
running lengths from the streams. It returns what `VLLMClient.generate` returns (prompt_ids per prompt, then
completion_ids, logprobs and logprob_token_ids per completion, prompt-major), so TRL's code after it is unchanged.

The rule (the same as on HF generate and in colocate mode): the length filter keeps the k completions of a group
with the fewest tokens, ties to the lower index. Once k completions of a group have finished, let L be the k-th
smallest of their lengths. A completion of that group still running with L tokens or more has not ended within L
tokens, so it will end longer than k finished completions: it is dropped whatever it goes on to say, and its stream
is closed. vLLM's server aborts a request whose client disconnects (its OpenAI endpoints are cancelled on
disconnect), so the server stops generating it at once; the completion comes back with the tokens and
log-probabilities received (L or more), marked stopped, and the length filter ranks a stopped completion one token
longer than it holds (selection.py), so it ranks below those k even under the tie rule. A completion waiting for a
slot, or holding fewer than L tokens, runs on. The main process sees every row of every group here, so a group that
straddles processes is stopped as any other.

Why not one request of `n=num_generations` per group: vLLM seeds choice i of a seeded n > 1 request with
`seed + i`, and a request is aborted whole (closing its stream, or the dev-mode `/abort_requests`, which takes the
request's id, not a choice's), so a group's choices could only be cut together, once every one still running had
reached L. One request per completion cuts each as soon as it reaches L, and gives each completion the seed the
colocate path gives it (`vllm_stop.request_seeds`), so both modes sample the same completions.

Why the kept completions do not change: each completion's tokens depend on its seed and its logits alone
(vllm_stop.py says why), and a streamed request samples exactly what the same request does unstreamed. With the
rule off the requests are sent unstreamed (a server that cannot stream serves them too), with the same seeds.

How the requests reach the server (ServerLimits, Transport): at most `max_in_flight` requests are open at once
(GFPOConfig.gfpo_vllm_server_max_in_flight; by default the server's own cap on requests in flight, vLLM's
`max_num_queued_reqs`, where /server_info reports one, else every completion of the call, which vLLM queues); a
request the server turns away before any token (503 when its queue limits are reached, as an answer or, to a
streamed request, as the one error event of its stream; 429, 502 and 504 from it or a gateway; a refused or dropped
connection, an answer broken off) is sent again after a growing, jittered pause until its retry deadline
(gfpo_vllm_server_retry_deadline), counted from its first try. "Before any token" means before the client has read
one: with the rule off the answer is read only once whole, so a connection that fails while the server generates is
sent again too, and the server (which aborts a request whose client left) generates that completion again from its
start, with the same seed; a completion is never returned in part. Once a token has been read (the rule on), a
broken stream fails the call: the rule may already have acted on it. The call fails when the server has sent nothing
on any open request for the read timeout (gfpo_vllm_server_read_timeout). Every failure is a ServerError of one line
naming the server, the completion (row, prompt, seed) and the reason. The requests carry the headers, proxy and TLS
settings TRL's client (a requests.Session) would use for the same URL, environment included (HTTP(S)_PROXY,
NO_PROXY, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import numbers
import random
import resource
import ssl
import threading
from dataclasses import dataclass, field

from .vllm_stop import VLLMSurfaceError, request_seeds

logger = logging.getLogger(__name__)

# the keyword arguments TRL's server path passes to VLLMClient.generate (trl 1.14 to 1.16), beside `prompts`
_SAMPLING_KEYS = ("n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs",
                  "structured_outputs_regex", "generation_kwargs")
# sockets kept free of the process's open-file limit for everything else it opens
_FD_MARGIN = 256
# answers that mean "not now": vLLM answers 503 when its queue limits are reached (max_num_queued_reqs,
# max_num_queued_tokens); 429, 502 and 504 come from rate limiters and gateways in front of it. Any other error
# (400 for a bad request, 500 for the server's own failure) fails at once: sending it again would fail again.
RETRY_STATUS = (429, 502, 503, 504)
# the pause before the n-th retry: uniform in [b/2, b] with b = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2**(n-1)),
# the jitter spreading the retries of many requests turned away together
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 8.0
_MESSAGE_CHARS = 300  # of a server's error message quoted in an error


def _json_decoder():
    """The decoder of the server's answers and events: msgspec's where installed (vLLM requires it, so a trainer in
    server mode has it), about 3x faster than json's on vLLM's events (docs/vllm.md); json's otherwise. Both decode
    JSON to the same values."""
    try:
        import msgspec
    except ImportError:
        return json.loads
    return msgspec.json.Decoder().decode


def _loop_runner():
    """What runs a call's event loop: uvloop's loop where installed (vLLM brings it, through fastapi[standard]),
    which reads the events for less CPU than asyncio's own (docs/vllm.md); asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return getattr(uvloop, "run", asyncio.run)


_decode = _json_decoder()
_run_loop = _loop_runner()


class ServerError(RuntimeError):
    """The vLLM server failed a completion request (an error answer or event, a dropped stream, the retry deadline
    or the read timeout passed)."""


def _aiohttp():
    try:
        import aiohttp
    except ImportError:  # vLLM itself requires aiohttp, so a client that has TRL's server mode has it
        raise ImportError("gfpo: generation through a vLLM server with the length filter needs aiohttp "
                          "(pip install aiohttp; vLLM installs it)") from None
    return aiohttp


@dataclass(frozen=True)
class ServerLimits:
    """What GFPO's client allows itself against the server (the GFPOConfig fields of the same names, prefixed
    `gfpo_vllm_server_`).

    Args:
        max_in_flight: requests open at once; None: the server's cap (vLLM's `max_num_queued_reqs`, from its
            /server_info) where it reports one, else every completion of the call.
        retry_deadline: seconds after its first try within which a request turned away (RETRY_STATUS, a refused or
            dropped connection, before any token) is tried again; 0: never.
        read_timeout: seconds the server may send nothing on every open request before the call fails.
    """

    max_in_flight: int | None = None
    retry_deadline: float = 300.0
    read_timeout: float = 600.0

    def __post_init__(self):
        bound = self.max_in_flight
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, numbers.Integral) or bound < 1):
            raise ValueError("gfpo_vllm_server_max_in_flight must be None (from the server's limits) or an int >= 1, "
                             f"got {bound!r}")
        if not (_seconds(self.retry_deadline) and self.retry_deadline >= 0):
            raise ValueError("gfpo_vllm_server_retry_deadline must be a finite number of seconds >= 0, got "
                             f"{self.retry_deadline!r}")
        if not (_seconds(self.read_timeout) and self.read_timeout > 0):
            raise ValueError("gfpo_vllm_server_read_timeout must be a finite number of seconds > 0, got "
                             f"{self.read_timeout!r}")

    @classmethod
    def from_config(cls, args) -> ServerLimits:
        """The limits a GFPOConfig sets (ValueError naming the field for a bad value)."""
        return cls(max_in_flight=args.gfpo_vllm_server_max_in_flight,
                   retry_deadline=args.gfpo_vllm_server_retry_deadline,
                   read_timeout=args.gfpo_vllm_server_read_timeout)


def _seconds(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Transport:
    """How requests reach the server: what TRL's client (a requests.Session) would send to the same URL.

    Args:
        headers: the session's headers and authentication (an Authorization header from `session.auth` or, with
            `trust_env`, ~/.netrc), less those aiohttp sets itself (body type and length, connection, encoding).
        proxy: the proxy URL the session would use (its `proxies`, else HTTP_PROXY / HTTPS_PROXY / ALL_PROXY unless
            NO_PROXY names the host), or None.
        ssl: for an https URL, the TLS context: the session's `verify` (REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE with
            `trust_env`; a bundle file or directory, or False for no verification) and client `cert`; True for
            aiohttp's default.
    """

    headers: dict = field(default_factory=dict)
    proxy: str | None = None
    ssl: object = True

    @classmethod
    def of_session(cls, session, url: str) -> Transport:
        """What `session` (TRL's client's) would send to `url`, read through requests' own merging of the session's
        settings with the environment's."""
        import requests

        prepared = session.prepare_request(requests.Request("POST", url, json={}))
        headers = {key: value for key, value in prepared.headers.items()
                   if key.lower() not in ("content-type", "content-length", "connection", "accept-encoding")}
        settings = session.merge_environment_settings(url, {}, None, None, None)
        proxy = requests.utils.select_proxy(url, settings["proxies"])
        context: object = True
        if url.lower().startswith("https://"):
            cert = settings["cert"]
            context = _ssl_context(settings["verify"], tuple(cert) if isinstance(cert, list) else cert)
        return cls(headers=headers, proxy=proxy, ssl=context)

    @classmethod
    def default(cls, url: str) -> Transport:
        """What a fresh requests.Session (as TRL's client starts) would use: the environment's settings."""
        import requests

        with requests.Session() as session:
            return cls.of_session(session, url)

    def request_options(self) -> dict:
        """The keyword arguments of an aiohttp request that carry these settings."""
        return {"headers": self.headers, "proxy": self.proxy, "ssl": self.ssl}


@functools.lru_cache(maxsize=8)
def _ssl_context(verify, cert):
    """requests' `verify` and `cert` as an ssl context (False: no verification). With verify=True, the system's
    store (and OpenSSL's SSL_CERT_FILE / SSL_CERT_DIR) and the certifi bundle requests trusts by default. Kept per
    setting: loading a CA bundle is costly, and a generation call would otherwise pay it every step."""
    import os

    from requests.utils import DEFAULT_CA_BUNDLE_PATH

    if verify is False:
        return False
    if verify is True or verify is None:
        context = ssl.create_default_context()
        context.load_verify_locations(cafile=DEFAULT_CA_BUNDLE_PATH)
    elif os.path.isdir(verify):
        context = ssl.create_default_context(capath=verify)
    else:
        context = ssl.create_default_context(cafile=verify)
    if cert:
        certfile, keyfile = (cert, None) if isinstance(cert, str) else cert
        context.load_cert_chain(certfile, keyfile)
    return context


def _run(coroutine_function):
    """Runs `coroutine_function()` to its end on an event loop of its own: this thread's, or, where this thread
    already runs one (a notebook), a new thread's."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_loop(coroutine_function())
    result: dict = {}

    def target():
        try:
            result["value"] = _run_loop(coroutine_function())
        except BaseException as error:  # re-raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=target, name="gfpo-vllm-server")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def open_file_budget(wanted: int) -> int:
    """How many requests may be in flight at once: `wanted`, if the open-file limit leaves room for that many
    sockets (the soft limit is raised up to the hard one where needed, with a log line saying so), else as many as
    it leaves (at least 1)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = wanted + _FD_MARGIN
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.info(f"gfpo: raised this process's open-file limit (RLIMIT_NOFILE) from {soft} to {target} for "
                        f"{wanted} vLLM server requests in flight")
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - _FD_MARGIN))


def _completions_url(base_url: str) -> str:
    return f"{base_url.rstrip('/')}/v1/completions"


def _one_line(text) -> str:
    """A server's message on one line, cut to _MESSAGE_CHARS."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = " ".join(str(text).split())
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def _error_message(body) -> str:
    """The message of an error answer or event (vLLM's `{"error": {"message", "type", "code"}}`, or a gateway's
    text)."""
    if isinstance(body, (bytes, str)):
        try:
            body = _decode(body)
        except ValueError:
            return _one_line(body) or "(no message)"
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        kind = " ".join(str(error[key]) for key in ("type", "code") if error.get(key) is not None)
        message = error.get("message", error.get("detail", error))
        return _one_line(f"{kind}: {message}" if kind else message)
    return _one_line(error)


def _check_choice(choice, what: str) -> None:
    """A choice (or a streamed delta of one) carries what GFPO reads: token ids, and per-token log-probabilities
    where requested."""
    if not isinstance(choice, dict) or not isinstance(choice.get("token_ids"), list):
        raise VLLMSurfaceError(f"the vLLM server's {what} carries no token_ids list (return_token_ids), which GFPO "
                               "reads")
    logprobs = choice.get("logprobs")
    if logprobs is not None:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            if len(logprobs.get(key) or ()) != len(choice["token_ids"]):
                raise VLLMSurfaceError(f"the vLLM server's {what} has logprobs.{key} of another length than its "
                                       "token_ids")


def server_vllm_version(base_url: str, session, timeout: float = 30.0) -> str:
    """The vLLM version the server at `base_url` runs: GET /version, which vLLM's OpenAI server (and so TRL's
    `trl vllm-serve`) answers with {"version": ...}, sent with `session` (TRL's client's requests.Session: its
    headers, proxy and TLS settings). Raises ValueError where the answer holds no version string; requests' errors
    (a refused connection, an error status) come through."""
    answer = session.get(f"{base_url.rstrip('/')}/version", timeout=timeout)
    answer.raise_for_status()
    body = answer.json()
    version = body.get("version") if isinstance(body, dict) else None
    if not isinstance(version, str):
        raise ValueError(f"/version answered {str(body)[:200]!r}, not a version")
    return version


def probe_streaming(base_url: str, model: str, transport: Transport | None = None,
                    limits: ServerLimits | None = None) -> str | None:
    """Sends one streamed 2-token completion to the server and checks that it streams what the early-stop rule
    reads (server-sent events, each choice's token ids and log-probabilities, a finish reason). Returns None if it
    does, else why not. `transport`: as the generation's requests go (default: the environment's settings);
    `limits`: a server that turns the probe away (busy) is asked again until the retry deadline, and the probe
    fails past the read timeout, as a generation's requests would."""
    payload = {"model": model, "prompt": [0], "max_tokens": 2, "temperature": 1.0, "seed": 0, "logprobs": 0,
               "stream": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
    transport = transport or Transport.default(base_url)
    limits = limits or ServerLimits()

    async def probe():
        aiohttp = _aiohttp()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.retry_deadline
        jitter = random.Random()
        tries = 0
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(60.0, limits.read_timeout),
                                        sock_read=limits.read_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                tries += 1
                try:
                    return await probe_once(session)
                except _TurnedAway as answer:
                    reason, retry_after = answer.reason, answer.retry_after
                except (aiohttp.ClientSSLError, aiohttp.ServerFingerprintMismatch):
                    raise
                except aiohttp.ClientConnectionError as error:
                    reason, retry_after = f"{type(error).__name__}: {_one_line(error)}", 0.0
                pause = _pause(tries, retry_after, jitter)
                if loop.time() + pause > deadline:
                    return (f"it turned a streamed /v1/completions request away {_times(tries)} within the retry "
                            f"deadline of {limits.retry_deadline:g} s, the last: {reason}")
                await asyncio.sleep(pause)

    async def probe_once(session):
        async with session.post(_completions_url(base_url), json=payload, **transport.request_options()) as response:
            if response.status in RETRY_STATUS:
                raise _TurnedAway(f"answered {response.status}: {_error_message(await response.read())}",
                                  _retry_after(response.headers.get("Retry-After")))
            if response.status != 200:
                return (f"a streamed /v1/completions request was answered {response.status}: "
                        f"{_error_message(await response.read())}")
            kind = response.headers.get("Content-Type", "")
            if not kind.startswith("text/event-stream"):
                return f"/v1/completions does not stream (a streamed request was answered with {kind or 'no type'})"
            finished = done = False
            async for data in _events(response):
                if data == b"[DONE]":
                    done = True
                    break
                event = _decode(data)
                if isinstance(event, dict) and "error" in event:
                    if _error_status(event) in RETRY_STATUS and not finished:
                        raise _TurnedAway(f"sent an error event: {_error_message(event)}", 0.0)
                    return f"its completion stream sent an error: {_error_message(event)}"
                for choice in event.get("choices", []):
                    try:
                        _check_choice(choice, "streamed completion")
                    except VLLMSurfaceError as error:
                        return str(error)
                    finished = finished or choice.get("finish_reason") is not None
            if not (finished and done):
                return "its completion stream ended without a finish reason and [DONE]"
        return None

    try:
        return _run(probe)
    except Exception as error:  # any failure to stream is a reason not to rely on streaming
        return f"a streamed /v1/completions request failed: {type(error).__name__}: {_one_line(error)}"


async def _events(response, heard=None):
    """The data fields of the server-sent events of `response`, as bytes, one each (events are separated by a blank
    line; a field can be longer than aiohttp's line limit, so the body is split here). `heard()` is called for every
    piece of the body received."""
    buffer = b""
    async for piece in response.content.iter_any():
        if heard is not None:
            heard()
        buffer += piece.replace(b"\r", b"")  # events may end in CRLF; JSON escapes every CR of its own
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2 :]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()


class ServerGroupGeneration:
    """One generation call of TRL's server path, run request by request (see the module docstring).

    Args:
        base_url: the server's base URL (TRL's `VLLMClient.base_url`).
        model: the served model's name (`VLLMClient.model`).
        group_size: completions per prompt (rows [g * group_size, (g + 1) * group_size) of the batch form group g).
        k: the completions the length filter keeps per group.
        base_seed: the completions' seeds are `vllm_stop.request_seeds(base_seed, 0, rows, rows)` for the `rows`
            completions asked for, as colocate mode seeds the same rows; None leaves sampling unseeded.
        stop: whether to stream the requests and close those the filter is certain to drop; False sends every
            request unstreamed and waits for its end.
        limits: requests in flight, retries, read timeout (ServerLimits).
        transport: headers, proxy and TLS of the requests (default: as a fresh requests.Session would send them).

    After `generate`: `called`, `stopped` (per completion, cut by the rule), `in_flight_limit` (the bound on
    requests open at once that the call used) and `in_flight_source` (where it came from:
    "gfpo_vllm_server_max_in_flight", "server max_num_queued_reqs", "every completion" or "open-file limit").
    """

    def __init__(self, base_url: str, model: str, *, group_size: int, k: int, base_seed: int | None, stop: bool,
                 limits: ServerLimits | None = None, transport: Transport | None = None):
        self.base_url, self.model = base_url, model
        self.group_size, self.k, self.base_seed, self.stop = group_size, k, base_seed, stop
        self.limits = limits or ServerLimits()
        self.transport = transport or Transport.default(base_url)
        self.called = False
        self.stopped: list[bool] = []
        self.in_flight_limit: int | None = None
        self.in_flight_source: str | None = None
        self._random = random.Random()  # the retries' jitter: no draw from the trainer's random streams

    def generate(self, prompts, features=None, **sampling):
        """Stands in for `VLLMClient.generate(prompts, features=None, n=..., ...)` as TRL's server path calls it, and
        returns what it returns."""
        if self.called:
            raise VLLMSurfaceError("TRL's vLLM server generation called VLLMClient.generate twice in one generation "
                                   "call")
        self.called = True
        unknown = sorted(set(sampling) - set(_SAMPLING_KEYS))
        if unknown:
            raise VLLMSurfaceError(f"TRL called VLLMClient.generate with {unknown}, which GFPO's server generation "
                                   "does not pass on")
        if features is not None:
            raise ValueError("gfpo: image prompts are not supported with the length filter on a vLLM server")
        n = sampling.pop("n", 1)
        if self.stop and n != self.group_size:  # the rule's groups are the n completions of a prompt
            raise VLLMSurfaceError(f"TRL's vLLM server generation asked for n={n} completions a prompt; "
                                   f"num_generations={self.group_size} was expected")
        prompts = [list(prompt) for prompt in prompts]
        if not all(isinstance(token, int) for prompt in prompts for token in prompt):
            raise VLLMSurfaceError("TRL's vLLM server generation no longer sends token ids")
        rows = len(prompts) * n
        seeds = None if self.base_seed is None else request_seeds(self.base_seed, 0, rows, rows)
        base = self._payload(sampling)
        payloads = []
        for row in range(rows):
            payload = {**base, "prompt": prompts[row // n]}
            if seeds is not None:
                payload["seed"] = int(seeds[row])
            payloads.append(payload)
        self._per_prompt = n
        outputs = _run(lambda: self._send_all(payloads))
        return self._result(outputs, n)

    def _payload(self, sampling: dict) -> dict:
        """The body of every request: TRL's sampling parameters (generation_kwargs over the named ones, as TRL's
        client merges them), one completion, token ids and log-probabilities as TRL's client asks for them."""
        sampling = dict(sampling)
        regex = sampling.pop("structured_outputs_regex", None)
        extra = sampling.pop("generation_kwargs", None) or {}
        if regex is not None:
            sampling["structured_outputs"] = {"regex": regex}
        for key in ("n", "seed", "stream", "prompt"):
            if key in extra:  # GFPOConfig refuses seed and n with the length filter; these are GFPO's to set
                raise ValueError(f"gfpo: generation_kwargs={{{key!r}: {extra[key]!r}}} is not supported with the "
                                 "length filter on a vLLM server (GFPO sends one request per completion)")
        return {**sampling, **extra, "model": self.model, "n": 1, "stream": self.stop, "return_token_ids": True,
                "return_tokens_as_token_ids": True}

    # ------------------------------------------------------------------ naming things in errors
    def _what(self, row: int) -> str:
        seed = self._payloads[row].get("seed")
        return (f"completion {row} (prompt {row // self._per_prompt}"
                f"{'' if seed is None else f', seed {seed}'})")

    def _fail(self, row: int, reason: str) -> ServerError:
        return ServerError(f"gfpo: the vLLM server at {self.base_url} failed {self._what(row)}: {reason}")

    # ------------------------------------------------------------------ the call
    async def _in_flight_bound(self, session, rows: int) -> tuple[int, str]:
        """The bound on requests open at once, and where it came from (see ServerLimits.max_in_flight)."""
        if self.limits.max_in_flight is not None:
            bound, source = min(rows, self.limits.max_in_flight), "gfpo_vllm_server_max_in_flight"
        else:
            cap = await self._server_queue_cap(session)
            bound, source = (min(rows, cap), "server max_num_queued_reqs") if cap else (rows, "every completion")
        budget = open_file_budget(bound)
        if budget < bound:
            logger.warning(f"gfpo: the open-file limit lets {budget} of {bound} vLLM server requests be in flight at "
                           "once (raise `ulimit -n` for a fuller server batch)")
            return budget, "open-file limit"
        return bound, source

    async def _server_queue_cap(self, session) -> int | None:
        """The server's cap on requests in flight: vLLM's `max_num_queued_reqs` (past it the server answers 503),
        read from /server_info (served in vLLM's dev mode, which TRL's weight sync needs); None where the server
        reports no cap or no configuration."""
        aiohttp = _aiohttp()
        url = f"{self.base_url.rstrip('/')}/server_info"
        try:
            async with session.get(url, params={"config_format": "json"}, **self.transport.request_options(),
                                   timeout=aiohttp.ClientTimeout(total=min(30.0, self.limits.read_timeout))) as answer:
                if answer.status != 200:
                    return None
                config = (await answer.json(content_type=None))["vllm_config"]
            cap = config["scheduler_config"].get("max_num_queued_reqs")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1 else None

    async def _send_all(self, payloads: list[dict]) -> list[dict]:
        aiohttp = _aiohttp()
        loop = asyncio.get_running_loop()
        rows = len(payloads)
        self._payloads = payloads
        self.stopped = [False] * rows
        self._tokens: list[list[int]] = [[] for _ in range(rows)]
        self._finished = [False] * rows
        groups = (rows + self.group_size - 1) // self.group_size
        self._finished_lengths: list[list[int]] = [[] for _ in range(groups)]
        self._cut_length: list[int | None] = [None] * groups  # L of each group, once k of its completions finished
        self._open: dict[int, float] = {}  # rows whose request is open: since when
        self._last_heard = loop.time()
        outputs: list[dict | None] = [None] * rows
        # no overall deadline (a call lasts as long as its longest completion): the read timeout bounds a silence
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(60.0, self.limits.read_timeout))
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            self.in_flight_limit, self.in_flight_source = await self._in_flight_bound(session, rows)
            gate = asyncio.Semaphore(self.in_flight_limit)
            tasks = [asyncio.ensure_future(self._send(session, gate, row, payload, outputs))
                     for row, payload in enumerate(payloads)]
            self._tasks = tasks
            check_every = min(1.0, self.limits.read_timeout / 4)
            try:
                pending = set(tasks)
                while pending:  # the first request that fails ends the call (a cut one ends cancelled)
                    done, pending = await asyncio.wait(pending, timeout=check_every,
                                                       return_when=asyncio.FIRST_EXCEPTION)
                    for task in done:
                        if not task.cancelled() and task.exception() is not None:
                            raise task.exception()
                    self._check_silence(loop.time())
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        for row, output in enumerate(outputs):
            if output is None:  # cannot happen: a request is cut only once it holds L >= 1 tokens
                raise RuntimeError(f"gfpo: the vLLM server returned nothing for completion {row}")
        return outputs

    def _heard(self) -> None:
        self._last_heard = asyncio.get_running_loop().time()

    def _check_silence(self, now: float) -> None:
        """Fails the call if the server has sent nothing on any open request for the read timeout."""
        silent = now - self._last_heard
        if self._open and silent > self.limits.read_timeout:
            first = min(self._open, key=self._open.get)
            raise ServerError(f"gfpo: the vLLM server at {self.base_url} sent nothing for {silent:.1f} s on any of "
                              f"{len(self._open)} open completion requests (read timeout {self.limits.read_timeout:g} "
                              f"s, gfpo_vllm_server_read_timeout), the longest open {self._what(first)}")

    async def _send(self, session, gate, row: int, payload: dict, outputs: list) -> None:
        """Sends one completion's request, again after a pause while the server turns it away (before any token),
        until its retry deadline."""
        aiohttp = _aiohttp()
        loop = asyncio.get_running_loop()
        async with gate:
            deadline = loop.time() + self.limits.retry_deadline
            tries = 0
            while True:
                tries += 1
                retry_after = 0.0
                try:
                    await self._send_once(session, row, payload, outputs)
                    return
                except _TurnedAway as answer:
                    reason, retry_after = answer.reason, answer.retry_after
                except (aiohttp.ClientSSLError, aiohttp.ServerFingerprintMismatch) as error:
                    raise self._fail(row, f"{type(error).__name__}: {_one_line(error)}") from None
                except aiohttp.ClientConnectionError as error:  # refused, reset, dropped, connect timeout
                    if self._tokens[row]:
                        raise self._fail(row, f"its stream broke after {len(self._tokens[row])} tokens: "
                                              f"{type(error).__name__}: {_one_line(error)}") from None
                    reason = f"{type(error).__name__}: {_one_line(error)}"
                except aiohttp.ClientPayloadError as error:  # the answer's body ended before it was whole
                    if self._tokens[row]:
                        raise self._fail(row, f"its answer broke off after {len(self._tokens[row])} tokens: "
                                              f"{_one_line(error)}") from None
                    reason = f"its answer broke off: {_one_line(error)}"
                except aiohttp.ClientError as error:
                    raise self._fail(row, f"{type(error).__name__}: {_one_line(error)}") from None
                pause = _pause(tries, retry_after, self._random)
                if loop.time() + pause > deadline:
                    raise self._fail(row, f"sent {_times(tries)} without an answer within the retry deadline of "
                                          f"{self.limits.retry_deadline:g} s (gfpo_vllm_server_retry_deadline), "
                                          f"the last: {reason}")
                logger.debug(f"gfpo: the vLLM server at {self.base_url} did not answer {self._what(row)}: {reason}; "
                             f"sending it again in {pause:.2f} s")
                await asyncio.sleep(pause)

    async def _send_once(self, session, row: int, payload: dict, outputs: list) -> None:
        """One try of a completion's request; _TurnedAway where the server answered RETRY_STATUS."""
        if not self._open:  # a silence counts from the moment something waits on the server
            self._heard()
        self._open[row] = asyncio.get_running_loop().time()
        try:
            async with session.post(_completions_url(self.base_url), json=payload,
                                    **self.transport.request_options()) as response:
                self._heard()
                try:
                    if response.status in RETRY_STATUS:
                        raise _TurnedAway(f"answered {response.status}: {_error_message(await response.read())}",
                                          _retry_after(response.headers.get("Retry-After")))
                    if response.status != 200:
                        raise self._fail(row, f"answered {response.status}: {_error_message(await response.read())}")
                    if self.stop:
                        await self._read_stream(row, response, outputs)
                    else:
                        body = await response.read()
                        self._heard()
                        data = self._parse(row, body)
                        choice = (data.get("choices") or [None])[0]
                        _check_choice(choice, "completion")
                        outputs[row] = choice
                finally:
                    # a cut request's connection is closed, not returned to the pool: the server sees the client
                    # leave and aborts the request
                    response.close()
        finally:
            self._open.pop(row, None)

    def _parse(self, row: int, data) -> dict:
        """An answer or event as JSON; an error one (vLLM's `{"error": ...}`) is a ServerError."""
        try:
            event = _decode(data)
        except ValueError:
            raise self._fail(row, f"it sent what is not JSON: {_one_line(data)}") from None
        if not isinstance(event, dict):
            raise self._fail(row, f"it sent what is not a JSON object: {_one_line(data)}")
        if "error" in event:
            if _error_status(event) in RETRY_STATUS and not self._tokens[row]:
                # vLLM turns a streamed request away in its stream: a 200 answer whose first event is the error
                raise _TurnedAway(f"sent an error event: {_error_message(event)}", 0.0)
            raise self._fail(row, f"it sent an error after {len(self._tokens[row])} tokens: {_error_message(event)}")
        return event

    async def _read_stream(self, row: int, response, outputs: list) -> None:
        """Reads one completion's stream, gathering its tokens and log-probabilities into `outputs[row]`, until it
        finishes or the rule cuts it."""
        output = {"prompt_token_ids": None, "token_ids": self._tokens[row], "logprobs": None, "finish_reason": None}
        outputs[row] = output
        group = row // self.group_size
        async for data in _events(response, self._heard):
            if data == b"[DONE]":
                break
            for choice in self._parse(row, data).get("choices", []):
                _check_choice(choice, "streamed completion")
                if choice.get("prompt_token_ids") is not None:
                    output["prompt_token_ids"] = choice["prompt_token_ids"]
                output["token_ids"].extend(choice["token_ids"])
                if choice.get("logprobs") is not None:
                    if output["logprobs"] is None:
                        output["logprobs"] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
                    for key in ("tokens", "token_logprobs", "top_logprobs"):
                        output["logprobs"][key].extend(choice["logprobs"][key])
                if choice.get("finish_reason") is not None:
                    output["finish_reason"] = choice["finish_reason"]
                    self._finished[row] = True
                    lengths = self._finished_lengths[group]
                    lengths.append(len(output["token_ids"]))
                    if len(lengths) >= self.k:
                        self._cut_length[group] = sorted(lengths)[self.k - 1]
                    self._cut_dropped(group, current=row)
                    return
            limit = self._cut_length[group]
            if limit is not None and len(output["token_ids"]) >= limit:
                self.stopped[row] = True  # this one is cut: returning closes its stream
                return
        if output["finish_reason"] is None and not self.stopped[row]:
            raise self._fail(row, f"its stream ended after {len(output['token_ids'])} tokens without a finish reason")

    def _cut_dropped(self, group: int, *, current: int) -> None:
        """Cuts the running completions of `group` other than `current` that hold as many tokens as the k-th
        shortest finished completion of the group, or more (each is cancelled, which closes its stream)."""
        limit = self._cut_length[group]
        if limit is None:
            return
        for row in range(group * self.group_size, min((group + 1) * self.group_size, len(self._tokens))):
            if row == current or self._finished[row] or self.stopped[row]:
                continue
            if len(self._tokens[row]) >= limit:
                self.stopped[row] = True
                self._tasks[row].cancel()

    def _result(self, outputs: list[dict], n: int) -> dict:
        """What VLLMClient.generate returns: prompt ids per prompt, then per completion (prompt-major) its token
        ids and TRL's parse of its log-probabilities."""
        from trl.generation.vllm_client import parse_logprobs

        prompt_ids = []
        for first in range(0, len(outputs), n):
            ids = outputs[first].get("prompt_token_ids")
            if not isinstance(ids, list):
                raise VLLMSurfaceError("the vLLM server's completion carries no prompt_token_ids (return_token_ids)")
            prompt_ids.append(ids)
        logprobs, logprob_token_ids = parse_logprobs([output["logprobs"] for output in outputs])
        return {"prompt_ids": prompt_ids, "completion_ids": [list(output["token_ids"]) for output in outputs],
                "logprobs": logprobs, "logprob_token_ids": logprob_token_ids}


def _pause(tries: int, retry_after: float, jitter: random.Random) -> float:
    """The pause before sending a request again after `tries` tries: doubling from _BACKOFF_FIRST_S up to
    _BACKOFF_MAX_S, drawn from its upper half, or the server's Retry-After where longer."""
    base = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (tries - 1))
    return max(retry_after, base * (0.5 + 0.5 * jitter.random()))


def _times(count: int) -> str:
    return f"{count} time{'' if count == 1 else 's'}"


def _error_status(event: dict):
    """The HTTP status an error answer or event carries (vLLM's `error.code`), or None."""
    error = event.get("error")
    return error.get("code") if isinstance(error, dict) else None


def _retry_after(value: str | None) -> float:
    """A Retry-After header's pause in seconds (0 where absent or given as a date)."""
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0


class _TurnedAway(Exception):
    """The server answered RETRY_STATUS: worth sending the request again after a pause."""

    def __init__(self, reason: str, retry_after: float):
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after
