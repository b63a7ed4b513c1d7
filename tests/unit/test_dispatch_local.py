"""Dispatch's local half: workspace scanning, excludes, and archives streamed to many hosts at once."""

import hashlib
import io
import os
import tarfile
import threading

from clusterctl.ops.dispatch import Archive, scan_workspace


def test_scan_applies_gitignore_style_excludes(tmp_path):
    for rel in ("a.py", "b.pyc", "sub/c.txt", ".git/HEAD", "build/x.o", "keep/build.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    files = scan_workspace(tmp_path, (".git/", "*.pyc", "build/"))
    assert sorted(files) == ["a.py", "keep/build.txt", "sub/c.txt"]
    assert files["a.py"].sha256 == hashlib.sha256(b"a.py").hexdigest()


def test_one_archive_streams_identically_to_many_hosts_at_once(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i}.bin").write_bytes(os.urandom(300_000))
    files = scan_workspace(tmp_path, ())
    archive = Archive(files, sorted(files))
    results = [None] * 8

    def read(i):
        results[i] = b"".join(archive.stream(b"header\n"))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for t in threads:  # started while the archive is still being built
        t.start()
    for t in threads:
        t.join()
    archive.close()
    assert archive.size == len(results[0]) - len(b"header\n")
    assert len({hashlib.sha256(r).hexdigest() for r in results}) == 1
    with tarfile.open(fileobj=io.BytesIO(results[0][len(b"header\n"):]), mode="r") as tar:
        assert sorted(m.name for m in tar.getmembers()) == sorted(files)


def test_the_combined_exclude_matcher_agrees_with_pathspec():
    """Ignoring-only patterns are matched by one regex; it decides every path as pathspec does."""
    import itertools

    import pathspec

    from clusterctl.ops.dispatch import ignore_matcher

    names = ["a.py", "b.pyc", ".git", "__pycache__", "build", "x.o", ".venv", "keep", "data.bin", "sub"]
    paths = ["/".join(p) for n in (1, 2, 3) for p in itertools.product(names, repeat=n)]
    paths += [p + "/" for p in paths]
    for exclude in ((".git/", "__pycache__/", "*.pyc", ".venv/"), ("build/", "*.o", "/keep", "sub/*.bin", "**/x.o"),
                    ("*.pyc", "!keep/b.pyc"), ("a.py",), (), ("sub/", "/build/", "?.py", "b.py?", "*", "sub/*"),
                    ("/sub/a.py", "keep/x.o", "s*b/", "*.py/", "a?py", "x.o/"), ("# comment", "", "build"),
                    ("sub/**", "[ab].py", "a\\.py", " a.py", "a.py ")):
        mine, theirs = ignore_matcher(exclude), pathspec.GitIgnoreSpec.from_lines(exclude).match_file
        assert [p for p in paths if mine(p)] == [p for p in paths if theirs(p)], exclude


def test_the_usual_excludes_need_no_pathspec():
    """The default excludes (and patterns like them) are matched without importing pathspec (~0.035 s)."""
    import subprocess
    import sys

    code = ("import sys; from clusterctl.ops.dispatch.scan import ignore_matcher; "
            "m = ignore_matcher(('.git/', '__pycache__/', '*.pyc', '.venv/', '/build', 'data/*.tmp')); "
            "assert m('a/.git/') and m('x.pyc') and m('build') and not m('a/build') and m('data/x.tmp'); "
            "print('pathspec' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "False", res.stderr


def test_symlinks_and_special_files_are_left_out_and_said_never_followed(tmp_path, caplog):
    # they were left out without a word: a workspace's `config.yaml -> conf/real.yaml` silently missing on the hosts
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "real.yaml").write_text("a: 1\n")
    (tmp_path / "config.yaml").symlink_to("conf/real.yaml")
    (tmp_path / "confdir").symlink_to("conf")
    (tmp_path / "outside").symlink_to("/etc/passwd")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "skip.pyc").symlink_to("conf/real.yaml")  # excluded: not said
    with caplog.at_level("WARNING", logger="clusterctl.dispatch"):
        files = scan_workspace(tmp_path, ("*.pyc",))
    assert sorted(files) == ["conf/real.yaml"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path}: left out 4 symlink(s) or special file(s) (dispatch sends regular files and directories, and "
        "follows no link): confdir, config.yaml, fifo, outside"]
    caplog.clear()
    (tmp_path / "config.yaml").unlink()
    for name in ("confdir", "outside", "fifo"):
        (tmp_path / name).unlink()
    scan_workspace(tmp_path, ("*.pyc",))
    assert caplog.records == []
