"""The Kubernetes backend's test harness: a pod image, a fake `kubectl` over Docker (fakekube.py), spec writers.

There is no Kubernetes API server on this machine. The harness runs what the pods would run (the image's
python3 running clusterctl/host/pod.py from the ConfigMap's files, with the environment the kubelet would
compute), one container per pod container, the pods' DNS names as docker network aliases, and a fake
`kubectl` first on PATH that implements exactly the commands the backend runs (fakekube.py's docstring).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

import fakekube

ROOT = Path(__file__).resolve().parents[2]
POD_IMAGE_REPO = "clusterctl/k8s-pod"


def _source_hash() -> str:
    """A hash of what goes into clusterctl's wheel (the package and pyproject.toml)."""
    digest = hashlib.sha256()
    files = sorted(p for p in (ROOT / "clusterctl").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in [*files, ROOT / "pyproject.toml"]:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def pod_image(packages: list[str], wheel) -> tuple[str, bool]:
    """The image the test pods run: the test cluster's node image (python3, /opt/venv with `packages`) plus this
    checkout of clusterctl installed as a wheel into /opt/venv (for clusterctl.ps). Built once per source.

    `wheel` is called (with no argument) for the wheel's path only when the image must be built.
    """
    from clusterctl import docker
    from clusterctl import testcluster as tc

    with tc._locked("images"):  # the test cluster's own lock: one build of the node image at a time
        base = tc._resolve_base_image(None, lambda _m: None)
        node, _ = tc._ensure_node_image(base, packages, lambda _m: None)
        node_id = (docker.image_id(node) or node).split(":")[-1][:12]
        tag = f"{POD_IMAGE_REPO}:{_source_hash()}-{node_id}"
        if docker.image_exists(tag):
            return tag, False
        path = Path(wheel())
        with tempfile.TemporaryDirectory(prefix="k8s-pod-") as tmp:
            ctx = Path(tmp)
            (ctx / path.name).write_bytes(path.read_bytes())
            (ctx / "Dockerfile").write_text(
                f"FROM {node}\nCOPY {path.name} /tmp/\n"
                f"RUN /opt/venv/bin/pip install -q --no-deps --no-index /tmp/{path.name} && rm /tmp/{path.name}\n"
                "LABEL clusterctl.k8s-pod=1\nENTRYPOINT []\n")
            subprocess.run(["docker", "build", "-q", "-t", tag, str(ctx)], check=True, capture_output=True, timeout=900)
        # the images of earlier sources: one image per checkout is enough (a GB each, shared layers aside)
        old = subprocess.run(["docker", "images", "--filter", "label=clusterctl.k8s-pod=1", "--format",
                              "{{.Repository}}:{{.Tag}}"], capture_output=True, text=True).stdout.split()
        stale = [t for t in old if t.startswith(POD_IMAGE_REPO + ":") and t != tag]
        if stale:
            subprocess.run(["docker", "rmi", *stale], capture_output=True)
        return tag, True


@dataclass
class FakeKube:
    """A fake cluster: its state dir, its docker network, the bin dir holding its `kubectl`."""

    dir: Path
    network: str
    bin: Path

    def env(self) -> dict[str, str]:
        """The environment in which `kubectl` is this fake (clusterctl's subprocesses inherit it)."""
        return {**os.environ, "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                "FAKEKUBE_DIR": str(self.dir), "FAKEKUBE_NETWORK": self.network}

    def kubectl(self, *args: str, ns: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run the fake kubectl as the backend would."""
        return subprocess.run([str(self.bin / "kubectl"), "--namespace", ns, *args], capture_output=True, text=True,
                              input=input, timeout=timeout, env=self.env())

    def journal(self) -> list[list[str]]:
        """Every kubectl command line run so far."""
        path = self.dir / "journal.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def sweeps(self) -> list[dict]:
        """What each pod held (processes tagged CLUSTERCTL_JOB) when its deletion began."""
        path = self.dir / "sweeps.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def containers(self) -> list[str]:
        """Names of every container of this fake cluster (running or not)."""
        res = subprocess.run(["docker", "ps", "-a", "--format", "{{.Names}}", "--filter",
                              f"label=fakekube={self._tag()}"], capture_output=True, text=True, check=True)
        return res.stdout.split()

    def _tag(self) -> str:
        return hashlib.sha256(str(self.dir).encode()).hexdigest()[:8]

    def main_container(self, pod: str, container: str) -> str:
        """The docker name of a pod's container."""
        return f"fk-{self._tag()}-{pod}-{container}"

    def pods(self, ns: str, selector: str) -> list[dict]:
        """`kubectl get pods -l SELECTOR -o json` items."""
        res = self.kubectl("get", "pods", "-l", selector, "-o", "json", ns=ns)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)["items"]


def up(dir: Path) -> FakeKube:
    """A fake cluster in `dir`: its network created, `kubectl` installed in dir/bin."""
    dir.mkdir(parents=True, exist_ok=True)
    kube = FakeKube(dir, f"fakekube-{hashlib.sha256(str(dir).encode()).hexdigest()[:8]}", dir / "bin")
    subprocess.run(["docker", "network", "create", "--label", "fakekube=1", kube.network], capture_output=True, check=True)
    fakekube.install(kube.bin)
    return kube


def down(kube: FakeKube) -> None:
    """Remove every container and the network of the fake cluster."""
    os.environ.setdefault("FAKEKUBE_DIR", str(kube.dir))
    old = os.environ.get("FAKEKUBE_DIR")
    os.environ["FAKEKUBE_DIR"] = str(kube.dir)
    try:
        fakekube.cleanup()
    finally:
        if old is not None:
            os.environ["FAKEKUBE_DIR"] = old
    subprocess.run(["docker", "network", "rm", kube.network], capture_output=True)


def write_spec(path: Path, *, name: str, image: str, workspace: Path, job: dict, hosts: int = 2, gpus: int = 0,
               kube: dict | None = None) -> Path:
    """A `backend: kubernetes` spec: `hosts` hosts of one slot give the shape, the code on a hostPath volume."""
    spec = {
        "name": name,
        "backend": "kubernetes",
        "hosts": [{"address": f"shape-{i}", **({"gpus": gpus} if gpus else {})} for i in range(hosts)],
        "job": job,
        "kubernetes": {"image": image, "namespace": "k8s-it", "image_pull_policy": "Never",
                       "workspace": {"host_path": str(workspace), "mount_path": "/workspace"}, "wait_timeout": 60,
                       **(kube or {})},
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def clusterctl(kube: FakeKube, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """The real CLI, with the fake kubectl first on PATH."""
    return subprocess.run([sys.executable, "-m", "clusterctl.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, env={**kube.env(), "COLUMNS": "200"})
