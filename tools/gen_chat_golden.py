"""Regenerate the chat-template golden files under ``tests/chat/golden/``.

Each file is one rendering made by transformers' ``apply_chat_template(..., tokenize=False)``::

    {"name": ..., "template": <jinja source>, "special_tokens": {"bos_token": ..., ...},
     "messages": [...], "options": {"add_generation_prompt": ..., "continue_final_message": ...,
     "tools": ..., "extra": {...}}, "expected": <rendered text>}

or, when the template calls ``raise_exception``, ``"error": <its message>`` instead of
``"expected"``. The Rust crate ``voltllm-chat`` renders every file and must agree byte for byte.

Templates: the default model's own (SmolLM2-135M-Instruct), plus hand-written templates that use
the constructs real Hugging Face templates use (Llama 3 / Mistral / Gemma / Qwen families: system
message handling, ``loop.first``/``loop.last``, ``namespace``, ``raise_exception``, ``tojson``,
Python string methods, tools and tool messages, reasoning content, text-part content lists,
``{% generation %}``). Each template is rendered with several message lists and option sets;
combinations a template cannot render (a non-``raise_exception`` error in transformers) and
combinations whose result repeats another option set's (the template ignores the option) are
skipped and counted.

Run from the repository root: ``python tools/gen_chat_golden.py``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE_DIR = REPO_ROOT / "tests" / "fixtures" / "smollm2"
GOLDEN_DIR = REPO_ROOT / "tests" / "chat" / "golden"

TEMPLATE_DIR = REPO_ROOT / "tests" / "chat" / "templates"


def _model_dir() -> Path:
    """The default model's folder when present, else the committed tokenizer fixture."""
    sys.path.insert(0, str(REPO_ROOT / "python"))
    try:
        from voltllm.loader.default_model import default_model_dir

        folder = Path(default_model_dir())
        if (folder / "tokenizer_config.json").exists():
            return folder
    except Exception as exc:  # noqa: BLE001 - any failure means: use the committed fixture
        print(f"default model unavailable ({exc}); using {FIXTURE_DIR}", file=sys.stderr)
    return FIXTURE_DIR


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
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": 'Search the web; quotes " and <tags> & ampersands stay unescaped',
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}

MESSAGE_LISTS: dict[str, list[dict[str, Any]]] = {
    "user_only": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "I am an assistant. "},
        {"role": "user", "content": "Tell me a joke.\nMake it short."},
    ],
    "unicode": [
        {"role": "user", "content": "Ünïcödé \"quotes\" 'apostrophes' 中文 😀\ttab\\backslash"},
        {"role": "assistant", "content": "Réponse: ✓ — ok"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Write a haiku about GPUs."},
        {"role": "assistant", "content": "Silicon rivers"},
    ],
    "tool_calls": [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21.5, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 21.5 °C and clear."},
    ],
    "tool_calls_string_args": [
        {"role": "user", "content": "Search for voltllm"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "search", "arguments": '{"q": "voltllm"}'}}
            ],
        },
        {"role": "tool", "content": "no results"},
        {"role": "tool", "content": "second response"},
    ],
    "content_parts": [
        {"role": "system", "content": [{"type": "text", "text": "System in parts."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First part."},
                {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
                {"type": "text", "text": " Second part."},
            ],
        },
    ],
    "reasoning": [
        {"role": "user", "content": "Think about 3*7."},
        {"role": "assistant", "content": "21", "reasoning_content": "3*7 is 21."},
        {"role": "user", "content": "And 6*7?"},
        {"role": "assistant", "content": "<think>\n6*7=42\n</think>\n\n42"},
    ],
    "reasoning_aliases": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning": "old-style field"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "reasoning_content": "r2", "content": "A2", "thinking": "own thinking"},
    ],
    "bad_alternation": [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
    ],
}

OPTION_SETS: dict[str, dict[str, Any]] = {
    "gen": {"add_generation_prompt": True},
    "nogen": {"add_generation_prompt": False},
    "tools": {"add_generation_prompt": True, "tools": [WEATHER_TOOL, SEARCH_TOOL]},
    "kwargs": {
        "add_generation_prompt": True,
        "extra": {"date_string": "01 Jan 2026", "enable_thinking": False},
    },
    "continue": {"continue_final_message": True},
}


def _load_templates(default_template: str) -> dict[str, str]:
    """The default model's template plus every ``tests/chat/templates/*.jinja``."""
    templates = {"smollm2": default_template}
    for path in sorted(TEMPLATE_DIR.glob("*.jinja")):
        templates[path.stem] = path.read_text(encoding="utf-8")
    return templates


def _render(tokenizer: Any, template: str, messages: list[dict[str, Any]], options: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=options.get("add_generation_prompt", False),
        continue_final_message=options.get("continue_final_message", False),
        tools=options.get("tools"),
        **options.get("extra", {}),
    )


def main() -> None:
    """Render every (template, messages, options) combination and write the golden files."""
    model_dir = _model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    special_tokens = {
        key: value
        for key, value in tokenizer.special_tokens_map.items()
        if key in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    templates = _load_templates(tokenizer.chat_template)

    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for stale in GOLDEN_DIR.glob("*.json"):
        stale.unlink()

    written = raised = skipped = duplicates = 0
    for template_name, template in templates.items():
        for messages_name, messages in MESSAGE_LISTS.items():
            # Outcomes already written for this template and message list: an option the template
            # ignores (tools, kwargs) would only repeat a golden file.
            outcomes: set[str] = set()
            for options_name, options in OPTION_SETS.items():
                if options_name == "continue" and (not messages or messages[-1]["role"] != "assistant"):
                    continue
                case: dict[str, Any] = {
                    "name": f"{template_name}__{messages_name}__{options_name}",
                    "template": template,
                    "special_tokens": special_tokens,
                    "messages": messages,
                    "options": options,
                }
                try:
                    case["expected"] = _render(tokenizer, template, messages, options)
                except jinja2.exceptions.TemplateError as exc:
                    # Only raise_exception raises the base class; subclasses (UndefinedError,
                    # TemplateSyntaxError) and Python errors mean "cannot render", not a golden.
                    if type(exc) is not jinja2.exceptions.TemplateError:
                        skipped += 1
                        continue
                    case["error"] = str(exc)
                    raised += 1
                except (TypeError, ValueError, KeyError, IndexError) as exc:
                    print(f"skip {case['name']}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    skipped += 1
                    continue
                outcome = json.dumps([case.get("expected"), case.get("error")])
                if outcome in outcomes:
                    duplicates += 1
                    continue
                outcomes.add(outcome)
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", case["name"])
                path = GOLDEN_DIR / f"{name}.json"
                path.write_text(json.dumps(case, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
                written += 1
    print(
        f"wrote {written} golden files ({raised} raise_exception cases); skipped {skipped} unrenderable"
        f" and {duplicates} duplicate combinations; template source: {model_dir}"
    )


if __name__ == "__main__":
    main()
