#!/usr/bin/env python3
"""Generates the chat-template fixtures in tests/data/chat-templates/ with HF transformers.

Run by hand when the fixtures must change; the outputs are committed and the C++ test
(tests/test_chat_template.cpp) only reads them. Nothing here runs at test time. No torch needed.

    python3 -m venv .venv-templates
    .venv-templates/bin/pip install transformers==5.24.0 tokenizers==0.23.3 \
        huggingface_hub==2.4.0 Jinja2==3.1.6          # pins: tests/requirements-fixtures.txt
    .venv-templates/bin/python tests/tools/make_template_fixtures.py

What it writes:

  <name>.jinja    the template sources, byte for byte as the models publish them (README.md
                  beside them gives each one's source and licence)
  language.json   short templates, one per language feature, with what Jinja renders
  fixtures.json   for each template and conversation: the messages, tools, flags, the special
                  tokens the tokenizer passes, and either the text that
                  `tokenizer.apply_chat_template(..., tokenize=False)` renders or the message of
                  the exception the template raises

Every expected text comes from apply_chat_template itself; the script then renders the same
template once more with transformers' own Jinja environment (`_compile_jinja_template`) on the
context exactly as the fixture stores it, and fails unless both agree. So the stored context is
precisely what the template saw, and a C++ renderer fed that context must give the same bytes.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from pathlib import Path

import jinja2
import tokenizers
import transformers
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import chat_template_utils as ctu

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "data" / "chat-templates"
TOKENIZERS = ROOT / "tests" / "data" / "tokenizers"
SMOLLM2_GGUF = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"

PINNED = {"transformers": "5.24.0", "jinja2": "3.1.6", "tokenizers": "0.23.3"}

# deepseek-ai/DeepSeek-R1-Distill-Llama-8B and -Qwen-1.5B (and the other R1 distills) publish
# this chat_template in tokenizer_config.json, revision of February 2025 (the generation prompt
# ends in "<think>\n"). Kept here as the JSON string literal of that file, escapes and all.
DEEPSEEK_R1_DISTILL_JSON = r'''"{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"'''

# HuggingFaceTB/SmolLM2-135M-Instruct tokenizer_config.json chat_template (ChatML with a default
# system prompt). The GGUF that scripts/fetch-model.sh fetches carries the same text as
# tokenizer.chat_template; when that file is present the script checks the two agree.
SMOLLM2_JSON = r'''"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"'''

# meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json chat_template: the tool-calling
# template (custom tools in the first user message, tojson(indent=4), ipython role). The
# tests/data/tokenizers/llama3_1 config carries the shorter Llama-3 template instead.
LLAMA3_1_TOOLS = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def tiny_tokenizer(**special: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose only purpose is to carry the special tokens of a model."""
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(special.values()))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab))))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def load_templates() -> dict[str, str]:
    templates = {}
    for name in ("llama3_1", "qwen3"):
        config = json.loads((TOKENIZERS / name / "tokenizer_config.json").read_text("utf-8"))
        templates[name] = config["chat_template"]
    templates["llama3_1_tools"] = LLAMA3_1_TOOLS
    templates["deepseek_r1_distill"] = json.loads(DEEPSEEK_R1_DISTILL_JSON)
    templates["smollm2"] = json.loads(SMOLLM2_JSON)
    if SMOLLM2_GGUF.exists():
        try:
            from gguf import GGUFReader
        except ImportError:
            GGUFReader = None
        if GGUFReader is not None:
            field = GGUFReader(str(SMOLLM2_GGUF)).fields["tokenizer.chat_template"]
            embedded = bytes(field.parts[field.data[0]]).decode("utf-8")
            if embedded != templates["smollm2"]:
                sys.exit("SmolLM2 template differs from the one embedded in the GGUF")
    return templates


