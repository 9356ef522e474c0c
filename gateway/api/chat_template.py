"""`--chat-template`: a Jinja chat template replacing the tokenizer's, given as a file or as the text itself.

Read as vLLM reads it: a path that opens is a file; otherwise a value with any of `{`, `}` or a newline is the
template's text, its backslash escapes decoded (so `--chat-template '{{ m }}\\n'` on a shell line means a
newline); anything else looks like a path that does not exist, and is refused. The template is compiled once
at load, so a syntax error stops the server at start, not each chat request.
"""

from __future__ import annotations

import codecs
from pathlib import Path

JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template's text.

    Raises:
        ValueError: a path that cannot be read, or text that is not valid Jinja.
    """
    try:
        text = Path(value).read_text()
    except (OSError, ValueError) as error:  # ValueError: a "path" with a NUL in it
        if not any(char in value for char in JINJA_CHARS):
            raise ValueError(f"{value!r} looks like a file path, but it cannot be read ({error})") from None
        text = codecs.decode(value, "unicode_escape")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # transformers renders templates in this sandbox too
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as error:
        raise ValueError(f"not a valid Jinja template: {error.message} (line {error.lineno})") from None
    return text
