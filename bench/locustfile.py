"""Open-loop trace replay against duet's OpenAI-compatible HTTP API, with locust.

A cross-check of `duet bench serve` by a tool the user already trusts: the same trace, the
same requests (same prompt token ids, max_tokens, ignore_eos, streaming with usage), timed
the same way, reported both in locust's own statistics table and as a JSON file whose
percentiles are computed like runtime/latency_stats.hpp computes them.

    DUET_TRACE=/path/trace.csv DUET_LOCUST_OUT=/tmp/locust.json \
      locust -f bench/locustfile.py --headless --host http://127.0.0.1:8080 -u 256 -r 256

The run stops by itself (runner.quit()) once every request of the trace has finished. Each
locust user is one client slot: it takes the next request of the shared schedule, sleeps
until that request's arrival time (relative to the moment the first request is taken) and
sends it. -u therefore bounds the number of requests in flight: when a request is due while
every user is still busy, it goes out late and the run is no longer open-loop. That is
logged as a warning and counted in the JSON ("late"); raise -u (and -r, so users are all
spawned before the first burst) until it stays 0.

Environment variables:
  DUET_TRACE            trace file (required): Azure LLM inference CSV (TIMESTAMP,
                        ContextTokens, GeneratedTokens) or Mooncake JSONL ({"timestamp": ms,
                        "input_length", "output_length"}), by extension (.csv / .jsonl, .json)
  DUET_START            skip the trace's first seconds (default 0)
  DUET_DURATION         replay this many seconds of the trace (default 0: to the end)
  DUET_RATE_SCALE       multiply the request rate (default 1)
  DUET_MAX_REQUESTS     replay at most this many requests (default 0: all)
  DUET_MAX_CONTEXT      clip prompt + output to this many tokens (default 32768, the default
                        model.max_context, which `duet bench serve --url http://...` uses when
                        it has no --config; 0 disables clipping)
  DUET_PROMPT_VOCAB     prompt token ids are drawn below this (default 30000)
  DUET_MODEL            the "model" field (default: the first id of GET /v1/models)
  DUET_API_KEY          sent as "Authorization: Bearer ..." when set
  DUET_TEMPERATURE      sampling temperature (default 0)
  DUET_REQUEST_TIMEOUT  seconds one request may take, connect to [DONE] (default 300)
  DUET_WAIT             seconds to wait for GET /v1/models to answer (default 60)
  DUET_LATE_WARN_MS     a request sent this much after its arrival time counts as late
                        (default 20)
  DUET_ITL_EVENTS       1: also report every inter-token gap to locust as an "ITL" event
                        (default 0: TTFT, TPOT and E2E only; the gaps are in the JSON anyway)
  DUET_LOCUST_OUT       write the per-request records and the computed percentiles here (JSON)

The trace transform follows sim/trace.cpp apply_transform: the time window first (arrivals in
[start, start + duration), shifted to start at 0), then the rate scale, then the request
limit, then the context clipping. Request i (0-based, in trace order after the transform)
with a prompt of length L sends ids[j] = (j*7919 + i*104729 + 1) % vocab (sim/http_replay.cpp
replay_prompt) and max_tokens = max(output length, 1).

Measured per request (as sim/http_replay.cpp): arrival = when the request was sent; TTFT =
the first SSE event carrying a choice (a non-final chunk, or a final one with text) minus the
arrival; each later such event is one inter-token gap, timed when its bytes were read (events
read together give 0 gaps); E2E = [DONE] minus the arrival; output tokens = the usage chunk's
completion_tokens (gaps past output tokens - 1, events of text held back until the end, are
dropped); TPOT = (E2E - TTFT) / (output tokens - 1). Outcomes: "ok" when the server
generated exactly max_tokens tokens; "rejected_429"/"rejected_503", "http_<status>",
"http_error" (an error event, or no [DONE]), "short_<finish_reason>", "connect_failed",
"client_timeout", "client_error". Percentiles cover "ok" requests only and interpolate
linearly between the closest ranks (numpy's default, type 7), like runtime/latency_stats.hpp.
"""
import datetime
import json
import logging
import math
import os
import re
import sys
import time

import gevent
import gevent.event
import requests
from locust import HttpUser, events, task
from locust.exception import StopUser

log = logging.getLogger("duet-locust")


# ----------------------------------------------------------------------------- configuration