def make_tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    llama = AutoTokenizer.from_pretrained(str(TOKENIZERS / "llama3_1"))
    return {
        "llama3_1": llama,
        "llama3_1_tools": llama,
        "qwen3": AutoTokenizer.from_pretrained(str(TOKENIZERS / "qwen3")),
        # DeepSeek-R1-Distill-Llama-8B: bos, eos and pad as its tokenizer_config.json names them.
        "deepseek_r1_distill": tiny_tokenizer(
            bos_token="<｜begin▁of▁sentence｜>",
            eos_token="<｜end▁of▁sentence｜>",
            pad_token="<｜end▁of▁sentence｜>",
        ),
        # SmolLM2-135M-Instruct's special tokens.
        "smollm2": tiny_tokenizer(
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            unk_token="<|endoftext|>",
            pad_token="<|im_end|>",
        ),
    }


def sys_msg(text):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}
CLOCK_TOOL = {
    "type": "function",
    "function": {"name": "now", "description": "Current time", "parameters": {}},
}


def tool_call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


UNICODE_TEXT = "Grüße aus Zürich — 日本語のテキスト, emoji 🌍🚀, “quotes” and ‘apostrophes’ … ñ"
AWKWARD_TEXT = '  Tabs\there, "double" and \'single\' quotes, back\\slash, {{ not a tag }} {% raw %}\n\n'
THINKING = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help?"

# (name, messages, flags): flags are add_generation_prompt plus extra template variables.
COMMON_CONVERSATIONS = [
    ("system_user_generation", [sys_msg("You are a terse assistant."), user("What is 2+2?")],
     {"add_generation_prompt": True}),
    ("multi_turn", [
        sys_msg("You are helpful."),
        user("Hi!"),
        assistant("Hello! How can I help?"),
        user("Tell me a joke."),
    ], {"add_generation_prompt": True}),
    ("multi_turn_no_generation_prompt", [
        user("Hi!"),
        assistant("Hello!"),
        user("Bye."),
        assistant("Goodbye."),
    ], {"add_generation_prompt": False}),
    ("assistant_thinking_in_history", [
        user("Hello"),
        assistant(THINKING),
        user("What is the capital of France?"),
    ], {"add_generation_prompt": True}),
    ("assistant_thinking_last", [user("Hello"), assistant(THINKING)],
     {"add_generation_prompt": False}),
    ("no_system", [user("Just a question.")], {"add_generation_prompt": True}),
    ("no_system_no_generation_prompt", [user("Just a question.")],
     {"add_generation_prompt": False}),
    ("empty_content", [sys_msg(""), user(""), assistant(""), user("")],
     {"add_generation_prompt": True}),
    ("unicode", [sys_msg("Réponds en français. 🤖"), user(UNICODE_TEXT),
                 assistant("Natürlich! 日本語も大丈夫です。"), user("Ещё раз, пожалуйста 🙏")],
     {"add_generation_prompt": True}),
    ("whitespace_and_quotes", [user(AWKWARD_TEXT), assistant("\n  indented answer  \n"),
                               user("  \n")], {"add_generation_prompt": True}),
    ("two_system_messages", [sys_msg("First rule."), user("Hi"), sys_msg("Second rule."),
                             user("Again")], {"add_generation_prompt": True}),
]

QWEN3_EXTRA = [
    ("enable_thinking_false", [user("Quick answer please.")],
     {"add_generation_prompt": True, "enable_thinking": False}),
    ("enable_thinking_true", [user("Think first.")],
     {"add_generation_prompt": True, "enable_thinking": True}),
    ("reasoning_content_field", [
        user("Hello"),
        assistant("Hi there!", reasoning_content="The user said hello."),
        user("How are you?"),
        assistant("Fine, thanks.", reasoning_content="\nA polite reply.\n"),
    ], {"add_generation_prompt": False}),
    ("tools_and_tool_calls", [
        sys_msg("You can look up the weather."),
        user("Weather in Zürich and Paris?"),
        assistant("", tool_calls=[
            tool_call("get_weather", {"city": "Zürich", "unit": "celsius"}),
            tool_call("get_weather", '{"city": "Paris"}'),
        ]),
        {"role": "tool", "content": '{"temperature": 21.5, "sky": "clear"}'},
        {"role": "tool", "content": '{"temperature": 18, "sky": "cloudy"}'},
        assistant("<think>\nBoth results are in.\n</think>\n\nZürich: 21.5 °C, Paris: 18 °C."),
    ], {"add_generation_prompt": False, "tools": [WEATHER_TOOL, CLOCK_TOOL]}),
    ("tools_without_system", [user("What time is it?")],
     {"add_generation_prompt": True, "tools": [CLOCK_TOOL]}),
    ("tool_response_after_user", [
        user("Call the clock."),
        assistant("Calling it.", tool_calls=[tool_call("now", {})]),
        {"role": "tool", "content": "12:00"},
        user("<tool_response>\nfake\n</tool_response>"),
    ], {"add_generation_prompt": True}),
]

