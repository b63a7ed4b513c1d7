"""A wheel of the clusterctl that is running, for shipping it to the hosts (demo, provisioning).

Built from the imported package's own files (package data included), so it works the same from a
checkout, an editable install, `pip install dist/*.whl` or pipx: no source tree, no build backend, no
network. The version is `X.Y.Z+src.<hash of the files>`: hosts reinstall whenever the code changed.
"""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile
from importlib import metadata, resources
from pathlib import Path

from ..errors import ClusterctlError

__all__ = ["package_files", "self_version", "build_self_wheel"]

_EPOCH = (2020, 1, 1, 0, 0, 0)  # fixed timestamps: the same files give the same wheel bytes


def package_files() -> list[tuple[str, bytes]]:
    """Every file of the running clusterctl package as (path inside the wheel, bytes), sorted; no caches."""
    root = Path(str(resources.files("clusterctl")))
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo") or not path.is_file():
            continue
        out.append((f"clusterctl/{rel.as_posix()}", path.read_bytes()))
    if not out:
        raise ClusterctlError(f"no clusterctl package files found under {root}")
    return out


def self_version(files: list[tuple[str, bytes]] | None = None) -> str:
    """`<__version__>+src.<12 hex digits of the files' hash>`."""
    from .. import __version__

    h = hashlib.sha256()
    for name, data in files if files is not None else package_files():
        h.update(name.encode() + b"\0" + data + b"\0")
    return f"{__version__.split('+')[0]}+src.{h.hexdigest()[:12]}"


def _requires() -> list[str]:
    """The running clusterctl's Requires-Dist (from its installed metadata; pyproject.toml in a bare checkout)."""
    try:
        return list(metadata.requires("clusterctl") or [])
    except metadata.PackageNotFoundError:
        pass
    import tomllib

    pyproject = Path(str(resources.files("clusterctl"))).parent / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise ClusterctlError(f"cannot tell clusterctl's dependencies (not installed, no {pyproject}): {exc}") from None
    return list(project.get("dependencies", []))


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_self_wheel(dest: Path) -> tuple[Path, str]:
    """Write (once per version) `dest/<version>/clusterctl-<version>-py3-none-any.whl`; return it and the version."""
    files = package_files()
    version = self_version(files)
    folder = Path(dest) / version
    wheel = folder / f"clusterctl-{version}-py3-none-any.whl"
    if wheel.is_file():
        return wheel, version
    info = f"clusterctl-{version}.dist-info"
    meta = [
        "Metadata-Version: 2.1",
        "Name: clusterctl",
        f"Version: {version}",
        "Summary: Run distributed deep-learning training on machines reached over SSH",
        "Requires-Python: >=3.11",
        *(f"Requires-Dist: {r}" for r in _requires()),
    ]
    extra = [
        (f"{info}/METADATA", ("\n".join(meta) + "\n").encode()),
        (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: clusterctl.selfwheel\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
        (f"{info}/entry_points.txt",
         b"[console_scripts]\nclusterctl = clusterctl.cli:main\nclusterctl-fab = clusterctl.fab:main\n"),
        (f"{info}/top_level.txt", b"clusterctl\n"),
    ]
    buf = io.BytesIO()
    record = []
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files + extra:
            zi = zipfile.ZipInfo(name, _EPOCH)
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
            record.append(f"{name},{_record_hash(data)},{len(data)}")
        record.append(f"{info}/RECORD,,")
        zi = zipfile.ZipInfo(f"{info}/RECORD", _EPOCH)
        zi.external_attr = 0o644 << 16
        zf.writestr(zi, "\n".join(record) + "\n")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = wheel.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(wheel)
    return wheel, version