def _env_float(name, default):
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        sys.exit(f"locustfile: {name}={text!r} is not a number")
    if not math.isfinite(value) or value < 0:
        sys.exit(f"locustfile: {name}={text!r} must be a finite number >= 0")
    return value


def _env_int(name, default):
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        sys.exit(f"locustfile: {name}={text!r} is not an integer")
    if value < 0:
        sys.exit(f"locustfile: {name}={text!r} must be >= 0")
    return value


# ----------------------------------------------------------------------------- traces

class TraceError(Exception):
    pass


_TIMESTAMP = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?(Z|[+-]\d{2}:\d{2})?$")


def _timestamp_ns(text):
    """ "YYYY-MM-DD HH:MM:SS[.f][Z|+HH:MM]" -> integer nanoseconds (sim/trace.cpp's rule)."""
    m = _TIMESTAMP.match(text)
    if not m:
        return None
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    try:
        days = (datetime.date(y, mo, d) - datetime.date(1970, 1, 1)).days
    except ValueError:
        return None
    if h > 23 or mi > 59 or s > 60:
        return None
    frac = (m.group(7) or "")[:9].ljust(9, "0")
    offset = 0
    if m.group(8) and m.group(8) != "Z":
        sign = 1 if m.group(8)[0] == "+" else -1
        offset = sign * (int(m.group(8)[1:3]) * 3600 + int(m.group(8)[4:6]) * 60)
    return (days * 86400 + h * 3600 + mi * 60 + s - offset) * 1_000_000_000 + int(frac)


def _field(text):
    text = text.strip(" \t\r")
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        text = text[1:-1]
    return text


def _count(text, what, where):
    if not text.isdigit() or int(text) > 0xFFFFFFFF:
        raise TraceError(f"{where}: bad {what} {text!r} (want a non-negative integer)")
    return int(text)


def load_azure_csv(path):
    """[(arrival_s, input_tokens, output_tokens)] of an Azure LLM inference trace."""
    rows, stamps, header = [], [], None
    with open(path, encoding="utf-8-sig", newline="") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip(" \t\r\n"):
                continue
            fields = [_field(x) for x in line.rstrip("\n").split(",")]
            where = f"{path}:{line_no}"
            if header is None:
                names = [x.lower() for x in fields]
                try:
                    header = (len(fields), names.index("timestamp"), names.index("contexttokens"),
                              names.index("generatedtokens"))
                except ValueError:
                    raise TraceError(f"{where}: expected a header with TIMESTAMP,ContextTokens,"
                                     f"GeneratedTokens, got {line.strip()!r}") from None
                continue
            columns, c_time, c_in, c_out = header
            if len(fields) != columns:
                raise TraceError(f"{where}: expected {columns} columns, got {len(fields)}")
            ns = _timestamp_ns(fields[c_time])
            if ns is None:
                raise TraceError(f"{where}: bad TIMESTAMP {fields[c_time]!r}")
            stamps.append(ns)
            rows.append((_count(fields[c_in], "ContextTokens", where),
                         _count(fields[c_out], "GeneratedTokens", where)))
    if header is None:
        raise TraceError(f"{path}: empty trace file")
    t0 = min(stamps) if stamps else 0
    return [((ns - t0) * 1e-9, i, o) for ns, (i, o) in zip(stamps, rows)]