LLAMA_TOOLS_EXTRA = [
    ("tools_in_user_message", [sys_msg("Use tools when needed."), user("  Weather in Oslo?  ")],
     {"add_generation_prompt": True, "tools": [WEATHER_TOOL], "date_string": "07 Feb 2025"}),
    ("tools_in_system_message", [user("Weather in Oslo?")],
     {"add_generation_prompt": True, "tools": [WEATHER_TOOL, CLOCK_TOOL],
      "tools_in_user_message": False}),
    ("tool_call_and_result", [
        user("Weather in Oslo?"),
        assistant("", tool_calls=[tool_call("get_weather", {"city": "Oslo", "days": 2})]),
        {"role": "tool", "content": {"temperature": -3, "note": "snow ❄"}},
        {"role": "ipython", "content": "plain text result"},
    ], {"add_generation_prompt": True, "tools": [WEATHER_TOOL]}),
    ("builtin_tools", [
        sys_msg("Be brief."),
        user("Search the web."),
        assistant("", tool_calls=[tool_call("brave_search", {"query": "duet", "n": "3"})]),
    ], {"add_generation_prompt": False,
        "builtin_tools": ["brave_search", "code_interpreter", "wolfram_alpha"]}),
    ("two_tool_calls_raise", [
        user("Two calls"),
        assistant("", tool_calls=[tool_call("now", {}), tool_call("now", {})]),
    ], {"add_generation_prompt": False}),
    ("tools_without_user_message_raise", [sys_msg("Only a system message.")],
     {"add_generation_prompt": True, "tools": [CLOCK_TOOL]}),
]

DEEPSEEK_EXTRA = [
    ("tool_outputs", [
        user("Use the tool."),
        assistant("", tool_calls=[tool_call("now", "{}")]),
        {"role": "tool", "content": "12:00"},
        {"role": "tool", "content": "UTC"},
        assistant("It is noon."),
    ], {"add_generation_prompt": True}),
    ("trailing_tool_output", [user("Use the tool."), {"role": "tool", "content": "42"}],
     {"add_generation_prompt": True}),
]

PER_TEMPLATE_EXTRA = {
    "qwen3": QWEN3_EXTRA,
    "llama3_1_tools": LLAMA_TOOLS_EXTRA,
    "deepseek_r1_distill": DEEPSEEK_EXTRA,
}


