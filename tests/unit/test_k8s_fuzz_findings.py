"""What a fuzzing pass of the spec and `clusterctl k8s render` found, each held here: bad input is a one-line spec
error at its key (exit 2, never a traceback), and validate, plan, plan --json and k8s render refuse the same specs."""

from __future__ import annotations

import pytest
import yaml

from clusterctl import cli, k8s
from clusterctl.errors import SpecError
from clusterctl.spec import parse_spec

HEAD = "name: fit\nbackend: kubernetes\nhosts: [{address: a}]\n"
JOB = "job: {entrypoint: [python3, t.py]}\n"
KUBE = "kubernetes: {image: x}\n"


def problems_of(text: str) -> list[str]:
    """Every problem parse_spec finds in `text`, as `line:col: key: message` ('' when it is valid)."""
    try:
        parse_spec(text)
    except SpecError as exc:
        return [f"{p.line}:{p.column}: {p.path}: {p.message}" for p in exc.problems]
    return []


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    got = capsys.readouterr()
    return rc, got.out, got.err


# ------------------------------------------------------------------------------------- 1. lone surrogates


@pytest.mark.parametrize("text,where", [
    (HEAD + 'job: {entrypoint: [python3, t.py], env: {X: "\\uD800"}}\n' + KUBE, "4:42: job.env.X"),
    (HEAD + 'job: {entrypoint: [python3, t.py], env: {"X\\uDC80": a}}\n' + KUBE, "4:42: job.env.X\\udc80"),
    (HEAD + 'job: {entrypoint: [python3, t.py], args: [ok, "ab\\uDC80"]}\n' + KUBE, "4:47: job.args[1]"),
    (HEAD + 'job: {entrypoint: [python3, "\\uDC80"]}\n' + KUBE, "4:29: job.entrypoint[1]"),
    (HEAD + JOB + 'kubernetes: {image: x, working_dir: "/w\\uDC80"}\n', "5:24: kubernetes.working_dir"),
    ('name: fit\nhosts: [{address: a}]\njob: {entrypoint: [python3, t.py], args: ["\\uD800"]}\n', "3:43: job.args[0]"),
])
def test_a_lone_surrogate_anywhere_is_refused_at_its_key(text, where):
    # "\uD800" in YAML double quotes is a str no encoder takes: a UnicodeEncodeError traceback in every command
    (found,) = problems_of(text)
    assert found.startswith(where + ": not valid Unicode: a lone surrogate '\\u"), found
    assert found.isascii() and found.isprintable()


def test_a_lone_surrogate_is_exit_2_in_every_command(tmp_path, capsys):
    spec = tmp_path / "c.yaml"
    spec.write_text(HEAD + 'job: {entrypoint: [python3, t.py], env: {X: "a\\uD800"}}\n' + KUBE)
    for argv in (["validate"], ["plan", "--json"], ["plan"], ["k8s", "render", "-o", "-"]):
        rc, out, err = run(capsys, *argv, str(spec))
        assert (rc, out) == (2, ""), (argv, err)
        assert err == (f"{spec}:4:42: job.env.X: not valid Unicode: a lone surrogate '\\ud800' at character 2 of "
                       "'a\\ud800'\n"), argv


# ------------------------------------------------------------------------------------- 6. pod host names


# ------------------------------------------------------------------------------------- 7, 11, 15. quantities


@pytest.mark.parametrize("resources,message", [
    ("{requests: {cpu: '٤'}}", "cpu: '٤' is not a Kubernetes quantity"),  # an Arabic-Indic digit
    ("{requests: {memory: '１６Gi'}}", "memory: '１６Gi' is not a Kubernetes quantity"),  # fullwidth digits
    ("{requests: {cpu: '1e٣'}}", "cpu: '1e٣' is not a Kubernetes quantity"),
    ("{requests: {cpu: '" + "1" * 5000 + "'}}",
     "cpu: a quantity of 5000 characters is not one Kubernetes takes (at most 64: a number with a suffix such as m, "
     "Mi or Gi)"),
    ("{limits: {nvidia.com/gpu: 0.5}}", "nvidia.com/gpu: '0.5' is not a whole number, and Kubernetes counts an "
     "extended resource (a name whose domain is not kubernetes.io) in whole units"),
    ("{limits: {example.com/fpga: 1500m}}", "example.com/fpga: '1500m' is not a whole number"),
    ("{limits: {example.com/fpga: 1e-3}}", "example.com/fpga: '1e-3' is not a whole number"),
])
def test_a_quantity_kubernetes_refuses_is_a_spec_error(resources, message):
    found = problems_of(HEAD + JOB + f"kubernetes: {{image: x, resources: {{pserver: {resources}}}}}\n")
    assert [f for f in found if "kubernetes.resources" in f] == found and len(found) == 1, found
    assert f"kubernetes.resources: {message}" in found[0]


