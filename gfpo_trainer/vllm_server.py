"""Generation through a vLLM server (server mode) with the length filter: one seeded, streamed request per
completion, and the streams of a group's completions closed once the filter is certain to drop them.

TRL's server mode sends the unique prompts of the global batch in one `/v1/completions` request with
`n=num_generations` from the main process (`VLLMClient.generate`), waits for every completion, and broadcasts them
to the other processes. For one generation call GFPO puts `ServerGroupGeneration.generate` in the place of that
method on the main process's client: each completion becomes its own `/v1/completions` request (`n=1`, its own
seed, the rest of TRL's sampling parameters unchanged), all of them in flight at once so the server batches them.
With the rule on they are streamed (one token delta per server step), and the rule reads the running lengths from
the streams. It returns what `VLLMClient.generate` returns (prompt_ids per prompt, then completion_ids, logprobs and
logprob_token_ids per completion, prompt-major), so TRL's code after it is unchanged.

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
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import threading

from .vllm_stop import VLLMSurfaceError, request_seeds

logger = logging.getLogger(__name__)

# the keyword arguments TRL's server path passes to VLLMClient.generate (trl 1.14 to 1.16), beside `prompts`
_SAMPLING_KEYS = ("n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs",
                  "structured_outputs_regex", "generation_kwargs")
# sockets kept free of the process's open-file limit for everything else it opens
_FD_MARGIN = 256
_RETRIES = 3  # a request that fails before any token arrives (connection refused, 500/502/503) is sent again
_RETRY_STATUS = (500, 502, 503)


class ServerError(RuntimeError):
    """The vLLM server answered a completion request with an error."""


def _aiohttp():
    try:
        import aiohttp
    except ImportError:  # vLLM itself requires aiohttp, so a client that has TRL's server mode has it
        raise ImportError("gfpo: generation through a vLLM server with the length filter needs aiohttp "
                          "(pip install aiohttp; vLLM installs it)") from None
    return aiohttp


def _run(coroutine_function):
    """Runs `coroutine_function()` to its end on an event loop of its own: this thread's, or, where this thread
    already runs one (a notebook), a new thread's."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine_function())
    result: dict = {}

    def target():
        try:
            result["value"] = asyncio.run(coroutine_function())
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
    sockets (the soft limit is raised up to the hard one where needed), else as many as it leaves (at least 1)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = wanted + _FD_MARGIN
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - _FD_MARGIN))


def _completions_url(base_url: str) -> str:
    return f"{base_url.rstrip('/')}/v1/completions"


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


def probe_streaming(base_url: str, model: str) -> str | None:
    """Sends one streamed 2-token completion to the server and checks that it streams what the early-stop rule
    reads (server-sent events, each choice's token ids and log-probabilities, a finish reason). Returns None if it
    does, else why not."""
    payload = {"model": model, "prompt": [0], "max_tokens": 2, "temperature": 1.0, "seed": 0, "logprobs": 0,
               "stream": True, "return_token_ids": True, "return_tokens_as_token_ids": True}

    async def probe():
        aiohttp = _aiohttp()
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(_completions_url(base_url), json=payload) as response:
                if response.status != 200:
                    return f"a streamed /v1/completions request was answered {response.status}: {await response.text()}"
                kind = response.headers.get("Content-Type", "")
                if not kind.startswith("text/event-stream"):
                    return f"/v1/completions does not stream (a streamed request was answered with {kind or 'no type'})"
                finished = done = False
                async for data in _events(response):
                    if data == "[DONE]":
                        done = True
                        break
                    for choice in json.loads(data).get("choices", []):
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
        return f"a streamed /v1/completions request failed: {type(error).__name__}: {error}"


