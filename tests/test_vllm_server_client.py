"""GFPO's vLLM server client (gfpo_trainer/vllm_server.py) against a fake server in this process: the bound on
requests in flight, the retries and their deadline, the read timeout, error events, and the headers, proxy and TLS
settings of TRL's client. No vLLM needed: the fake answers /v1/completions as vLLM 0.31's OpenAI server does (a
first event with the prompt's ids, one event per token with its log-probability, the finish reason with the last
token, `[DONE]`; `{"error": ...}` events and bodies), and /server_info as its dev mode does. The real server:
tests/test_vllm_server.py.

Every completion is a function of its request's seed (fake_completion), so what the client returns is checked
against what the fake was asked to send. Time limits are small, never asserted: the tests check what happens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the server client streams with aiohttp (gfpo's test extra)")
requests = pytest.importorskip("requests")
pytest.importorskip("trl")
from aiohttp import web  # noqa: E402

from gfpo_trainer import vllm_server  # noqa: E402
from gfpo_trainer.vllm_server import (  # noqa: E402
    ServerError, ServerGroupGeneration, ServerLimits, Transport, open_file_budget, probe_streaming
)
from gfpo_trainer.vllm_stop import request_seeds  # noqa: E402

DATA = Path(__file__).parent / "data"
PROMPTS = [[5, 6, 7], [8, 9]]
G, K, MAX_TOKENS = 4, 2, 12
SAMPLING = dict(n=G, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=MAX_TOKENS,
                logprobs=0, structured_outputs_regex=None, generation_kwargs={})


VLLM_BUSY = ("The engine is currently busy and cannot accept new requests. Please try again later or on a different "
             "instance.")  # vLLM 0.31's QueueOverflowError


def fake_completion(seed: int, max_tokens: int) -> tuple[list[int], list[float], str]:
    """What the fake server generates for a request: token ids, their log-probabilities, the finish reason."""
    length = 1 + seed % max_tokens
    ids = [10 + (seed + i) % 50 for i in range(length)]
    return ids, [-((seed + i) % 7) / 8 for i in range(length)], "stop" if length < max_tokens else "length"


def _choice(ids, logprobs, finish, prompt=None) -> dict:
    tokens = [f"token_id:{t}" for t in ids]
    return {"index": 0, "text": "", "token_ids": ids, "prompt_token_ids": prompt, "finish_reason": finish,
            "logprobs": {"tokens": tokens, "token_logprobs": logprobs,
                         "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, logprobs)],
                         "text_offset": [0] * len(ids)}}


def _event(data) -> bytes:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


class FakeVLLM:
    """A stand-in for vLLM's OpenAI server on 127.0.0.1, served by its own event loop on a thread.

    Knobs (set before a call), keyed by a request's seed (so a request left over from an earlier call changes
    nothing): `turn_away` {seed: answers} answers the request's tries with these first (an int status with vLLM's
    error body; "event 503", as vLLM turns a streamed request away: a 200 stream whose one event is that error;
    "drop" to close the connection unanswered; "drop mid-generation" to close it unanswered after `generation_s`,
    as a server or a link that fails while the request generates; "break off" to answer 200 and close the connection
    partway: half of an unstreamed answer's body, or a stream's first event, before any token); `stall_after` /
    `error_after` / `break_after` {seed: n} sends n tokens of the request and then nothing / an error event / closes
    the connection; `server_info`: what /server_info answers (None: 404, as without dev mode); `version`: the vLLM
    version /version answers, as vLLM's server does (None: 404; `version_headers` records the headers of its
    requests); `gather_until_open`:
    each request waits (up to 0.5 s) until this many are open.

    Records every /v1/completions request (`received`: its body, headers, Host) and the most requests open at once
    (`peak_open`): a request counts from its arrival until its answer ends or the server sees its connection
    closed (the client's close of a cut stream reaches the server before the next request does).
    """

    def __init__(self, ssl_context=None, port=0):
        self.ssl_context, self.port = ssl_context, port
        self.turn_away: dict[int, list] = {}
        self.stall_after: dict[int, int] = {}
        self.error_after: dict[int, int] = {}
        self.break_after: dict[int, int] = {}
        self.generation_s = 0.05
        self.server_info = None
        self.version, self.version_headers = "0.31.0", []
        self.received: list[SimpleNamespace] = []
        self.live: dict = {}  # the requests being answered, by id
        self.peak_open = 0
        self.gather_until_open = 0

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    def start(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    async def _start(self):
        self.release = asyncio.Event()  # ends the stalls when the server stops
        self.opened = asyncio.Condition()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/version", self._version)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=self.ssl_context)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def stop(self):
        async def stop():
            self.release.set()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    async def _version(self, request):
        self.version_headers.append(dict(request.headers))
        if self.version is None:
            return web.Response(status=404, text='{"detail":"Not Found"}')
        return web.json_response({"version": self.version})

    async def _server_info(self, request):
        if self.server_info is None:
            return web.Response(status=404, text='{"detail":"Not Found"}')
        return web.json_response(self.server_info)

    async def _completions(self, request):
        payload = await request.json()
        self.received.append(SimpleNamespace(payload=payload, headers=dict(request.headers),
                                             host=request.headers.get("Host")))
        answers = self.turn_away.get(payload.get("seed"))
        if answers:
            answer = answers.pop(0)
            if answer in ("drop", "drop mid-generation"):
                if answer == "drop mid-generation":
                    await asyncio.sleep(self.generation_s)
                request.transport.close()
                return web.Response(status=500)  # never sent: the connection is closed
            if answer == "break off":
                return await self._break_off(request, payload)
            if answer == "event 503":
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
                await response.prepare(request)
                await response.write(_event({"error": {"message": VLLM_BUSY, "type": "Service Unavailable",
                                                       "param": None, "code": 503}}))
                await response.write(_event("[DONE]"))
                return response
            headers = {"Retry-After": "0"} if answer == 429 else None
            return web.json_response({"error": {"message": "Request queue full", "type": "Service Unavailable",
                                                "param": None, "code": answer}}, status=answer, headers=headers)
        self.live[id(request)] = request
        self.peak_open = max(self.peak_open, self.open())
        try:
            async with self.opened:
                self.opened.notify_all()
                try:
                    await asyncio.wait_for(self.opened.wait_for(lambda: self.open() >= self.gather_until_open), 0.5)
                except asyncio.TimeoutError:
                    pass
            return await self._answer(request, payload)
        except ConnectionResetError:  # the client closed the stream (a cut): vLLM aborts the request
            return web.Response()
        finally:
            del self.live[id(request)]

    async def _break_off(self, request, payload):
        """A 200 answer whose connection closes partway: half the body of an unstreamed answer, the first event
        (the prompt's ids, no token) of a stream."""
        ids, logprobs, finish = fake_completion(payload["seed"], payload["max_tokens"])
        if payload.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await response.prepare(request)
            await response.write(_event({"id": "cmpl-1", "choices": [_choice([], [], None, payload["prompt"])]}))
        else:
            body = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": payload["model"],
                               "choices": [_choice(ids, logprobs, finish, payload["prompt"])]}).encode()
            response = web.StreamResponse(headers={"Content-Type": "application/json",
                                                   "Content-Length": str(len(body))})
            await response.prepare(request)
            await response.write(body[: len(body) // 2])
        await asyncio.sleep(0.01)
        request.transport.close()
        return response

    def open(self) -> int:
        return sum(1 for r in self.live.values() if r.transport is not None and not r.transport.is_closing())

    async def _answer(self, request, payload):
        seed = payload["seed"]
        ids, logprobs, finish = fake_completion(seed, payload["max_tokens"])
        if not payload.get("stream"):
            if seed in self.stall_after:
                await self.release.wait()
            return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": payload["model"],
                                      "choices": [_choice(ids, logprobs, finish, payload["prompt"])]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        await response.write(_event({"id": "cmpl-1", "choices": [_choice([], [], None, payload["prompt"])]}))
        per_event = payload.get("stream_interval") or 1  # as vLLM: the tokens of that many steps an event
        for i in range(0, len(ids), per_event):
            if self.stall_after.get(seed) == i:
                await self.release.wait()
            if self.break_after.get(seed) == i:
                await asyncio.sleep(0.01)
                request.transport.close()
                return response
            if self.error_after.get(seed) == i:
                await response.write(_event({"error": {"message": "Internal server error", "type":
                                                       "InternalServerError", "param": None, "code": 500}}))
                await response.write(_event("[DONE]"))
                return response
            last = i + per_event >= len(ids)
            await response.write(_event({"id": "cmpl-1", "choices": [
                _choice(ids[i : i + per_event], logprobs[i : i + per_event], finish if last else None)]}))
            await asyncio.sleep(0.002)  # one "server step" an event: a cut lands mid-stream
        await response.write(_event("[DONE]"))
        return response


@pytest.fixture
def server():
    fake = FakeVLLM().start()
    yield fake
    fake.stop()


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(vllm_server, "_BACKOFF_FIRST_S", 0.01)
    monkeypatch.setattr(vllm_server, "_BACKOFF_MAX_S", 0.02)


@pytest.fixture
def no_proxy_env(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


def _generation(server, *, stop=True, base_seed=3, limits=None, transport=None, url=None):
    return ServerGroupGeneration(url or server.url, "fake", group_size=G, k=K, base_seed=base_seed, stop=stop,
                                 limits=limits or ServerLimits(retry_deadline=5.0, read_timeout=30.0),
                                 transport=transport)


def _check(result, generation, base_seed=3):
    """Each completion is the fake's for its seed: whole where it finished, a prefix of at least the group's k-th
    finished length where the rule cut it; the filter keeps the same rows as without the rule."""
    rows = len(PROMPTS) * G
    seeds = request_seeds(base_seed, 0, rows, rows)
    assert result["prompt_ids"] == PROMPTS
    full = [fake_completion(int(seed), MAX_TOKENS) for seed in seeds]
    for row, (ids, logprobs, _) in enumerate(full):
        got = result["completion_ids"][row]
        if generation.stopped[row]:
            group = range(row // G * G, row // G * G + G)
            kth = sorted(len(full[j][0]) for j in group if not generation.stopped[j])[K - 1]
            assert kth <= len(got) < len(ids) and got == ids[: len(got)]
        else:
            assert got == ids
        assert result["logprobs"][row] == [[lp] for lp in logprobs[: len(got)]]
        assert result["logprob_token_ids"][row] == [[t] for t in got]
    return full


def _seed(row: int, base_seed: int = 3) -> int:
    rows = len(PROMPTS) * G
    return int(request_seeds(base_seed, 0, rows, rows)[row])


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- the bound on requests in flight


@pytest.mark.parametrize("stop", [True, False])
def test_bound_smaller_than_the_rows(server, stop):
    """max_in_flight=3 for 8 completions: the server never sees more than 3 open at once (it holds each request
    until 3 are open, so a looser client would show more), and every completion arrives as without a bound."""
    server.gather_until_open = 3
    generation = _generation(server, stop=stop, limits=ServerLimits(max_in_flight=3, read_timeout=30.0))
    result = generation.generate(PROMPTS, **SAMPLING)
    assert server.peak_open == 3 and len(server.received) == len(PROMPTS) * G
    assert (generation.in_flight_limit, generation.in_flight_source) == (3, "gfpo_vllm_server_max_in_flight")
    _check(result, generation)
    assert any(generation.stopped) == stop


def test_bound_from_the_servers_limit(server):
    """Without gfpo_vllm_server_max_in_flight: the server's max_num_queued_reqs from /server_info bounds the
    requests in flight; where /server_info is absent (404), every completion is sent at once."""
    server.server_info = {"vllm_config": {"scheduler_config": {"max_num_seqs": 256, "max_num_queued_reqs": 5}}}
    server.gather_until_open = 5
    generation = _generation(server)
    _check(generation.generate(PROMPTS, **SAMPLING), generation)
    assert (generation.in_flight_limit, generation.in_flight_source) == (5, "server max_num_queued_reqs")
    assert server.peak_open == 5

    server.server_info, server.peak_open, server.gather_until_open = None, 0, len(PROMPTS) * G
    generation = _generation(server)
    _check(generation.generate(PROMPTS, **SAMPLING), generation)
    assert (generation.in_flight_limit, generation.in_flight_source) == (len(PROMPTS) * G, "every completion")
    assert server.peak_open == len(PROMPTS) * G

    # a server without a cap (vLLM's default, max_num_queued_reqs None): every completion
    server.server_info = {"vllm_config": {"scheduler_config": {"max_num_seqs": 256, "max_num_queued_reqs": None}}}
    generation = _generation(server)
    generation.generate(PROMPTS, **SAMPLING)
    assert (generation.in_flight_limit, generation.in_flight_source) == (len(PROMPTS) * G, "every completion")


def test_open_file_budget_says_when_it_raises_the_limit(monkeypatch, caplog):
    import resource

    limits = {"now": (300, 10_000)}
    monkeypatch.setattr(vllm_server, "resource", SimpleNamespace(
        RLIMIT_NOFILE=resource.RLIMIT_NOFILE, RLIM_INFINITY=resource.RLIM_INFINITY,
        getrlimit=lambda kind: limits["now"], setrlimit=lambda kind, value: limits.update(now=value)))
    with caplog.at_level(logging.INFO, logger="gfpo_trainer.vllm_server"):
        assert open_file_budget(1000) == 1000
    assert limits["now"] == (1256, 10_000)
    assert any("raised this process's open-file limit (RLIMIT_NOFILE) from 300 to 1256" in r.getMessage()
               for r in caplog.records)
    limits["now"] = (300, 400)  # the hard limit leaves room for 144
    assert open_file_budget(1000) == 144


def test_probe_asks_a_busy_server_again(server, fast_retries):
    """The streaming probe (when the trainer is built) sends its request again while the server turns it away, as
    the generation's requests are, and reports the server's answer once the retry deadline passes."""
    server.turn_away = {0: [503, "event 503"]}  # the probe's seed
    assert probe_streaming(server.url, "fake", Transport(), ServerLimits(retry_deadline=5.0)) is None
    assert [r.payload["seed"] for r in server.received] == [0, 0, 0]
    server.turn_away = {0: [503] * 10_000}
    reason = probe_streaming(server.url, "fake", Transport(), ServerLimits(retry_deadline=0.2))
    assert reason.startswith("it turned a streamed /v1/completions request away ")
    assert reason.endswith("times within the retry deadline of 0.2 s, the last: answered 503: Service Unavailable "
                           "503: Request queue full")


def test_several_tokens_an_event(server):
    """generation_kwargs={"stream_interval": 3} reaches every request, and the server then sends three tokens an
    event (vLLM's stream_interval): the rule cuts a completion at the first event that takes it to L tokens or more,
    and every completion is still the fake's for its seed (a cut one a prefix of at least L tokens)."""
    generation = _generation(server)
    result = generation.generate(PROMPTS, **{**SAMPLING, "generation_kwargs": {"stream_interval": 3}})
    assert {received.payload["stream_interval"] for received in server.received} == {3}
    _check(result, generation)
    assert any(generation.stopped)


# --------------------------------------------------------------------------- retries


@pytest.mark.parametrize("answers", [[503], [503, 503, 503], [429], [504], [502], ["event 503"], ["drop"],
                                     ["break off"]])
def test_turned_away_then_served(server, fast_retries, caplog, answers):
    """A request turned away (503 as vLLM's queue limits answer, 429, 502, 504, a dropped connection, a stream
    broken off before its first token) is sent again until the server takes it: the same completions, one more
    request received per answer, a debug line each naming the server, the completion and the answer."""
    server.turn_away = {_seed(5): list(answers)}
    generation = _generation(server)
    with caplog.at_level(logging.DEBUG, logger="gfpo_trainer.vllm_server"):
        _check(generation.generate(PROMPTS, **SAMPLING), generation)
    assert len(server.received) == len(PROMPTS) * G + len(answers) and not server.turn_away[_seed(5)]
    retries = [r.getMessage() for r in caplog.records if "sending it again" in r.getMessage()]
    assert len(retries) == len(answers)
    expected = {"drop": "ServerDisconnectedError", "break off": "its answer broke off: ",
                "event 503": f"sent an error event: Service Unavailable 503: {VLLM_BUSY}"}.get(
        answers[0], f"answered {answers[0]}: Service Unavailable")
    assert all(line.startswith(f"gfpo: the vLLM server at {server.url} did not answer completion 5 (prompt 1, seed "
                               f"{_seed(5)}): ") and expected in line for line in retries)


@pytest.mark.parametrize("answers", [["drop mid-generation"], ["break off"], ["drop mid-generation", "break off"]])
def test_rule_off_a_generation_lost_before_its_answer_is_generated_again(server, fast_retries, caplog, answers):
    """With the rule off the requests are unstreamed and nothing of a completion is read before its whole answer:
    a connection that closes while the server generates (or while it sends the answer) is sent again, as a request
    turned away is, with the same body and seed, and the completion returned is the whole one the server generated
    again, never a part of the lost one."""
    server.turn_away = {_seed(5): list(answers)}
    generation = _generation(server, stop=False)
    with caplog.at_level(logging.DEBUG, logger="gfpo_trainer.vllm_server"):
        _check(generation.generate(PROMPTS, **SAMPLING), generation)
    assert not any(generation.stopped)
    sent = [received.payload for received in server.received if received.payload["seed"] == _seed(5)]
    assert len(sent) == len(answers) + 1 and all(payload == sent[0] for payload in sent)
    assert sent[0]["stream"] is False and not server.turn_away[_seed(5)]
    retries = [r.getMessage() for r in caplog.records if "sending it again" in r.getMessage()]
    expected = {"drop mid-generation": "ServerDisconnectedError", "break off": "its answer broke off: "}
    assert [expected[answer] in line for answer, line in zip(answers, retries)] == [True] * len(answers)
    assert all(line.startswith(f"gfpo: the vLLM server at {server.url} did not answer completion 5 (prompt 1, seed "
                               f"{_seed(5)}): ") for line in retries)


def test_rule_off_a_generation_lost_past_the_retry_deadline_fails(server, fast_retries):
    """The retry deadline counts from a request's first try: a generation that ran longer than it before its
    connection closed is not sent again, and the call fails in one line naming the completion and the loss."""
    server.turn_away, server.generation_s = {_seed(5): ["drop mid-generation"]}, 0.3
    with pytest.raises(ServerError) as error:
        _generation(server, stop=False, limits=ServerLimits(retry_deadline=0.2)).generate(PROMPTS, **SAMPLING)
    assert _one_line(error) == (f"gfpo: the vLLM server at {server.url} failed completion 5 (prompt 1, seed "
                                f"{_seed(5)}): sent 1 time without an answer within the retry deadline of 0.2 s "
                                "(gfpo_vllm_server_retry_deadline), the last: ServerDisconnectedError: Server "
                                "disconnected")
    assert [received.payload["seed"] for received in server.received].count(_seed(5)) == 1


def test_rule_on_a_stream_broken_after_a_token_fails_at_once(server, fast_retries):
    """With the rule on, a stream that breaks once a token has been read fails the call, naming the completion and
    the tokens read, and is not sent again (the rule may have acted on those tokens). Completion 0 (5 tokens) is
    among the 2 its group keeps, so the rule never cuts it first."""
    assert len(fake_completion(_seed(0), MAX_TOKENS)[0]) == 5
    server.break_after = {_seed(0): 2}
    with pytest.raises(ServerError) as error:
        _generation(server).generate(PROMPTS, **SAMPLING)
    message = _one_line(error)
    assert message.startswith(f"gfpo: the vLLM server at {server.url} failed completion 0 (prompt 0, seed "
                              f"{_seed(0)}): its ")
    assert re.search(r"\): its (answer broke off|stream broke) after 2 tokens: ", message), message
    assert [received.payload["seed"] for received in server.received].count(_seed(0)) == 1


def test_refused_connection_then_served(fast_retries, caplog, no_proxy_env):
    """Nothing listens on the port at first (connection refused): the requests are sent again until a server comes
    up there, and it serves them."""
    late = FakeVLLM(port=_free_port())
    generation = ServerGroupGeneration(late.url, "fake", group_size=G, k=K, base_seed=3, stop=True,
                                       limits=ServerLimits(retry_deadline=120.0))
    starter = threading.Timer(0.3, late.start)
    try:
        with caplog.at_level(logging.DEBUG, logger="gfpo_trainer.vllm_server"):
            starter.start()
            _check(generation.generate(PROMPTS, **SAMPLING), generation)
    finally:
        starter.join()
        late.stop()
    assert any("ClientConnectorError" in r.getMessage() and "sending it again" in r.getMessage()
               for r in caplog.records)


def test_turned_away_past_the_deadline_fails_in_one_line(server, fast_retries):
    """A server that keeps answering 503: the call fails once the request's retry deadline passes, in one line
    naming the server, the completion (row, prompt, seed), the deadline and the server's last answer."""
    server.turn_away = {_seed(6): [503] * 10_000}
    generation = _generation(server, limits=ServerLimits(retry_deadline=0.3))
    with pytest.raises(ServerError) as error:
        generation.generate(PROMPTS, **SAMPLING)
    message = _one_line(error)
    assert message.startswith(f"gfpo: the vLLM server at {server.url} failed completion 6 (prompt 1, seed "
                              f"{_seed(6)}): sent ")
    assert message.endswith("times without an answer within the retry deadline of 0.3 s "
                            "(gfpo_vllm_server_retry_deadline), the last: "
                            "answered 503: Service Unavailable 503: Request queue full")


def test_no_retry_with_a_zero_deadline_nor_for_other_errors(server, fast_retries):
    """retry_deadline=0 sends a request once; a 400 or 500 (not "not now") fails at once, naming the answer."""
    server.turn_away = {_seed(0): [503]}
    with pytest.raises(ServerError, match=r"completion 0 .* sent 1 time without an answer within the retry deadline of 0 s "
                                          r"\(gfpo_vllm_server_retry_deadline\), the last: answered 503"):
        _generation(server, limits=ServerLimits(retry_deadline=0)).generate(PROMPTS, **SAMPLING)
    for base_seed, status in ((4, 400), (5, 500)):
        server.turn_away = {_seed(1, base_seed): [status, status]}
        with pytest.raises(ServerError) as error:
            _generation(server, base_seed=base_seed).generate(PROMPTS, **SAMPLING)
        assert _one_line(error) == (f"gfpo: the vLLM server at {server.url} failed completion 1 (prompt 0, seed "
                                    f"{_seed(1, base_seed)}): answered {status}: Service Unavailable {status}: "
                                    "Request queue full")
        assert server.turn_away[_seed(1, base_seed)] == [status]  # sent once, never again


# --------------------------------------------------------------------------- timeouts and errors in a stream


def test_stream_that_stalls_fails_at_the_read_timeout(server):
    """One stream stops sending after its first event, before any token (so the rule cannot cut it), while the
    others finish: the call fails once the server has sent nothing for the read timeout, naming the server, the
    timeout and the silent completion."""
    server.stall_after = {_seed(5): 0}
    generation = _generation(server, limits=ServerLimits(read_timeout=0.5))
    with pytest.raises(ServerError) as error:
        generation.generate(PROMPTS, **SAMPLING)
    message = _one_line(error)
    assert message.startswith(f"gfpo: the vLLM server at {server.url} sent nothing for ")
    assert f"on any of 1 open completion requests (read timeout 0.5 s, gfpo_vllm_server_read_timeout), the " \
           f"longest open completion 5 (prompt 1, seed {_seed(5)})" in message


def test_unstreamed_answer_that_never_comes_fails_at_the_read_timeout(server):
    server.stall_after = {_seed(2): 0}
    with pytest.raises(ServerError, match=r"sent nothing for .* the longest open completion 2 \(prompt 0, seed"):
        _generation(server, stop=False, limits=ServerLimits(read_timeout=0.5)).generate(PROMPTS, **SAMPLING)


def test_error_event_mid_stream(server):
    """vLLM ends a stream whose generation failed with an `{"error": ...}` event: the call fails in one line naming
    the server, the completion, the tokens it had and the server's message (never a silent short completion)."""
    rows = len(PROMPTS) * G
    seeds = request_seeds(3, 0, rows, rows)
    row = next(r for r in range(rows) if len(fake_completion(int(seeds[r]), MAX_TOKENS)[0]) > 2)
    server.error_after = {int(seeds[row]): 2}
    with pytest.raises(ServerError) as error:
        _generation(server).generate(PROMPTS, **SAMPLING)
    assert _one_line(error) == (f"gfpo: the vLLM server at {server.url} failed completion {row} (prompt {row // G}, "
                                f"seed {int(seeds[row])}): it sent an error after 2 tokens: InternalServerError 500: "
                                "Internal server error")


def test_limits_checked():
    for bad, match in ((dict(max_in_flight=0), "gfpo_vllm_server_max_in_flight must be None .* got 0"),
                       (dict(max_in_flight=2.5), "gfpo_vllm_server_max_in_flight .* got 2.5"),
                       (dict(retry_deadline=-1), "gfpo_vllm_server_retry_deadline must be a finite number of "
                                                 "seconds >= 0, got -1"),
                       (dict(read_timeout=0), "gfpo_vllm_server_read_timeout must be a finite number of seconds > 0, "
                                              "got 0"),
                       (dict(read_timeout=float("inf")), "gfpo_vllm_server_read_timeout .* got inf")):
        with pytest.raises(ValueError, match=match):
            ServerLimits(**bad)


# --------------------------------------------------------------------------- TRL's client settings


def test_trl_client_headers_reach_every_request(server):
    """The headers of TRL's client session (one a user set, its auth, its User-Agent) reach the completion requests
    and /server_info; aiohttp's own body headers are not doubled."""
    session = requests.Session()
    session.headers["X-Cluster-Token"] = "abc"
    session.auth = ("user", "pass")
    transport = Transport.of_session(session, server.url)
    generation = _generation(server, transport=transport)
    generation.generate(PROMPTS, **SAMPLING)
    for received in server.received:
        assert received.headers["X-Cluster-Token"] == "abc"
        assert received.headers["Authorization"] == "Basic dXNlcjpwYXNz"  # user:pass
        assert received.headers["User-Agent"] == session.headers["User-Agent"]
        assert received.headers["Content-Type"] == "application/json"


def test_proxy_from_the_environment(server, monkeypatch, no_proxy_env):
    """HTTP_PROXY reaches the requests (the fake server stands as the proxy for a host that does not resolve) and
    the probe; NO_PROXY naming the host sends them straight."""
    monkeypatch.setenv("HTTP_PROXY", server.url)
    url = "http://vllm.gfpo-test.invalid:8000"
    generation = _generation(server, url=url, transport=Transport.default(url))
    _check(generation.generate(PROMPTS, **SAMPLING), generation)
    assert {received.host for received in server.received} == {"vllm.gfpo-test.invalid:8000"}
    assert probe_streaming(url, "fake") is None

    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    generation = _generation(server, transport=Transport.default(server.url))
    _check(generation.generate(PROMPTS, **SAMPLING), generation)


@pytest.fixture
def tls_server():
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(DATA / "fake_server.crt", DATA / "fake_server.key")
    fake = FakeVLLM(ssl_context=context).start()
    yield fake
    fake.stop()


def test_ca_bundle_from_the_environment(tls_server, monkeypatch, no_proxy_env, caplog):
    """An https server whose certificate only the bundle in REQUESTS_CA_BUNDLE (or CURL_CA_BUNDLE) signs: served
    with it; without it, one line naming the certificate failure, not retried; TRL's session with verify=False:
    served."""
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
        monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
        monkeypatch.setenv(name, str(DATA / "fake_server.crt"))
        generation = _generation(tls_server, transport=Transport.default(tls_server.url))
        _check(generation.generate(PROMPTS, **SAMPLING), generation)

    monkeypatch.delenv("CURL_CA_BUNDLE")
    with caplog.at_level(logging.DEBUG, logger="gfpo_trainer.vllm_server"), pytest.raises(ServerError) as error:
        _generation(tls_server, transport=Transport.default(tls_server.url)).generate(PROMPTS, **SAMPLING)
    message = _one_line(error)
    assert message.startswith(f"gfpo: the vLLM server at {tls_server.url} failed completion ")
    assert "ClientConnectorCertificateError" in message and "CERTIFICATE_VERIFY_FAILED" in message
    assert not any("sending it again" in r.getMessage() for r in caplog.records)

    session = requests.Session()
    session.verify = False
    generation = _generation(tls_server, transport=Transport.of_session(session, tls_server.url))
    _check(generation.generate(PROMPTS, **SAMPLING), generation)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --------------------------------------------------------------------------- the trainer's wiring


def _server_mode_trainer(server, session, **args):
    """A GFPOTrainer in server mode as far as its generation (_generate_single_turn on the server path) and the
    streaming probe of its construction read it, with TRL's client (base_url, model, its requests session) and
    GFPOConfig's fields."""
    import dataclasses
    from collections import defaultdict

    import torch

    from gfpo_trainer import GFPOConfig, GFPOTrainer
    from gfpo_trainer.batch import GenerationBatch

    client_fields = {f.name: f.default for f in dataclasses.fields(GFPOConfig) if f.name.startswith("gfpo_vllm_server")}
    assert set(client_fields) >= set(args)
    trainer = GFPOTrainer.__new__(GFPOTrainer)
    trainer.args = SimpleNamespace(**{**client_fields, **args}, gfpo_stop_dropped_generations=True,
                                   adaptive_difficulty=False, gfpo_vllm_request_seeds=True, num_remains_in_group=K,
                                   group_filter="length", loss_includes_rejected=False)
    trainer.accelerator = SimpleNamespace(is_main_process=True, num_processes=1, process_index=0,
                                          device=torch.device("cpu"))
    trainer.tools, trainer.use_vllm, trainer.use_transformers_continuous_batching = None, True, False
    trainer.vllm_mode, trainer.model = "server", SimpleNamespace(training=True)
    trainer.num_generations, trainer._server_stop_unavailable, trainer._gfpo_warned = G, None, set()
    trainer._gfpo_batch = GenerationBatch(filtering=True, skip_zero=False)
    trainer._metrics = {"train": defaultdict(list)}
    trainer.vllm_generation = SimpleNamespace(vllm_client=SimpleNamespace(base_url=server.url, model="fake",
                                                                          session=session))
    return trainer


def test_trainer_passes_its_limits_and_trls_session(server, monkeypatch):
    """The trainer's server path builds its requests from GFPOConfig's gfpo_vllm_server_* fields and TRL's client
    session: the bound reaches the server, and so does a header set on TRL's session."""
    from trl import GRPOTrainer

    import gfpo_trainer.trainer

    def trl_server_path(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        client = self.vllm_generation.vllm_client
        output = client.generate(prompts=prompt_ids[::num_generations], features=None, **SAMPLING)
        return output["completion_ids"]

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", trl_server_path)
    monkeypatch.setattr(gfpo_trainer.trainer, "generation_seed", lambda colocated, process_index: 3)
    session = requests.Session()
    session.headers["X-Cluster-Token"] = "abc"
    trainer = _server_mode_trainer(server, session, gfpo_vllm_server_max_in_flight=3)
    server.gather_until_open = 3
    prompt_ids = [prompt for prompt in PROMPTS for _ in range(G)]
    completions = trainer._generate_single_turn(prompt_ids, None, None, G, False)
    assert completions == [fake_completion(_seed(row), MAX_TOKENS)[0][: len(completions[row])]
                           for row in range(len(prompt_ids))]
    assert server.peak_open == 3 and len(server.received) == len(prompt_ids)
    assert all(received.headers["X-Cluster-Token"] == "abc" for received in server.received)
    assert trainer._gfpo_batch.stopped_rows.any()


def _stop_unavailable(trainer):
    """What GFPOTrainer.__init__ asks of the server path."""
    from gfpo_trainer.generation_paths import ServerPath

    return ServerPath.stop_unavailable(trainer.vllm_generation, trainer.accelerator, trainer.args,
                                       trainer._early_stop_configured())


def test_trainer_checks_its_limits_when_built(server):
    """A bad gfpo_vllm_server_* value fails when the trainer is built (in ServerPath.stop_unavailable), naming it; a
    good one lets the probe run with TRL's session."""
    session = requests.Session()
    trainer = _server_mode_trainer(server, session, gfpo_vllm_server_read_timeout=-5)
    with pytest.raises(ValueError,
                       match="gfpo_vllm_server_read_timeout must be a finite number of seconds > 0, got -5"):
        _stop_unavailable(trainer)
    session.headers["X-Cluster-Token"] = "abc"
    assert _stop_unavailable(_server_mode_trainer(server, session)) is None
    assert server.received[-1].headers["X-Cluster-Token"] == "abc"


def test_the_fast_decoder_decodes_as_json_does():
    """Where msgspec is installed (wherever vLLM is) the client decodes with it: the same values as json.loads on
    what vLLM sends, extreme floats and ints included."""
    import json as stdlib_json

    pytest.importorskip("msgspec")
    decode = vllm_server._json_decoder()
    assert decode is not stdlib_json.loads
    event = {"choices": [_choice([0, 2**31, 151935], [-0.0, -1e-45, -1.7976931348623157e308], None, [1, 2])],
             "id": "cmpl-1", "big": 2**70, "tiny": 5e-324, "text": "é\u2028\\n\""}
    for text in (stdlib_json.dumps(event), stdlib_json.dumps(event, ensure_ascii=False)):
        assert decode(text.encode()) == stdlib_json.loads(text)


@pytest.mark.parametrize("served, local, problem", [
    ("0.31.0", "0.31.0", None),
    ("0.22.1+cpu", "0.22.1", None),
    ("0.22.0", "0.22.0", "vllm 0.22.0 at {url} is untested: GFPO's vLLM paths ran on vllm 0.22.1 to 0.31.0"),
    ("0.22.1", "0.31.0", "the vLLM server at {url} runs vllm 0.22.1, this process has vllm 0.31.0: TRL's client "
                         "picks the server's endpoints by the installed vLLM's version"),
    ("0.21.0", "0.31.0", "ValueError: use_vllm=True, vllm_mode='server': the vLLM server at {url} runs vllm 0.21.0, "
                         "GFPOTrainer supports vllm 0.22.0 to 0.31.0 (trl 1.16.0's range): serve from a vLLM in "
                         "that range"),
    (None, "0.31.0", "the vLLM server at {url} did not say its vLLM version (HTTPError: 404 Client Error"),
])
def test_the_servers_vllm_version_is_checked(server, monkeypatch, served, local, problem):
    """Server mode checks the vLLM the server runs (its /version, asked with TRL's client session), not only the one
    installed here: outside TRL's range one error naming the server and both; untested, other than the installed
    one, or unreadable: one warning; in the range and the installed one: nothing."""
    import warnings

    import trl

    from gfpo_trainer import _compat
    from gfpo_trainer.generation_paths import check_server_version

    monkeypatch.setattr(trl, "__version__", "1.16.0")
    monkeypatch.setattr(_compat, "vllm_version", lambda: local)
    monkeypatch.setattr(_compat, "_warned_untested_vllm", set())
    server.version = served
    session = requests.Session()
    session.headers["X-Cluster-Token"] = "abc"
    generation = SimpleNamespace(vllm_client=SimpleNamespace(base_url=server.url, session=session))
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_server_version(generation, accelerator)
            raised = None
        except ValueError as error:
            raised = f"ValueError: {error}"
    messages = [str(w.message) for w in caught if str(w.message).startswith("gfpo: ")]
    assert server.version_headers[-1]["X-Cluster-Token"] == "abc"
    if problem is None:
        assert raised is None and messages == []
    elif problem.startswith("ValueError"):
        assert raised == problem.format(url=server.url) and messages == []
    else:
        assert raised is None and len(messages) == 1
        assert messages[0].startswith(f"gfpo: {problem.format(url=server.url)}")
