"""The OpenAI-compatible HTTP front end, end to end, with the official openai SDK.

Starts `duet up` (the sim engine) as a subprocess on a free loopback port, waits for /health,
and checks completions, chat, streaming, errors, malformed input, slow clients and
disconnects. The sim engine has no tokenizer: a prompt is one token per UTF-8 byte and
generated ids of 256 and above read as " <id>" (docs/http.md).
"""
import asyncio
import json
import math
import os
import pathlib
import re
import resource
import shutil
import signal
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DUET_BIN = os.environ.get("DUET_BIN", str(ROOT / "build" / "duet"))
MODEL = "duet-sim-test"
API_KEY = "sk-duet-test-0123456789"
MAX_CONTEXT = 2048


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def actors_toml(kv_blocks=4096):
    return f"""
[[nodes.actors]]
name = "router"
role = "router"

[[nodes.actors]]
name = "broker"
role = "broker"

[[nodes.actors]]
name = "prefill0"
role = "prefill"
kv_blocks = {kv_blocks}
max_batch = 64

[[nodes.actors]]
name = "decode0"
role = "decode"
kv_blocks = {kv_blocks}
max_batch = 256
"""


def head_toml(queue_limit=4096, time_scale=1.0):
    return f"""
[model]
name = "{MODEL}"
max_context = {MAX_CONTEXT}
block_tokens = 16

[engine]
kind = "sim"
time_scale = {time_scale}

[router]
queue_limit = {queue_limit}
request_timeout_ms = 60000
"""