# ------------------------------------------------------------------------------------- 10. the trainers' GPUs


# ------------------------------------------------------------------------------------- 8, 9. paths in the pods


@pytest.mark.parametrize("working_dir,message", [
    ("rel/dir", "expected an absolute path, got 'rel/dir'"),
    ('"/w\\n"', "control character '\\n' at character 3 of '/w\\n'"),
    ('"/w\\u202e"', "character '\\u202e' at character 3 of '/w\\u202e': a path here is one line of printable characters"),
])
def test_working_dir_is_an_absolute_printable_path(working_dir, message):
    (found,) = problems_of(HEAD + JOB + f"kubernetes: {{image: x, working_dir: {working_dir}}}\n")
    assert found.startswith("5:24: kubernetes.working_dir: ") and message in found, found
    _, docs = rendered(HEAD + JOB + "kubernetes: {image: x, working_dir: /srv/my code}\n")
    assert docs[-1]["spec"]["template"]["spec"]["containers"][0]["workingDir"] == "/srv/my code"


@pytest.mark.parametrize("mount_path,message", [
    ("//opt/clusterctl", "//opt/clusterctl is where clusterctl mounts its own volume in every pod; choose another"),
    ("///var/lib/clusterctl/", "///var/lib/clusterctl/ is where clusterctl mounts its own volume"),
    ("/opt/clusterctl/code", "/opt/clusterctl/code is inside /opt/clusterctl, where clusterctl mounts its own volume "
     "in every pod; choose another"),
    ("/var/lib/clusterctl/jobs/x", "is inside /var/lib/clusterctl, where clusterctl mounts"),
    ("/opt/./clusterctl/../clusterctl", "is where clusterctl mounts"),
    ('"/w\\u202e"', "character '\\u202e' at character 3"),
])
def test_a_mount_path_on_or_inside_clusterctls_own_mounts_is_refused(mount_path, message):
    (found,) = problems_of(HEAD + JOB + f"kubernetes: {{image: x, workspace: {{pvc: ws, mount_path: {mount_path}}}}}\n")
    assert found.startswith("5:45: kubernetes.workspace.mount_path: ") and message in found, found


@pytest.mark.parametrize("mount_path", ["/opt", "/opt/clusterctl-data", "/var/lib", "/workspace"])
def test_a_mount_path_beside_clusterctls_is_taken(mount_path):
    assert problems_of(HEAD + JOB + f"kubernetes: {{image: x, workspace: {{pvc: ws, mount_path: {mount_path}}}}}\n") == []


# ------------------------------------------------------------------------------------- 12. the pods' own env


# ------------------------------------------------------------------------------------- 13, 14. every command agrees


AGREE = {
    "service_name": "name: 1abc\nbackend: kubernetes\nhosts: [{address: a}]\n" + JOB + KUBE,
    "host_name": "name: " + "a" * 53 + "\nbackend: kubernetes\nhosts: [{address: a}]\n"
                 "job: {mode: pserver, entrypoint: [python3, t.py], pservers: 11, ports: {pserver: 7000}}\n" + KUBE,
    "mount_path": HEAD + JOB + "kubernetes: {image: x, workspace: {pvc: ws, mount_path: /opt/clusterctl}}\n",
    "mixed_gpus": "name: fit\nbackend: kubernetes\nhosts: [{address: a, gpus: 1}, {address: b, gpus: 4, slots: 2}]\n"
                  "job: {entrypoint: [python3, t.py], trainers: gpu}\n" + KUBE,
    "ssh_section": HEAD + JOB + KUBE + "ssh: {user: bob}\n",
    "data_section": HEAD + JOB + KUBE + "data: {local: /tmp}\n",
    "pserver_list": "name: fit\nbackend: kubernetes\nhosts: [{address: a}, {address: b}]\n"
                    "job: {mode: pserver, entrypoint: [python3, t.py], pservers: [a]}\n" + KUBE,
    "host_labels": "name: fit\nbackend: kubernetes\nhosts: [{address: a, labels: {x: y}}]\n" + JOB + KUBE,
    "ssh_spec_service_name": "name: 1abc\nhosts: [{address: a}]\n" + JOB + KUBE,
}


# ------------------------------------------------------------------------------------- 16. plan's table


# ------------------------------------------------------------------------------------- 17. render's hints


def rendered(text: str):
    docs = k8s.render(parse_spec(text), token="0" * 32)
    return None, list(yaml.safe_load_all(k8s.dump(docs)))
