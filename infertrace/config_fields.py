"""Settings made from the fields of a config dataclass, so each setting is declared once: its type, its default and
its help (`field(default=..., metadata={"help": ...})`). From the fields come the command-line flags, the parsing
of `key=value` overrides and of typed values (a recipe's), and a JSON form that reads back. Torch-free: every
command imports it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import click

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
NONE_WORDS = ("none", "null", "")


class FieldError(ValueError):
    """A setting that names no field, or a value its field's type cannot take; `name` is the setting."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def field_help(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


@functools.cache
def field_types(cls: type) -> dict[str, tuple[type, ...]]:
    """Each field's allowed types, the type hint flattened: `int | None` -> (int, NoneType)."""
    hints = typing.get_type_hints(cls)
    return {f.name: allowed_types(hints[f.name]) for f in dataclasses.fields(cls)}


@functools.cache
def _element_types(cls: type) -> dict[str, tuple[type, ...]]:
    """For a `tuple[X, ...]` field, X's allowed types (empty for a bare `tuple`)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        args = [a for a in _union_args(hints[f.name]) if typing.get_origin(a) is tuple]
        out[f.name] = allowed_types(typing.get_args(args[0])[0]) if args and typing.get_args(args[0]) else ()
    return out


def allowed_types(hint: Any) -> tuple[type, ...]:
    return tuple(dict.fromkeys(typing.get_origin(a) or a for a in _union_args(hint)))


def _union_args(hint: Any) -> tuple:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _type_names(allowed: tuple[type, ...]) -> str:
    return " or ".join("None" if t is type(None) else t.__name__ for t in allowed)


def parse_value(name: str, text: str, allowed: tuple[type, ...], element: tuple[type, ...] = ()) -> Any:
    """A command line's text as a value of a field that allows `allowed` (a tuple's elements: `element`)."""
    s = text.strip()
    if type(None) in allowed and s.lower() in NONE_WORDS:
        return None
    if bool in allowed:
        if s.lower() in TRUE_WORDS:
            return True
        if s.lower() in FALSE_WORDS:
            return False
        raise FieldError(name, f"{name} must be true or false, got {text!r}")
    try:
        if int in allowed and float in allowed:
            return _number(s)
        if int in allowed:
            return int(s)
        if float in allowed:
            return float(s)
        if tuple in allowed:
            parts = s.replace(",", " ").split()
            return tuple(parse_value(name, p, element) if element else _number(p) for p in parts)
    except ValueError:
        raise FieldError(name, f"{name} must be {_type_names(allowed)}, got {text!r}") from None
    return text


def _number(s: str) -> int | float:
    try:
        return int(s)
    except ValueError:
        return float(s)  # also inf, which JSON and a command line spell as text


def check_value(name: str, value: Any, allowed: tuple[type, ...]) -> None:
    """FieldError when `value` is not of an allowed type (a bool is not an int here, an int is a float)."""
    if isinstance(value, bool) and bool not in allowed:
        ok = False  # a bool is an int to Python, not to a user who typed block_size=True
    elif isinstance(value, int) and float in allowed:
        ok = True
    else:
        ok = isinstance(value, allowed)
    if not ok:
        raise FieldError(name, f"{name} must be {_type_names(allowed)}, got {value!r}")


def check_types(obj: Any) -> None:
    """Every field of a config dataclass instance holds a value of its declared type."""
    for name, allowed in field_types(type(obj)).items():
        check_value(name, getattr(obj, name), allowed)


def unknown_field(cls: type, name: str, what: str) -> FieldError:
    known = sorted(field_types(cls))
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(known)}"
    return FieldError(name, f"unknown {what} field {name!r}{hint}")


def parse_overrides(cls: type, values: Mapping[str, Any], what: str = "config") -> dict[str, Any]:
    """`values` by field name as typed values: text parsed by the field's type, anything else checked against
    it. FieldError names the first setting that is unknown or of the wrong type."""
    types_ = field_types(cls)
    for name in sorted(map(str, values)):
        if name not in types_:
            raise unknown_field(cls, name, what)
    out = {}
    for name, value in values.items():
        if isinstance(value, str) and str not in types_[name]:
            value = parse_value(name, value, types_[name], _element_types(cls)[name])
        elif isinstance(value, list) and tuple in types_[name]:
            value = tuple(value)  # a YAML or JSON list
        check_value(name, value, types_[name])
        out[name] = value
    return out


def key_values(pairs: Iterable[str], flag: str) -> dict[str, str]:
    """`KEY=VALUE` texts by key (dashes in a key read as underscores); ValueError for one without `=`."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE, got {pair!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


