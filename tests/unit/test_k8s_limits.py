"""What `start` of a backend: kubernetes spec would hit beyond each string's 128 KiB (test_k8s_sizes_at_load.py): a Job
over what etcd stores in one object (1.5 MiB), and a pod whose main process gets more than execve's 2 MiB of
arguments and environment together. Both are refused when the spec is loaded, at the key that gives most of it, in one
line (validate, plan --json, plan and k8s render alike, exit 2); a spec just under either bound loads."""

from __future__ import annotations

import errno
import json
import resource
import subprocess

import pytest

from clusterctl import backends, cli, k8s
from clusterctl.backends.k8s_limits import EXEC_LIMIT, OBJECT_LIMIT, exec_size
from clusterctl.errors import SpecError
from clusterctl.spec import parse_spec

LONG = "k" * 40  # kubernetes.name: pod names of ~100 bytes (`<LONG>-trainer-999.<LONG>:6180`)


def endpoints_args(n: int) -> str:
    """1,000 trainers, `n` arguments of `{trainer_endpoints}` (~100 kB each): the trainer Job holds each once."""
    args = ", ".join(["'--eps={trainer_endpoints}'"] * n)
    return (f"name: fit\nbackend: kubernetes\nhosts: [{{address: a, slots: 1000}}]\n"
            f"job: {{entrypoint: [python3, t.py], args: [{args}]}}\nkubernetes: {{image: x, name: {LONG}}}\n")


def env_values(n: int) -> str:
    """`n` job.env values of 100 kB (one YAML alias each): every value is in the Job once."""
    return ("name: fit\nbackend: kubernetes\nhosts: [{address: a}]\njob:\n  entrypoint: [python3, t.py]\n  env:\n"
            "    A0: &v '" + "v" * 100_000 + "'\n" + "".join(f"    A{i}: *v\n" for i in range(1, n))
            + "kubernetes: {image: x}\n")


def host_args(n: int) -> str:
    """4 trainers, `n` arguments of 1,000 `{host}` each: `$(POD_IP)` in the Job (9 bytes), the pod's DNS name (91
    bytes) once the kubelet expands it, so ~91 kB each in the process and ~9 kB in the Job."""
    args = ", ".join(["'" + "{host}" * 1000 + "'"] * n)
    return (f"name: fit\nbackend: kubernetes\nhosts: [{{address: a, slots: 4}}]\n"
            f"job: {{entrypoint: [python3, t.py], args: [{args}]}}\nkubernetes: {{image: x, name: {LONG}}}\n")


JOB_SIZE = ("the trainer Job would be {size} bytes, {part} of them {key}: Kubernetes stores no object over 1.5 MiB "
            "(1572864 bytes, etcd's request limit)")
EXEC = ("the arguments and environment of a trainer pod's main process would be 2185792 bytes, 2184216 of them "
        "job.args: Linux starts no process with over 2 MiB of both together (E2BIG)")

# (spec refused, the same spec just under the bound, what loading it says)
CASES = {
    "job_args": (endpoints_args(15), endpoints_args(14),
                 "4:36: job.args: " + JOB_SIZE.format(size=1588379, part=1483470, key="job.args")),
    "job_env": (env_values(16), env_values(15),
                "6:3: job.env: " + JOB_SIZE.format(size=1605915, part=1600406, key="job.env")),
    "exec": (host_args(24), host_args(23), "4:36: job.args: " + EXEC),
}


def load(text: str, source: str = "<spec>"):
    """`text` loaded as every command loads a spec (its backend's checks, then the spec's own)."""
    return parse_spec(text, source, check=backends.problems)


def secrets_of(docs: list[dict]) -> dict:
    secret = next(d for d in docs if d["kind"] == "Secret")
    return {(secret["metadata"]["name"], k8s.TOKEN_KEY): "0" * 32}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loading_refuses_it_at_the_key_that_gives_most_and_takes_it_just_under(case):
    over, under, said = CASES[case]
    with pytest.raises(SpecError) as info:
        load(over)
    assert [str(p) for p in info.value.problems] == [f"<spec>:{said}"]
    assert load(under).kubernetes is not None


@pytest.mark.parametrize("case", ["job_args", "job_env"])
def test_the_job_measured_is_the_one_render_makes(case):
    """The check measures the Job `start` creates (k8s.render's, as kubectl sends it), not an estimate of it."""
    over, under, said = CASES[case]
    size = int(said.split(" Job would be ")[1].split()[0])
    for text, fits in ((over, False), (under, True)):
        (job,) = [d for d in k8s.render(parse_spec(text)) if d["kind"] == "Job"]
        sent = len(json.dumps(job, separators=(",", ":"), ensure_ascii=False).encode())
        assert (sent <= OBJECT_LIMIT) == fits, sent
        if not fits:
            assert sent == size


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_STACK)[0] != 8 << 20,
                    reason="execve's bound is a quarter of the stack limit: 2 MiB with the default 8 MiB")
def test_the_exec_bound_is_the_kernels_own():
    """The argv and environment the kubelet gives the last pod (k8s.pod_argv, pod_env) of the spec just under the
    bound start here (the program's path, the little more the kernel counts, fits); those just over do not (E2BIG)."""
    for text, fits in ((CASES["exec"][1], True), (CASES["exec"][0], False)):
        docs = k8s.render(parse_spec(text))
        job = docs[-1]
        argv = k8s.pod_argv(job, 3, secrets=secrets_of(docs))
        env = k8s.pod_env(job, 3, secrets=secrets_of(docs))
        assert (exec_size(argv, env) <= EXEC_LIMIT) == fits
        if fits:
            assert subprocess.run(argv, executable="/bin/true", env=env, timeout=30).returncode == 0
        else:
            with pytest.raises(OSError) as raised:
                subprocess.run(argv, executable="/bin/true", env=env, timeout=30)
            assert raised.value.errno == errno.E2BIG


@pytest.mark.parametrize("case", ["job_env", "exec"])
def test_validate_plan_and_render_refuse_it_in_one_line(case, tmp_path, capsys):
    spec = tmp_path / "c.yaml"
    spec.write_text(CASES[case][0])
    for argv in (["validate"], ["plan", "--json"], ["plan"], ["k8s", "render", "-o", "-"]):
        rc = cli.main([*argv, str(spec)])
        out, err = capsys.readouterr()
        assert (rc, out, err) == (2, "", f"{spec}:{CASES[case][2]}\n"), argv


def test_arguments_of_many_megabytes_are_measured_on_the_first_ones():
    """100 arguments of ~100 kB each (10 MB; a spec may hold 100,000 of them: gigabytes) are refused without building
    the whole Job: measured on the first ones that take over ARGS_CAP (8 MiB), and said as "more than"."""
    with pytest.raises(SpecError) as info:
        load(endpoints_args(100))
    assert [str(p) for p in info.value.problems] == [
        "<spec>:4:36: job.args: the trainer Job would be more than 8511239 bytes, more than 8406330 of them job.args: "
        "Kubernetes stores no object over 1.5 MiB (1572864 bytes, etcd's request limit)"]
