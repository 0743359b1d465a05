"""Chat templates: the model directory's Jinja template when it has one, a simple default otherwise.

The default renders each message as `<|role|>` on its own line followed by the content, then opens
the assistant's turn:

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

Templates run in Jinja's immutable sandbox, so a template cannot reach Python objects.
"""
from __future__ import annotations

import json
import os

DEFAULT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def find_template(model: str) -> tuple[str, str]:
    """(template, where it came from) for a model name or directory."""
    if os.path.isdir(model):
        path = os.path.join(model, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path) as f:
                return f.read(), path
        path = os.path.join(model, "tokenizer_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                tmpl = json.load(f).get("chat_template")
            if isinstance(tmpl, list):  # named templates: take the default one
                tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
            if isinstance(tmpl, str):
                return tmpl, path
    return DEFAULT_TEMPLATE, "default"


def load_template(arg: str) -> tuple[str, str]:
    """--chat-template: a Jinja file, or the template itself (a string with Jinja tags), as vLLM takes it."""
    if os.path.isfile(arg):
        with open(arg) as f:
            return f.read(), arg
    if "{{" in arg or "{%" in arg:
        return arg, "--chat-template"
    raise ValueError(f"--chat-template: {arg!r} is neither a file nor a Jinja template")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        from jinja2 import TemplateSyntaxError

        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ValueError(f"the chat template is not valid Jinja: {e}") from e
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token, tools=tools)
        except TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from e


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)
