"""What `start` of a `backend: kubernetes` spec would hit beyond what `k8s render` refuses: a Job larger than Kubernetes
stores in one object, and a pod whose main process gets more arguments and environment together than Linux's execve
takes (each string on its own is k8s_content's check: 128 KiB).

Both are measured on what `start` creates and what the kubelet makes of it: each role's Job as clusterctl.k8s renders
it (without the plan: milliseconds, also for 10,000 pods), and the argv and environment its last pod gets (the longest
index in its names), by clusterctl.k8s's own `pod_argv` and `pod_env`. KubernetesBackend.check makes these checks when
a spec is loaded, so validate, plan, k8s render and start refuse the same spec in the same line."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .. import k8s
from ..spec.errors import dotted
from .k8s_content import K8sShape, k8s_last_placeholders, k8s_shape, kubernetes_problems

if TYPE_CHECKING:
    from ..spec import ClusterSpec

__all__ = ["start_problems", "limit_problems", "exec_size", "OBJECT_LIMIT", "EXEC_LIMIT", "EXEC_POINTER", "ARGS_CAP"]

# etcd's largest request: its --max-request-bytes, 1.5 MiB by default (https://etcd.io/docs/v3.5/dev-guide/limit/).
# The API server stores each object in one request, so `kubectl create` of a Job over it fails ("etcdserver: request
# is too large"), and so would the Job controller's pods, which carry the Job's pod template. A Job is measured as the
# JSON kubectl sends; the API server stores it as protobuf, no larger but for the metadata it adds (a few hundred bytes).
OBJECT_LIMIT = 1536 * 1024
# Linux's bound on a new program's arguments and environment together: a quarter of the stack limit (fs/exec.c,
# bprm_stack_limits; RLIMIT_STACK is 8 MiB by default, `getconf ARG_MAX` says 2097152), counting every string with its
# NUL and one pointer for it. Over it execve fails with E2BIG ("argument list too long"): the container never starts.
# Each string alone is bounded too (MAX_ARG_STRLEN, 128 KiB: clusterctl.host.layout.MAX_EXEC_STRING). What clusterctl
# does not set is not counted: the program's path (the kernel counts it too), what the image's ENV and the kubelet
# (HOSTNAME, KUBERNETES_SERVICE_*) add to the environment: a few hundred bytes.
EXEC_LIMIT = 2 * 1024 * 1024
EXEC_POINTER = 8  # bytes of each string's pointer (argv[i], envp[i]) on a 64-bit machine
TOKEN_LENGTH = 32  # the job's token in the pods' environment: 16 random bytes in hex (k8s.render)
# Bytes of job.args (placeholders filled in) past which the Jobs are built from the first arguments only, those that
# take this much: each argument fits in 128 KiB, but 100,000 of them (as many as a spec's YAML may hold) would be
# gigabytes. A pod given that much could not start whatever its Job is (EXEC_LIMIT): the size is then said as "more than".
ARGS_CAP = 4 * EXEC_LIMIT


def start_problems(spec: ClusterSpec) -> list[tuple[tuple, str]]:
    """(path, message) for what `start` of a spec with a kubernetes: section would fail at: what `k8s render` refuses
    (clusterctl.backends.k8s_content.kubernetes_problems), then (when none of that) limit_problems."""
    return kubernetes_problems(spec) or limit_problems(spec)


def limit_problems(spec: ClusterSpec) -> list[tuple[tuple, str]]:
    """The first of: a role's Job over OBJECT_LIMIT (`kubectl create` fails), a role's pod whose main process's argv and
    environment are over EXEC_LIMIT (no pod starts); each at the key that gives most of it (job.args, job.env or
    job.entrypoint). For a spec kubernetes_problems has nothing against (its names, GPUs and strings fit)."""
    shape = k8s_shape(spec)
    spec, more = _capped(spec, shape)
    jobs = [(role, count, k8s._job(spec, shape, role, count, port, gpus))  # as k8s.render makes each role's Job
            for role, count, port, gpus in (("pserver", shape.pservers, spec.job.ports.pserver, 0),
                                            ("trainer", shape.trainers, spec.job.ports.trainer, shape.gpus)) if count]
    for role, _, job in jobs:  # what `kubectl create` meets first
        size = len(_json(job))
        if size > OBJECT_LIMIT:
            at, part = _largest(_manifest_parts(spec, job))
            return [(at, f"the {role} Job would be {more}{size} bytes, {more}{part} of them {dotted(at)}: Kubernetes "
                     f"stores no object over {OBJECT_LIMIT / 2**20:g} MiB ({OBJECT_LIMIT} bytes, etcd's request limit)")]
    for role, count, job in jobs:  # then each pod's main process
        argv, env = _last_pod(spec, shape, job, count)
        size = exec_size(argv, env)
        if size > EXEC_LIMIT:
            at, part = _largest(_exec_parts(spec, job, argv, env))
            return [(at, f"the arguments and environment of a {role} pod's main process would be {more}{size} bytes, "
                     f"{more}{part} of them {dotted(at)}: Linux starts no process with over {EXEC_LIMIT / 2**20:g} MiB "
                     "of both together (E2BIG)")]
    return []


def _capped(spec: ClusterSpec, shape: K8sShape) -> tuple[ClusterSpec, str]:
    """`spec`, or (when job.args, placeholders filled in as in the last trainer pod, take over ARGS_CAP bytes) a copy
    with the first arguments that do, and "more than " (what the sizes measured then are)."""
    values, total = k8s_last_placeholders(spec, shape, "trainer"), 0
    for i, arg in enumerate(spec.job.args):
        total += _bytes(arg.format_map(values))
        if total > ARGS_CAP:
            return spec.model_copy(update={"job": spec.job.model_copy(update={"args": spec.job.args[:i + 1]})}), \
                "more than "
    return spec, ""


def exec_size(argv: list[str], env: dict[str, str]) -> int:
    """What execve counts of `argv` and `env` against EXEC_LIMIT: every string (`NAME=value` for the environment) with
    its NUL, and its pointer."""
    strings = [*argv, *(f"{k}={v}" for k, v in env.items())]
    return sum(_bytes(s) + 1 + EXEC_POINTER for s in strings)


def _last_pod(spec: ClusterSpec, shape: K8sShape, job: dict, count: int) -> tuple[list[str], dict[str, str]]:
    """The argv and environment the kubelet gives the main container of `job`'s last pod."""
    secrets = {(k8s.names(spec)["secret"], k8s.TOKEN_KEY): "0" * TOKEN_LENGTH}
    return k8s.pod_argv(job, count - 1, secrets=secrets), k8s.pod_env(job, count - 1, secrets=secrets)