# Language cases: (a sentence naming the behaviour, template, context). Expected texts come
# from transformers' Jinja environment. Tuples are left out of printed results: the C++
# renderer holds them as lists (docs/chat-templates.md).
LANGUAGE_CASES = [
    ("trim_blocks drops the newline after a block tag and lstrip_blocks the indent before it",
     "{% if true %}\n  yes\n{% endif %}\nafter", {}),
    ("minus signs strip all whitespace on their side of a tag",
     "a  {%- if true -%}  b  {%- endif -%}  c", {}),
    ("lstrip_blocks strips only the indentation of a line that starts with a block tag",
     "line\n    {% if true %}x{% endif %}\n", {}),
    ("print tags are never lstripped and keep the newline after them",
     "  {{ 'v' }}  \n  {% set x = 1 %}\nz", {}),
    ("comments are dropped and take part in whitespace control",
     "a\n  {#- comment -#}  \nb {# c #}\nd", {}),
    ("plus signs turn lstrip_blocks and trim_blocks off for one tag",
     "  {%+ if true %}k{% endif +%}\nm", {}),
    ("CRLF becomes LF and one trailing newline is dropped", "x\r\ny\r\n", {}),
    ("raw blocks are not parsed", "{% raw %}{{ not parsed }}{% endraw %}", {}),
    ("a for loop provides loop.index, index0, length, first, last and revindex",
     "{% for m in ms %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.length }}/{{ loop.first }}/"
     "{{ loop.last }}/{{ loop.revindex }} {% endfor %}", {"ms": ["a", "b", "c"]}),
    ("a loop filter skips items before loop counts them",
     "{% for m in ms if m != 'b' %}{{ m }}{{ loop.index }}{{ ',' if not loop.last }}{% endfor %}",
     {"ms": ["a", "b", "c"]}),
    ("the else branch of a for loop runs when nothing was iterated",
     "{% for m in [] %}x{% else %}empty{% endfor %}", {}),
    ("for loops unpack pairs and iterate dict keys in order",
     "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|{% for k, v in d|items %}{{ k }}"
     "{% endfor %}|{% for k in d %}{{ k }}{% endfor %}", {"d": {"z": 1, "a": [1, 2]}}),
    ("break and continue control the innermost loop",
     "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}"
     "{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("a set inside a loop does not outlive its iteration",
     "{% set x = 'outer' %}{% for i in [1, 2] %}{{ x }}{% set x = i %}{{ x }}{% endfor %}|{{ x }}",
     {}),
    ("namespace attributes carry values out of loops",
     "{% set ns = namespace(n=0, s='') %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}"
     "{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.n }} {{ ns.s }}", {}),
    ("nested loops each have their own loop variable",
     "{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{{ b }}{% endfor %}"
     "{{ loop.index }}{% endfor %}", {}),
    ("loop.previtem, loop.nextitem and loop.cycle",
     "{% for x in xs %}{{ loop.previtem | default('-') }}{{ x }}{{ loop.nextitem | default('-') }}"
     " {{ loop.cycle('o', 'e') }};{% endfor %}", {"xs": [1, 2, 3]}),
    ("if, elif and else pick the first true branch",
     "{% if n > 2 %}big{% elif n > 1 %}mid{% else %}small{% endif %}", {"n": 2}),
    ("set unpacks, and block sets capture output through filters",
     "{% set a, b = [1, 2] %}{{ b }}{{ a }}{% set c %}block {{ a }}{% endset %}[{{ c }}]"
     "{% set d | upper %}up{% endset %}{{ d }}", {}),
    ("macros take positional, keyword and default arguments",
     "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} "
     "{{ greet('B', '?') }} {{ greet(name='C', punct='.') }}", {}),
    ("string literals decode Python escapes and adjacent literals join",
     r"{{ 'a\tb\n\'q\' \\ \u00e9 \x41 \101' }}|{{ " + '"dq"' + r" 'adj' }}", {}),
    ("numbers, booleans, none, lists and dicts print as Python prints them",
     "{{ 42 }}|{{ 1_000 }}|{{ 0x1F }}|{{ 2.5 }}|{{ 1e3 }}|{{ true }}|{{ none }}|"
     "{{ [1, 'two', none, true, 1.5] }}|{{ {'k': 'v', 'n': {'x': 1}} }}", {}),
    ("items and attributes are read with [] and dot, missing ones are empty",
     "{{ m['role'] }} {{ m.role }} [{{ m.missing }}] {{ xs[0] }} {{ xs[-1] }} [{{ xs[10] }}]",
     {"m": {"role": "user"}, "xs": [1, 2, 3]}),
    ("slices follow Python on lists and on characters of strings",
     "{{ xs[1:] }} {{ xs[::-1] }} {{ xs[:-1] }} {{ 'hello'[1:3] }} {{ 'héllo'[::-2] }} "
     "{{ 'héllo'[1] }} {{ xs[5:] }} {{ xs[-2::-1] }}", {"xs": [1, 2, 3]}),
    ("arithmetic follows Python: true division, floor division, modulo and powers",
     "{{ 7 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} "
     "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7.5 // 2 }} {{ 0.1 + 0.2 }} {{ 10 / 5 }} {{ -3 }} "
     "{{ 1e16 }} {{ 1e-5 }} {{ 123456789.125 }} {{ -2.5 % 2 }}", {}),
    ("plus concatenates strings and lists, tilde converts to strings first",
     "{{ 'a' + 'b' }} {{ 'a' ~ 1 ~ none ~ true }} {{ [1] + [2] }} {{ 'ab' * 3 }} {{ 3 * [0] }} "
     "{{ true + 1 }}", {}),
    ("comparisons chain and compare numbers across int, float and bool",
     "{{ 1 == 1.0 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' < 'b' }} {{ [1, 2] == [1, 2] }} "
     "{{ 'ell' in 'hello' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1, 2] }} "
     "{{ none == none }} {{ true == 1 }} {{ '1' == 1 }} {{ [1, 2] < [1, 3] }}", {}),
    ("and, or and the inline if return operands",
     "{{ 0 or 'x' }} {{ 'a' and 'b' }} [{{ '' and 'b' }}] {{ not [] }} "
     "{{ 'y' if 1 > 2 else 'n' }} [{{ 'y' if false }}] {{ none or [] }}", {}),
    ("tests check definedness and types",
     "{{ x is defined }} {{ y is defined }} {{ y is undefined }} {{ n is none }} "
     "{{ n is not none }} {{ x is string }} {{ d is mapping }} {{ xs is iterable }} "
     "{{ x is iterable }} {{ 1 is iterable }} {{ y is iterable }} {{ d is sequence }} "
     "{{ range is callable }}",
     {"x": "s", "n": None, "d": {"a": 1}, "xs": [1]}),
    ("tests of numbers and values",
     "{{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 1 is number }} "
     "{{ true is number }} {{ true is integer }} {{ 1.5 is float }} {{ true is boolean }} "
     "{{ false is false }} {{ 1 is true }} {{ 'a' is equalto 'a' }} {{ 2 is gt 1 }} "
     "{{ 'a' is in 'abc' }} {{ 'x' is lower }} {{ 'X' is upper }} {{ none is sameas none }}", {}),
    ("string filters",
     "[{{ '  pad  ' | trim }}] [{{ 'xxaxx' | trim('x') }}] {{ 'Hello' | upper }} "
     "{{ 'Hello' | lower }} {{ 'hello world' | capitalize }} {{ 'hello-world foo' | title }} "
     "{{ 'aXbX' | replace('X', '.') }} {{ 'aaa' | replace('a', 'b', 2) }} {{ 5 | string }} "
     "{{ '<b>' | safe }} {{ '<&>' | escape }}", {}),
    ("length, first, last, join and default",
     "{{ 'abc' | length }} {{ [1, 2] | length }} {{ {'a': 1} | count }} {{ y | length }} "
     "{{ [3, 1, 2] | first }} {{ [3, 1, 2] | last }} {{ 'xyz' | first }} "
     "{{ [1, 2, 3] | join('-') }} {{ ['a', 'b'] | join }} {{ y | default('dflt') }} "
     "{{ '' | default('e', true) }} {{ none | default('n') }}", {}),
    ("conversions: list, int, float, string, reverse, abs and round",
     "{{ 'ab' | list }} {{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int(7) }} {{ 3.9 | int }} "
     "{{ '2.5' | float }} {{ [1, 2] | string }} {{ [1, 2, 3] | reverse | list }} "
     "{{ 'abc' | reverse }} {{ -3 | abs }} {{ 2.567 | round(2) }} {{ 2.5 | round }} "
     "{{ 2.1 | round(0, 'ceil') }}", {}),
    ("selectattr, rejectattr, select, reject and map",
     "{{ users | selectattr('active') | map(attribute='name') | join(',') }} "
     "{{ users | rejectattr('active') | map(attribute='name') | list }} "
     "{{ users | selectattr('age', 'gt', 30) | map(attribute='name') | first }} "
     "{{ [1, 2, 3, 4] | select('odd') | list }} {{ [1, 2, 3, 4] | reject('odd') | list }} "
     "{{ ['a', 'B'] | map('upper') | list }} {{ users | map(attribute='age') | sum }} "
     "{{ users | map(attribute='nick', default='?') | list }} "
     "{{ users | selectattr('name', 'equalto', 'bob') | list | length }}",
     {"users": [{"name": "ann", "active": True, "age": 31},
                {"name": "bob", "active": False, "age": 25},
                {"name": "cy", "active": True, "age": 40}]}),
    ("sort, unique, min and max",
     "{{ [3, 1, 2] | sort | list }} {{ ['b', 'A', 'c'] | sort | list }} "
     "{{ [3, 1, 2] | sort(reverse=true) | list }} {{ [1, 2, 1, 3] | unique | list }} "
     "{{ [4, 2, 9] | min }} {{ [4, 2, 9] | max }} "
     "{{ users | sort(attribute='age') | map(attribute='name') | list }}",
     {"users": [{"name": "ann", "age": 31}, {"name": "bob", "age": 25}]}),
    ("tojson keeps non-ASCII text and key order, with indent, separators and sort_keys",
     "{{ obj | tojson }}|{{ obj | tojson(indent=2) }}|{{ obj | tojson(ensure_ascii=true) }}|"
     "{{ obj | tojson(separators=(',', ':')) }}|{{ obj | tojson(sort_keys=true) }}|"
     "{{ [] | tojson(indent=2) }}|{{ 'x\"\\\\\\n\\u0001' | tojson }}|{{ 'a' | tojson(indent='\\t') }}",
     {"obj": {"z": "é\u2028😀", "a": [1, 2.5, None, True, {}], "n": 1e100, "i": -7}}),
    ("indent and wordcount",
     "{{ 'line1\\nline2\\n\\nline4' | indent(2) }}|{{ 'a\\nb' | indent(first=true) }}|"
     "{{ 'a\\n\\nb' | indent(2, blank=true) }}|{{ 'one two  three' | wordcount }}", {}),
    ("string methods strip, split, startswith, replace and friends",
     "[{{ '  s  '.strip() }}] [{{ 'xxsxx'.strip('x') }}] [{{ '\\n\\ns\\n'.lstrip('\\n') }}] "
     "[{{ 's  '.rstrip() }}] {{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} "
     "{{ 'a b c'.split(' ', 1) }} {{ 'a,b,c'.rsplit(',', 1) }} {{ 'abc'.startswith('ab') }} "
     "{{ 'abc'.endswith(('x', 'c')) }} {{ 'aXa'.replace('a', 'b') }} {{ 'aB'.upper() }} "
     "{{ 'aB'.lower() }} {{ 'hello world'.title() }} {{ 'hello'.capitalize() }} "
     "{{ 'hello'.find('l') }} {{ 'hello'.count('l') }} {{ '-'.join(['a', 'b']) }} "
     "{{ '12'.isdigit() }} {{ 'Hi {} and {name}'.format('x', name='y') }} "
     "{{ ' a b '.split(none, 1) }} {{ ' a b '.rsplit(none, 1) }} {{ 'a  '.split(none, 1) }}",
     {}),
    ("dict and list methods",
     "{{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 5) }} {{ d.keys() | list }} "
     "{{ d.values() | list }} {{ [1, 2, 1].count(1) }} {{ [5, 6].index(6) }} "
     "{% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %}", {"d": {"a": 1, "b": 2}}),
    ("unicode text is measured, indexed, cased and split by characters",
     "{{ s | length }} {{ s | upper }} {{ s[0] }} {{ s[-1] }} {{ s.split('ü') }} {{ [s] }} "
     "{{ 'Straße' | lower }} {{ 'ÉCOLE' | lower }} {{ 'ÿ' | upper }}", {"s": "Grüße 🌍"}),
    ("strings inside lists print with Python's repr quoting and escapes",
     r"{{ ['it\'s', 'say " + '"hi"' + r"', 'both \' " + '"' + r"', 'tab\t', 'nl\n', '\x00', 'é', '\u00a0', '\u2028', '\\'] }}",
     {}),
    ("range, dict and namespace globals",
     "{{ range(3) | list }} {{ range(1, 7, 2) | list }} {{ range(3, 0, -1) | list }} "
     "{{ dict(a=1, b='x') }} {{ namespace(a=1).a }} {{ namespace({'b': 2}, c=3).b }}", {}),
    ("the generation tag renders its body", "{% generation %}gen{% endgeneration %}", {}),
    ("a name assigned later at top level is undefined in an earlier loop, not the context's",
     "{% for i in [1] %}[{{ n }}]{% endfor %}{% set n = 4 %}{{ n }}", {"n": 5}),
    ("a name read at top level before its assignment still sees the context",
     "{{ n }}{% set n = 4 %}{{ n }}", {"n": 5}),
    ("an assignment inside an if leaves the context value visible to an earlier loop",
     "{% for i in [1] %}[{{ n }}]{% endfor %}{% if true %}{% set n = 4 %}{% endif %}{{ n }}",
     {"n": 5}),
    ("a name assigned later in a loop body is undefined in a loop nested before it",
     "{% for i in [1, 2] %}{% for j in [1] %}[{{ n }}]{% endfor %}{% set n = 8 %}{% endfor %}",
     {"n": 5}),
    ("macros see the names of the frame they were defined in, as closures",
     "{% macro m() %}{{ n }}{% endmacro %}[{{ m() }}]{% set n = 3 %}[{{ m() }}]"
     "{% for i in [1] %}{% set b = 7 %}{% macro k() %}{{ b }}{% endmacro %}{{ k() }}{% endfor %}",
     {"n": 5}),
    ("sets inside for-else, filter blocks and block sets stay inside",
     "{% for i in [] %}{% else %}{% set x = 1 %}{% endfor %}[{{ x }}]"
     "{% filter upper %}{% set y = 2 %}{% endfilter %}[{{ y }}]"
     "{% set z %}{% set w = 3 %}{% endset %}[{{ w }}]", {}),
    ("select, reject and map of a false value give nothing; round keeps ints",
     "{{ none | select('odd') | list }} {{ 0 | map('string') | list }} {{ 3 | round }} "
     "{{ 1234 | round(-2) }} {{ 4.0 is even }} {{ 1.5 is odd }} {{ {'a': 1} is lower }}", {}),
    ("filter blocks filter their output", "{% filter upper %}shout {{ 'it' }}{% endfilter %}",
     {}),
    ("context values of every JSON type print as Python would",
     "{{ i }} {{ f }} {{ b }} {{ n }} {{ s }} {{ l }} {{ o }} {{ big }}",
     {"i": 3, "f": 0.5, "b": False, "n": None, "s": "t", "l": [1, "x"], "o": {"k": [None]},
      "big": 12345678901234567}),
]


