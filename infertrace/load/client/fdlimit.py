"""Open files for many concurrent streams: each is a socket. The soft limit is raised as far as the hard limit
allows before any load; a run that needs more is refused with one line naming the limit."""

from __future__ import annotations

import resource

MARGIN = 64  # files the process holds besides its sockets (the interpreter, a tokenizer, result files)


class OpenFileLimitError(RuntimeError):
    pass


def ensure_open_files(streams: int) -> int:
    """Raise RLIMIT_NOFILE's soft limit to cover `streams` sockets (up to the hard limit); the soft limit now."""
    need = streams + MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(hard, max(need, soft))
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        raise OpenFileLimitError(
            f"{streams} concurrent streams need about {need} open files and this process may open {soft} "
            f"(RLIMIT_NOFILE, hard limit {hard}): raise it with `ulimit -n {need}` (or in limits.conf), or spread "
            "the load over --workers")
    return soft
