"""What `k8s render` refused of a spec only when rendering (an argument or the pserver list over what execve takes,
the ConfigMap over 1 MiB, launcher: mpi beside a kubernetes: section) is refused when the spec is loaded:
validate, plan --json, plan and k8s render say it in the same one line, exit 2. Each spec below was valid for
validate before (its SSH plan fits) and refused by render."""

from __future__ import annotations

import pytest

from clusterctl import backends, cli, k8s
from clusterctl.backends.k8s_content import CONFIGMAP_LIMIT, k8s_shape
from clusterctl.errors import SpecError
from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec

LONG = "k" * 40  # kubernetes.name: pod names of ~100 bytes (`<LONG>-trainer-3999.<LONG>:6180`), hosts' ~10

# 4,000 trainers on 100 hosts: the hosts' endpoint list is ~40 kB, the pods' ~400 kB
ARGS = ("name: fit\nbackend: kubernetes\nhosts:\n" + "".join(f"  - {{address: h{i}, slots: 40}}\n" for i in range(100))
        + "job: {entrypoint: [python3, t.py], trainers: 1, args: ['--eps={trainer_endpoints}']}\n"
        + f"kubernetes: {{image: x, name: {LONG}}}\n")
# 2,000 pservers: the hosts' PADDLE_PSERVERS_IP_PORT_LIST ~20 kB, the pods' ~200 kB
PSERVERS = ("name: fit\nbackend: kubernetes\nhosts:\n" + "".join(f"  - {{address: h{i}}}\n" for i in range(10))
            + "job: {mode: pserver, entrypoint: [python3, t.py], pservers: {per_host: 200}, ports: {pserver: 20000}}\n"
            + f"kubernetes: {{image: x, name: {LONG}}}\n")
# 2,600 env names of 200 characters: the template lists them (the host package is ~470 kB of the 1 MB)
ENV = ("name: fit\nbackend: kubernetes\nhosts: [{address: a}]\njob:\n  entrypoint: [python3, t.py]\n  env:\n"
       + "".join(f"    E{i:04}{'_' * 195}: x\n" for i in range(2600)) + "kubernetes: {image: x}\n")
MPI = "name: fit\nhosts: [{address: a}]\njob: {launcher: mpi, entrypoint: [python3, t.py]}\nkubernetes: {image: x}\n"

CASES = {
    "args": (ARGS, "104:49: job.args: an argument (after its placeholders) would be 398895 bytes in a trainer pod: "
                   "Linux starts no process with an argument or environment string over 128 KiB (E2BIG)"),
    "pservers": (PSERVERS, "14:51: job.pservers: PADDLE_PSERVERS_IP_PORT_LIST would be 200918 bytes: Linux starts no "
                           "process with an environment string over 128 KiB (E2BIG)"),
    "configmap": (ENV, None),  # its size: what render would have written (below)
    "mpi": (MPI, "3:7: job.launcher: launcher: mpi is not supported under Kubernetes; use launcher: ssh (one process "
                 "per pod)"),
}


def without_kubernetes(text: str) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith(("kubernetes:", "backend:")))


def load(text: str):
    """`text` loaded as every command loads a spec: the spec's backend's checks (backend: kubernetes: its pods'
    sizes, clusterctl.backends.k8s_limits), then the spec's own."""
    return parse_spec(text, check=backends.problems)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.mark.parametrize("case", ["args", "pservers", "configmap"])
def test_the_same_spec_over_ssh_plans(case):
    """The refusals are the pods' (their DNS names, their ConfigMap): the spec without kubernetes: is a valid plan."""
    assert make_plan(parse_spec(without_kubernetes(CASES[case][0]))).processes


