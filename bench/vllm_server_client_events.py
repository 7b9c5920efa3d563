"""What GFPO's vLLM server client (gfpo_trainer/vllm_server.py, the early-stop rule on) costs per streamed event, and
whether its one asyncio loop keeps up: a fake server in another process streams `streams` completions of `tokens`
tokens, vLLM-shaped events (logprobs=0, return_token_ids), paced like a server that runs `rate` engine steps a
second and sends every running request its new tokens after each step; the client reads them as in a training step.

Per arm (decoder and event loop, streams, tokens per event), interleaved round by round:
- the client process's CPU time per event while streaming: (streaming CPU of the call) - (that of the same call
  with one event a stream), over the events in between: the per-event cost, free of the call's fixed cost
  (connections); TRL's parse of the log-probabilities after the streams end (parse_logprobs, which TRL's own client
  runs too) is reported apart, per token;
- the events a second one core reads at that cost;
- the lag: how long after the server's last event the client had read every stream. A client that keeps up lags
  about a step; one that cannot falls behind by the surplus of events, and cuts that much later than the rule could.
Each call starts after a full garbage collection with the process's objects frozen (gc.freeze): a full collection
traverses every object of the process (a trainer's millions), lands wherever allocations happen to trigger it, and
would otherwise add a random 0.1-0.5 s here to one call in a few; the client's own collections of what it allocates
are counted.
Clients: "stdlib" (json.loads, asyncio's loop), "msgspec" (msgspec's decoder, asyncio's loop) and "fast" (msgspec's
decoder, uvloop's loop: what the client uses where both are installed, as they are wherever vLLM is). `tokens per
event` > 1 is vLLM's `stream_interval` (a /v1/completions request field from vLLM 0.31, or the server's
`--stream-interval`): one event every that many tokens. The client sends it as generation_kwargs, and this server
honours it as vLLM does.

    python bench/vllm_server_client_events.py [--clients stdlib msgspec fast] [--streams 256 1024] [--tokens 128]
        [--per-event 1 4 16] [--rate 100] [--rounds 3] [--json OUT.json]

Needs aiohttp and TRL; the "fast" client msgspec and uvloop (scripts/test_vllm_cpu.sh's .venv-vllm has all four).
No vLLM engine, no GPU: the server is a stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

G = 16  # completions per prompt; the client runs with k = G, so the rule never cuts and every stream is read whole


def _event(tokens: int, first: bool, last: bool) -> bytes:
    """One event as vLLM 0.31 streams it for TRL's request (logprobs=0, return_token_ids, token ids as tokens)."""
    ids = [1234 + i for i in range(tokens)]
    names = [f"token_id:{t}" for t in ids]
    choice = {"index": 0, "text": "x" * tokens,
              "logprobs": {"text_offset": list(range(tokens)), "token_logprobs": [-0.53125] * tokens,
                           "tokens": names, "top_logprobs": [{name: -0.53125} for name in names]},
              "finish_reason": "length" if last else None, "stop_reason": None, "token_ids": ids,
              "prompt_token_ids": [11, 12, 13, 14] if first else None}
    data = {"id": "cmpl-5f3c2a9b8e7d4c1a9f0e6d3b2a1c0f9e-0", "object": "text_completion", "created": 1790000000,
            "model": "/models/Qwen2.5-7B-Instruct", "choices": [choice], "usage": None}
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def serve(port_queue, rate: float) -> None:
    """The fake server (a process of its own). POST: a stream of the request's max_tokens tokens, stream_interval
    tokens an event; every `1/rate` s (one engine step) each running stream gets its next tokens once it holds
    stream_interval new ones, as vLLM sends them. GET /last: when it wrote the last event of any stream."""

    async def main():
        events: dict[tuple, bytes] = {}
        running: list[list] = []  # [writer, tokens sent, max_tokens, per event]
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nConnection: close\r\n\r\n"
        last_write = [0.0]

        def event(tokens, first, last):
            key = (tokens, first, last)
            if key not in events:
                events[key] = _event(*key)
            return events[key]

        async def handle(reader, writer):
            header = await reader.readuntil(b"\r\n\r\n")
            if header.startswith(b"GET /last"):
                body = json.dumps({"last": last_write[0]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
                await writer.drain()
                writer.close()
                return
            length = next(int(line.split(b":")[1]) for line in header.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            payload = json.loads(await reader.readexactly(length))
            writer.write(head)
            running.append([writer, 0, payload["max_tokens"], payload.get("stream_interval") or 1])

        async def steps():
            next_at = time.monotonic()
            step = 0
            while True:
                step += 1
                for stream in list(running):
                    writer, sent, total, per_event = stream
                    if (step - 1) % per_event and sent + (step - 1) % per_event < total:
                        continue  # vLLM holds a stream's tokens until it has stream_interval new ones (or ends)
                    tokens = min(per_event, total - sent)
                    stream[1] = sent + tokens
                    writer.write(event(tokens, sent == 0, stream[1] == total))
                    if stream[1] == total:
                        writer.write(b"data: [DONE]\n\n")
                        writer.close()
                        running.remove(stream)
                        last_write[0] = time.monotonic()
                next_at += 1.0 / rate
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))

        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
        port_queue.put(server.sockets[0].getsockname()[1])
        await steps()

    asyncio.run(main())


def use_client(client: str) -> None:
    """The client's JSON decoder and event loop: json's and asyncio's ("stdlib"), msgspec's and asyncio's
    ("msgspec"), or msgspec's and uvloop's ("fast")."""
    import json as stdlib_json

    import msgspec
    import uvloop

    from gfpo_trainer import vllm_server

    decode = stdlib_json.loads if client == "stdlib" else msgspec.json.Decoder().decode
    vllm_server._decode, vllm_server._run_loop = decode, uvloop.run if client == "fast" else asyncio.run


def call(url: str, streams: int, tokens: int, per_event: int) -> dict:
    from gfpo_trainer.vllm_server import ServerGroupGeneration, ServerLimits, Transport

    class Timed(ServerGroupGeneration):
        def _result(self, outputs, n):  # the streams are read: what follows is TRL's parse
            self.streams_read = time.monotonic(), time.process_time()
            return super()._result(outputs, n)

    generation = Timed(url, "m", group_size=G, k=G, base_seed=0, stop=True,
                       limits=ServerLimits(max_in_flight=streams), transport=Transport())
    sampling = dict(n=G, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=tokens,
                    logprobs=0, structured_outputs_regex=None,
                    generation_kwargs={"stream_interval": per_event} if per_event > 1 else {})
    gc.collect()
    gc.freeze()
    try:
        start, start_cpu = time.monotonic(), time.process_time()
        result = generation.generate([[11, 12, 13, 14]] * (streams // G), **sampling)
        end_cpu = time.process_time()
    finally:
        gc.unfreeze()
    read_at, read_cpu = generation.streams_read
    with urllib.request.urlopen(f"{url}/last", timeout=30) as answer:
        last = json.loads(answer.read())["last"]
    received = sum(map(len, result["completion_ids"]))
    if received != streams * tokens:
        raise RuntimeError(f"received {received} tokens, not {streams} x {tokens}")
    return {"cpu_s": read_cpu - start_cpu, "parse_cpu_s": end_cpu - read_cpu, "wall_s": read_at - start,
            "lag_s": read_at - last, "events": streams * -(-tokens // per_event), "tokens": received}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", nargs="+", default=["stdlib", "msgspec", "fast"],
                        choices=["stdlib", "msgspec", "fast"])
    parser.add_argument("--streams", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--per-event", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rate", type=float, default=100.0, help="the server's engine steps a second")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    import trl.generation.vllm_client  # noqa: F401  (a trainer has imported it: no part of a call's cost)

    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    server = context.Process(target=serve, args=(ports, args.rate), daemon=True)
    server.start()
    try:
        url = f"http://127.0.0.1:{ports.get(timeout=60)}"
        call(url, G, 4, 1)  # warm-up: imports, the event loop's first use
        load_before = _load()
        rows: dict[tuple, list[dict]] = {}
        for round_index in range(args.rounds):
            for client in args.clients:
                use_client(client)
                for streams in args.streams:
                    for per_event in args.per_event:
                        short = call(url, streams, per_event, per_event)  # one event a stream: the fixed cost
                        full = call(url, streams, args.tokens, per_event)
                        full["cpu_us_per_event"] = ((full["cpu_s"] - short["cpu_s"])
                                                    / (full["events"] - short["events"]) * 1e6)
                        full["fixed_cpu_s"] = short["cpu_s"]
                        full["parse_us_per_token"] = full["parse_cpu_s"] / full["tokens"] * 1e6
                        rows.setdefault((client, streams, per_event), []).append(full)
                        print(f"round {round_index} {client} streams {streams} tokens/event {per_event}: streaming "
                              f"CPU {full['cpu_s']:.2f} s (one event a stream {short['cpu_s']:.2f} s), "
                              f"{full['cpu_us_per_event']:.1f} us/event, lag {full['lag_s'] * 1e3:.0f} ms, TRL's "
                              f"parse {full['parse_us_per_token']:.2f} us/token", flush=True)
        load_after = _load()
    finally:
        server.kill()
        server.join(30)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\nload average before / after: {load_before} / {load_after}; commit {commit}; {args.rate:g} engine "
          f"steps/s; {args.tokens} tokens a stream; medians over {args.rounds} rounds")
    print("| client | streams | tokens/event | events/s sent | streaming CPU, s | fixed CPU, s | CPU us/event "
          "| events/s one core reads | lag after the last event, ms | TRL's parse, us/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    for (client, streams, per_event), results in rows.items():
        median = {key: statistics.median(r[key] for r in results) for key in results[0]}
        print(f"| {client} | {streams} | {per_event} | {streams * args.rate / per_event:.0f} | {median['cpu_s']:.2f} | "
              f"{median['fixed_cpu_s']:.2f} | {median['cpu_us_per_event']:.1f} | "
              f"{1e6 / median['cpu_us_per_event']:.0f} | {median['lag_s'] * 1e3:.0f} | "
              f"{median['parse_us_per_token']:.2f} |")
        summary.append({"client": client, "streams": streams, "tokens_per_event": per_event, "rounds": results,
                        "median": median})
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": commit,
            "load_before": load_before, "load_after": load_after, "rate": args.rate, "tokens": args.tokens,
            "arms": summary}, indent=1))


if __name__ == "__main__":
    main()
