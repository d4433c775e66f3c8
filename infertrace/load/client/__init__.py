"""How a request reaches a target and comes back timed: the HTTP and embedded targets, the SSE parser, the one
timing loop, and the open-file limit many streams need."""
