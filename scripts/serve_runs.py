"""What a stored serving run (docs/data/h200-serve*/ or h100-serve*/NAME.{toml,json}) replayed: its trace
window and the engine settings the simulator must be given to price it as it ran. The one
place that knows; scripts/resim-serve.sh, fit-concurrency.py and repeat-spread.py read it.

  python3 scripts/serve_runs.py docs/data/h200-serve-2026-12-03d/conv4-pd-streams-b256
  -> AzureLLMInferenceTrace_conv_2023.csv 0 240 4 32 1 0
     (trace file, start s, duration s, rate scale, decode bucket step, prefill thread, decode
      thread)
"""
import os
import pathlib
import re
import sys

# Name patterns, the first that matches wins, and the window (trace start duration rate) of
# each (scripts/gpu-serve.sh's runs). 42-s replays of a later window are named by rate and start
# (conv475s900-: x4.75 from second 900) and window_42s reads them.
WINDOWS = ((r"conv6-.*-42s$", "conv 0 252 6"), (r"conv5-.*-42s$", "conv 0 210 5"), (r"conv5-", "conv 0 300 5"), (r"conv45-.*-42s$", "conv 0 189 4.5"), (r"conv45-", "conv 0 240 4.5"),
           (r"conv4-.*-42s$", "conv 0 168 4"), (r"conv4-", "conv 0 240 4"),
           (r"conv35-.*-42s$", "conv 0 147 3.5"), (r"conv35-", "conv 0 210 3.5"),
           (r"conv3-.*-42s$", "conv 0 126 3"), (r"conv3-", "conv 0 180 3"),
           (r"conv25-.*-42s$", "conv 0 105 2.5"),
           (r"conv3long-", "conv 0 540 3"), (r"conv-1p1d$", "conv 0 180 6"), (r"conv-", "conv 0 180 3"),
           (r"mc025-63s-", "mooncake 63 14 0.25"), (r"mc025-", "mooncake 0 14 0.25"),
           (r"code1-.*-42s$", "code 0 42 1"), (r"code1-", "code 180 60 1"), (r"code07-", "code 180 60 0.7"), (r"code05-", "code 180 60 0.5"), (r"code-1p1d$", "code 180 60 1.4"), (r"code-", "code 180 60 0.7"))


# The file of each trace a window names, in the traces folder (../shared/traces, .devdata).
TRACE_FILES = {"conv": "AzureLLMInferenceTrace_conv_2023.csv", "code": "AzureLLMInferenceTrace_code_2023.csv",
               "mooncake": "mooncake_conversation_trace.jsonl"}


def trace_file(trace):
    """The file name of a window's trace ("conv", "code" or "mooncake")."""
    return TRACE_FILES[trace]


# conv<rate digits>s<start>-...-42s: the rate's first digit is its whole part (475: 4.75), and
# the window is 42 s of replay, round(42 * rate) seconds of the trace.
WINDOW_42S = re.compile(r"conv(\d)(\d*)s(\d+)-.*-42s$")


def window_42s(name):
    """The window of a run named conv<rate>s<start>-...-42s, or None."""
    found = WINDOW_42S.match(name)
    if not found:
        return None
    rate = float(f"{found.group(1)}.{found.group(2) or 0}")
    return ["conv", found.group(3), str(round(42 * rate)), f"{rate:g}"]


def window(name):
    """The trace, start, duration and rate scale of a run, from its name."""
    if (w := window_42s(name)) is not None:
        return w
    for pattern, w in WINDOWS:
        if re.match(pattern, name):
            return w.split()
    raise SystemExit(f"no trace window known for run '{name}'")


def bucket_step(run):
    """The decode graph step the run's engine had (a pathlib.Path): every 32 rows from the
    12-03d runs on, powers of two (0) before them and in runs named -pow2."""
    folder = run.parent.name
    old = folder == "h200-serve" or re.search(r"-12-0[12]|-12-03[bc]?$", folder)
    return 0 if old or run.name.endswith("-pow2") else 32


def prefill_thread(run):
    """1, or 0 for runs named -sync: they ran with DUET_PREFILL_THREAD=0 (prefill steps on the
    actor's thread), which the simulator reads as the workers do."""
    return 0 if run.name.endswith("-sync") else 1


# The last folder whose runs computed decode steps on the actor's thread: the decode step
# thread (runtime/decode_core.hpp, DUET_DECODE_THREAD) came after it.
LAST_INLINE_DECODE = ("2026-12-05", "e")


def decode_thread(run):
    """1 for runs of a duet with decode steps on a thread of their own, 0 before (folders dated
    up to LAST_INLINE_DECODE, letters included: h200-serve-2026-12-05b is before, -05f after)
    and for runs named -inline (DUET_DECODE_THREAD=0, scripts/gpu-serve.sh)."""
    if run.name.endswith("-inline"):
        return 0
    found = re.search(r"(\d{4}-\d{2}-\d{2})([a-z]?)$", run.parent.name)
    if not found:  # h200-serve: the 11-29 runs
        return 0
    return 0 if (found.group(1), found.group(2)) <= LAST_INLINE_DECODE else 1


def sim_argv(config, trace_path, start, duration, rate, calibration, out, spread=0.0):
    """The `duet sim` arguments (after the binary) that replay a trace window on a deployment
    file with issue 9's SLO."""
    return ["sim", "--config", str(config), "--trace", str(trace_path), "--start", str(start),
            "--duration", str(duration), "--rate-scale", str(rate), "--slo", "ttft=2s,tpot=50ms",
            "--calibration", str(calibration), "--speed-spread", str(spread), "--out", str(out)]


def sim_command(run, duet, traces, calibration, out, spread=0.0):
    """The `duet sim` command line and environment that replay a stored run's window on its
    deployment file (RUN.toml) with the engine settings it ran with: (argv, env)."""
    trace, start, duration, rate = window(run.name)
    env = dict(os.environ, DUET_PREFILL_THREAD=str(prefill_thread(run)), DUET_DECODE_THREAD=str(decode_thread(run)),
               DUET_DECODE_BUCKET_STEP=str(bucket_step(run)))
    argv = [str(duet)] + sim_argv(f"{run}.toml", f"{traces}/{trace_file(trace)}", start, duration, rate,
                                  calibration, out, spread)
    return argv, env


if __name__ == "__main__":
    run = pathlib.Path(sys.argv[1])
    trace, *rest = window(run.name)
    print(trace_file(trace), *rest, bucket_step(run), prefill_thread(run), decode_thread(run))
