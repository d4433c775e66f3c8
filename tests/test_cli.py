import click
import pytest
from click.testing import CliRunner

from infertrace.cli import main


def _walk(cmd: click.Command, path: tuple[str, ...] = ()):
    yield path, cmd
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            yield from _walk(cmd.get_command(ctx, name), path + (name,))


def test_every_command_and_option_has_help():
    missing = []
    for path, cmd in _walk(main):
        if not (cmd.help or cmd.short_help):
            missing.append(" ".join(path) or "infertrace")
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.help and not p.hidden:
                missing.append(f"{' '.join(path)} {p.opts[0]}")
    assert not missing, missing
    assert {"bench", "serve", "profile", "analyze", "ablate", "gate", "model"} <= set(main.list_commands(None))


def test_a_command_imports_only_its_own_package():
    """`infertrace analyze` and the rest do not load every other command's modules first (bench's alone took
    about 0.1 s)."""
    import subprocess
    import sys

    code = ("import sys; from infertrace.cli import main; main.get_command(None, 'gate'); "
            "print(sorted(m for m in sys.modules if m.startswith('infertrace.') and m.count('.') == 1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "'infertrace.gate'" in out and "'infertrace.load'" not in out and "'infertrace.server'" not in out


@pytest.mark.parametrize("path", [p for p, _ in _walk(main)])
def test_help_runs(path):
    result = CliRunner().invoke(main, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_model_init_without_out_is_one_line_usage_error():
    result = CliRunner().invoke(main, ["model", "init", "--preset", "tiny"])
    assert result.exit_code == 2
    assert "Missing option '--out'" in result.output
    assert len([l for l in result.output.splitlines() if l.startswith("Error")]) == 1


def test_unknown_flag_is_usage_error():
    result = CliRunner().invoke(main, ["model", "init", "--preset", "tiny", "--out", "x", "--bogus"])
    assert result.exit_code == 2
    assert "No such option" in result.output and "--bogus" in result.output


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "infertrace", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("infertrace, version ")


def test_no_placeholder_module_remains():
    import importlib.util

    assert importlib.util.find_spec("infertrace.pending") is None
