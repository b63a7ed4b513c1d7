"""On-disk checkpoints of pserver shards (the seed's ``save_persistables`` / ``load_persistables``).

Layout of a checkpoint directory::

    DIR/pserver-<id>/manifest.json   # step, server id/count, mode, optimizer, block table, parameter shapes
    DIR/pserver-<id>/tensors.npz     # every block and its optimizer state
    DIR/pserver-<id>.prev/           # the checkpoint before it (kept so that pservers that crashed between
                                     # two saves can still agree on a common step: see load_server(step=))
    DIR/pserver-<id>.new/            # only while a save swaps it in (or after a crash in the middle of that)
    DIR/checkpoint.json              # commit record written by the trainer that asked for the save,
                                     # only after every pserver reported success

Each pserver writes its own subdirectory atomically: a temporary directory, renamed to ``pserver-<id>.new``
once complete and fsynced, then swapped in (``pserver-<id>`` -> ``.prev`` -> dropped; ``.new`` ->
``pserver-<id>``), the directory fsynced after the renames. A crash at any point of the swap leaves a
state :func:`recover_server` finishes at the next save or load (a pserver runs it at startup), so no
complete shard is lost. Loading checks the manifest against the server's identity and, where the commit
record or sibling manifests are visible (shared or local filesystem), picks the committed step (latest
or previous shard) and checks that every visible sibling holds it.

Blocks are flat, so a block's size and dtype cannot tell a (3, 4) parameter from a (4, 3) one: the manifest
also records the full shape and dtype of every parameter the shard holds blocks of (``params``), which the
pserver compares with the trainers' (server.py). Checkpoints written before that have no ``params``; they
load, and only their block names, sizes and dtypes are checked.

Shard directories are never followed through a symlink: every ``pserver-<id>``, ``pserver-<id>.prev``
and temporary directory is checked with ``os.lstat`` before a save or load touches it (a symlink is a
CheckpointError naming it), and a load opens the directory and its files with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import stat
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CheckpointError, PsConfigError
from .optim import OptimizerConfig, init_state, state_dtype

__all__ = [
    "FORMAT",
    "ServerCheckpoint",
    "has_server_checkpoint",
    "load_server",
    "param_table",
    "parse_params",
    "read_commit",
    "recover_server",
    "save_server",
    "saved_steps",
    "server_dir",
    "write_commit",
]

log = logging.getLogger(__name__)

FORMAT = "clusterctl.ps/1"


@dataclass
class ServerCheckpoint:
    """What one pserver saves: its blocks, their optimizer state, and where in training it was."""

    server_id: int
    num_servers: int
    step: int
    mode: str
    optimizer: dict[str, Any] | None
    blocks: dict[str, np.ndarray]
    states: dict[str, dict[str, np.ndarray]]
    #: shape and dtype of each parameter the blocks belong to; empty when loaded from an older checkpoint
    params: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)


def param_table(params: Mapping[str, tuple[tuple[int, ...], str]]) -> dict[str, dict[str, Any]]:
    """``params`` as JSON, in a manifest or an ``init`` header: ``{name: {"shape": [...], "dtype": ...}}``."""
    return {name: {"shape": list(shape), "dtype": dtype} for name, (shape, dtype) in params.items()}


def parse_params(table: Any) -> dict[str, tuple[tuple[int, ...], str]] | None:
    """The inverse of :func:`param_table`; None when ``table`` is malformed."""
    if not isinstance(table, dict):
        return None
    out = {}
    for name, entry in table.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (not isinstance(shape, list) or not isinstance(entry.get("dtype"), str)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            return None
        out[name] = (tuple(shape), entry["dtype"])
    return out


def server_dir(root: str | os.PathLike[str], server_id: int) -> Path:
    """The subdirectory pserver ``server_id`` writes under ``root``."""
    return Path(root) / f"pserver-{server_id}"


def prev_dir(root: str | os.PathLike[str], server_id: int) -> Path:
    """The subdirectory holding pserver ``server_id``'s checkpoint before the latest."""
    return Path(root) / f"pserver-{server_id}.prev"