def _exec_parts(spec: ClusterSpec, job: dict, argv: list[str], env: dict[str, str]) -> dict[tuple, int]:
    """How much of exec_size(argv, env) job.entrypoint, job.args and job.env each give."""
    glue = len(_main_container(job)["command"])  # the pod's own program (clusterctl/host/pod.py) comes first
    entrypoint = glue + len(spec.job.entrypoint)
    return {("job", "entrypoint"): exec_size(argv[glue:entrypoint], {}), ("job", "args"): exec_size(argv[entrypoint:], {}),
            ("job", "env"): exec_size([], {k: v for k, v in env.items() if k in spec.job.env})}


def _manifest_parts(spec: ClusterSpec, job: dict) -> dict[tuple, int]:
    """How much of the Job's JSON job.entrypoint, job.args and job.env each give."""
    container = _main_container(job)
    n = len(spec.job.entrypoint)
    return {("job", "entrypoint"): sum(len(_json(a)) + 1 for a in container["args"][:n]),
            ("job", "args"): sum(len(_json(a)) + 1 for a in container["args"][n:]),
            ("job", "env"): sum(len(_json(e)) + 1 for e in container["env"] if e["name"] in spec.job.env)}


def _main_container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def _largest(parts: dict[tuple, int]) -> tuple[tuple, int]:
    """The key that gives most, and how much (the first of equals)."""
    return max(parts.items(), key=lambda kv: kv[1])


def _json(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogateescape")


def _bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape"))
