#!/usr/bin/python3
"""The Python client (scripts/duet_client.py) and the C++ codec agree on the wire format.

    check_python_encoding.py DECODE_FRAMES [unittest options]

DECODE_FRAMES is the tests/tools/decode_frames binary. What Python encodes is decoded by the
C++ codec, and what the C++ codec encodes is decoded by the Python client.
"""

import io
import json
import os
import subprocess
import sys
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLIENT = os.path.join(ROOT, "scripts", "duet_client.py")
PYTHON = "/usr/bin/python3"
DECODE_FRAMES = None  # set from argv

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import duet_client  # noqa: E402


def decode_with_codec(stream):
    """Runs decode_frames on a stream; returns (exit code, list of JSON lines)."""
    done = subprocess.run([DECODE_FRAMES], input=stream, capture_output=True, check=False)
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    return done.returncode, lines


def dump_submit(*args):
    done = subprocess.run([PYTHON, CLIENT, "--dump-submit", *args], capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


class SubmitFromTheCommandLine(unittest.TestCase):
    def test_a_submit_with_prompt_tokens_and_sampling_decodes_field_by_field(self):
        before = int(time.time() * 1000)
        stream = dump_submit("--router-node", "n7", "--name", "client-test",
                             "--request-id", "12345678901234567890",
                             "--prompt-tokens", "1,2,-3,128000", "--max-new-tokens", "7",
                             "--temperature", "0.5", "--top-k", "40", "--seed", "99",
                             "--ignore-eos", "--stop-token-ids", "128001,128009", "--timeout", "30")
        code, lines = decode_with_codec(stream)
        self.assertEqual(code, 0, lines)
        self.assertEqual(len(lines), 1)
        m = lines[0]
        self.assertTrue(m["ok"], m)
        self.assertEqual(m["type_name"], "submit")
        self.assertEqual(m["frames"], 3)
        env = m["envelope"]
        self.assertEqual(env["version"], 1)
        self.assertEqual(env["type"], 10)
        self.assertEqual(env["src"], "client-test/client")
        self.assertEqual(env["dst"], "n7/router")
        self.assertEqual(env["correlation"], 12345678901234567890)
        self.assertGreaterEqual(env["deadline_ms"], before + 30000)
        self.assertLessEqual(env["deadline_ms"], int(time.time() * 1000) + 30000)
        body = m["body"]
        self.assertEqual(body["request_id"], 12345678901234567890)
        self.assertEqual(body["prompt"], "")
        s = body["sampling"]
        self.assertEqual(s["max_new_tokens"], 7)
        self.assertEqual(s["temperature"], 0.5)
        self.assertEqual(s["top_k"], 40)
        self.assertEqual(s["seed"], 99)
        self.assertTrue(s["has_seed"])
        self.assertTrue(s["ignore_eos"])
        self.assertEqual(s["stop_token_ids"], [128001, 128009])
        self.assertEqual(s["top_p"], 1.0)  # not sent: the C++ default stands
        self.assertEqual(m["raw"], [[1, 2, -3, 128000]])

    def test_a_submit_with_prompt_text_carries_it_as_utf8_and_no_tokens(self):
        code, lines = decode_with_codec(dump_submit("--router-node", "r", "--prompt", "héllo wörld ✓"))
        self.assertEqual(code, 0, lines)
        m = lines[0]
        self.assertEqual(m["body"]["prompt"], "héllo wörld ✓")
        self.assertEqual(m["body"]["sampling"]["max_new_tokens"], 16)
        self.assertFalse(m["body"]["sampling"]["has_seed"])
        self.assertEqual(m["raw"], [[]])
        self.assertRegex(m["envelope"]["src"], r"^client-\d+/client$")


class EncodingFromTheModule(unittest.TestCase):
    def test_cancel_and_a_message_with_three_raw_frames_decode(self):
        out = io.BytesIO()
        duet_client.write_stream(out, duet_client.encode(
            "cancel", {"request_id": 5}, src="client-1/client", dst="n0/router", correlation=5))
        duet_client.write_stream(out, duet_client.encode(
            "token_batch", {}, [[1, 2**64 - 1], [-1, 7], [0, 2**32 - 1]], src="n0/decode0", dst="x/client"))
        code, lines = decode_with_codec(out.getvalue())
        self.assertEqual(code, 0, lines)
        self.assertEqual(lines[0]["type_name"], "cancel")
        self.assertEqual(lines[0]["body"], {"request_id": 5})
        self.assertEqual(lines[1]["type_name"], "token_batch")
        self.assertEqual(lines[1]["raw"], [[1, 2**64 - 1], [-1, 7], [0, 2**32 - 1]])

    def test_the_codec_refuses_another_protocol_version_with_a_message(self):
        frames = duet_client.encode("cancel", {"request_id": 5})
        env = duet_client.msgpack.unpackb(frames[0])
        env["version"] = 2
        frames[0] = duet_client.msgpack.packb(env)
        out = io.BytesIO()
        duet_client.write_stream(out, frames)
        code, lines = decode_with_codec(out.getvalue())
        self.assertEqual(code, 1)
        self.assertFalse(lines[0]["ok"])
        self.assertIn("protocol version 2 is not the supported 1", lines[0]["error"])

    def test_every_sampling_field_the_module_accepts_is_one_the_codec_knows(self):
        sampling = dict(temperature=0.25, top_p=0.5, top_k=3, min_p=0.125, presence_penalty=0.5,
                        frequency_penalty=0.75, repetition_penalty=1.5, seed=2**63, max_new_tokens=9,
                        ignore_eos=True, logprobs=True, top_logprobs=2, stop_token_ids=[1, 2], stop_strings=["</s>"])
        self.assertEqual(set(sampling) | {"has_seed"}, set(duet_client.SAMPLING_FIELDS))
        out = io.BytesIO()
        duet_client.write_stream(out, duet_client.submit_frames(3, "c/client", "n/router", [9], **sampling))
        code, lines = decode_with_codec(out.getvalue())
        self.assertEqual(code, 0, lines)
        self.assertEqual(lines[0]["body"]["sampling"], dict(sampling, has_seed=True))


class RepliesFromTheCodec(unittest.TestCase):
    def replay(self, *args):
        replies = subprocess.run([DECODE_FRAMES, "--emit-replies", "42", "client-t/client"],
                                 capture_output=True, check=True).stdout
        return subprocess.run([PYTHON, CLIENT, "--replay", "--router-node", "n0", "--request-id", "42",
                               "--prompt-tokens", "1,2,3", *args],
                              input=replies, capture_output=True, check=False)

    def test_the_client_streams_tokens_of_its_request_until_finish_and_exits_0(self):
        done = self.replay("--json")
        self.assertEqual(done.returncode, 0, done.stderr.decode())
        events = [json.loads(line) for line in done.stdout.decode().splitlines()]
        self.assertEqual([e["event"] for e in events], ["admitted", "token", "token", "finish"])
        self.assertEqual([(e["token"], e["position"]) for e in events[1:3]], [(791, 0), (4320, 1)])
        self.assertEqual(events[3]["reason"], "length")
        self.assertEqual(events[3]["completion_tokens"], 2)
        self.assertTrue(all(e["request_id"] == 42 for e in events))

    def test_without_json_the_client_prints_token_ids_on_one_line(self):
        done = self.replay()
        self.assertEqual(done.returncode, 0, done.stderr.decode())
        self.assertEqual(done.stdout.decode().split(), ["791", "4320"])
        self.assertIn("finish:", done.stderr.decode())

    def test_a_stream_without_a_final_answer_exits_3(self):
        replies = subprocess.run([DECODE_FRAMES, "--emit-replies", "42", "client-t/client"],
                                 capture_output=True, check=True).stdout
        frames = list(duet_client.read_stream(io.BytesIO(replies)))
        out = io.BytesIO()
        for message in frames[:-1]:  # everything but finish
            duet_client.write_stream(out, message)
        done = subprocess.run([PYTHON, CLIENT, "--replay", "--router-node", "n0", "--request-id", "42",
                               "--prompt-tokens", "1"], input=out.getvalue(), capture_output=True, check=False)
        self.assertEqual(done.returncode, 3)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not os.access(sys.argv[1], os.X_OK):
        sys.exit("usage: check_python_encoding.py DECODE_FRAMES [unittest options]")
    DECODE_FRAMES = sys.argv.pop(1)
    unittest.main(verbosity=2)
