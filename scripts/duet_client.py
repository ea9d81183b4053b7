#!/usr/bin/python3
"""duet_client: submit a generation request to a duet cluster over ZeroMQ and stream tokens.

A complete client of the wire protocol (docs/protocol.md) in Python, with pyzmq and msgpack
(Debian: python3-zmq, python3-msgpack).

As a command:
    scripts/duet_client.py --endpoint tcp://127.0.0.1:5601 --router-node prefill-host \\
        --prompt-tokens 1,2,3 --max-new-tokens 16
  prints the token ids on stdout as they arrive (with --json: one JSON object per event) and
  exits 0 when a finish with reason stop or length arrives, 1 when the request was rejected,
  cancelled, timed out or failed, 2 on bad arguments, 3 when no final answer came within
  --timeout seconds (a cancel is sent first).

As a module:
    from duet_client import Client
    with Client("tcp://127.0.0.1:5601", router_node="prefill-host") as client:
        for event in client.generate(prompt_tokens=[1, 2, 3], max_new_tokens=8):
            print(event)

Test hooks (no socket): --dump-submit writes the submit message to stdout in the stream format
of tests/tools/decode_frames (per message: u32 frame count, then per frame u32 length and its
bytes, little-endian); --replay reads the replies from stdin in the same format.
"""

import argparse
import itertools
import json
import os
import struct
import sys
import time

import msgpack

PROTOCOL_VERSION = 1

TYPE_IDS = {
    "hello": 1, "heartbeat": 2, "error": 3,
    "submit": 10, "admitted": 11, "rejected": 12, "cancel": 13, "token_batch": 14, "finish": 15,
    "prefill_request": 20, "prefill_done": 21, "stage_failed": 22, "cancel_seq": 23,
    "request_done": 24, "kv_adopt": 25,
    "kv_register": 30, "kv_registered": 31, "kv_pull": 32, "kv_moved": 33, "kv_confirm": 34,
    "kv_release": 35, "kv_nack": 36, "kv_renew": 37, "kv_drop": 38,
    "load_report": 40, "stats_request": 41, "stats_reply": 42,
}
TYPE_NAMES = {number: name for name, number in TYPE_IDS.items()}

# Raw frames after the body, in order: (field, struct format of one little-endian element).
RAW_FRAMES = {
    "submit": [("prompt_tokens", "i")],
    "token_batch": [("request_ids", "Q"), ("tokens", "i"), ("positions", "I")],
    "prefill_request": [("tokens", "i")],
    "kv_adopt": [("prompt", "i")],
    "kv_register": [("block_ids", "I")],
    "kv_pull": [("block_ids", "I")],
}

FINISH_REASONS = {0: "stop", 1: "length", 2: "cancelled", 3: "timeout", 4: "error"}
ERROR_CODES = {
    0: "none", 400: "bad_request", 401: "unauthorized", 404: "not_found",
    413: "prompt_too_long", 429: "overloaded", 500: "internal", 503: "unavailable",
    504: "timeout", 505: "incompatible",
}

# The sampling fields a submit may carry; a missing key keeps the server's default.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "has_seed", "max_new_tokens", "ignore_eos", "logprobs", "top_logprobs",
    "stop_token_ids", "stop_strings",
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_ANSWER = 0, 1, 2, 3


class ProtocolError(Exception):
    """A message that does not follow docs/protocol.md."""


def now_ms():
    return int(time.time() * 1000)


def pack_array(values, element):
    return struct.pack("<%d%s" % (len(values), element), *values)