def new_dir(root: str | os.PathLike[str], server_id: int) -> Path:
    """The subdirectory holding pserver ``server_id``'s complete new shard while a save swaps it in."""
    return Path(root) / f"pserver-{server_id}.new"


def has_server_checkpoint(root: str | os.PathLike[str], server_id: int) -> bool:
    """Whether ``root`` holds a manifest for pserver ``server_id`` (a symlinked shard counts: loading refuses it)."""
    sdir = server_dir(root, server_id)
    return _lexists(sdir) and (sdir.is_symlink() or (sdir / "manifest.json").is_file())


def _lexists(path: Path) -> bool:
    """Whether ``path`` exists, without following a symlink; CheckpointError when it is one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{path} is a symlink; checkpoints are never read or written through one")
    return True


def _open_dir(path: Path) -> int:
    """A descriptor of directory ``path``, opened without following a symlink."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        if _lexists(path) and not path.is_dir():
            raise CheckpointError(f"{path} is not a directory") from None
        raise CheckpointError(f"{path}: {exc.strerror}") from None


def _read_at(dfd: int, name: str, where: Path) -> bytes:
    """The content of file ``name`` in the directory open as ``dfd`` (never through a symlink)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
    except FileNotFoundError:
        raise CheckpointError(f"{where / name}: missing") from None
    except OSError as exc:
        raise CheckpointError(f"{where / name}: unreadable: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the renames in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_server(root: str | os.PathLike[str], ckpt: ServerCheckpoint, *, job: str = "") -> Path:
    """Write ``ckpt`` atomically to ``root/pserver-<id>``; return that directory."""
    final = server_dir(root, ckpt.server_id)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        for path in (final, prev_dir(root, ckpt.server_id), new_dir(root, ckpt.server_id), tmp):
            _lexists(path)  # refused before anything is written or renamed
        recover_server(root, ckpt.server_id)  # a swap a crash interrupted is finished first
        if _lexists(tmp):
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_shard(tmp, ckpt, job)
        tmp.rename(new_dir(root, ckpt.server_id))  # complete under a name a restart finds
        _fsync_dir(final.parent)
        _swap_in(root, ckpt.server_id)
    except OSError as exc:
        raise CheckpointError(f"cannot save pserver {ckpt.server_id}'s shard under {root}: {exc}") from None
    log.info("saved %d block(s) at step %d to %s", len(ckpt.blocks), ckpt.step, final)
    return final


def _step_of(sdir: Path) -> int | None:
    """The step in ``sdir``'s manifest; None when it is absent, unreadable or no step."""
    try:
        step = _read_manifest(sdir).get("step")
    except CheckpointError:
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _swap_in(root: str | os.PathLike[str], server_id: int) -> None:
    """Make ``pserver-<id>.new`` the latest shard; the latest becomes ``.prev`` and the ``.prev`` before it goes.

    A latest shard that is not older than the new one (a save after a load of an earlier step, or an
    unreadable one), or one the commit record does not name while ``.prev`` holds the step it names (a save that
    failed on another pserver), is replaced instead and ``.prev`` stays.
    Every state a crash can leave between these renames is finished by :func:`recover_server`.
    """
    final, prev, new = server_dir(root, server_id), prev_dir(root, server_id), new_dir(root, server_id)
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    _lexists(old)
    if _lexists(final):
        latest, step = _step_of(final), _step_of(new)
        try:
            committed = (_commit(Path(root)) or {}).get("step")
        except CheckpointError:
            committed = None
        # the latest is a save that never committed (it failed on another pserver) and .prev holds the committed
        # step: the latest goes, not .prev, or a second failed save would leave the job no step to resume at
        keep_prev = committed is not None and latest != committed and _step_of(prev) == committed
        if latest is not None and step is not None and latest < step and not keep_prev:
            if _lexists(prev):
                prev.rename(old)
            final.rename(prev)
        else:
            final.rename(old)
    new.rename(final)
    _fsync_dir(final.parent)
    if _lexists(old):
        shutil.rmtree(old)


