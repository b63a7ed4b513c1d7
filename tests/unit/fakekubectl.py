"""A scripted `kubectl` for unit tests of backend: kubernetes: no cluster, no Docker, no pods that run.

`install(bin_dir, state_dir)` writes `kubectl` into bin_dir (put it first on PATH). It takes exactly the verbs
clusterctl/backends/kubernetes.py runs (tests/integration/fakekube.py's list) and refuses anything else (exit 2),
and answers from what the test wrote into the state dir with `FakeKubectl`:

- ``objects``: the cluster's objects (Jobs, Services, ConfigMaps, Secrets, Pods). `get KINDS -l K=V -o json` lists
  those of KINDS carrying label K=V. ``pods``, when set, is a sequence of pod lists instead: the n-th `get` that
  lists pods answers the n-th list (the last one from then on), so a test plays how the pods go on between looks.
- `create -f -` adds the List on stdin to the objects (and keeps the List); `delete KINDS -l K=V ...` removes those
  objects and, with the Jobs, every pod (until the next create).
- ``exec``: pod -> agent subcommand (status, stop, top) -> {"rc", "out", "err"}; a pod without one is kubectl's
  NotFound error (exit 1). `top --progress-only` (what `clusterctl status` asks: the status with each process's
  progress) is answered by the pod's "status" entry.
- ``logs``: pod -> its container log (`logs POD -c C`), or {"out": log, "hold": seconds it takes}; ``follow``: pod -> the successive `logs -f` streams
  ({"out", "rc", "err", "end"}: each call answers the next; with "end" the pod's container has ended afterwards:
  its state is then terminated, exit code "end"; "hold": seconds the stream then stays open, as a running
  container's does; each `logs -f` process's pid is kept: `follower_pids()`).
- ``fail``: verb -> {"rc", "err"}: every call of that verb fails so.

Every call's argv (after `kubectl`) is logged in order; `calls()` reads them back.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

__all__ = ["install", "FakeKubectl"]

KIND = {"jobs": "Job", "pods": "Pod", "services": "Service", "configmaps": "ConfigMap", "secrets": "Secret"}


def install(bin_dir: Path, state: Path) -> "FakeKubectl":
    """Write `kubectl` into bin_dir, playing the cluster kept in `state`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / "kubectl"
    # -S: the fake needs nothing outside the stdlib, and every call starts a Python
    tool.write_text(f"#!{sys.executable} -S\nimport sys\nsys.argv[1:1] = [{str(state)!r}]\n"
                    f"exec(compile(open({__file__!r}).read(), {__file__!r}, 'exec'))\n")
    tool.chmod(0o755)
    return FakeKubectl(state)


class FakeKubectl:
    """The test's side of the fake: what the cluster holds and answers, and the calls it got."""

    def __init__(self, state: Path):
        self.state = Path(state)

    def set(self, **what) -> None:
        """Set objects=, pods=, exec=, logs=, follow=, fail= (see the module's docstring); gets=0 starts the
        `pods` sequence again."""
        for key, value in what.items():
            (self.state / f"{key}.json").write_text(json.dumps(value))

    def calls(self) -> list[list[str]]:
        """Every call's argv after `kubectl`, in order."""
        log = self.state / "argv.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def follower_pids(self) -> list[int]:
        """The pid of every `logs -f` started so far."""
        path = self.state / "follower_pids.json"
        return json.loads(path.read_text()) if path.exists() else []

    def created(self) -> list[dict]:
        """The objects of every `create -f -`, as kubectl read them from stdin."""
        path = self.state / "created.json"
        return json.loads(path.read_text()) if path.exists() else []


# ----------------------------------------------------------------------------------------- the tool


