"""--structured: requests constrained to a JSON schema (`response_format`) or to a tool call (`tools` +
`tool_choice`), the schemas from a JSONL file or generated, and whether each output honours its schema.

The validator covers the subset of JSON Schema that the generated schemas use and that a schema file may hold
(type, properties, required, additionalProperties, items, enum, const, minimum/maximum, minLength/maxLength,
minItems/maxItems): a file using any other keyword is refused when read, so no output is ever judged by a rule the
check does not know."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

from infertrace import input_files
from infertrace.load.records import RequestResult
from infertrace.load.workloads.dataset import DatasetError

MAX_SCHEMA_FILE_BYTES = 64 << 20
KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "minimum",
            "maximum", "minLength", "maxLength", "minItems", "maxItems", "title", "description", "$schema"}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
# what generated schemas are made of: values a model with random weights still finishes within a few tokens
COLOURS = ["red", "green", "blue", "amber"]
SIZES = ["small", "medium", "large"]


class SchemaError(DatasetError):
    """A schema file bench cannot use; the message names the line."""


def generated_schema(index: int, seed: int) -> dict:
    """A small object schema of its own for request `index`: 1 to 4 required properties, booleans and string enums,
    no other property allowed."""
    rng = random.Random(f"schema:{seed}:{index}")
    properties = {}
    for k in range(rng.randint(1, 4)):
        kind = rng.choice(("boolean", "colour", "size"))
        properties[f"field_{k}"] = {"type": "boolean"} if kind == "boolean" else \
            {"type": "string", "enum": COLOURS if kind == "colour" else SIZES}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def read_schemas(path: str) -> list[dict]:
    """Every schema of a JSONL file, one JSON object a line (blank lines skipped); SchemaError names the line."""
    try:
        text = input_files.read_text(path, MAX_SCHEMA_FILE_BYTES)
    except (OSError, ValueError) as e:
        raise SchemaError(f"--schemas {path}: {e}") from None
    schemas = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            schema = json.loads(line)
        except ValueError as e:
            raise SchemaError(f"--schemas {path} line {number}: not JSON ({e})") from None
        if not isinstance(schema, dict):
            raise SchemaError(f"--schemas {path} line {number}: expected a JSON schema object")
        if (problem := unsupported(schema)) is not None:
            raise SchemaError(f"--schemas {path} line {number}: {problem}")
        schemas.append(schema)
    if not schemas:
        raise SchemaError(f"--schemas {path}: holds no schema")
    return schemas


def unsupported(schema, where: str = "") -> str | None:
    """Why `schema` is outside what `violation` checks, or None."""
    if not isinstance(schema, dict):
        return f"{where or 'the schema'} is not an object"
    for key in schema:
        if key not in KEYWORDS:
            return f"keyword {key!r}{f' at {where}' if where else ''} is outside what bench validates " \
                   f"({', '.join(sorted(KEYWORDS - {'title', 'description', '$schema'}))})"
    kind = schema.get("type")
    if kind is not None and kind not in (*TYPES, "integer", "number"):
        return f"type {kind!r}{f' at {where}' if where else ''} is not one bench validates"
    for name, sub in (schema.get("properties") or {}).items():
        if (problem := unsupported(sub, f"{where}.{name}" if where else name)) is not None:
            return problem
    if "items" in schema and (problem := unsupported(schema["items"], f"{where}[]")) is not None:
        return problem
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict) and (problem := unsupported(extra, f"{where}.*")) is not None:
        return problem
    return None


def violation(value, schema: dict, where: str = "$") -> str | None:
    """The first way `value` breaks `schema` (a schema `unsupported` accepts), or None when it holds."""
    kind = schema.get("type")
    if kind == "integer":
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            return f"{where} is not an integer"
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{where} is not a number"
    elif kind is not None and not isinstance(value, TYPES[kind]):
        return f"{where} is not {kind}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} is not one of the enum"
    if "const" in schema and value != schema["const"]:
        return f"{where} is not the const"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"] or "maximum" in schema and value > schema["maximum"]:
            return f"{where} is out of range"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", math.inf):
            return f"{where} has the wrong length"
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", math.inf):
            return f"{where} has the wrong number of items"
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                if (problem := violation(item, schema["items"], f"{where}[{i}]")) is not None:
                    return problem
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for name in schema.get("required") or []:
            if name not in value:
                return f"{where}.{name} is missing"
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            sub = properties.get(name, extra if isinstance(extra, dict) else None)
            if sub is None and extra is False:
                return f"{where}.{name} is not allowed"
            if sub is not None and (problem := violation(item, sub, f"{where}.{name}")) is not None:
                return problem
    return None


@dataclass(frozen=True, slots=True)
class StructuredPlan:
    """Which requests are constrained (a draw from the seed and the index, at --structured-share), to which schema
    (the file's, cycled by index, or a generated one), and how the body asks for it."""

    mode: str
    share: float
    seed: int
    schemas: tuple[dict, ...] = ()  # from --schemas; empty: generated
    tool_choice: str = "required"

    def schema(self, index: int) -> dict | None:
        """The schema request `index` is held to; None for an unconstrained request."""
        if self.share < 1 and random.Random(f"structured:{self.seed}:{index}").random() >= self.share:
            return None
        return self.schemas[index % len(self.schemas)] if self.schemas else generated_schema(index, self.seed)

    def body(self, index: int) -> dict:
        """The keys request `index` adds to its body (none for an unconstrained request)."""
        schema = self.schema(index)
        if schema is None:
            return {}
        if self.mode == "json-schema":
            return {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": schema, "strict": True}}}
        name = f"record_{index}"
        choice = "required" if self.tool_choice == "required" else {"type": "function", "function": {"name": name}}
        # strict: OpenAI's ask to hold the arguments to the parameters (vLLM 0.32 constrains them only then)
        return {"tools": [{"type": "function", "function": {"name": name, "description": "Record the answer.",
                                                            "parameters": schema, "strict": True}}],
                "tool_choice": choice}

    def verdict(self, r: RequestResult) -> str | None:
        """Why the output of a constrained request breaks its schema ("" when it holds); None when unconstrained."""
        schema = self.schema(r.index)
        if schema is None:
            return None
        if self.mode == "json-schema":
            return _cut(r, _parsed_violation(r.text, schema)) or ""
        calls = r.tool_calls or []
        if not calls:
            return "no tool call"
        for call in calls:
            if call.get("name") != f"record_{r.index}":
                return f"called {call.get('name')!r}, not the tool offered"
            if (problem := _parsed_violation(call.get("arguments") or "", schema)) is not None:
                return _cut(r, problem)
        return ""


def _cut(r: RequestResult, problem: str | None) -> str | None:
    """A value cut off at max_tokens says so: its schema may hold, the length did not."""
    if problem == "not JSON" and r.finish_reason == "length":
        return "cut at max_tokens before the JSON ended (raise --output-len)"
    return problem


def _parsed_violation(text: str, schema: dict) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return "not JSON"
    return violation(value, schema)


def structured_plan(cfg) -> StructuredPlan | None:
    """The plan of a BenchConfig's --structured flags, its schema file read (SchemaError); None without them."""
    if cfg.structured is None:
        return None
    schemas = tuple(read_schemas(cfg.schemas_path)) if cfg.schemas_path else ()
    return StructuredPlan(cfg.structured, cfg.structured_share, cfg.seed, schemas, cfg.tool_choice)