class Server:
    """A `duet` subprocess serving HTTP on 127.0.0.1:port; always killed at the end."""

    def __init__(self, args, port, log_path, env=None):
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w+b")
        self.proc = subprocess.Popen([DUET_BIN, *args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def wait_listening(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"duet exited with {self.proc.returncode}:\n{self.output()}")
            try:
                return httpx.get(self.base + "/health", timeout=2.0)
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError(f"duet did not listen within {timeout} s:\n{self.output()}")

    def wait_healthy(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.wait_listening(timeout)
            if r.status_code == 200:
                return
            time.sleep(0.1)
        raise RuntimeError(f"/health did not turn 200 within {timeout} s:\n{self.output()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self.log.close()


def one_node_server(tmp, name, env=None, **head):
    """`duet up` of one node named `name` holding every actor, HTTP on a free port, started
    (the caller waits with `wait_healthy` and ends it with `stop`); `head` goes to head_toml,
    `env` to the process's environment."""
    port = free_port()
    config = tmp / f"{name}.toml"
    config.write_text(head_toml(**head) + f"""
[[nodes]]
name = "{name}"
endpoint = "inproc://duet-http-{name}-{port}"
http = "127.0.0.1:{port}"
""" + actors_toml())
    return Server(["up", "--config", str(config), "--api-key", API_KEY], port, tmp / "duet.log", env=env)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not os.path.exists(DUET_BIN):
        pytest.fail(f"no duet binary at {DUET_BIN} (set DUET_BIN)")
    s = one_node_server(tmp_path_factory.mktemp("duet-http"), "local")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def auth():
    return {"Authorization": f"Bearer {API_KEY}"}


def metrics(server):
    """The /metrics samples as {(name, frozenset(labels)): value}."""
    text = httpx.get(server.base + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$', line)
        assert m, f"malformed metrics line: {line!r}"
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric_values(samples, name):
    return {labels: v for (n, labels), v in samples.items() if n == name}


# ------------------------------------------------------------------ the happy paths

def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_returns_text_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert r.model == MODEL
    assert len(r.choices) == 1
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5  # one token per byte
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == 13


def test_completion_accepts_token_ids(client):
    r = client.completions.create(model=MODEL, prompt=[72, 105, 33], max_tokens=3)
    assert r.usage.prompt_tokens == 3
    assert r.usage.completion_tokens == 3


def test_completion_takes_max_new_tokens_the_field_notes_name(client):
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=0,
                                  extra_body={"max_new_tokens": 6})
    assert r.usage.completion_tokens == 6
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_body={"max_new_tokens": 5})
    assert e.value.body["param"] == "max_new_tokens"
    assert "disagree" in e.value.body["message"]


def test_every_documented_parameter_is_accepted(client):
    r = client.completions.create(model=MODEL, prompt="params", max_tokens=4, temperature=0.7, top_p=0.9,
                                  seed=7, presence_penalty=0.1, frequency_penalty=0.2, stop=["\n\n"], user="u",
                                  logprobs=2, extra_body={"top_k": 40, "min_p": 0.05, "ignore_eos": True,
                                                          "stop_token_ids": [2], "an_unknown_field": 1})
    assert r.usage.completion_tokens == 4
    assert r.choices[0].logprobs is None  # accepted; the engines do not report logprobs yet


def test_stop_string_across_token_boundaries_ends_the_text_before_it(client):
    full = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert len(text) > 12
    stop = text[6:11]  # spans the boundary between two generated tokens' text
    cut = client.completions.create(model=MODEL, prompt="stop test", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 12


def test_chat_completion_renders_messages_and_answers_as_assistant(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert isinstance(msg.content, str) and msg.content
    assert r.choices[0].finish_reason == "length"
    rendered = "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n"  # the plain fallback template
    assert r.usage.prompt_tokens == len(rendered.encode())
    assert r.usage.completion_tokens == 6


def test_chat_max_completion_tokens_and_reasoning_shape(client):
    messages = [{"role": "user", "content": "think"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3
    # The sim engine never writes <think>: no reasoning_content; the splitter is unit-tested in C++.
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    raw = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                         extra_body={"reasoning_format": "raw"})
    assert raw.choices[0].message.content == r.choices[0].message.content


# ------------------------------------------------------------------ streaming

def test_streaming_completion_arrives_incrementally_with_usage(client):
    baseline = client.completions.create(model=MODEL, prompt="stream me", max_tokens=40, temperature=0)
    chunks, times = [], []
    stream = client.completions.create(model=MODEL, prompt="stream me", max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        chunks.append(chunk)
        times.append(time.monotonic())
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(text_chunks) >= 3, "tokens should arrive over several chunks"
    assert times[-1] - times[0] > 0.02, "chunks should be spread over the generation"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == baseline.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == len("stream me")
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat_starts_with_the_role_and_matches_the_whole_answer(client):
    messages = [{"role": "user", "content": "count"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_a_token_whose_text_is_held_back_still_goes_out_as_an_empty_event(tmp_path):
    """The first token of these prompts is a UTF-8 lead byte (the sim engine's tokens follow
    from the prompt's last id and length, sim_engine::next_token; found by search): its text waits
    for the next token, but an event with empty text goes out when it comes, so a client's first
    chunk is the first token's (not one decode step later, or a whole decode queue at high load)."""
    # Decode steps of ~100 ms: the first and second tokens never share a bridge round.
    s = one_node_server(tmp_path, "slow", time_scale=20.0)
    try:
        s.wait_healthy()
        c = openai.OpenAI(base_url=s.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        prompt = [3091]  # first token 224 (0xE0, a lead byte), then 123622 (" <123622>")
        whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert whole.choices[0].text.startswith("\ufffd <123622>")  # the precondition: 0xE0 alone
        chunks = [ch for ch in c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True)
                  if ch.choices]
        assert chunks[0].choices[0].text == ""
        assert chunks[1].choices[0].text.startswith("\ufffd <123622>")
        assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
        # Chat: the rendered prompt of 973 characters of content ends with "\n" at position 997,
        # whose next token is 198 (0xC6, a lead byte).
        messages = [{"role": "user", "content": "a" * 973}]
        whole_chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        assert whole_chat.choices[0].message.content.startswith("\ufffd")
        chat = [ch for ch in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
                if ch.choices]
        assert chat[0].choices[0].delta.role == "assistant"  # the role chunk, at admission
        assert chat[1].choices[0].delta.content == ""  # the first token, its text held back
        assert chat[2].choices[0].delta.content.startswith("\ufffd")
        assert "".join(ch.choices[0].delta.content or "" for ch in chat) == whole_chat.choices[0].message.content
    finally:
        s.stop()


def test_curl_sees_raw_sse_data_lines_and_done(server):
    curl = shutil.which("curl")
    assert curl, "curl is needed (scripts/setup.sh installs it)"
    body = json.dumps({"model": MODEL, "prompt": "curl", "max_tokens": 5, "stream": True})
    out = subprocess.run([curl, "-sN", "--max-time", "30", "-H", "Content-Type: application/json",
                          "-H", f"Authorization: Bearer {API_KEY}", "-d", body, server.base + "/v1/completions"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.endswith("\n\n")
    events = out.split("\n\n")[:-1]
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert e.startswith("data: ") and "\n" not in e
        chunk = json.loads(e[len("data: "):])
        assert chunk["object"] == "text_completion"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_two_thousand_concurrent_streams_all_complete(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    n = 2000
    body = json.dumps({"model": MODEL, "prompt": "many", "max_tokens": 4, "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
               ).encode() + body

    async def one():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(request)
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), timeout=120)
            return data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in data
        finally:
            writer.close()

    async def run_all():
        return await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)

    results = asyncio.run(run_all())
    failures = [r for r in results if r is not True]
    assert not failures, f"{len(failures)} of {n} streams failed, e.g. {failures[:3]}"
    assert httpx.get(server.base + "/health").status_code == 200


# ------------------------------------------------------------------ errors

def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    assert e.value.body["param"] == "model"


def test_unknown_path_is_404_in_openai_shape(server):
    r = httpx.get(server.base + "/v1/nothing", headers=auth())
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_bad_parameters_are_400_naming_the_parameter(client):
    cases = [dict(temperature=5), dict(max_tokens=-1), dict(top_p=2), dict(presence_penalty=9),
             dict(extra_body={"top_k": -5})]
    for kwargs in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", **{"max_tokens": 2, **kwargs})
        assert e.value.body["type"] == "invalid_request_error"
        assert e.value.body["param"] in {"temperature", "max_tokens", "top_p", "presence_penalty", "top_k"}


def test_wrong_types_and_truncated_json_are_400(server):
    url = server.base + "/v1/completions"
    for body in ['{"model": "%s", "prompt": "x", "max_tokens": "ten"}' % MODEL,
                 '{"model": "%s", "prompt": 12}' % MODEL,
                 '{"model": "%s", "prompt": "x", "stream": "yes"}' % MODEL,
                 '{"model": "%s", "prompt": "x", "temperature": [1]}' % MODEL,
                 '{"model": "%s", "prompt": "x"' % MODEL,
                 '[1, 2, 3]', 'not json at all', '']:
        r = httpx.post(url, content=body, headers={**auth(), "Content-Type": "application/json"})
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_prompt_longer_than_the_context_is_400_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x" * (MAX_CONTEXT + 10), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x" * 100, max_tokens=MAX_CONTEXT)
    assert e.value.body["code"] == "context_length_exceeded"


def test_missing_or_wrong_api_key_is_401(server):
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
    r = httpx.post(server.base + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base + "/v1/models").status_code == 401
    assert httpx.get(server.base + "/health").status_code == 200  # health and metrics need no key
    assert httpx.get(server.base + "/metrics").status_code == 200


def test_body_over_the_limit_is_413(server):
    big = b'{"prompt":"' + b"x" * (5 << 20) + b'"}'
    r = httpx.post(server.base + "/v1/completions", content=big,
                   headers={**auth(), "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.base + "/health").status_code == 200


def test_wrong_method_is_405(server):
    r = httpx.get(server.base + "/v1/completions", headers=auth())
    assert r.status_code == 405
    assert "POST" in r.headers["allow"]


# ------------------------------------------------------------------ malformed input, slow clients

def raw_exchange(port, data, timeout=10.0):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)


def test_garbage_and_oversized_headers_get_4xx_or_a_close_and_the_server_keeps_serving(server):
    for data in [b"NOT HTTP AT ALL\r\n\r\n", b"\x00\x01\x02\xff" * 100 + b"\r\n\r\n",
                 b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{\"a"]:
        reply = raw_exchange(server.port, data)
        assert reply == b"" or re.match(rb"HTTP/1\.[01] 4\d\d", reply), reply[:80]
    assert httpx.get(server.base + "/health").status_code == 200


def test_slow_loris_connection_is_closed_while_others_are_served(server, client):
    closed_after = []

    def loris():
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            try:
                for _ in range(30):
                    s.sendall(b"X-Slow: 1\r\n")
                    time.sleep(1.0)
                    s.settimeout(0.01)
                    try:
                        if s.recv(1) == b"":
                            break
                    except socket.timeout:
                        pass
                    s.settimeout(30)
            except (BrokenPipeError, ConnectionResetError):
                pass
        closed_after.append(time.monotonic() - start)

    t = threading.Thread(target=loris)
    t.start()
    # Meanwhile the server answers everyone else.
    for _ in range(3):
        assert client.completions.create(model=MODEL, prompt="meanwhile", max_tokens=2).usage.completion_tokens == 2
        time.sleep(1)
    t.join(timeout=60)
    assert closed_after and closed_after[0] < 20, "the header timeout (10 s) should close a slow-loris connection"
    assert httpx.get(server.base + "/health").status_code == 200


def test_client_disconnect_mid_stream_cancels_end_to_end(server):
    body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 1500, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.base + "/v1/completions", json=body, headers=auth()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept alive: closing the generator would close the connection here
            seen = 0
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                if seen >= 5:
                    break
            # The request holds KV blocks while it decodes.
            deadline = time.monotonic() + 5
            held = 0
            while time.monotonic() < deadline and held == 0:
                held = sum(metric_values(metrics(server), "duet_kv_blocks_used").values())
                time.sleep(0.1)
            assert held > 0
            assert metric_values(metrics(server), "duet_http_requests_in_flight")[frozenset()] >= 1
        # Leaving both blocks closes the connection mid-stream.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = metrics(server)
        in_flight = metric_values(m, "duet_http_requests_in_flight")[frozenset()]
        upstream = metric_values(m, "duet_http_upstream_in_flight")[frozenset()]
        used = sum(metric_values(m, "duet_kv_blocks_used").values())
        if in_flight == 0 and upstream == 0 and used == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"after the disconnect: in flight {in_flight}, upstream {upstream}, KV blocks used {used}")
    counters = metric_values(m, "duet_actor_counter")
    cancels = [v for labels, v in counters.items() if ("counter", "cancels") in labels]
    assert cancels and max(cancels) >= 1, "the router should have received the cancel"
    cancelled = [v for labels, v in metric_values(m, "duet_http_requests_total").items()
                 if ("outcome", "cancelled") in labels]
    assert sum(cancelled) >= 1
    free = metric_values(m, "duet_kv_blocks_free")
    total = metric_values(m, "duet_kv_blocks_total")
    assert free == total


def test_metrics_expose_latency_histograms_and_actor_counters(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    m = metrics(server)
    assert metric_values(m, "duet_http_ttft_seconds_count")[frozenset()] >= 1
    assert metric_values(m, "duet_http_itl_seconds_count")[frozenset()] >= 1
    assert metric_values(m, "duet_cluster_ready")[frozenset()] == 1
    ok = [v for labels, v in metric_values(m, "duet_http_requests_total").items() if ("outcome", "ok") in labels]
    assert sum(ok) >= 1
    actors = {dict(labels)["actor"] for labels in metric_values(m, "duet_kv_blocks_total")}
    assert actors == {"local/prefill0", "local/decode0"}


# ------------------------------------------------------------------ other deployments

def test_http_flag_without_a_key_and_429_when_admission_refuses(tmp_path):
    port = free_port()
    config = tmp_path / "one-slot.toml"
    config.write_text(head_toml(queue_limit=1) + f"""
[[nodes]]
name = "solo"
endpoint = "inproc://duet-http-solo-{port}"
""" + actors_toml())
    s = Server(["up", "--config", str(config), "--http", f"127.0.0.1:{port}"], port, tmp_path / "duet.log",
               env={"DUET_API_KEY": ""})
    try:
        s.wait_healthy()
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="anything", max_retries=0)
        long_one = c.completions.create(model=MODEL, prompt="occupy", max_tokens=500, stream=True)
        next(iter(long_one))  # admitted and streaming: the one slot is taken
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt="second", max_tokens=1)
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["code"] == "rate_limit_exceeded"
        long_one.close()
    finally:
        s.stop()


def front_and_workers_toml(tmp_path, http=""):
    """Two nodes over ipc://: `front` (router, broker, and HTTP when `http` names host:port) and
    `workers` (prefill0, decode0)."""
    http_line = f'http = "{http}"\n' if http else ""
    return head_toml() + f"""
[[nodes]]
name = "front"
endpoint = "ipc://{tmp_path}/front.sock"
{http_line}
[[nodes.actors]]
name = "router"
role = "router"

[[nodes.actors]]
name = "broker"
role = "broker"

[[nodes]]
name = "workers"
endpoint = "ipc://{tmp_path}/workers.sock"

[[nodes.actors]]
name = "prefill0"
role = "prefill"

[[nodes.actors]]
name = "decode0"
role = "decode"
"""


def test_a_router_late_to_answer_counter_polls_is_slow_not_gone(tmp_path):
    """The front end polls the router's counters every 250 ms and waits 200 ms for them. A
    router busy past that (the end of a burst, on the H200) missed a poll, and until the next
    one every request got 503. Here half its replies arrive 1 s late: /health stays 200 and
    requests are served, since readiness lasts 3 s from the router's last answer."""
    s = one_node_server(tmp_path, "slowstats", env={"DUET_TRANSPORT_FAULT": "delay:stats_reply:1000ms:0.5"})
    try:
        s.wait_healthy()
        # The hook's delays reorder replies (a ZeroMQ connection does not): a reply from before
        # the workers were up may land up to 1 s after a newer one. Let those pass first.
        time.sleep(1.5)
        statuses = []
        for _ in range(60):  # 3 s: several polls with no answer in their wait
            statuses.append(httpx.get(s.base + "/health", timeout=5).status_code)
            time.sleep(0.05)
        assert statuses == [200] * 60, statuses
        c = openai.OpenAI(base_url=s.base + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
        assert c.completions.create(model=MODEL, prompt="late", max_tokens=4).usage.completion_tokens == 4
        assert "transport fault: delayed stats_reply" in s.output()
    finally:
        s.stop()


def test_node_without_workers_answers_503_and_health_503(tmp_path):
    port = free_port()
    config = tmp_path / "split.toml"
    config.write_text(front_and_workers_toml(tmp_path))
    # Only the router's node runs: no worker is alive.
    s = Server(["node", "--config", str(config), "--name", "front", "--http", f"127.0.0.1:{port}",
                "--api-key", API_KEY], port, tmp_path / "duet.log")
    try:
        r = s.wait_listening()
        time.sleep(0.6)
        r = httpx.get(s.base + "/health")
        assert r.status_code == 503
        c = openai.OpenAI(base_url=s.base + "/v1", api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert e.value.status_code == 503
        assert e.value.response.headers["retry-after"]
    finally:
        s.stop()


def test_workers_on_another_node_stream_through_the_front_nodes_http(tmp_path):
    """Router and HTTP on one process, prefill and decode on another (over ipc://): the decode
    worker's tokens reach the HTTP client through the front node, streamed or not."""
    port = free_port()
    config = tmp_path / "two-nodes.toml"
    config.write_text(front_and_workers_toml(tmp_path, http=f"127.0.0.1:{port}"))
    s = Server(["up", "--config", str(config), "--api-key", API_KEY], port, tmp_path / "duet.log")
    try:
        s.wait_healthy()
        c = openai.OpenAI(base_url=s.base + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
        whole = c.completions.create(model=MODEL, prompt="over there", max_tokens=12)
        assert whole.usage.completion_tokens == 12
        assert whole.choices[0].finish_reason == "length"
        chunks = list(c.completions.create(model=MODEL, prompt="over there", max_tokens=12, stream=True,
                                           stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 12
        # Tokens 2..12 come from the decode worker on the other node: more than one event.
        assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) > 1
    finally:
        s.stop()


def test_logprobs_from_the_embedded_model_match_the_answer_streamed_or_not(tmp_path):
    """`duet up` with no config: SmolLM2 on the CPU engine (scripts/fetch-model.sh), prefill and
    decode actors; the official SDK asks for log-probabilities in every shape it has."""
    port = free_port()
    s = Server(["up", "--http", f"127.0.0.1:{port}"], port, tmp_path / "duet.log", env={"DUET_API_KEY": ""})
    try:
        s.wait_healthy(timeout=60)
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="anything", max_retries=0, timeout=120)
        model = "smollm2-135m-instruct"
        ask = dict(model=model, messages=[{"role": "user", "content": "Say hello."}], max_completion_tokens=6,
                   temperature=0, logprobs=True, top_logprobs=3)
        r = c.chat.completions.create(**ask)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
        assert "".join(e.token for e in content) == r.choices[0].message.content
        for e in content:
            assert len(e.top_logprobs) == 3
            assert e.logprob <= 0 and math.isfinite(e.logprob)
            # greedy: the chosen token is the most likely one, with the same value
            assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
            assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        streamed = [e for chunk in c.chat.completions.create(**ask, stream=True)
                    for e in ((chunk.choices[0].logprobs.content or [])
                              if chunk.choices and chunk.choices[0].logprobs else [])]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
        k = c.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                                 logprobs=2)
        lp = k.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
        assert "".join(lp.tokens) == k.choices[0].text
        assert [b - a for a, b in zip(lp.text_offset, lp.text_offset[1:])] == [len(t) for t in lp.tokens[:3]]
        plain = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=2)
        assert plain.choices[0].logprobs is None
    finally:
        s.stop()
