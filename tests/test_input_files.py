"""Reading a file the user gives: regular files only, never waiting on a pipe, never more than the bound."""

import os

import pytest

from infertrace.input_files import InputFileError, read_bytes, read_text


def test_a_regular_file_is_read_and_a_byte_order_mark_dropped(tmp_path):
    path = tmp_path / "f.json"
    path.write_bytes(b"\xef\xbb\xbf[1]")
    assert read_text(path, 100) == "[1]"
    link = tmp_path / "link.json"
    link.symlink_to(path)
    assert read_bytes(link, 100) == b"\xef\xbb\xbf[1]"


@pytest.mark.parametrize("make, reason", [
    (lambda p: p, "no such file"),
    (lambda p: (p.mkdir(), p)[1], "not a regular file"),
    (lambda p: (os.mkfifo(p), p)[1], "not a regular file"),  # refused at once, not waited on
    (lambda p: (p.write_bytes(b"x" * 2048), p)[1], "2 KiB, above the 1 KiB such a file may hold"),
    (lambda p: (p.write_bytes(b"caf\xe9"), p)[1], "not UTF-8 text (byte 3)"),
])
def test_what_cannot_be_read_is_one_reason(tmp_path, make, reason):
    path = make(tmp_path / "f")
    with pytest.raises(InputFileError) as info:
        read_text(path, 1024)
    assert str(info.value) == reason


def test_a_device_is_refused_not_read_until_memory_runs_out():
    with pytest.raises(InputFileError, match="^not a regular file$"):
        read_bytes("/dev/zero", 1 << 20)