def language_fixtures():
    out = []
    for name, template, context in LANGUAGE_CASES:
        try:
            rendered = ctu._compile_jinja_template(template).render(**copy.deepcopy(context))
        except jinja2.exceptions.TemplateError as exc:
            sys.exit(f"language case {name!r} failed in Jinja: {exc}")
        out.append({"name": name, "template": template, "context": context,
                    "expected": rendered})
    return out


# Seeded random conversations over awkward contents, to catch what the named cases miss.
RANDOM_SEED = 20250207
RANDOM_PER_TEMPLATE = 8
RANDOM_CONTENTS = [
    "", " ", "\n", "plain words", "  padded  ", "\n\nleading newlines", "trailing newlines\n\n",
    "tabs\tand\r\ncarriage returns", "quotes ' \" and backslashes \\ \\n", "{{ braces }} {% tags %}",
    "<think>\nhidden thoughts\n</think>\n\nvisible answer", "<think>unclosed thinking",
    "only </think> closing", "<tool_response>\nresult\n</tool_response>", "Ünïcödé — 漢字 — 😀👍🏽",
    "\u00a0non-breaking\u00a0spaces\u2028line separator", "emoji at end 🎉", "x" * 300,
]


def random_conversations(rng):
    cases = []
    for k in range(RANDOM_PER_TEMPLATE):
        messages = []
        if rng.random() < 0.5:
            messages.append(sys_msg(rng.choice(RANDOM_CONTENTS)))
        for turn in range(rng.randint(1, 4)):
            messages.append(user(rng.choice(RANDOM_CONTENTS)))
            if turn < 3 and rng.random() < 0.8:
                messages.append(assistant(rng.choice(RANDOM_CONTENTS)))
        if rng.random() < 0.3 and messages[-1]["role"] == "assistant":
            messages.pop()
        cases.append((f"random_{k}", messages, {"add_generation_prompt": rng.random() < 0.6}))
    return cases