def unpack_array(frame, element, field):
    size = struct.calcsize(element)
    if len(frame) % size:
        raise ProtocolError("raw frame %s of %d bytes is not a whole number of %d-byte elements"
                            % (field, len(frame), size))
    return list(struct.unpack("<%d%s" % (len(frame) // size, element), frame))


def encode(type_name, body, raw=(), src="", dst="", correlation=0, deadline_ms=0):
    """Frames of one message: [envelope][body][raw frames of RAW_FRAMES[type_name]...]."""
    layout = RAW_FRAMES.get(type_name, [])
    if len(raw) != len(layout):
        raise ValueError("%s takes %d raw arrays, got %d" % (type_name, len(layout), len(raw)))
    envelope = {
        "version": PROTOCOL_VERSION,
        "type": TYPE_IDS[type_name],
        "src": src,
        "dst": dst,
        "correlation": correlation,
        "deadline_ms": deadline_ms,
    }
    frames = [msgpack.packb(envelope, use_bin_type=True), msgpack.packb(body, use_bin_type=True)]
    frames += [pack_array(values, element) for (_, element), values in zip(layout, raw)]
    return frames


class Message:
    """A decoded message: envelope (dict), type (name), body (dict), raw (field -> list)."""

    def __init__(self, envelope, type_name, body, raw):
        self.envelope, self.type, self.body, self.raw = envelope, type_name, body, raw

    def __repr__(self):
        return "Message(%s, %r, %r)" % (self.type, self.body, self.raw)


def decode(frames):
    """Decodes a message as the C++ codec does; raises ProtocolError on anything malformed."""
    if len(frames) < 2:
        raise ProtocolError("a message needs at least 2 frames, got %d" % len(frames))
    try:
        envelope = msgpack.unpackb(frames[0], raw=False)
        body = msgpack.unpackb(frames[1], raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError("malformed msgpack: %s" % e) from e
    if not isinstance(envelope, dict) or not isinstance(body, dict):
        raise ProtocolError("envelope and body must be msgpack maps")
    if envelope.get("version") != PROTOCOL_VERSION:
        raise ProtocolError("protocol version %r is not the supported %d"
                            % (envelope.get("version"), PROTOCOL_VERSION))
    type_name = TYPE_NAMES.get(envelope.get("type"))
    if type_name is None:
        raise ProtocolError("unknown message type %r" % envelope.get("type"))
    layout = RAW_FRAMES.get(type_name, [])
    if len(frames) != 2 + len(layout):
        raise ProtocolError("%s: expected %d frames, got %d" % (type_name, 2 + len(layout), len(frames)))
    raw = {field: unpack_array(frame, element, field)
           for (field, element), frame in zip(layout, frames[2:])}
    return Message(envelope, type_name, body, raw)


def submit_frames(request_id, src, dst, prompt_tokens=None, prompt="", deadline_ms=0, **sampling):
    """The submit message; sampling takes any of SAMPLING_FIELDS (others keep their defaults)."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise ValueError("unknown sampling fields: %s" % ", ".join(sorted(unknown)))
    body = {"request_id": request_id, "prompt": prompt,
            "sampling": {k: v for k, v in sampling.items() if v is not None}}
    if "seed" in body["sampling"]:
        body["sampling"]["has_seed"] = True
    return encode("submit", body, [list(prompt_tokens or [])], src=src, dst=dst,
                  correlation=request_id, deadline_ms=deadline_ms)


class Event:
    """What happened to a request: kind is admitted | rejected | token | finish | error."""

    def __init__(self, kind, request_id, **fields):
        self.kind, self.request_id, self.fields = kind, request_id, fields

    def __getattr__(self, name):
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def final(self):
        return self.kind in ("rejected", "finish", "error")

    @property
    def succeeded(self):
        return self.kind == "finish" and self.fields.get("reason") in ("stop", "length")

    def as_dict(self):
        return dict(event=self.kind, request_id=self.request_id, **self.fields)

    def __repr__(self):
        return "Event(%s)" % json.dumps(self.as_dict())


def events_of(message, request_id):
    """The events one received message carries for request_id (token_batch: zero or more)."""
    body = message.body
    if message.type == "token_batch":
        raw = message.raw
        if not len(raw["request_ids"]) == len(raw["tokens"]) == len(raw["positions"]):
            raise ProtocolError("token_batch arrays differ in length")
        return [Event("token", request_id, token=token, position=position)
                for rid, token, position in zip(raw["request_ids"], raw["tokens"], raw["positions"])
                if rid == request_id]
    if message.type == "admitted" and body.get("request_id") == request_id:
        return [Event("admitted", request_id, prompt_tokens=body.get("prompt_tokens", 0),
                      queue_position=body.get("queue_position", 0))]
    if message.type == "rejected" and body.get("request_id") == request_id:
        return [Event("rejected", request_id, code=ERROR_CODES.get(body.get("code", 400), "unknown"),
                      message=body.get("message", ""), retry_after_ms=body.get("retry_after_ms", 0))]
    if message.type == "finish" and body.get("request_id") == request_id:
        return [Event("finish", request_id,
                      reason=FINISH_REASONS.get(body.get("reason", 0), "unknown"),
                      code=ERROR_CODES.get(body.get("code", 0), "unknown"),
                      message=body.get("message", ""),
                      prompt_tokens=body.get("prompt_tokens", 0),
                      completion_tokens=body.get("completion_tokens", 0))]
    if message.type == "error" and body.get("about", 0) in (0, request_id):
        return [Event("error", request_id, code=ERROR_CODES.get(body.get("code", 500), "unknown"),
                      message=body.get("message", ""))]
    return []


class Client:
    """One DEALER socket connected to a node; its routing id is the client's node name."""

    def __init__(self, endpoint, router_node, name=None, context=None):
        import zmq  # imported here so that the encoding helpers work without pyzmq
        self._zmq = zmq
        self.name = name or "client-%d" % os.getpid()
        self.address = self.name + "/client"
        self.router = router_node + "/router"
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.ROUTING_ID, self.name.encode())
        self._socket.setsockopt(zmq.LINGER, 500)
        self._socket.connect(endpoint)
        # Request ids are unique per client name; starting from the clock keeps them unique
        # when a restarted client reuses a name (client-<pid>).
        self._ids = itertools.count(int(time.time() * 1000) << 16)
        self.malformed = 0  # replies dropped because they did not decode

    def close(self):
        self._socket.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, frames):
        self._socket.send_multipart(frames)

    def receive(self, timeout_s):
        """The next message, or None after timeout_s seconds. Malformed ones raise ProtocolError."""
        if not self._socket.poll(max(0, int(timeout_s * 1000))):
            return None
        return decode(self._socket.recv_multipart())

    def submit(self, prompt_tokens=None, prompt="", timeout_s=60.0, request_id=None, **sampling):
        request_id = next(self._ids) if request_id is None else request_id
        deadline = now_ms() + int(timeout_s * 1000) if timeout_s else 0
        self.send(submit_frames(request_id, self.address, self.router, prompt_tokens, prompt,
                                deadline_ms=deadline, **sampling))
        return request_id

    def cancel(self, request_id):
        self.send(encode("cancel", {"request_id": request_id}, src=self.address, dst=self.router,
                         correlation=request_id))

    def stream(self, request_id, timeout_s=60.0):
        """Yields the request's events until a final one; raises TimeoutError (after sending
        cancel) when none arrives within timeout_s seconds of the call."""
        give_up = time.monotonic() + timeout_s
        while True:
            left = give_up - time.monotonic()
            try:
                message = self.receive(left) if left > 0 else None
            except ProtocolError as e:
                self.malformed += 1
                print("duet_client: dropped a malformed reply: %s" % e, file=sys.stderr)
                continue
            if message is None:
                self.cancel(request_id)
                raise TimeoutError("no final answer for request %d within %.1f s" % (request_id, timeout_s))
            for event in events_of(message, request_id):
                yield event
                if event.final:
                    return

    def generate(self, prompt_tokens=None, prompt="", timeout_s=60.0, **sampling):
        """submit, then stream: yields admitted, token..., and a final event."""
        request_id = self.submit(prompt_tokens, prompt, timeout_s=timeout_s, **sampling)
        yield from self.stream(request_id, timeout_s)


# ---------------------------------------------------------------- stream format (test hooks)

def write_stream(out, frames):
    out.write(struct.pack("<I", len(frames)))
    for frame in frames:
        out.write(struct.pack("<I", len(frame)))
        out.write(frame)


def read_stream(source):
    """Yields the messages (lists of frames) of a stream; raises ProtocolError if it is cut."""
    def exactly(n):
        data = source.read(n)
        if len(data) != n:
            raise ProtocolError("the stream ends inside a message")
        return data
    while True:
        head = source.read(4)
        if not head:
            return
        if len(head) != 4:
            raise ProtocolError("the stream ends inside a frame count")
        (count,) = struct.unpack("<I", head)
        yield [exactly(struct.unpack("<I", exactly(4))[0]) for _ in range(count)]


# ---------------------------------------------------------------- command line

def parse_args(argv):
    p = argparse.ArgumentParser(description="Submit a request to a duet cluster and stream its tokens.")
    p.add_argument("--endpoint", help="ZeroMQ endpoint of the router's node, e.g. tcp://127.0.0.1:5601")
    p.add_argument("--router-node", help="name of the node that runs the router")
    p.add_argument("--name", help="this client's node name and routing id (default client-<pid>)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-tokens", help="prompt token ids, comma separated: 1,2,3")
    prompt.add_argument("--prompt", help="prompt text, tokenized by the router")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--stop-token-ids", help="comma separated token ids that end generation")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the final answer")
    p.add_argument("--request-id", type=int, help="request id (default: chosen by the client)")
    p.add_argument("--json", action="store_true", help="print one JSON object per event")
    hooks = p.add_mutually_exclusive_group()
    hooks.add_argument("--dump-submit", action="store_true",
                       help="write the submit message to stdout in the stream format and exit")
    hooks.add_argument("--replay", action="store_true",
                       help="read the replies from stdin in the stream format instead of a socket")
    args = p.parse_args(argv)
    if not args.dump_submit and not args.replay and not args.endpoint:
        p.error("--endpoint is required")
    if not args.router_node:
        p.error("--router-node is required")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    try:
        args.tokens = [int(t) for t in args.prompt_tokens.split(",")] if args.prompt_tokens else []
        args.stops = [int(t) for t in args.stop_token_ids.split(",")] if args.stop_token_ids else None
    except ValueError:
        p.error("token ids must be comma separated integers")
    if args.prompt is not None and not args.prompt:
        p.error("--prompt must not be empty")
    return args


def sampling_of(args):
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
                stop_token_ids=args.stops)


