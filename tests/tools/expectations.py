"""The checks of tests/tools/check_*.py: each prints ok or FAIL with what it expected, and the
script exits non-zero if any failed."""
import sys

failures = []
checks = 0


def expect(what, ok):
    global checks
    checks += 1
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def finish():
    print(f"{checks - len(failures)} passed, {len(failures)} failed")
    sys.exit(1 if failures else 0)
