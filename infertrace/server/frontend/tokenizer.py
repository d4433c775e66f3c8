"""The front end's tokenizer: the model directory's `tokenizer.json` through the Rust `tokenizers` library and its
chat template through jinja2, without transformers (whose import loads torch into the front end).

Chat templates render in the environment transformers gives them (`render_jinja_template`, transformers 5.x): a
sandbox with trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now` and a
`tojson` that does not escape HTML, with the special tokens of `tokenizer_config.json` as variables.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from pathlib import Path
from typing import Any

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class FrontendTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json (the server needs a fast tokenizer)")
        self.backend = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
        self.chat_template = _chat_template(model_dir, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch entry point releases the GIL while it works (the server tokenizes on a thread pool)
        [encoding] = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False,
                            **kwargs: Any) -> str | list[int]:
        if self.chat_template is None:
            raise ValueError("the model directory has no chat template (tokenizer_config.json chat_template or "
                             "chat_template.jinja)")
        special = {k: v for k, v in self.special_tokens.items() if v is not None}
        text = _compile(self.chat_template).render(messages=messages, tools=kwargs.pop("tools", None),
                                                   documents=kwargs.pop("documents", None),
                                                   add_generation_prompt=add_generation_prompt, **special, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(model_dir: Path, config: dict) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=4)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return dt.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
