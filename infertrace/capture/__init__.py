"""Capture: torch.profiler and nsys windows, in-process over engine steps or toggled on a live server."""
