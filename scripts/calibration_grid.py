"""Calibration grids for the fitting scripts (scripts/fit-concurrency.py, scripts/fit-prefill-mix.py):
a base calibration file with keys replaced, and the points of --grid KEY=V1,,V2 options."""
import itertools
import re


def with_keys(base_text, keys):
    """The calibration text with each key's line replaced (or appended; None removes it)."""
    text = base_text
    for key, value in keys.items():
        pattern = re.compile(rf"^{re.escape(key)}\s*=.*$", re.M)
        line = "" if value is None else f"{key} = {value}"
        text = pattern.sub(line, text) if pattern.search(text) else text + line + "\n"
    return text


def grid_points(grids):
    """Every point of the product of `KEY=V1,,V2,,...` options (TOML values; "-" leaves the key
    out), as lists of (key, value) pairs; one empty point without options."""
    axes = []
    for g in grids:
        key, _, values = g.partition("=")
        axes.append([(key, None if v.strip() == "-" else v.strip()) for v in values.split(",,")])
    return list(itertools.product(*axes)) if axes else [()]