def recover_server(root: str | os.PathLike[str], server_id: int) -> None:
    """Finish a save of pserver ``server_id`` that a crash interrupted, so ``pserver-<id>`` is its latest shard.

    A complete ``pserver-<id>.new`` is swapped in; without it, a missing ``pserver-<id>`` whose ``.prev``
    is there (left by a crash between two renames of a save) is replaced by ``.prev``. Leftover
    temporary directories of this pserver are removed. Logged; a no-op when nothing was interrupted.
    """
    final, prev, new = server_dir(root, server_id), prev_dir(root, server_id), new_dir(root, server_id)
    try:
        # first: a leftover of a crashed process with this pid (pids repeat in containers) would block a rename
        stale = re.compile(rf"\.pserver-{server_id}\.(tmp|old)-\d+")
        for path in final.parent.glob(f".pserver-{server_id}.*"):
            if stale.fullmatch(path.name) and not path.is_symlink() and path.is_dir():
                shutil.rmtree(path)
        if _lexists(new):
            if _step_of(new) is None:  # written and fsynced before its rename: only damage gets here
                log.warning("pserver %d: dropping the unreadable interrupted save %s", server_id, new)
                shutil.rmtree(new)
            else:
                log.warning("pserver %d: finishing the save of step %d that was interrupted (%s)",
                            server_id, _step_of(new), new)
                _swap_in(root, server_id)
        if not _lexists(final) and _lexists(prev):
            log.warning("pserver %d: %s is missing (a save was interrupted); using %s, step %s",
                        server_id, final, prev, _step_of(prev))
            prev.rename(final)
            _fsync_dir(final.parent)
    except OSError as exc:
        raise CheckpointError(f"cannot recover pserver {server_id}'s interrupted save under {root}: {exc}") from None


def _write_shard(tmp: Path, ckpt: ServerCheckpoint, job: str) -> None:
    """Write tensors.npz and manifest.json of ``ckpt`` into the new directory ``tmp``."""
    arrays: dict[str, np.ndarray] = {}
    table = []
    for i, (key, arr) in enumerate(ckpt.blocks.items()):
        arrays[f"p{i}"] = arr
        names = sorted(ckpt.states.get(key, {}))
        for name in names:
            arrays[f"s{i}_{name}"] = ckpt.states[key][name]
        table.append({"key": key, "dtype": arr.dtype.name, "size": int(arr.size), "state": names})
    with open(tmp / "tensors.npz", "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    manifest = {
        "format": FORMAT,
        "job": job,
        "server_id": ckpt.server_id,
        "num_servers": ckpt.num_servers,
        "step": ckpt.step,
        "mode": ckpt.mode,
        "optimizer": ckpt.optimizer,
        "blocks": table,
        "params": param_table(ckpt.params),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _fsync_file(tmp / "manifest.json")


def _read_json(path: Path, raw: bytes | None = None) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes() if raw is None else raw)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} file")
    return data


def _read_manifest(sdir: Path) -> dict[str, Any]:
    """``sdir/manifest.json``, the directory and the file opened without following a symlink."""
    if not _lexists(sdir):
        raise CheckpointError(f"{sdir / 'manifest.json'}: missing")
    dfd = _open_dir(sdir)
    try:
        return _read_json(sdir / "manifest.json", _read_at(dfd, "manifest.json", sdir))
    finally:
        os.close(dfd)


def saved_steps(root: str | os.PathLike[str], server_id: int) -> list[int]:
    """Steps of pserver ``server_id``'s checkpoints under ``root`` (the latest and the one before), newest first."""
    steps = []
    for sdir in (server_dir(root, server_id), prev_dir(root, server_id)):
        try:
            step = _read_manifest(sdir).get("step")
        except CheckpointError:  # absent, unreadable, or a symlink (which a load refuses by name)
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            steps.append(step)
    return steps


