"""Shared fixtures: a tiny model built once per test session, and skipping GPU tests without CUDA."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A float32 `tiny` model directory written by `infertrace model init`."""
    from infertrace.modelgen import init_model

    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0, dtype="float32")


# a probe run first in a page: records uncaught errors and console errors, and counts the plotly charts that drew
_PROBE = ("<script>window.__errors=[];window.addEventListener('error',e=>__errors.push(String(e.message)));"
          "const __ce=console.error;console.error=(...a)=>{__errors.push(a.join(' '));__ce(...a)};"
          "window.addEventListener('load',()=>setTimeout(()=>{const p=document.createElement('pre');"
          "p.id='probe';p.textContent=JSON.stringify({errors:__errors,svgs:[...document.querySelectorAll("
          "'.js-plotly-plot svg.main-svg')].filter(s=>s.querySelector('path,rect')).length});"
          "document.body.appendChild(p)},500));</script>")


@pytest.fixture
def browse(tmp_path):
    """`result, done = browse(html_path)`: the page rendered in headless Chromium with the probe injected;
    `result` holds its errors and how many plotly charts drew, `done` the browser's process (DOM on stdout).
    Skipped where Chromium is absent (the Debian package `chromium`)."""
    import json
    import re
    import shutil
    import subprocess

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")

    def run(path):
        probed = tmp_path / f"probed-{path.name}"
        probed.write_text(path.read_text(encoding="utf-8").replace("<head>", "<head>" + _PROBE, 1), encoding="utf-8")
        done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                               "--v=0", "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        probe = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
        assert probe, "the page never finished loading"
        return json.loads(probe.group(1).replace("&quot;", '"')), done

    return run
