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


# ------------------------------------------------------------------------------------- 10. the trainers' GPUs


# ------------------------------------------------------------------------------------- 8, 9. paths in the pods


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
