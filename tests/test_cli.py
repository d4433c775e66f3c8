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


def _one_error_line(result, command: str) -> str:
    """The single line a usage error prints: `infertrace <command>: error: <what> (see --help)`."""
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{command}: error: ") and lines[0].endswith(" (see --help)"), lines[0]
    assert result.stdout == ""
    return lines[0]


def test_model_init_without_out_is_one_line_usage_error():
    result = CliRunner().invoke(main, ["model", "init", "--preset", "tiny"])
    assert "Missing option '--out'" in _one_error_line(result, "infertrace model init")


def test_unknown_flag_is_usage_error():
    result = CliRunner().invoke(main, ["model", "init", "--preset", "tiny", "--out", "x", "--bogus"])
    line = _one_error_line(result, "infertrace model init")
    assert "No such option" in line and "--bogus" in line


LEAF_COMMANDS = [p for p, cmd in _walk(main) if p and not isinstance(cmd, click.Group)]


@pytest.mark.parametrize("path", LEAF_COMMANDS, ids=[" ".join(p) for p in LEAF_COMMANDS])
def test_every_command_gives_a_usage_error_in_one_line(path):
    """click's own form is three or four lines (Usage:, Try '... --help', Error: ...)."""
    result = CliRunner().invoke(main, [*path, "--no-such-option"])
    assert "--no-such-option" in _one_error_line(result, " ".join(("infertrace", *path)))


@pytest.mark.parametrize("args, command, expected", [
    (["gate", "r.json", "--max-drop", "nonsense"], "infertrace gate", "'nonsense' is not METRIC=LIMIT"),
    (["gate", "r.json", "--resamples", "many"], "infertrace gate", "'many' is not a valid integer"),
    (["ablate"], "infertrace ablate", "Missing argument 'RECIPE'"),
    (["--no-such-option"], "infertrace", "No such option"),
])
def test_bad_values_and_missing_arguments_are_one_line(args, command, expected):
    assert expected in _one_error_line(CliRunner().invoke(main, args), command)


def test_a_usage_error_raised_by_a_command_body_is_one_line(tmp_path):
    (tmp_path / "r.json").write_text('{"output_throughput": 100.0}')
    result = CliRunner().invoke(main, ["gate", str(tmp_path / "r.json"), "--update-baseline"])
    assert "--update-baseline needs --baseline" in _one_error_line(result, "infertrace gate")


@pytest.mark.parametrize("args, command, expected", [
    (["benh"], "infertrace", "no command 'benh'; did you mean 'bench'?"),
    (["analyse"], "infertrace", "did you mean 'analyze'?"),
    (["model", "inti"], "infertrace model", "no command 'inti'; did you mean 'init'?"),
    (["zzzz"], "infertrace", "commands: bench, serve, profile, analyze, ablate, gate, model"),
])
def test_a_mistyped_command_gets_the_closest_one(args, command, expected):
    assert expected in _one_error_line(CliRunner().invoke(main, args), command)


def test_ctrl_c_a_command_does_not_handle_exits_130(monkeypatch):
    """click's default is "Aborted!" and exit 1; the README's table says 130."""
    from infertrace import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "slow", "unused:unused")
    real = cli.LazyGroup.get_command
    monkeypatch.setattr(cli.LazyGroup, "get_command", lambda self, ctx, name: click.Command(
        name, callback=interrupted, help="x") if name == "slow" else real(self, ctx, name))
    result = CliRunner().invoke(main, ["slow"])
    assert result.exit_code == 130
    assert "interrupted" in result.stderr and "Aborted" not in result.output


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "infertrace", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("infertrace, version ")


def test_no_placeholder_module_remains():
    import importlib.util

    assert importlib.util.find_spec("infertrace.pending") is None