@contextmanager
def _locked(state: Path):
    with open(state / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _load(state: Path, key: str, default):
    path = state / f"{key}.json"
    return json.loads(path.read_text()) if path.exists() else default


def _save(state: Path, key: str, value) -> None:
    (state / f"{key}.json").write_text(json.dumps(value))


def _labelled(obj: dict, selector: str) -> bool:
    key, _, value = selector.partition("=")
    return (obj.get("metadata", {}).get("labels") or {}).get(key) == value


def _pods(state: Path, count: bool) -> list[dict]:
    """The pods now: the next of the `pods` sequence (or the objects' pods), the ended ones ended."""
    seq = _load(state, "pods", None)
    if _load(state, "gone", False):
        return []
    if seq is None:
        pods = [o for o in _load(state, "objects", []) if o.get("kind") == "Pod"]
    else:
        n = _load(state, "gets", 0)
        pods = seq[min(n, len(seq) - 1)] if seq else []
        if count:
            _save(state, "gets", n + 1)
    ended = _load(state, "ended", {})
    for pod in pods:
        name = pod["metadata"]["name"]
        if name in ended:
            role = pod["metadata"]["labels"]["clusterctl.io/role"]
            pod["status"] = {"phase": "Succeeded" if ended[name] == 0 else "Failed",
                             "containerStatuses": [{"name": role, "state": {"terminated": {"exitCode": ended[name]}}}]}
    return pods


def _fail(state: Path, verb: str) -> None:
    failure = _load(state, "fail", {}).get(verb)
    if failure:
        sys.stderr.write(failure["err"])
        sys.exit(failure["rc"])


def main(state: Path, argv: list[str]) -> int:
    with _locked(state), open(state / "argv.jsonl", "a") as log:
        log.write(json.dumps(argv) + "\n")
    args = list(argv)
    while args and args[0] in ("--context", "--namespace"):
        args = args[2:]
    verb = args[0] if args else ""
    if verb == "logs" and len(args) > 1 and args[1] == "-f":
        verb, args = "logs -f", ["logs", *args[2:]]
    _fail(state, verb)
    if verb == "get" and args[2] == "-l" and args[4:] == ["-o", "json"]:
        kinds = [KIND[k] for k in args[1].split(",")]
        with _locked(state):
            items = [o for o in _load(state, "objects", []) if o.get("kind") in kinds and o.get("kind") != "Pod"]
            if "Pod" in kinds:
                items += _pods(state, count=True)
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": [o for o in items if _labelled(o, args[3])]}))
        return 0
    if verb == "create" and args[1:] == ["-f", "-"]:
        body = json.loads(sys.stdin.read())
        with _locked(state):
            _save(state, "created", _load(state, "created", []) + body["items"])
            _save(state, "objects", _load(state, "objects", []) + body["items"])
            _save(state, "gone", False)
        for obj in body["items"]:
            print(f"{obj['kind'].lower()}/{obj['metadata']['name']} created")
        return 0
    if verb == "delete" and args[2] == "-l":
        kinds = [KIND[k] for k in args[1].split(",")]
        with _locked(state):
            objects = _load(state, "objects", [])
            gone = [o for o in objects if o.get("kind") in kinds and _labelled(o, args[3])]
            _save(state, "objects", [o for o in objects if o not in gone and
                                     not ("Job" in kinds and o.get("kind") == "Pod")])
            if "Job" in kinds:
                _save(state, "gone", True)
        for obj in gone:
            print(f"{obj['kind'].lower()}/{obj['metadata']['name']} deleted")
        return 0
    if verb == "exec" and args[2] == "-c" and args[4] == "--":
        pod, command = args[1], args[5:]
        sub = command[command.index("clusterctl_host.agent") + 1] if "clusterctl_host.agent" in command else "?"
        if sub == "top" and "--progress-only" in command:  # `status` asks this: the status, with progress
            sub = "status"
        answer = _load(state, "exec", {}).get(pod, {}).get(sub)
        if answer is None:
            sys.stderr.write(f'Error from server (NotFound): pods "{pod}" not found\n')
            return 1
        sys.stdout.write(answer.get("out", ""))
        sys.stderr.write(answer.get("err", ""))
        return answer.get("rc", 0)
    if verb == "logs" and args[2] == "-c":
        text = _load(state, "logs", {}).get(args[1])
        if isinstance(text, dict):  # {"out": the log, "hold": seconds the answer takes}
            time.sleep(text.get("hold", 0))
            text = text["out"]
        if text is None:
            sys.stderr.write(f'Error from server (BadRequest): container "{args[3]}" in pod "{args[1]}" is waiting '
                             "to start: ContainerCreating\n")
            return 1
        sys.stdout.write(text)
        return 0
    if verb == "logs -f" and args[2] == "-c":
        pod = args[1]
        with _locked(state):
            served = _load(state, "served", {})
            streams = _load(state, "follow", {}).get(pod, [])
            stream = streams[min(served.get(pod, 0), len(streams) - 1)] if streams else {"rc": 1, "err": "no stream"}
            served[pod] = served.get(pod, 0) + 1
            _save(state, "served", served)
            _save(state, "follower_pids", _load(state, "follower_pids", []) + [os.getpid()])
        sys.stdout.write(stream.get("out", ""))
        sys.stdout.flush()
        sys.stderr.write(stream.get("err", ""))
        if "hold" in stream:
            time.sleep(stream["hold"])
        if "end" in stream:
            with _locked(state):
                _save(state, "ended", {**_load(state, "ended", {}), pod: stream["end"]})
        return stream.get("rc", 0)
    sys.stderr.write(f"fakekubectl: unsupported: kubectl {' '.join(argv)}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
