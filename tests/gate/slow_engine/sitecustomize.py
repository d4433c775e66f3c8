"""Makes the bundled engine slower, for tests only: Python imports this at start-up when this folder is on
PYTHONPATH, and with INFERTRACE_TEST_SLOWDOWN=F every engine step keeps the CPU busy until it has taken F times
as long as it did (F=2: twice the work per token), but only in the infertrace imported from
INFERTRACE_TEST_SLOWDOWN_ROOT (the gate runs a reference commit's code beside the checkout's)."""

import os
from pathlib import Path

_factor = float(os.environ.get("INFERTRACE_TEST_SLOWDOWN", "1"))

if _factor > 1:
    import time

    import infertrace
    from infertrace.engine.model_runner import ModelRunner

    if Path(infertrace.__file__).resolve().parents[1] == Path(os.environ["INFERTRACE_TEST_SLOWDOWN_ROOT"]).resolve():
        _launch = ModelRunner.launch  # on a CPU device the step's work is done when launch returns

        def _slow_launch(self, plan, *args, **kwargs):
            start = time.perf_counter()
            launched = _launch(self, plan, *args, **kwargs)
            until = start + (time.perf_counter() - start) * _factor
            while time.perf_counter() < until:
                pass
            return launched

        ModelRunner.launch = _slow_launch
