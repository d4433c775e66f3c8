"""Headers every HTTP call to a server carries: `--api-key` (or OPENAI_API_KEY) as a Bearer token, and repeatable
`--header KEY:VALUE`. One option decorator for every command that talks to a server (bench, profile), and the check
of the URL they are given."""

from __future__ import annotations

import click

API_KEY_ENV = "OPENAI_API_KEY"


def _parse_header(ctx, param, values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for text in values:
        key, sep, value = text.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not key or any(c in key for c in " \t\r\n") or any(c in value for c in "\r\n"):
            raise click.BadParameter(f"{text!r} is not KEY:VALUE", param=param)
        pairs.append((key, value))
    return tuple(pairs)


def server_auth_options(command):
    """`--api-key` and `--header`, as the keyword arguments `api_key` and `header`."""
    command = click.option("--header", "header", multiple=True, callback=_parse_header, metavar="KEY:VALUE",
                           help="An HTTP header sent on every call to the server (repeatable).")(command)
    return click.option("--api-key", "api_key", envvar=API_KEY_ENV, show_envvar=True,
                        help="Sent as `Authorization: Bearer KEY` on every call to the server.")(command)


def request_headers(api_key: str | None, header: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """The headers for every call: the key first, so an explicit `--header Authorization:...` wins."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(dict(header))
    return headers


def check_url(url: str, option: str = "--base-url") -> str:
    """`url` when it is an http(s) URL with a host; else ValueError in one line. `localhost:8000` parses as the
    scheme `localhost`, and aiohttp would then fail with a misleading "cannot reach"."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError as e:
        raise ValueError(f"{option} {url!r} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        hint = f"; did you mean http://{url}?" if "://" not in url else ""
        raise ValueError(f"{option} {url!r} needs http:// or https://{hint}")
    if not parts.hostname:
        raise ValueError(f"{option} {url!r} names no host")
    return url