@pytest.mark.parametrize("case", sorted(CASES))
def test_loading_the_spec_refuses_what_render_refused(case):
    text, said = CASES[case]
    with pytest.raises(SpecError) as info:
        load(text)
    (problem,) = info.value.problems
    if said is None:
        size = sum(len(k) + len(v.encode()) for k, v in k8s.host_package().items()) + len(k8s.TEMPLATE_KEY)
        assert problem.path == "kubernetes" and size < CONFIGMAP_LIMIT, problem
        assert problem.message.startswith("the host package and template take "), problem
        taken = int(problem.message.split(" take ")[1].split()[0])
        assert taken > CONFIGMAP_LIMIT and taken > size + 2600 * 200, problem  # every name in the template
        assert problem.message.endswith(f" bytes; a ConfigMap holds at most {CONFIGMAP_LIMIT}"), problem
    else:
        assert f"{problem.line}:{problem.column}: {problem.path}: {problem.message}" == said


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_plan_and_render_refuse_it_in_one_line(case, tmp_path, capsys):
    spec = tmp_path / "c.yaml"
    spec.write_text(CASES[case][0])
    said = set()
    for argv in (["validate"], ["plan", "--json"], ["plan"], ["k8s", "render", "-o", "-"]):
        rc, out, err = run(capsys, *argv, str(spec))
        assert (rc, out) == (2, ""), (argv, out[:300], err)
        assert err.startswith(f"{spec}:") and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
        said.add(err)
    assert len(said) == 1, said
    if CASES[case][1] is not None:
        assert said == {f"{spec}:{CASES[case][1]}\n"}


def test_a_smaller_fleet_renders_with_the_argument_whole():
    """The bound is execve's own: 40 hosts (1,600 pods, ~160 kB) are refused, 30 (~120 kB) render."""
    def fleet(hosts: int) -> str:
        return "".join(line for line in ARGS.splitlines(keepends=True)
                       if not line.startswith("  - {address: h") or int(line[15:].split(",")[0]) < hosts)

    with pytest.raises(SpecError, match="job.args: an argument .* would be 158895 bytes in a trainer pod"):
        load(fleet(40))
    docs = k8s.render(load(fleet(30)))
    arg = docs[-1]["spec"]["template"]["spec"]["containers"][0]["args"][-1]
    assert 100_000 < len(arg.encode()) < 128 * 1024 and arg.count(",") == 1199


@pytest.mark.parametrize("text", [
    "name: fit\nhosts: [{address: a, gpus: 2}, {address: b, gpus: 2, slots: 1}, {address: c, gpus: 2, spare: true}]\n"
    "job: {mode: pserver, pservers: {per_host: 2}, trainers: 1, restarts: 1, entrypoint: [x]}\nkubernetes: {image: x}\n",
    "name: fit\nhosts: [{address: a, gpus: 4}, {address: b, gpus: 4}]\n"
    "job: {trainers: gpu, entrypoint: [x]}\nkubernetes: {image: x}\n",
    "name: fit\nhosts: [{address: a}, {address: b}]\njob: {mode: pserver, pservers: [a, b], entrypoint: [x]}\n"
    "kubernetes: {image: x}\n",
])
def test_the_pods_are_counted_as_the_plan_counts_them(text):
    """What is checked at load (k8s_shape, no plan) is what render makes: as many pods as the plan has processes."""
    spec = parse_spec(text)
    shape, plan = k8s_shape(spec), make_plan(spec)
    assert (shape.trainers, shape.pservers) == (len(plan.trainers), len(plan.pservers))
    jobs = {d["metadata"]["labels"][k8s.LABEL_ROLE]: d["spec"]["completions"] for d in k8s.render(spec)
            if d["kind"] == "Job"}
    assert jobs == {r: n for r, n in (("pserver", len(plan.pservers)), ("trainer", len(plan.trainers))) if n}


def test_the_template_lists_every_name_the_containers_set():
    """The template's env (what the supervisor passes on) is the containers' env less the main process's own two."""
    from clusterctl.host import pod as hostpod

    spec = parse_spec("name: fit\nhosts: [{address: a, gpus: 2}]\njob: {mode: pserver, pservers: 1, trainers: gpu, "
                      "entrypoint: [x], env: {MINE: x}}\nkubernetes: {image: x}\n")
    docs = k8s.render(spec)
    import json

    template = json.loads(docs[1]["data"][k8s.TEMPLATE_KEY])
    names = [e["name"] for d in docs if d["kind"] == "Job" for e in d["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert template["env"] == list(dict.fromkeys(n for n in names if n not in (hostpod.SECRET_ENV, hostpod.POD_NAME_ENV)))
    assert "MINE" in template["env"] and "CUDA_VISIBLE_DEVICES" in template["env"]
