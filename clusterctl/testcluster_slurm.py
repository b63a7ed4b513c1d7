"""A real Slurm cluster in Docker containers: the test cluster's nodes plus Debian's slurm-wlm and munge.

``up`` builds (and caches) an image FROM the test cluster's node image with ``slurm-wlm`` and ``munge``
installed from Debian's packages, starts N nodes on the cluster's private network (node0's /shared is
a volume every node mounts: a shared filesystem for ``slurm.workspace: shared``), pins host keys and
installs the client key as ``clusterctl testcluster up`` does, then writes one munge key and one
slurm.conf to every node and starts munged everywhere, slurmctld on node0 and slurmd on every node,
and waits until ``sinfo`` shows every node idle. See docs/slurm.md.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import secrets
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import docker
from . import testcluster as tc

__all__ = ["DEFAULT_NAME", "PARTITION", "SHARED_DIR", "SLURM_PACKAGES", "up", "down", "slurm_conf", "add_cli"]

DEFAULT_NAME = "clusterctl-slurm"
PARTITION = "debug"
SHARED_DIR = "/shared"  # node0's volume, mounted by every node: the shared filesystem
SLURM_PACKAGES = ("slurm-wlm", "munge")
SLURM_IMAGE_REPO = "clusterctl/testcluster-slurm"
CPUS_PER_NODE = 16  # declared, not real: lets a node run a few processes of each step (config_overrides)
IDLE_TIMEOUT = 60.0
DAEMON_TIMEOUT = 60.0

_DOCKERFILE = """\
ARG NODE_IMAGE
FROM ${NODE_IMAGE}
RUN apt-get update \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends %s \\
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \\
 && mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /shared