@dataclasses.dataclass(frozen=True)
class FlagSet:
    """The flags of one config dataclass on a command: one per field (`--max-num-seqs`, a bool as
    `--prefix-caching/--no-prefix-caching`, more spellings from the field's metadata "aliases"), each defaulting to
    "not given" so that the default stays the dataclass's; optionally a repeatable `KEY=VALUE` flag that takes any
    field by name, and shortcut flags that set several fields at once."""

    cls: type
    prefix: str  # the parameters' names: prefix + field name
    what: str = "config"  # in error messages: "unknown {what} field ..."
    overrides_flag: str | None = None  # e.g. "--engine-opt"
    shortcuts: Mapping[str, tuple[Mapping[str, Any], str]] = dataclasses.field(default_factory=dict)
    help_prefix: str = ""  # e.g. "(embedded engine) ", where a command has settings of its own too
    example: str = ""  # KEY=VALUE shown in the overrides flag's help

    def options(self, taken: Iterable[str] = ()) -> list[click.Option]:
        """The click options, leaving out any whose flag is in `taken` (the command's own flags)."""
        taken = set(taken)
        out = []
        if self.overrides_flag:
            out.append(click.Option(
                [self._param("overrides"), self.overrides_flag], multiple=True, metavar="KEY=VALUE",
                help=f"{self.help_prefix}One {self.what} field by name, e.g. "
                     f"{self.overrides_flag} {self.example or self._example()} (repeatable); the flags below win "
                     "over it."))
        for flag, (_, text) in self.shortcuts.items():
            out.append(click.Option([self._param(flag.replace("-", "_")), f"--{flag}"], is_flag=True, default=False,
                                    help=self.help_prefix + text))
        for f in dataclasses.fields(self.cls):
            flag = f.name.replace("_", "-")
            if f"--{flag}" not in taken and flag not in taken:
                out.append(self._option(f, flag))
        return out

    def values(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The typed settings a command's parameters give: the overrides flag's, then the flags given (they win),
        then the shortcuts. FieldError (a ValueError) for an unknown field or a value of the wrong type."""
        given: dict[str, Any] = {}
        if self.overrides_flag:
            given.update(key_values(params.get(self._param("overrides")) or (), self.overrides_flag))
        names = {f.name for f in dataclasses.fields(self.cls)}
        given.update({name: params[self._param(name)] for name in names
                      if params.get(self._param(name)) is not None})
        for flag, (settings, _) in self.shortcuts.items():
            if params.get(self._param(flag.replace("-", "_"))):
                given.update(settings)
        return parse_overrides(self.cls, given, self.what)

    def own(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """`params` less this flag set's."""
        return {k: v for k, v in params.items() if not k.startswith(self.prefix)}

    def _param(self, name: str) -> str:
        return self.prefix + name

    def _example(self) -> str:
        f = next((f for f in dataclasses.fields(self.cls) if isinstance(field_default(f), str)),
                 dataclasses.fields(self.cls)[0])
        return f"{f.name}={field_default(f)}"

    def _option(self, f: dataclasses.Field, flag: str) -> click.Option:
        default = field_default(f)
        help_text = self.help_prefix + (field_help(f) or f"{self.what} field {f.name}.")
        if default is not None:
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            help_text += f"  [default: {shown}]"
        allowed = set(field_types(self.cls)[f.name])
        aliases = f.metadata.get("aliases", ())
        if allowed == {bool}:
            decls = [self._param(f.name), f"--{flag}/--no-{flag}", *(f"--{a}/--no-{a}" for a in aliases)]
            return click.Option(decls, default=None, help=help_text)
        if allowed <= {int, type(None)}:
            kind = click.INT
        elif allowed <= {float, int, type(None)}:
            kind = click.FLOAT
        else:  # text and tuples: parse_overrides reads them by the field's type
            kind = click.STRING
        return click.Option([self._param(f.name), f"--{flag}", *(f"--{a}" for a in aliases)], type=kind,
                            default=None, help=help_text)


def to_json(obj: Any) -> dict[str, Any]:
    """A config dataclass instance as a JSON object; JSON has no infinity, so a non-finite number is its text
    ("inf"), which `from_json` reads back by the field's type."""
    return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def jsonable(value: Any) -> Any:
    """`value` as JSON holds it: a non-finite number as its text ("inf"), inside lists and dicts too."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


def from_json(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The field values of `cls` in a JSON object that `to_json` wrote (keys that name no field are left out): a
    number written as text is read back as one, a list as a tuple where the field is one."""
    types_ = field_types(cls)
    out = {}
    for name, value in data.items():
        if name not in types_:
            continue
        allowed = types_[name]
        if isinstance(value, list) and tuple in allowed:
            element = _element_types(cls)[name]
            value = tuple(_number_from_json(name, v, element or (int, float)) for v in value)
        else:
            value = _number_from_json(name, value, allowed)
        out[name] = value
    return out


def _number_from_json(name: str, value: Any, allowed: tuple[type, ...]) -> Any:
    if isinstance(value, str) and str not in allowed and (float in allowed or int in allowed):
        return parse_value(name, value, allowed)
    return value


def setting(default: Any, help: str, **metadata: Any) -> Any:
    """A config field with its help beside its default: `block_size: int = setting(16, "Tokens per KV block.")`.
    Other metadata: "aliases", more flag spellings of the field (vLLM's, for people who have them in their
    fingers)."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})
