"""infertrace serve has no grammar backend: every way of asking for constrained output is refused with a 400 that
says so, never answered with unconstrained output."""

from __future__ import annotations

import pytest

from infertrace.server.frontend.protocol import ApiError, Endpoint, parse_generate_request

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}}


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
    ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("structured_outputs", {"json": SCHEMA}),
    ("guided_json", SCHEMA),
    ("guided_choice", ["a", "b"]),
])
def test_constrained_output_is_refused_with_a_400_that_says_so(field, value):
    with pytest.raises(ApiError) as err:
        parse_generate_request({"messages": USER, field: value}, Endpoint.CHAT)
    assert err.value.status == 400 and err.value.param == field
    assert err.value.message.startswith(f"structured output is not supported: this server cannot honour {field}=")


@pytest.mark.parametrize("extra", [{}, {"response_format": {"type": "text"}}, {"tool_choice": "none"},
                                   {"tool_choice": "auto"}, {"tools": []}])
def test_unconstrained_spellings_pass(extra):
    assert parse_generate_request({"messages": USER, **extra}, Endpoint.CHAT).messages == USER