""" % " ".join(SLURM_PACKAGES)


def _noop(_: str) -> None:
    return None


def _image_tag(node_image: str) -> str:
    digest = hashlib.sha256((docker.image_id(node_image) or node_image).encode() + _DOCKERFILE.encode())
    return f"{SLURM_IMAGE_REPO}:{digest.hexdigest()[:16]}"


def _ensure_slurm_image(node_image: str, say: tc.Progress) -> tuple[str, bool]:
    """The Slurm node image FROM node_image, built if absent; the flag says whether a build happened."""
    tag = _image_tag(node_image)
    if docker.image_exists(tag):
        return tag, False
    say(f"building {tag} FROM {node_image} (apt-get install {' '.join(SLURM_PACKAGES)})")
    with tempfile.TemporaryDirectory(prefix="clusterctl-slurm-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(_DOCKERFILE)
        env = {} if docker.buildkit_available() else {"DOCKER_BUILDKIT": "0"}
        args = ["build", "--tag", tag, "--label", f"{tc.IMAGE_LABEL}=1", "--build-arg", f"NODE_IMAGE={node_image}"]
        docker.run([*args, tmp], env=env, timeout=tc.BUILD_TIMEOUT)
    return tag, True


def slurm_conf(name: str, nodes: Sequence[tc.Node], *, cpus: int = CPUS_PER_NODE) -> str:
    """slurm.conf for the cluster (pure): slurmctld on nodes[0], one partition of every node, no cgroups."""
    head = nodes[0]
    lines = [
        f"ClusterName={name.replace('.', '-')[:40]}",
        f"SlurmctldHost={head.hostname}({head.ip})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",  # containers: no cgroup hierarchy of our own
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SlurmdParameters=config_overrides",  # the declared CPUs are more than the container has
        "ReturnToService=2",
        "MinJobAge=3600",  # `scontrol show job` remembers finished jobs for an hour (no slurmdbd here)
        "KillWait=5",
        "InactiveLimit=0",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        "SlurmdSpoolDir=/var/spool/slurmd",
        "StateSaveLocation=/var/spool/slurmctld",
        "SlurmctldLogFile=/var/log/slurm/slurmctld.log",
        "SlurmdLogFile=/var/log/slurm/slurmd.log",
    ]
    lines += [f"NodeName={n.hostname} NodeAddr={n.ip} CPUs={cpus} State=UNKNOWN" for n in nodes]
    lines.append(f"PartitionName={PARTITION} Nodes={','.join(n.hostname for n in nodes)} Default=YES "
                 "MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _files_tar(files: dict[str, tuple[bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, (data, mode) in files.items():
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _copy_in(container: str, payload: bytes) -> None:
    argv = [docker.docker_binary(), "cp", "-", f"{container}:/"]
    proc = subprocess.run(argv, input=payload, capture_output=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise docker.DockerError(argv, proc.returncode, proc.stderr.decode(errors="replace"))


_START_MUNGE = (
    "chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key"
    " && install -d -o munge -g munge -m 0755 /run/munge"
    " && { pidof munged >/dev/null || runuser -u munge -- /usr/sbin/munged; }"
)
# Daemons are (re)started so that they read the slurm.conf just written.
_RESTART = (
    "if [ -s /run/{d}.pid ] && kill $(cat /run/{d}.pid) 2>/dev/null; then"
    " while kill -0 $(cat /run/{d}.pid) 2>/dev/null; do sleep 0.1; done; fi; /usr/sbin/{d}{args}"
)
_START_SLURMCTLD = _RESTART.format(d="slurmctld", args=" -i")
_START_SLURMD = _RESTART.format(d="slurmd", args="")


def _sh(container: str, script: str, *, timeout: float = 60) -> str:
    return docker.run(["exec", container, "sh", "-c", script], timeout=timeout).stdout


def _configure(name: str, nodes: Sequence[tc.Node], state: Path, say: tc.Progress) -> None:
    """One munge key and slurm.conf everywhere; munged on all, slurmctld on node0, slurmd on all."""
    key_path = state / "munge.key"
    if not key_path.is_file():
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_bytes(1024))
    payload = _files_tar({
        "etc/munge/munge.key": (key_path.read_bytes(), 0o400),
        "etc/slurm/slurm.conf": (slurm_conf(name, nodes).encode(), 0o644),
    })
    containers = [n.container for n in nodes]
    tc._parallel(lambda c: _copy_in(c, payload), containers, "writing munge key and slurm.conf")
    tc._parallel(lambda c: _sh(c, _START_MUNGE), containers, "starting munged")
    say(f"starting slurmctld on {nodes[0].container} and slurmd on {len(nodes)} node(s)")
    _sh(containers[0], _START_SLURMCTLD)
    tc._parallel(lambda c: _sh(c, _START_SLURMD), containers, "starting slurmd")


def _wait_idle(name: str, nodes: Sequence[tc.Node], timeout: float = IDLE_TIMEOUT) -> float:
    """Seconds until `sinfo` on node0 shows every node idle; raise with sinfo's view if it never does."""
    t0 = time.monotonic()
    head = nodes[0].container
    wanted = {n.hostname for n in nodes}
    seen = ""
    while time.monotonic() - t0 < timeout:
        proc = docker.run(["exec", head, "sinfo", "--noheader", "--Node", "--format=%N %t"], check=False, timeout=30)
        seen = (proc.stdout + proc.stderr).strip()
        states = dict(line.split(None, 1) for line in proc.stdout.splitlines() if len(line.split()) == 2)
        if proc.returncode == 0 and wanted <= set(states) and all(states[h] == "idle" for h in wanted):
            return time.monotonic() - t0
        if any(states.get(h, "").startswith(("drain", "down")) for h in wanted) and time.monotonic() - t0 > 10:
            for h in wanted:
                if states.get(h, "").startswith(("drain", "down")):
                    docker.run(["exec", head, "scontrol", "update", f"NodeName={h}", "State=RESUME"], check=False)
        time.sleep(0.5)
    log = docker.run(["exec", head, "tail", "-n", "15", "/var/log/slurm/slurmctld.log"], check=False).stdout
    raise tc.DockerClusterError(f"Slurm nodes of {name} not idle after {timeout:g}s; sinfo says:\n{seen}\n"
                                f"slurmctld.log:\n{log}")


def _start_node(name: str, index: int, image: str, net: str) -> str:
    """`docker run` one Slurm node; node0 owns the /shared volume, the others mount it from node0."""
    container = tc._container_name(name, index)
    shared = ["--volume", SHARED_DIR] if index == 0 else ["--volumes-from", tc._container_name(name, 0)]
    docker.run(
        [
            "run", "--detach", "--init",
            "--name", container, "--hostname", container, "--network", net,
            "--label", f"{tc.LABEL}={name}",
            "--label", f"{tc.INDEX_LABEL}={index}",
            "--label", f"{tc.IMAGE_LABEL}={image}",
            "--label", f"{tc.LAYOUT_LABEL}={tc.LAYOUT}",
            "--tmpfs", f"{tc.SMALL_TMPFS}:rw,size=2m,mode=1777",
            "--shm-size", "1g",
            *shared,
            image,
        ]
    )  # fmt: skip
    return container


def _spec(name: str, nodes: Sequence[tc.Node], key_path: Path, known_hosts: Path) -> dict[str, Any]:
    spec = tc._spec_dict(name, nodes, key_path, known_hosts)
    del spec["hosts"]  # Slurm places the processes; the spec gives the shape
    spec["backend"] = "slurm"
    spec["slurm"] = {"login": nodes[0].ip, "nodes": len(nodes), "partition": PARTITION, "time": "00:10:00"}
    return spec


