"""Output from hosts: JSON replies found past shell start-up noise, control characters escaped before
they reach the terminal, streamed output not retained (issue 12, findings 12 and 13)."""

from __future__ import annotations

import io

import pytest

from clusterctl.console import printable, write_line
from clusterctl.errors import RemoteError
from clusterctl.plan import Host
from clusterctl.remote import LineSplitter, Result

HOST = Host("h1", 22, "u", 0)


def result(stdout: str) -> Result:
    return Result(HOST, "python3 tool state", 0, stdout, "", 0.1)


@pytest.mark.parametrize("stdout", [
    '{"gen": "g1", "drift": []}\n',
    'Welcome to h1!\nLast login: yesterday\n{"gen": "g1", "drift": []}\n',
    'motd without newline{"gen": "g1", "drift": []}\n',
    'a {brace} in the banner\n{"gen": "g1", "drift": []}\n\n',
    '{"gen": "g1", "drift": []}\nbye from .bash_logout\n',
])
def test_the_reply_is_found_past_shell_noise(stdout):
    assert result(stdout).reply() == {"gen": "g1", "drift": []}


@pytest.mark.parametrize("stdout", ["", "no json here\n", '{"truncated": \n', "[1, 2]\n", "{" * 5000 + "\n"])
def test_no_reply_is_a_clear_error_naming_the_host(stdout):
    with pytest.raises(RemoteError) as info:
        result(stdout).reply()
    assert "h1" in str(info.value) and "no JSON reply on stdout" in str(info.value)


def test_control_characters_from_hosts_are_escaped():
    assert printable("plain\ttext") == "plain\ttext"
    assert printable("\x1b]0;owned\x07\x1b[2J\rX\x08\x9b\u202e") == "\\x1b]0;owned\\x07\\x1b[2J\\rX\\x08\\x9b\\u202e"
    buf = io.StringIO()
    write_line(buf, "[h1 trainer.0] \x1b[31mred\r")
    assert buf.getvalue() == "[h1 trainer.0] \\x1b[31mred\\r\n"


def test_streamed_output_is_not_retained():
    seen = []
    split = LineSplitter(HOST, "out", lambda h, s, line: seen.append(len(line)))
    line = b"x" * 99 + b"\n"
    chunk = line * 655  # 65,500 bytes
    peak = 0
    for _ in range(320):  # ~21 MB through the callback
        split.feed(chunk)
        peak = max(peak, sum(len(c) for c in split.chunks))
    tail = split.close()
    assert len(seen) == 320 * 655 and set(seen) == {99}
    assert peak <= LineSplitter.KEEP_WITH_CALLBACK + len(chunk)
    assert 0 < len(tail) <= LineSplitter.KEEP_WITH_CALLBACK + len(chunk) and tail.startswith("x" * 99 + "\n")


def test_a_crlf_ends_a_line_and_other_carriage_returns_stay_for_printable_to_show():
    seen = []
    split = LineSplitter(HOST, "err", lambda h, s, line: seen.append(line))
    for chunk in (b"ssh: connect to host 10.0.0.7 port 22: Connection refused\r", b"\n50%\r100%\r\n\r\nlast\r"):
        split.feed(chunk)
    split.close()
    assert seen == ["ssh: connect to host 10.0.0.7 port 22: Connection refused", "50%\r100%", "", "last\r"]


def test_without_a_callback_everything_is_kept():
    split = LineSplitter(HOST, "out", None)
    for _ in range(40):
        split.feed(b"y" * 65536)
    assert len(split.close()) == 40 * 65536


def test_stderr_without_a_callback_keeps_its_end_only():
    # a control command's stderr is read for a tail (a reason): a host that sent 256 MiB of it had all of it kept,
    # beside 256 MiB of stdout (3.3 GB for one host's `status`, decoded)
    split = LineSplitter(HOST, "err", None)
    line = b"e" * 99 + b"\n"
    peak = 0
    for _ in range(320):  # ~21 MB
        split.feed(line * 655)
        peak = max(peak, sum(len(c) for c in split.chunks))
    split.feed(b"the last words\n")
    text = split.close()
    assert peak <= LineSplitter.KEEP_WITH_CALLBACK + 65_500
    assert text.endswith("the last words\n") and text.startswith("e" * 99 + "\n") and len(text) <= 2 << 20


def test_without_a_callback_a_flood_is_cut_at_the_limit_and_says_so(monkeypatch):
    # a compromised host answering a control command with gigabytes must not fill the controller's memory
    monkeypatch.setattr(LineSplitter, "MAX_KEPT", 1 << 20)
    split = LineSplitter(HOST, "out", None)
    peak = 0
    for _ in range(160):  # 10 MiB, then the reply a real host would end with
        split.feed(b"y" * 65536)
        peak = max(peak, sum(len(c) for c in split.chunks))
    split.feed(b'{"gen": "g1", "drift": []}\n')
    text = split.close()
    assert peak <= 1 << 20
    assert text.endswith(f"\n[clusterctl: {9 * 2**20 + 27:,} more bytes beyond 1 MiB dropped]\n"), text[-120:]
    with pytest.raises(RemoteError, match=r"no JSON reply on stdout .*more bytes beyond 1 MiB dropped"):
        result(text).reply()  # the reply after the flood is not taken: that host fails, by name


def test_an_endless_line_is_handed_on_in_pieces():
    got = []
    split = LineSplitter(HOST, "out", lambda h, s, line: got.append(len(line)))
    for _ in range(100):
        split.feed(b"z" * 65536)  # 6.5 MB, no newline
    split.close()
    assert sum(got) == 100 * 65536 and max(got) <= LineSplitter.MAX_PARTIAL + 65536