def render_fixture(template_name, template, tokenizer, case_name, messages, flags):
    flags = dict(flags)
    add_generation_prompt = flags.pop("add_generation_prompt")
    tools = flags.pop("tools", None)
    fixture = {
        "name": f"{template_name}/{case_name}",
        "template": template_name,
        "messages": copy.deepcopy(messages),
        "tools": copy.deepcopy(tools),
        "add_generation_prompt": add_generation_prompt,
        "kwargs": copy.deepcopy(flags),
        "special_tokens": dict(tokenizer.special_tokens_map),
    }
    expected = error = None
    try:
        expected = tokenizer.apply_chat_template(
            copy.deepcopy(messages), tools=copy.deepcopy(tools), chat_template=template,
            add_generation_prompt=add_generation_prompt, tokenize=False, **copy.deepcopy(flags))
    except jinja2.exceptions.TemplateError as exc:
        error = str(exc)

    # transformers hands the template the messages after two rewrites; store them as seen.
    seen = ctu._alias_reasoning_fields(ctu._normalize_chat_messages(copy.deepcopy(messages)))
    fixture["messages"] = seen
    context = {"messages": seen, "tools": fixture["tools"], "documents": None,
               "add_generation_prompt": add_generation_prompt,
               **fixture["special_tokens"], **fixture["kwargs"]}
    try:
        again = ctu._compile_jinja_template(template).render(**copy.deepcopy(context))
        again_error = None
    except jinja2.exceptions.TemplateError as exc:
        again, again_error = None, str(exc)
    if (again, again_error) != (expected, error):
        sys.exit(f"{fixture['name']}: the stored context does not reproduce apply_chat_template")

    if error is not None:
        fixture["error"] = error
    else:
        fixture["expected"] = expected
    return fixture


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    versions = {"transformers": transformers.__version__, "jinja2": jinja2.__version__,
                "tokenizers": tokenizers.__version__}
    if versions != PINNED:
        sys.exit(f"pinned versions {PINNED} expected, found {versions}")

    templates = load_templates()
    toks = make_tokenizers()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in templates.items():
        (args.out / f"{name}.jinja").write_bytes(text.encode("utf-8"))

    fixtures = []
    rng = random.Random(RANDOM_SEED)
    for name, text in templates.items():
        cases = COMMON_CONVERSATIONS + PER_TEMPLATE_EXTRA.get(name, []) + random_conversations(rng)
        for case_name, messages, flags in cases:
            fixtures.append(render_fixture(name, text, toks[name], case_name, messages, flags))

    doc = {
        "generator": "tests/tools/make_template_fixtures.py",
        "versions": versions,
        "context": "messages, tools, documents (null), add_generation_prompt, then "
                   "special_tokens, then kwargs, as transformers' render_jinja_template passes them",
        "fixtures": fixtures,
    }
    with open(args.out / "fixtures.json", "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    language = {
        "generator": "tests/tools/make_template_fixtures.py",
        "versions": versions,
        "cases": language_fixtures(),
    }
    with open(args.out / "language.json", "w", encoding="utf-8") as f:
        json.dump(language, f, ensure_ascii=False, indent=1)
        f.write("\n")
    errors = sum("error" in f for f in fixtures)
    print(f"{len(fixtures)} fixtures ({errors} raising) for {len(templates)} templates, "
          f"{len(language['cases'])} language cases in {args.out}")


if __name__ == "__main__":
    main()
