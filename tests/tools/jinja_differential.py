#!/usr/bin/env python3
"""Compares the C++ chat-template renderer with transformers' Jinja environment on generated
templates. A development tool (not run by ctest): it needs the .venv-templates of
tests/tools/make_template_fixtures.py and a built render_chat_template.

    cmake --build build --target render_chat_template
    .venv-templates/bin/python tests/tools/jinja_differential.py build/tests/render_chat_template \\
        --mode all --seed 1 --count 3000

Modes: whitespace (random -/+ whitespace control around nested if/for/set/comment/print tags
and awkward text), scoping (random set, loops, ifs, macros, block sets and filter blocks over
names that are also in the context), expressions (random expressions over literals, operators,
filters, tests, methods, subscripts and slices). A case matches when both render the same text
or both fail. Differences that docs/chat-templates.md lists as known are not counted.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import subprocess
import sys
import warnings

from transformers.utils.chat_template_utils import _compile_jinja_template

warnings.filterwarnings("ignore")  # Jinja's compiler warns about constant subscripts

TEXT = ["", " ", "  ", "\n", "\n\n", "\t", " \n ", "x", "a b", "\n  ", "  \n", "\u00a0",
        "\u3000\n", "\r\n", "y\n"]


def whitespace_case(rng: random.Random) -> dict:
    def mod():
        return rng.choice(["", "", "-", "+"])

    def piece(depth):
        r = rng.random()
        if r < 0.3:
            return rng.choice(TEXT)
        if r < 0.45:
            value = rng.choice(["'v'", "n", "none", "'\\n'", "1"])
            return "{{" + rng.choice(["", "-"]) + " " + value + " " + rng.choice(["", "-"]) + "}}"
        if r < 0.55:
            return "{#" + mod() + " c " + mod() + "#}"
        if r < 0.62:
            return "{%" + mod() + " set n = " + str(rng.randint(0, 9)) + " " + mod() + "%}"
        if depth > 2:
            return rng.choice(TEXT)
        body = "".join(piece(depth + 1) for _ in range(rng.randint(0, 4)))
        if r < 0.8:
            s = "{%" + mod() + " if " + rng.choice(["true", "false", "n > 3"]) + " " + mod() + "%}"
            s += body
            if rng.random() < 0.5:
                s += "{%" + mod() + " else " + mod() + "%}"
                s += "".join(piece(depth + 1) for _ in range(rng.randint(0, 3)))
            return s + "{%" + mod() + " endif " + mod() + "%}"
        return ("{%" + mod() + " for i in [1, 2] " + mod() + "%}" + body +
                rng.choice(["", "{{ loop.index }}"]) + "{%" + mod() + " endfor " + mod() + "%}")

    return {"t": "".join(piece(0) for _ in range(rng.randint(1, 6))), "c": {"n": 5}}


def scoping_case(rng: random.Random) -> dict:
    names = ["a", "b", "c"]

    def expr():
        r = rng.random()
        if r < 0.5:
            return rng.choice(names)
        if r < 0.7:
            return str(rng.randint(0, 9))
        if r < 0.8:
            return "ns.x"
        return rng.choice(names) + " ~ " + rng.choice(names)

    def stmt(depth):
        r = rng.random()
        if r < 0.25:
            return "{{ " + expr() + " }}"
        if r < 0.45:
            return "{% set " + rng.choice(names) + " = " + expr() + " %}"
        if r < 0.5:
            return "{% set ns.x = " + expr() + " %}"
        if r < 0.55:
            return "{{ m() }}"
        if depth > 2:
            return "{{ " + expr() + " }}"

        def body():
            return "".join(stmt(depth + 1) for _ in range(rng.randint(0, 3)))

        if r < 0.68:
            s = "{% if " + rng.choice(["true", "false", rng.choice(names)]) + " %}" + body()
            for _ in range(rng.randint(0, 2)):
                s += "{% elif " + rng.choice(["true", "false"]) + " %}" + body()
            if rng.random() < 0.5:
                s += "{% else %}" + body()
            return s + "{% endif %}"
        if r < 0.82:
            s = "{% for i in " + rng.choice(["[1, 2]", "[]", "[3]"]) + " %}" + body()
            if rng.random() < 0.3:
                s += "{% else %}" + body()
            return s + "{% endfor %}"
        if r < 0.88:
            return "{% macro m() %}" + body() + "{% endmacro %}"
        if r < 0.94:
            return "{% set " + rng.choice(names) + " %}" + body() + "{% endset %}"
        return "{% filter upper %}" + body() + "{% endfilter %}"

    template = "{% set ns = namespace(x='X') %}" + "".join(
        stmt(0) for _ in range(rng.randint(1, 7)))
    return {"t": template, "c": {"a": "A", "c": "C"}}


ATOMS = ["0", "1", "-3", "7", "2.0", "0.5", "-1.25", "1e20", "''", "'a'", "'Ab c'", "' x '",
         "'é'", "'a,b'", "'x\\ny'", "none", "true", "false", "[1, 'a']", "[]", "[3, 1, 2]",
         "{'k': 1, 'a': 'b'}", "{}", "s", "n", "f", "xs", "d", "u", "m", "m.role", "m['content']",
         "m.missing", "ws"]
FILTERS = ["length", "upper", "lower", "trim", "first", "last", "join(',')", "default('D')",
           "default('D', true)", "string", "int", "float", "list", "reverse|list", "tojson", "abs",
           "round", "round(1)", "sort|list", "unique|list", "capitalize", "title",
           "replace('a', 'b')", "select('odd')|list", "reject('even')|list", "map('string')|list",
           "count", "trim('x')", "tojson(indent=1)", "int(5)", "first|default('F')", "sum", "min",
           "max", "indent(2)", "wordcount"]
TESTS = ["defined", "undefined", "none", "string", "number", "integer", "float", "mapping",
         "iterable", "sequence", "odd", "even", "divisibleby 2", "boolean", "true", "false",
         "eq 1", "in 'abc'", "in [1, 2]", "lower", "upper"]
METHODS = ["strip()", "split(',')", "split()", "startswith('a')", "endswith(('c', 'b'))",
           "upper()", "lower()", "replace('a', 'b')", "lstrip()", "rstrip('x')", "title()",
           "count('a')", "find('a')", "get('k')", "get('k', 0)", "keys()|list", "values()|list",
           "split(',', 1)", "rsplit(None, 1)", "capitalize()", "isdigit()", "splitlines()",
           "index(1)", "count(1)", "startswith(s)"]
OPERATORS = ["+", "-", "*", "/", "//", "%", "**", "~", "==", "!=", "<", "<=", ">", ">=", "in",
             "not in", "and", "or"]
SUBSCRIPTS = ["[0]", "[-1]", "[1:]", "[::-1]", "['k']", ".k", "[:2]", "[5]", "[-2::-1]"]
EXPR_CONTEXT = {"s": "héllo, World", "n": 3, "f": 2.5, "xs": [3, "b", None, 1.5],
                "d": {"k": "v", "z": [1, 2]}, "m": {"role": "user", "content": " hi "},
                "ws": " \t\n"}


def expression_case(rng: random.Random) -> dict:
    def e(depth):
        r = rng.random()
        if depth > 3 or r < 0.3:
            return rng.choice(ATOMS)
        if r < 0.45:
            return "(" + e(depth + 1) + " " + rng.choice(OPERATORS) + " " + e(depth + 1) + ")"
        if r < 0.55:
            return "(" + e(depth + 1) + "|" + rng.choice(FILTERS) + ")"
        if r < 0.62:
            return ("(" + e(depth + 1) + " is " + rng.choice(["", "not "]) + rng.choice(TESTS) +
                    ")")
        if r < 0.72:
            return "(" + e(depth + 1) + ")." + rng.choice(METHODS)
        if r < 0.78:
            return "(" + e(depth + 1) + " if " + e(depth + 1) + " else " + e(depth + 1) + ")"
        if r < 0.84:
            return "(not " + e(depth + 1) + ")"
        if r < 0.88:
            return "(-" + e(depth + 1) + ")"
        return "(" + e(depth + 1) + ")" + rng.choice(SUBSCRIPTS)

    return {"t": "{{ " + e(0) + " }}", "c": EXPR_CONTEXT}


def known_difference(ours: dict) -> bool:
    """Differences docs/chat-templates.md lists: slices of non-sequences, % formatting, ints."""
    error = ours.get("e", "")
    return any(k in error for k in ("subscriptable", "'slice'", "printf-style", "(64-bit)"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("renderer", help="path of the built render_chat_template")
    ap.add_argument("--mode", choices=["whitespace", "scoping", "expressions", "all"],
                    default="all")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=3000, help="cases per mode")
    ap.add_argument("--show", type=int, default=10, help="differences to print")
    args = ap.parse_args()

    makers = {"whitespace": whitespace_case, "scoping": scoping_case,
              "expressions": expression_case}
    modes = list(makers) if args.mode == "all" else [args.mode]
    total_bad = 0
    for mode in modes:
        rng = random.Random(args.seed)
        cases = [makers[mode](rng) for _ in range(args.count)]
        run = subprocess.run([args.renderer], input="".join(json.dumps(c) + "\n" for c in cases),
                             capture_output=True, text=True, check=True)
        ours_all = [json.loads(line) for line in run.stdout.splitlines()]
        bad = 0
        for case, ours in zip(cases, ours_all):
            try:
                template = _compile_jinja_template(case["t"])
                want = {"o": template.render(**copy.deepcopy(case["c"]))}
            except Exception as exc:  # any Jinja failure counts as "fails"
                want = {"e": f"{type(exc).__name__}: {exc}"}
            same = ("o" in want) == ("o" in ours) and want.get("o") == ours.get("o")
            if same or known_difference(ours):
                continue
            bad += 1
            if bad <= args.show:
                print(f"[{mode}] {case['t']!r}\n  jinja: {want!r:.300}\n  ours:  {ours!r:.300}")
        print(f"{mode}: {bad} differences in {len(cases)} cases")
        total_bad += bad
    return 1 if total_bad else 0


if __name__ == "__main__":
    sys.exit(main())