def report(events, as_json, out=sys.stdout, err=sys.stderr):
    """Prints events as they come; returns the exit code of the final one."""
    tokens_on_line = False
    for event in events:
        if as_json:
            print(json.dumps(event.as_dict()), file=out, flush=True)
        elif event.kind == "token":
            print(event.token, end=" ", file=out, flush=True)
            tokens_on_line = True
        else:
            if tokens_on_line and event.final:
                print(file=out, flush=True)
            print("%s: %s" % (event.kind, json.dumps(event.fields)), file=err, flush=True)
        if event.final:
            return EXIT_OK if event.succeeded else EXIT_FAILED
    return EXIT_NO_ANSWER


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    name = args.name or "client-%d" % os.getpid()
    request_id = args.request_id if args.request_id is not None else 1
    if args.dump_submit:
        frames = submit_frames(request_id, name + "/client", args.router_node + "/router",
                               args.tokens, args.prompt or "",
                               deadline_ms=now_ms() + int(args.timeout * 1000), **sampling_of(args))
        write_stream(sys.stdout.buffer, frames)
        sys.stdout.buffer.flush()
        return EXIT_OK
    try:
        if args.replay:
            events = (e for frames in read_stream(sys.stdin.buffer)
                      for e in events_of(decode(frames), request_id))
            return report(events, args.json)
        with Client(args.endpoint, args.router_node, name=name) as client:
            request_id = client.submit(args.tokens, args.prompt or "", timeout_s=args.timeout,
                                       request_id=args.request_id, **sampling_of(args))
            try:
                return report(client.stream(request_id, args.timeout), args.json)
            except KeyboardInterrupt:
                client.cancel(request_id)
                return EXIT_FAILED
    except TimeoutError as e:
        print("duet_client: %s (cancel sent)" % e, file=sys.stderr)
        return EXIT_NO_ANSWER
    except ProtocolError as e:
        print("duet_client: malformed reply: %s" % e, file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