def load_mooncake_jsonl(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise TraceError(f"{where}: invalid JSON: {e}") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object")
            ts = obj.get("timestamp")
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
                raise TraceError(f"{where}: \"timestamp\" must be a non-negative number of milliseconds")
            counts = []
            for key in ("input_length", "output_length"):
                v = obj.get(key)
                if isinstance(v, float) and v.is_integer():
                    v = int(v)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 0xFFFFFFFF:
                    raise TraceError(f"{where}: \"{key}\" must be a non-negative integer")
                counts.append(v)
            out.append((ts / 1000.0, counts[0], counts[1]))
    return out


def load_trace(path):
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        trace = load_azure_csv(path)
    elif ext in (".jsonl", ".json"):
        trace = load_mooncake_jsonl(path)
    else:
        raise TraceError(f"{path}: unknown trace format (want .csv for Azure or .jsonl for Mooncake)")
    trace.sort(key=lambda r: r[0])  # stable, as normalize_arrivals
    if trace:
        t0 = trace[0][0]
        trace = [(a - t0, i, o) for a, i, o in trace]
    return trace


def apply_transform(trace, start_s=0.0, duration_s=math.inf, rate_scale=1.0, max_requests=0,
                    max_context=0):
    """sim/trace.cpp apply_transform: window, rate scale, request limit, context clipping."""
    if start_s != 0 or math.isfinite(duration_s):
        end_s = start_s + duration_s
        trace = [(a - start_s, i, o) for a, i, o in trace if start_s <= a < end_s]
    if rate_scale != 1.0:
        trace = [(a / rate_scale, i, o) for a, i, o in trace]
    if max_requests > 0:
        trace = trace[:max_requests]
    if max_context > 0:
        clipped = []
        for a, i, o in trace:
            if i + o > max_context:
                room = 0 if o >= max_context else max_context - o
                i = max(1, min(i, room))
                o = min(o, max_context - i if max_context > i else 0)
            clipped.append((a, i, o))
        trace = clipped
    return trace


def replay_prompt(index, length, vocab):
    """sim/http_replay.cpp replay_prompt: the ids both live replays send for request `index`."""
    vocab = max(vocab, 2)
    base = index * 104729 + 1
    return [(j * 7919 + base) % vocab for j in range(length)]


# ----------------------------------------------------------------------------- statistics

def percentile_sorted(xs, p):
    """numpy's default (type 7): linear between the closest ranks; 0 for no samples."""
    if not xs:
        return 0.0
    if not p > 0:
        return xs[0]
    if p >= 100:
        return xs[-1]
    h = (len(xs) - 1) * p / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def summarize_samples(samples):
    xs = sorted(x for x in samples if not math.isnan(x))
    if not xs:
        return {"count": 0, "mean": 0.0, "min": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    return {"count": len(xs), "mean": sum(xs) / len(xs), "min": xs[0],
            "p50": percentile_sorted(xs, 50), "p90": percentile_sorted(xs, 90),
            "p99": percentile_sorted(xs, 99), "max": xs[-1]}


def summarize(records):
    """The latency part of runtime/latency_stats.hpp summarize(): "ok" requests only."""
    ok = [r for r in records if r["outcome"] == "ok"]
    outcomes = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    sent = [r for r in records if r["arrival_s"] is not None]
    duration = (max(r["finish_s"] for r in sent) - min(r["arrival_s"] for r in sent)) if sent else 0.0
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "outcomes": outcomes,
        "duration_s": duration,
        "input_tokens": sum(r["prompt_tokens"] for r in ok),
        "output_tokens": out_tokens,
        "request_throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "output_token_throughput": out_tokens / duration if duration > 0 else 0.0,
        "percentile_method": "linear",
        "ttft_s": summarize_samples([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "tpot_s": summarize_samples([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "itl_s": summarize_samples([g for r in ok for g in r["itl_s"]]),
        "e2e_s": summarize_samples([r["e2e_s"] for r in ok]),
    }


# ----------------------------------------------------------------------------- the replay

class Replay:
    """The shared schedule and results of one run (one locust process: gevent, no locks)."""

    def __init__(self):
        self.trace = []
        self.config = {}
        self.model = ""
        self.api_key = ""
        self.temperature = 0.0
        self.vocab = 30000
        self.request_timeout = 300.0
        self.wait_s = 60.0
        self.late_warn_s = 0.02
        self.itl_events = False
        self.out_path = ""
        self.start = None  # perf_counter of arrival 0, set when the first request is taken
        self.next_index = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.max_users = 0
        self.records = []
        self.finished = 0
        self.late = 0
        self.late_busy = 0
        self.max_late_s = 0.0
        self.all_done = gevent.event.Event()
        self.written = False

    def take(self):
        """The next request index (None when the schedule is exhausted)."""
        if self.next_index >= len(self.trace):
            return None
        if self.start is None:
            self.start = time.perf_counter()
        i = self.next_index
        self.next_index += 1
        return i

    def elapsed(self):
        return time.perf_counter() - self.start

    def done(self, record):
        self.records[record["index"]] = record
        self.finished += 1
        if self.finished == len(self.trace):
            self.all_done.set()

    def write(self, environment):
        if not self.out_path:
            return
        records = [r for r in self.records if r is not None]
        payload = {
            "generator": "bench/locustfile.py",
            "host": environment.host,
            "model": self.model,
            "config": self.config,
            "users": self.max_users,  # the most users seen running
            "max_in_flight": self.max_in_flight,
            "late": {"requests": self.late, "all_users_busy": self.late_busy,
                     "max_late_s": self.max_late_s, "threshold_s": self.late_warn_s},
            "summary": summarize(records),
            "records": records,
        }
        tmp = self.out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")
        os.replace(tmp, self.out_path)
        self.written = True


REPLAY = Replay()


@events.init.add_listener
def _on_init(environment, **_kwargs):
    path = os.environ.get("DUET_TRACE", "")
    if not path:
        sys.exit("locustfile: set DUET_TRACE to an Azure .csv or Mooncake .jsonl trace")
    start = _env_float("DUET_START", 0.0)
    duration = _env_float("DUET_DURATION", 0.0)
    rate_scale = _env_float("DUET_RATE_SCALE", 1.0)
    if not rate_scale > 0:
        sys.exit("locustfile: DUET_RATE_SCALE must be > 0")
    max_requests = _env_int("DUET_MAX_REQUESTS", 0)
    max_context = _env_int("DUET_MAX_CONTEXT", 32768)
    vocab = _env_int("DUET_PROMPT_VOCAB", 30000)
    if not 2 <= vocab <= 1 << 30:
        sys.exit("locustfile: DUET_PROMPT_VOCAB must be in [2, 2^30]")
    try:
        trace = load_trace(path)
    except (OSError, TraceError) as e:
        sys.exit(f"locustfile: {e}")
    trace = apply_transform(trace, start, duration if duration > 0 else math.inf, rate_scale,
                            max_requests, max_context)
    if not trace:
        sys.exit(f"locustfile: trace {path!r}: no request in the chosen window")
    r = REPLAY
    r.trace = trace
    r.records = [None] * len(trace)
    r.vocab = vocab
    r.model = os.environ.get("DUET_MODEL", "")
    r.api_key = os.environ.get("DUET_API_KEY", "")
    r.temperature = _env_float("DUET_TEMPERATURE", 0.0)
    r.request_timeout = _env_float("DUET_REQUEST_TIMEOUT", 300.0) or 300.0
    r.wait_s = _env_float("DUET_WAIT", 60.0)
    r.late_warn_s = _env_float("DUET_LATE_WARN_MS", 20.0) / 1e3
    r.itl_events = os.environ.get("DUET_ITL_EVENTS", "0") not in ("", "0")
    r.out_path = os.environ.get("DUET_LOCUST_OUT", "")
    r.config = {"trace": path, "start_s": start, "duration_s": duration, "rate_scale": rate_scale,
                "max_requests": max_requests, "max_context": max_context, "prompt_vocab": vocab,
                "temperature": r.temperature, "request_timeout_s": r.request_timeout,
                "requests": len(trace), "span_s": trace[-1][0]}
    log.info("trace %s: %d requests over %.1f s (rate x%g)", path, len(trace), trace[-1][0], rate_scale)


def _auth_headers():
    return {"Authorization": f"Bearer {REPLAY.api_key}"} if REPLAY.api_key else {}


def _first_model(host):
    """GET /v1/models until it answers (bounded by DUET_WAIT); its first id."""
    deadline = time.monotonic() + REPLAY.wait_s
    last = "no answer"
    while True:
        try:
            res = requests.get(host.rstrip("/") + "/v1/models", headers=_auth_headers(), timeout=5)
            if res.status_code == 200:
                return res.json()["data"][0]["id"]
            last = f"GET /v1/models answered {res.status_code}"
            if res.status_code == 401:
                break
        except (requests.RequestException, ValueError, KeyError, IndexError) as e:
            last = str(e)
        if time.monotonic() >= deadline:
            break
        gevent.sleep(0.2)
    raise RuntimeError(f"{host} did not answer within {REPLAY.wait_s:g} s: {last}")


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs):
    if not REPLAY.model:
        try:
            REPLAY.model = _first_model(environment.host or "")
        except RuntimeError as e:
            log.error("%s", e)
            environment.process_exit_code = 1
            gevent.spawn(environment.runner.quit)
            return
    log.info("model %s; %d requests to replay", REPLAY.model, len(REPLAY.trace))


@events.test_stop.add_listener
def _on_test_stop(environment, **_kwargs):
    REPLAY.write(environment)
    if REPLAY.late:
        log.warning("%d of %d requests went out more than %.0f ms late (max %.0f ms; %d found every "
                    "user busy): not open-loop; raise -u / -r", REPLAY.late, len(REPLAY.trace),
                    REPLAY.late_warn_s * 1e3, REPLAY.max_late_s * 1e3, REPLAY.late_busy)


class DuetTraceUser(HttpUser):
    """One client slot of the open-loop replay."""

    def wait_time(self):
        return 0

    @task
    def replay(self):
        r = REPLAY
        if not r.model:  # test_start has not found the model (or gave up)
            gevent.sleep(0.1)
            return
        i = r.take()
        if i is None:
            # The schedule is exhausted: this user stops; the one that finishes the last
            # request comes back here and ends the run.
            if r.all_done.is_set() and not r.written:
                r.write(self.environment)
                if self.environment.runner:
                    gevent.spawn(self.environment.runner.quit)
            raise StopUser()
        arrival, prompt_len, out_len = r.trace[i]
        taken_late = r.elapsed() - arrival
        if arrival > r.elapsed():
            gevent.sleep(arrival - r.elapsed())
        late = r.elapsed() - arrival
        if late > r.late_warn_s:
            r.late += 1
            r.max_late_s = max(r.max_late_s, late)
            busy = taken_late > r.late_warn_s  # no user was free when it was due
            r.late_busy += busy
            if r.late in (1, 10, 100, 1000):
                log.warning("request %d went out %.0f ms late (%s); late so far: %d", i, late * 1e3,
                            f"all {self.environment.runner.user_count} users were busy" if busy
                            else "the client's event loop was busy", r.late)
        r.in_flight += 1
        r.max_in_flight = max(r.max_in_flight, r.in_flight)
        r.max_users = max(r.max_users, self.environment.runner.user_count if self.environment.runner else 0)
        try:
            record = self._send(i, prompt_len, out_len)
        except Exception:  # a bug here must not leave the run waiting for this request
            log.exception("request %d", i)
            record = {"index": i, "id": i + 1, "scheduled_s": arrival, "arrival_s": None,
                      "first_token_s": None, "finish_s": r.elapsed(), "prompt_tokens": prompt_len,
                      "expected_tokens": max(out_len, 1), "output_tokens": 0, "itl_s": [],
                      "status": 0, "finish_reason": None, "outcome": "client_error",
                      "e2e_s": 0.0, "ttft_s": None, "tpot_s": None}
        finally:
            r.in_flight -= 1
        record["late_s"] = late
        r.done(record)
        self._report(record)

    def _send(self, i, prompt_len, out_len):
        r = REPLAY
        expected = max(out_len, 1)
        body = {"model": r.model, "prompt": replay_prompt(i, prompt_len, r.vocab),
                "max_tokens": expected, "temperature": r.temperature, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        rec = {"index": i, "id": i + 1, "scheduled_s": r.trace[i][0], "arrival_s": None,
               "first_token_s": None, "finish_s": None, "prompt_tokens": prompt_len,
               "expected_tokens": expected, "output_tokens": 0, "itl_s": [], "status": 0,
               "finish_reason": None, "outcome": "not_sent"}
        state = {"done": False, "error": False, "completion_tokens": None, "last": 0.0}

        def on_event(event, t):
            for line in event.split("\n"):
                line = line.rstrip("\r")
                if not line.startswith("data:"):
                    continue
                data = line[5:]
                if data.startswith(" "):
                    data = data[1:]
                if data == "[DONE]":
                    state["done"] = True
                    continue
                try:
                    j = json.loads(data)
                except ValueError:
                    state["error"] = True
                    continue
                if not isinstance(j, dict) or "error" in j:
                    state["error"] = True
                    continue
                usage = j.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    state["completion_tokens"] = usage["completion_tokens"]
                choices = j.get("choices")
                if not isinstance(choices, list) or not choices:
                    continue
                c = choices[0]
                text = c.get("text")
                has_text = isinstance(text, str) and text != ""
                finish = c.get("finish_reason")
                if finish is not None:
                    rec["finish_reason"] = finish if isinstance(finish, str) else ""
                    if not has_text:
                        continue
                if rec["first_token_s"] is None:
                    rec["first_token_s"] = t
                else:
                    rec["itl_s"].append(t - state["last"])
                state["last"] = t

        outcome = None
        response = None
        timer = gevent.Timeout(r.request_timeout)
        timer.start()
        try:
            rec["arrival_s"] = r.elapsed()
            try:
                response = self.client.post(
                    "/v1/completions", data=json.dumps(body, separators=(",", ":")),
                    headers={"Content-Type": "application/json", **_auth_headers()},
                    stream=True, name="/v1/completions (headers)",
                    timeout=(10.0, r.request_timeout))
            except requests.RequestException:
                outcome = "connect_failed"
            if response is not None and not response.status_code:
                outcome = "connect_failed"  # locust's session turns a connection error into status 0
            elif response is not None:
                rec["status"] = response.status_code
                if response.status_code != 200:
                    response.content  # drain (bounded by the timer)
                else:
                    buffer = ""
                    for chunk in response.iter_content(chunk_size=None):
                        t = r.elapsed()  # one timestamp per read, as bench serve
                        buffer += chunk.decode("utf-8", errors="replace")
                        while "\n\n" in buffer:
                            event, buffer = buffer.split("\n\n", 1)
                            on_event(event, t)
                        if state["done"]:
                            break
        except gevent.Timeout as e:
            if e is not timer:
                raise
            outcome = "client_timeout"
        except (requests.RequestException, OSError):
            outcome = None  # the stream broke: judged below (no [DONE] -> http_error)
        except Exception:  # a bug here must not leave the run waiting for this request
            log.exception("request %d", i)
            outcome = "client_error"
        finally:
            timer.cancel()
            rec["finish_s"] = r.elapsed()
            if response is not None:
                try:
                    response.close()
                except Exception:  # locust's stand-in response of a failed connection has no body
                    pass
        status = rec["status"]
        if outcome is None:
            if status in (429, 503):
                outcome = f"rejected_{status}"
            elif status != 200:
                outcome = f"http_{status}"
            elif state["error"] or not state["done"]:
                outcome = "http_error"
            elif state["completion_tokens"] is not None and state["completion_tokens"] != expected:
                outcome = f"short_{rec['finish_reason'] or ''}"
            else:
                outcome = "ok"
        rec["outcome"] = outcome
        if state["completion_tokens"] is not None:
            rec["output_tokens"] = state["completion_tokens"]
            # An event after the last token carries only text held back until the end (a
            # character the last token left incomplete): no gap, as in bench serve.
            if rec["first_token_s"] is not None:
                del rec["itl_s"][max(rec["output_tokens"] - 1, 0):]
        elif rec["first_token_s"] is not None:
            rec["output_tokens"] = len(rec["itl_s"]) + 1
        rec["e2e_s"] = rec["finish_s"] - rec["arrival_s"]
        rec["ttft_s"] = (rec["first_token_s"] - rec["arrival_s"]) if rec["first_token_s"] is not None else None
        rec["tpot_s"] = ((rec["e2e_s"] - rec["ttft_s"]) / (rec["output_tokens"] - 1)
                         if rec["ttft_s"] is not None and rec["output_tokens"] > 1 else None)
        return rec

    def _report(self, rec):
        """Custom locust events, so locust's own table shows TTFT / TPOT / E2E (ms)."""
        fire = self.environment.events.request.fire
        name = "/v1/completions"
        if rec["outcome"] != "ok":
            fire(request_type="E2E", name=name, response_time=rec["e2e_s"] * 1e3, response_length=0,
                 exception=RuntimeError(rec["outcome"]), context={})
            return
        if rec["ttft_s"] is not None:
            fire(request_type="TTFT", name=name, response_time=rec["ttft_s"] * 1e3,
                 response_length=0, exception=None, context={})
        if rec["tpot_s"] is not None:
            fire(request_type="TPOT", name=name, response_time=rec["tpot_s"] * 1e3,
                 response_length=rec["output_tokens"], exception=None, context={})
        if REPLAY.itl_events:
            for gap in rec["itl_s"]:
                fire(request_type="ITL", name=name, response_time=gap * 1e3, response_length=0,
                     exception=None, context={})
        fire(request_type="E2E", name=name, response_time=rec["e2e_s"] * 1e3,
             response_length=rec["output_tokens"], exception=None, context={})