def load_server(root: str | os.PathLike[str], server_id: int, num_servers: int, *, step: int | None = None,
                siblings: bool = True) -> ServerCheckpoint:
    """Read and verify pserver ``server_id``'s shard of the checkpoint in ``root`` (at ``step``: latest or previous).

    With ``siblings`` and no ``step``, a commit record in ``root`` names the step to load (the latest or the
    previous shard: a later save may have failed on another pserver) and every sibling visible in ``root``
    must hold that step; without a record, the latest shard is loaded and every visible sibling's latest
    must be at its step. ``siblings=False`` skips both (pservers that save on their own, ``checkpoint_every``,
    agree on a step through their trainers instead).
    """
    rec = _commit(Path(root)) if siblings and step is None else None
    if rec is not None:
        step = rec["step"]
        if step not in saved_steps(root, server_id):
            raise CheckpointError(f"{root}: the commit record says step {step}, but pserver {server_id} holds "
                                  f"{_holds(root, server_id)}")
    sdir = server_dir(root, server_id)
    if step is not None and step not in saved_steps(root, server_id)[:1]:
        sdir = prev_dir(root, server_id)
    if not _lexists(sdir):
        raise CheckpointError(f"{sdir / 'manifest.json'}: missing")
    dfd = _open_dir(sdir)
    try:
        manifest = _read_json(sdir / "manifest.json", _read_at(dfd, "manifest.json", sdir))
        tensors = _read_at(dfd, "tensors.npz", sdir)
    finally:
        os.close(dfd)
    if manifest.get("server_id") != server_id or manifest.get("num_servers") != num_servers:
        raise CheckpointError(
            f"{sdir}: saved by pserver {manifest.get('server_id')} of {manifest.get('num_servers')}, "
            f"cannot load into pserver {server_id} of {num_servers}"
        )
    want, step = step, manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{sdir}/manifest.json: step is not a non-negative integer")
    if not isinstance(manifest.get("optimizer"), (dict, type(None))):
        raise CheckpointError(f"{sdir}/manifest.json: optimizer is not an object")
    table = manifest.get("blocks", [])
    if not isinstance(table, list) or not all(map(_is_entry, table)):
        raise CheckpointError(f"{sdir}/manifest.json: the block table is malformed")
    params = parse_params(manifest.get("params", {}))
    if params is None:
        raise CheckpointError(f"{sdir}/manifest.json: the parameter table is malformed")
    if want is not None and step != want:
        raise CheckpointError(f"{sdir}: pserver {server_id} has no checkpoint at step {want} "
                              f"(it has {saved_steps(root, server_id)})")
    if rec is not None:
        if rec.get("num_servers") != num_servers:
            raise CheckpointError(f"{root}: commit record says step {step} with {rec.get('num_servers')} "
                                  f"pserver(s), but this shard is step {step} of {num_servers}")
        _check_siblings(Path(root), step, server_id, committed=True)
    elif siblings and want is None:
        _check_siblings(Path(root), step, server_id, committed=False)
    opt = None
    if manifest.get("optimizer") is not None:
        try:
            opt = OptimizerConfig.from_dict(manifest["optimizer"])
        except (PsConfigError, TypeError) as exc:
            raise CheckpointError(f"{sdir}/manifest.json: optimizer: {exc}") from None
    try:
        with np.load(io.BytesIO(tensors), allow_pickle=False) as npz:
            data = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # truncated or not an npz at all
        raise CheckpointError(f"{sdir}/tensors.npz: unreadable: {exc}") from None
    blocks: dict[str, np.ndarray] = {}
    states: dict[str, dict[str, np.ndarray]] = {}
    for i, entry in enumerate(table):
        arr = data.get(f"p{i}")
        if arr is None or arr.dtype.name != entry["dtype"] or arr.size != entry["size"]:
            raise CheckpointError(f"{sdir}: block {entry.get('key')!r} does not match its manifest entry")
        key = entry["key"]
        blocks[key] = arr.reshape(-1).copy()
        want_state = init_state(opt, blocks[key]) if opt is not None else None
        if want_state is not None and sorted(want_state) != sorted(entry.get("state", [])):
            raise CheckpointError(f"{sdir}/manifest.json: block {key!r} has optimizer state "
                                  f"{sorted(entry.get('state', []))}, {opt.kind} needs {sorted(want_state)}")
        st = {}
        for name in entry.get("state", []):
            if f"s{i}_{name}" not in data:
                raise CheckpointError(f"{sdir}: optimizer state {name!r} of {key!r} is missing")
            st[name] = data[f"s{i}_{name}"].copy()
            if want_state is not None:
                st[name] = _checked_state(sdir, key, name, st[name], want_state[name], arr.dtype)
        states[key] = st
    log.info("loaded %d block(s) at step %d from %s", len(blocks), step, sdir)
    return ServerCheckpoint(server_id, num_servers, step, str(manifest.get("mode", "")),
                            manifest.get("optimizer"), blocks, states, params)


