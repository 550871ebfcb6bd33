"""Chat messages -> prompt text.

With a tokenizer chat template (tokenizer_config.json `chat_template`) the messages are rendered
with Jinja2 the way Hugging Face `apply_chat_template` does (sandboxed, trim_blocks,
lstrip_blocks, `raise_exception`, `add_generation_prompt=True`).  Without one, the plain template:

    system: You are terse.
    user: Hi
    assistant: Hello!
    user: Bye
    assistant:

one "<role>: <content>" line per message, then "assistant:" for the model to continue.
"""

from __future__ import annotations

import functools
import json

ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplateError(ValueError):
    pass


def plain_template(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@functools.lru_cache(maxsize=4)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(messages: list[dict], template: str | None, *, bos_token: str = "", eos_token: str = "") -> str:
    if not template:
        return plain_template(messages)
    from jinja2.exceptions import TemplateError

    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token
        )
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template rejected these messages: {e}") from None
