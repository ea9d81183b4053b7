#!/usr/bin/python3
"""The wire protocol works from another language: Python (pyzmq + msgpack, Debian packages)
submits to a two-process duet cluster over ipc:// and streams tokens back from the decode node.

Usage: check_python_client.py DUET_BINARY
Exits 0 when every check passes; prints what failed otherwise.
"""
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from duet_client import Client  # noqa: E402

MASK = (1 << 64) - 1


def sim_next_token(previous, position, vocab):
    """runtime/sim_engine.cpp next_token, bit for bit."""
    x = (((previous & 0xFFFFFFFF) << 32) ^ position) & MASK
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK
    x ^= x >> 33
    return x % vocab


def reference(prompt, n, vocab=128256):
    seq, out = list(prompt), []
    for _ in range(n):
        t = sim_next_token(seq[-1], len(seq), vocab)
        seq.append(t)
        out.append(t)
    return out


CONFIG = """
[model]
name = "py-check"
preset = "r1-distill-llama-8b"
[engine]
kind = "sim"
gpu = "h200"
time_scale = 0.1
[[nodes]]
name = "n1"
endpoint = "ipc://{dir}/n1.sock"
[[nodes.actors]]
name = "router"
role = "router"
[[nodes.actors]]
name = "broker"
role = "broker"
[[nodes.actors]]
name = "prefill0"
role = "prefill"
[[nodes]]
name = "n2"
endpoint = "ipc://{dir}/n2.sock"
[[nodes.actors]]
name = "decode0"
role = "decode"
"""


def main():
    duet = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory(prefix="duet-py-") as tmp:
        config = os.path.join(tmp, "cluster.toml")
        with open(config, "w") as f:
            f.write(CONFIG.format(dir=tmp))
        nodes = [subprocess.Popen([duet, "node", "--config", config, "--name", n]) for n in ("n1", "n2")]
        try:
            with Client("ipc://%s/n1.sock" % tmp, router_node="n1") as client:
                prompt = [101, 202, 303, 404]
                events = []
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:  # until both workers reported to the router
                    events = list(client.generate(prompt_tokens=prompt, max_new_tokens=24, timeout_s=10))
                    if events and events[-1].kind != "rejected":
                        break
                    time.sleep(0.2)
                kinds = [e.kind for e in events]
                tokens = [e.token for e in events if e.kind == "token"]
                final = events[-1] if events else None
                if not final or final.kind != "finish" or final.reason != "length":
                    failures.append("expected finish(length), got %r" % (events[-1:] if events else None))
                if "admitted" not in kinds:
                    failures.append("no admitted event")
                if tokens != reference(prompt, 24):
                    failures.append("tokens %r differ from the sim reference %r" % (tokens, reference(prompt, 24)))
                rejected = list(client.generate(prompt_tokens=[], prompt="", max_new_tokens=4, timeout_s=5))
                if not rejected or rejected[-1].kind != "rejected" or rejected[-1].code != "bad_request":
                    failures.append("an empty prompt should be rejected as bad_request, got %r" % rejected)
        finally:
            for p in nodes:
                p.terminate()
            for p in nodes:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    for f in failures:
        print("FAILED:", f)
    if not failures:
        print("python client streamed the expected tokens from the decode node")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