def up(
    nodes: int,
    name: str = DEFAULT_NAME,
    spec_out: Path | None = None,
    packages: list[str] | None = None,
    *,
    base_image: str | None = None,
    progress: tc.Progress | None = None,
) -> tc.ClusterInfo:
    """Bring up (or reuse) an N-node Slurm cluster named name and write its spec; see module docs."""
    say = progress or _noop
    tc._checked_name(name)
    tc._checked_nodes(nodes)
    pkgs = tc._checked_packages(packages)
    base_image = tc._checked_base_image(base_image)
    spec_out = tc._checked_spec_out(spec_out)
    started = time.monotonic()
    tc.ensure_docker()
    state = tc._made(tc.state_dir(name), 0o700)
    with tc._locked("images"):
        base = tc._resolve_base_image(base_image, say)
        node_image, built = tc._ensure_node_image(base, pkgs, say)
        image, slurm_built = _ensure_slurm_image(node_image, say)
    images_done = time.monotonic()
    with tc._locked(f"cluster-{name}"):
        existing = tc._cluster_containers(name)
        reused = tc._reusable(existing, nodes, image, name)
        if reused:
            say(f"reusing the {nodes} node(s) of {name}")
            containers = tc._parallel(tc._wake, existing, "waking nodes")
        else:
            if existing or docker.ids_with_label("network", f"{tc.LABEL}={name}"):
                say(f"recreating {name}: it has {len(existing)} node(s) or another image")
                tc._remove(name)
            net = tc._ensure_network(name)
            say(f"starting {nodes} Slurm node(s) on network {net}")
            containers = [_start_node(name, 0, image, net)]
            containers += tc._parallel(lambda i: _start_node(name, i, image, net), list(range(1, nodes)),
                                       "starting nodes")
        node_list = tc._wait_nodes(name, containers, tc._network_name(name), say)
        key_path, known_hosts = tc._pin_and_authorize(node_list, state)
        nodes_done = time.monotonic()
        _configure(name, node_list, state, say)
        _wait_idle(name, node_list)
        spec_path = spec_out or (state / "cluster.yaml").resolve()
        tc._write_spec(spec_path, _spec(name, node_list, key_path, known_hosts))
    done = time.monotonic()
    return tc.ClusterInfo(
        name=name, nodes=node_list, spec_path=spec_path, key_path=key_path, known_hosts_path=known_hosts,
        state_dir=state, image=image, network=tc._network_name(name), packages=pkgs,
        image_built=built or slurm_built, reused=reused,
        timings={"images": images_done - started, "containers": nodes_done - images_done,
                 "slurm": done - nodes_done, "total": done - started},
    )


def down(name: str = DEFAULT_NAME) -> int:
    """Remove the Slurm cluster's containers, shared volume and network; idempotent. Returns count."""
    return tc.down(name)


# --------------------------------------------------------------------------------------------- CLI


def cmd_up(args: argparse.Namespace) -> int:
    """`testcluster up --slurm` / `testcluster-slurm up`: bring the Slurm cluster up; print nodes, timings, spec."""
    from rich.console import Console

    console = Console(log_path=False)
    packages = [p for p in (args.packages or "").split(",") if p.strip()]
    info = up(args.nodes, name=args.name, spec_out=Path(args.spec_out) if args.spec_out else None,
              packages=packages, base_image=getattr(args, "base_image", None),
              progress=lambda msg: console.log(msg, markup=False, highlight=False))
    for node in info.nodes:
        console.print(f"{node.container}  {node.ip}  {node.hostname}", markup=False, highlight=False)
    t = info.timings
    console.print(f"{'reused' if info.reused else 'started'} in {t['total']:.1f}s (images {t['images']:.1f}s, "
                  f"containers {t['containers']:.1f}s, slurm {t['slurm']:.1f}s); image {info.image}",
                  markup=False, highlight=False)
    console.print(f"spec: {info.spec_path}", markup=False, highlight=False)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """`testcluster-slurm down`: remove the cluster."""
    removed = down(args.name)
    print(f"removed {removed} docker object(s) of test cluster {args.name}")
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register `testcluster-slurm up|down`; handlers in args.func."""
    parser = subparsers.add_parser("testcluster-slurm", help="a Slurm cluster (slurm-wlm, munge) in containers")
    sub = parser.add_subparsers(dest="testcluster_slurm_command", required=True, metavar="{up,down}")
    p_up = sub.add_parser("up", help="create or reuse the Slurm cluster and write its spec")
    tc.add_up_arguments(p_up, DEFAULT_NAME, base_image=False)
    p_up.set_defaults(func=cmd_up)
    tc.add_down_parser(sub, DEFAULT_NAME, cmd_down, "remove the cluster's containers, volume and network")
    return parser