def _is_entry(entry: Any) -> bool:
    """Whether ``entry`` is a well-formed block table entry of a manifest (as _write_shard writes them)."""
    return (isinstance(entry, dict) and isinstance(entry.get("key"), str) and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("size"), int) and isinstance(entry.get("state", []), list)
            and all(isinstance(name, str) for name in entry.get("state", [])))


def _checked_state(sdir: Path, key: str, name: str, arr: np.ndarray, want: np.ndarray, block: np.dtype) -> np.ndarray:
    """Optimizer state ``name`` of block ``key`` as :func:`init_state` makes it, or a CheckpointError.

    A float16 block's state saved in float16 (before its arithmetic was float32) is widened to float32.
    """
    if arr.shape == want.shape and arr.dtype == block and want.dtype == state_dtype(block) != block:
        arr = arr.astype(want.dtype)
    if arr.shape != want.shape or arr.dtype != want.dtype:
        raise CheckpointError(f"{sdir}/tensors.npz: optimizer state {name!r} of block {key!r} is "
                              f"{arr.dtype.name}{list(arr.shape)}, want {want.dtype.name}{list(want.shape)}")
    return arr


def _commit(root: Path) -> dict[str, Any] | None:
    """The commit record in ``root``, None when there is none; CheckpointError when its step is no step."""
    commit = root / "checkpoint.json"
    if not commit.is_file():
        return None
    rec = _read_json(commit)
    if isinstance(rec.get("step"), bool) or not isinstance(rec.get("step"), int) or rec["step"] < 0:
        raise CheckpointError(f"{commit}: step is not a non-negative integer")
    return rec


def _holds(root: str | os.PathLike[str], server_id: int) -> str:
    """The steps pserver ``server_id`` holds under ``root``, for an error message."""
    held = [f"step {step} ({sdir.name})" for sdir in (server_dir(root, server_id), prev_dir(root, server_id))
            if (step := _step_of(sdir)) is not None]
    return " and ".join(held) or "no readable shard"


_SHARD = re.compile(r"pserver-(\d+)(\.prev)?")


def _check_siblings(root: Path, step: int, server_id: int, *, committed: bool) -> None:
    """Every sibling shard visible in ``root`` must hold ``step``: its latest or (``committed``) its previous."""
    others: dict[int, list[int | None]] = {}
    for other in sorted(root.glob("pserver-*")):
        m = _SHARD.fullmatch(other.name)
        if m is None or int(m[1]) == server_id or (m[2] and not committed):
            continue  # not a shard dir (e.g. .new, finished by its own pserver), this one, or an unused .prev
        if not other.is_symlink() and not (other / "manifest.json").is_file():
            continue
        others.setdefault(int(m[1]), []).append(_read_manifest(other).get("step"))  # a symlink is refused by name
    for sid, steps in sorted(others.items()):
        if step not in steps:
            if committed:
                raise CheckpointError(f"{root}: the commit record says step {step}, but pserver {sid} holds "
                                      f"{_holds(root, sid)}")
            raise CheckpointError(f"{root}: inconsistent checkpoint: pserver-{sid} is at step {steps[0]}, "
                                  f"expected {step}")


def write_commit(root: str | os.PathLike[str], step: int, endpoints: list[str], *, job: str = "") -> Path:
    """Record that every pserver saved ``step`` under ``root`` (written by the requesting trainer)."""
    path = Path(root) / "checkpoint.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".checkpoint.json.tmp-{os.getpid()}")
    rec = {"format": FORMAT, "job": job, "step": step, "num_servers": len(endpoints), "endpoints": endpoints}
    try:
        os.unlink(tmp)  # a stale one (or a planted symlink: removed, never followed)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(rec, indent=1, sort_keys=True))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


def read_commit(root: str | os.PathLike[str]) -> Mapping[str, Any]:
    """The commit record of the checkpoint in ``root``."""
    return _read_json(Path(root) / "checkpoint.json")