async def _events(response):
    """The data fields of the server-sent events of `response`, one string each (events are separated by a blank
    line; a field can be longer than aiohttp's line limit, so the body is split here)."""
    buffer = b""
    async for piece in response.content.iter_any():
        buffer += piece.replace(b"\r", b"")  # events may end in CRLF; JSON escapes every CR of its own
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2 :]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode()


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

    After `generate`: `called`, and `stopped` (per completion, cut by the rule).
    """

    def __init__(self, base_url: str, model: str, *, group_size: int, k: int, base_seed: int | None, stop: bool):
        self.base_url, self.model = base_url, model
        self.group_size, self.k, self.base_seed, self.stop = group_size, k, base_seed, stop
        self.called = False
        self.stopped: list[bool] = []

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

    async def _send_all(self, payloads: list[dict]) -> list[dict]:
        aiohttp = _aiohttp()
        rows = len(payloads)
        self.stopped = [False] * rows
        self._tokens: list[list[int]] = [[] for _ in range(rows)]
        self._finished = [False] * rows
        groups = (rows + self.group_size - 1) // self.group_size
        self._finished_lengths: list[list[int]] = [[] for _ in range(groups)]
        outputs: list[dict | None] = [None] * rows
        in_flight = open_file_budget(rows)
        if in_flight < rows:
            logger.warning(f"gfpo: the open-file limit lets {in_flight} of {rows} vLLM server requests be in flight at "
                           "once (raise `ulimit -n` for a fuller server batch)")
        gate = asyncio.Semaphore(in_flight)
        # no overall deadline: a generation call lasts as long as its longest completion
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
        connector = aiohttp.TCPConnector(limit=in_flight)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            tasks = [asyncio.ensure_future(self._send(session, gate, row, payload, outputs))
                     for row, payload in enumerate(payloads)]
            self._tasks = tasks
            try:
                pending = set(tasks)
                while pending:  # the first request that fails ends the call (a cut one ends cancelled)
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                    for task in done:
                        if not task.cancelled() and task.exception() is not None:
                            raise task.exception()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        for row, output in enumerate(outputs):
            if output is None:  # cannot happen: a request is cut only once it holds L >= 1 tokens
                raise RuntimeError(f"gfpo: the vLLM server returned nothing for completion {row}")
        return outputs

    async def _send(self, session, gate, row: int, payload: dict, outputs: list) -> None:
        aiohttp = _aiohttp()
        async with gate:
            for attempt in range(_RETRIES + 1):
                try:
                    async with session.post(_completions_url(self.base_url), json=payload) as response:
                        try:
                            if response.status in _RETRY_STATUS and attempt < _RETRIES:
                                raise _Retry()
                            if response.status != 200:
                                raise ServerError(f"gfpo: the vLLM server answered {response.status} to a completion "
                                                  f"request: {await response.text()}")
                            if self.stop:
                                await self._read_stream(row, response, outputs)
                            else:
                                data = await response.json()
                                choice = (data.get("choices") or [None])[0]
                                _check_choice(choice, "completion")
                                outputs[row] = choice
                        finally:
                            # a cut request's connection is closed, not returned to the pool: the server sees the
                            # client leave and aborts the request
                            response.close()
                    return
                except (_Retry, aiohttp.ClientConnectorError):
                    if attempt == _RETRIES or self._tokens[row]:
                        raise
                    await asyncio.sleep(2**attempt)

    async def _read_stream(self, row: int, response, outputs: list) -> None:
        """Reads one completion's stream, gathering its tokens and log-probabilities into `outputs[row]`, until it
        finishes or the rule cuts it."""
        output = {"prompt_token_ids": None, "token_ids": self._tokens[row], "logprobs": None, "finish_reason": None}
        outputs[row] = output
        async for data in _events(response):
            if data == "[DONE]":
                break
            for choice in json.loads(data).get("choices", []):
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
                    self._finished_lengths[row // self.group_size].append(len(output["token_ids"]))
                    self._cut_dropped(row // self.group_size, current=row)
                    return
            if self._cut_dropped(row // self.group_size, current=row, only=row):
                return
        if output["finish_reason"] is None and not self.stopped[row]:
            raise ServerError(f"gfpo: the vLLM server's stream of completion {row} ended without a finish reason")

    def _cut_dropped(self, group: int, *, current: int, only: int | None = None) -> bool:
        """Cuts the running completions of `group` (or just `only`) that hold as many tokens as the k-th shortest
        finished completion of the group, or more; returns whether `current` was cut (its reader then returns,
        closing its stream; every other one is cancelled, which closes its stream)."""
        lengths = self._finished_lengths[group]
        if len(lengths) < self.k:
            return False
        limit = sorted(lengths)[self.k - 1]
        rows = [only] if only is not None else range(group * self.group_size, (group + 1) * self.group_size)
        cut_current = False
        for row in rows:
            if row >= len(self._tokens) or self._finished[row] or self.stopped[row]:
                continue
            if len(self._tokens[row]) >= limit:
                self.stopped[row] = True
                if row == current:
                    cut_current = True
                else:
                    self._tasks[row].cancel()
        return cut_current

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


class _Retry(Exception):
    """A response worth sending the request again for (the server was briefly unavailable)."""
