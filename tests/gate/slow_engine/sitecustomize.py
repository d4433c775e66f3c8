"""Makes the bundled engine slower, for tests only: Python imports this at start-up when this folder is on
PYTHONPATH, and with INFERTRACE_TEST_SLOWDOWN=F every engine step keeps the CPU busy until it has taken F times
as long as it did (F=2: twice the work per token)."""

import os

_factor = float(os.environ.get("INFERTRACE_TEST_SLOWDOWN", "1"))

if _factor > 1:
    import time

    from infertrace.engine.model_runner import ModelRunner

    _run = ModelRunner.run

    def _slow_run(self, plan):
        start = time.perf_counter()
        tokens = _run(self, plan)
        until = start + (time.perf_counter() - start) * _factor
        while time.perf_counter() < until:
            pass
        return tokens

    ModelRunner.run = _slow_run
