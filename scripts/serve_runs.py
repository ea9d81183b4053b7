"""What a stored H200 serving run (docs/data/h200-serve*/NAME.{toml,json}) replayed, as
scripts/resim-serve.sh reads it: for scripts/fit-concurrency.py and scripts/repeat-spread.py."""
import re


def window(name):
    """The trace, start, duration and rate scale of a run, from its name's prefix."""
    for prefix, w in (("conv5-", "conv 0 300 5"), ("conv45-", "conv 0 240 4.5"),
                      ("conv4-", "conv 0 240 4"), ("conv3long-", "conv 0 540 3"),
                      ("conv3-", "conv 0 180 3"), ("code1-", "code 180 60 1"),
                      ("code-", "code 180 60 0.7")):
        if name.startswith(prefix):
            return w.split()
    raise SystemExit(f"no trace window known for run '{name}'")


def bucket_step(run):
    """The decode graph step the run's engine had (a pathlib.Path): every 32 rows from the
    12-03d runs on, powers of two (0) before them and in runs named -pow2."""
    folder = run.parent.name
    old = folder == "h200-serve" or re.search(r"-12-0[12]|-12-03[bc]?$", folder)
    return 0 if old or run.name.endswith("-pow2") else 32
