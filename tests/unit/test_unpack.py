"""The host package's installer (clusterctl/host/unpack.py), as ssh runs it (hosttools._INSTALL): a real
python3 -S -E process reading the real payload, in a scratch home."""

import json
import subprocess
import sys
import zlib
from pathlib import Path

from clusterctl.host import slurm
from clusterctl.host import unpack
from clusterctl.host.unpack import INSTALL
from clusterctl.ops import hosttools


def _run(home, payload):
    return subprocess.run([sys.executable, "-S", "-E", "-c", hosttools._INSTALL], input=payload, cwd=home,
                          capture_output=True)


def test_install_unpacks_the_package_privately_and_once(tmp_path):
    payload = hosttools._package_payload()
    res = _run(tmp_path, payload)
    assert res.returncode == 0, res.stderr
    dest = tmp_path / hosttools.package_dir()
    _, layout, data, _ = hosttools._package()
    assert sorted(p.name for p in (dest / hosttools.HOST_PACKAGE).iterdir()) == sorted(
        rel.split("/")[1] for rel, _ in layout)
    assert (dest / hosttools.HOST_PACKAGE / "unpack.py").read_bytes() == Path(unpack.__file__).read_bytes()
    assert oct(dest.stat().st_mode & 0o777) == "0o700" and oct(dest.parent.stat().st_mode & 0o777) == "0o700"
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".tmp-host-")]
    # there already: nothing is read back or rewritten (even a payload that would no longer match)
    marker = dest / hosttools.HOST_PACKAGE / "agent.py"
    before = marker.stat().st_mtime_ns
    line, _, blob = payload.partition(b"\n")
    assert _run(tmp_path, line + b"\n" + bytes(len(blob))).returncode == 0
    assert marker.stat().st_mtime_ns == before


def test_a_corrupt_or_short_upload_installs_nothing(tmp_path):
    payload = hosttools._package_payload()
    line, _, blob = payload.partition(b"\n")
    head = json.loads(line)
    other = zlib.compress(zlib.decompress(blob) + b"#")  # decompresses, but not to what the sha256 says
    bad = json.dumps({**head, "size": len(other)}).encode() + b"\n" + other
    res = _run(tmp_path, bad)
    assert res.returncode == 1 and b"clusterctl: corrupt upload of the host package" in res.stderr
    assert not (tmp_path / hosttools.package_dir()).exists()
    res = _run(tmp_path, payload[:-10])
    assert res.returncode == 1 and b"clusterctl: short read of the host package" in res.stderr
    assert not (tmp_path / hosttools.package_dir()).exists()


def test_both_installers_are_built_from_the_one_function():
    assert INSTALL in hosttools._INSTALL and INSTALL in slurm.BOOT
    assert "def install(" not in hosttools._INSTALL.replace(INSTALL, "")
    assert "def install(" not in slurm.BOOT.replace(INSTALL, "")
