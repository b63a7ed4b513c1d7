"""What a fuzzing pass of the spec and `clusterctl k8s render` found, each held here: bad input is a one-line spec
error at its key (exit 2, never a traceback), and validate, plan, plan --json and k8s render refuse the same specs."""

from __future__ import annotations

import pytest
import yaml

from clusterctl import backends, cli, k8s
from clusterctl.errors import SpecError
from clusterctl.spec import CONTRACT_ENV, parse_spec

HEAD = "name: fit\nbackend: kubernetes\nhosts: [{address: a}]\n"
JOB = "job: {entrypoint: [python3, t.py]}\n"
KUBE = "kubernetes: {image: x}\n"


def problems_of(text: str) -> list[str]:
    """Every problem loading `text` finds (as every command loads a spec: its backend's checks too), as
    `line:col: key: message` ('' when it is valid)."""
    try:
        parse_spec(text, check=backends.problems)
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


@pytest.mark.parametrize("job,longest", [
    ("{mode: pserver, entrypoint: [python3, t.py], pservers: 11, ports: {pserver: 7000}}", "pserver-10"),
    ("{mode: pserver, entrypoint: [python3, t.py], pservers: {per_host: 10}}", "pserver-9"),
    ("{entrypoint: [python3, t.py], trainers: 10}", "trainer-9"),
])
def test_every_roles_longest_pod_host_name_is_checked(job, longest):
    name = "a" * (63 - len("-" + longest)) + "a"  # one character too long for that role's last pod only
    (found,) = problems_of(f"name: {name}\nbackend: kubernetes\nhosts: [{{address: a}}]\njob: {job}\n" + KUBE)
    assert found == f"1:1: name: pod host names like '{name}-{longest}' must be 1-63 characters; set a shorter " \
                    "kubernetes.name"
    assert problems_of(f"name: {name[1:]}\nbackend: kubernetes\nhosts: [{{address: a}}]\njob: {job}\n" + KUBE) == []


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


@pytest.mark.parametrize("resources,where,message", [
    ("{requests: {example.com/fpga: 2}}", "requests.example.com/fpga",
     "example.com/fpga is an extended resource: Kubernetes takes a request of one only with a limit equal to it; set "
     "limits.example.com/fpga (or only the limit)"),
    ("{requests: {example.com/fpga: 1}, limits: {example.com/fpga: 2}}", "requests.example.com/fpga",
     "1 but limits.example.com/fpga is 2: Kubernetes takes an extended resource's request only equal to its limit"),
    ("{requests: {nvidia.com/gpu: 1}}", "requests.nvidia.com/gpu",  # no GPUs from the plan: no limit from clusterctl
     "nvidia.com/gpu is an extended resource: Kubernetes takes a request of one only with a limit equal to it; set "
     "limits.nvidia.com/gpu (or only the limit)"),
])
def test_an_extended_resources_request_needs_an_equal_limit(resources, where, message):
    text = HEAD + JOB + f"kubernetes: {{image: x, resources: {{trainer: {resources}}}}}\n"
    (found,) = problems_of(text)
    assert found.split(": ", 1)[1] == f"kubernetes.resources.trainer.{where}: {message}"


@pytest.mark.parametrize("resources", [
    "{requests: {example.com/fpga: 2}, limits: {example.com/fpga: '2'}}",
    "{limits: {example.com/fpga: 2k}}",  # 2000: whole
    "{requests: {cpu: 500m, hugepages-2Mi: 1Mi, kubernetes.io/thing: 0.5}}",  # native resources: fractions are fine
])
def test_what_the_api_server_takes_of_extended_resources_is_taken(resources):
    assert problems_of(HEAD + JOB + f"kubernetes: {{image: x, resources: {{trainer: {resources}}}}}\n") == []


# ------------------------------------------------------------------------------------- 10. the trainers' GPUs


def test_a_trainers_gpu_resource_that_contradicts_the_plans_is_refused():
    text = (HEAD.replace("{address: a}", "{address: a, gpus: 1}") + "job: {entrypoint: [python3, t.py], trainers: gpu}\n"
            "kubernetes: {image: x, resources: {trainer: {requests: {nvidia.com/gpu: 2}, limits: {nvidia.com/gpu: 4}}}}\n")
    # was rendered as requests 2, limits '1' (the user's 4 silently replaced; a request over the limit)
    assert problems_of(text) == [
        f"5:{col}: kubernetes.resources.trainer.{kind}.nvidia.com/gpu: {n}, but each trainer pod gets 1 GPU(s) "
        "(hosts[].gpus or kubernetes.gpus_per_trainer): the limit clusterctl sets and CUDA_VISIBLE_DEVICES names; "
        "remove it, or set kubernetes.gpus_per_trainer" for kind, n, col in (("requests", 2, 57), ("limits", 4, 86))]
    same = text.replace("gpu: 2", "gpu: 1").replace("gpu: 4", "gpu: 1")
    _, docs = rendered(same)
    assert docs[-1]["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}
    only_request = text.replace("gpu: 2}, limits: {nvidia.com/gpu: 4}", "gpu: 1}")  # clusterctl sets the limit
    _, docs = rendered(only_request)
    assert docs[-1]["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}


def test_gpus_per_trainer_is_the_count_a_gpu_resource_is_checked_against():
    text = (HEAD.replace("{address: a}", "{address: a, gpus: 4}") + "job: {entrypoint: [python3, t.py], trainers: 2}\n"
            "kubernetes: {image: x, gpus_per_trainer: 1, resources: {trainer: {limits: {nvidia.com/gpu: 2}}}}\n")
    (found,) = problems_of(text)
    assert "limits.nvidia.com/gpu: 2, but each trainer pod gets 1 GPU(s)" in found
    assert problems_of(text.replace("gpus_per_trainer: 1", "gpus_per_trainer: 2")) == []
    assert problems_of(text.replace("gpus_per_trainer: 1, ", "")) == []  # 4 GPUs for 2 trainers: 2 each


def test_with_no_gpus_from_the_plan_the_users_gpu_resource_is_kept():
    _, docs = rendered(HEAD + JOB + "kubernetes: {image: x, resources: {trainer: {limits: {nvidia.com/gpu: 2}}}}\n")
    container = docs[-1]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert not {"CUDA_VISIBLE_DEVICES", "FLAGS_selected_gpus"} & {e["name"] for e in container["env"]}


def test_the_spec_level_gpu_count_is_the_plans():
    from clusterctl.plan import make_plan
    from clusterctl.spec.checks import k8s_gpus_per_trainer

    for hosts, trainers in (("[{address: a, gpus: 4}, {address: b, gpus: 4}]", "gpu"),
                            ("[{address: a, gpus: 4, slots: 2}, {address: b, gpus: 6, slots: 3}]", "gpu"),
                            ("[{address: a, gpus: 5}, {address: b, gpus: 5}]", "2"),
                            ("[{address: a}, {address: b, slots: 3}]", "2"),
                            ("[{address: a, gpus: 2}, {address: b, gpus: 6, slots: 3}]", "1")):
        spec = parse_spec(f"name: fit\nhosts: {hosts}\njob: {{entrypoint: [t], trainers: {trainers}}}\n" + KUBE)
        assert k8s_gpus_per_trainer(spec) == tuple(sorted({len(t.gpus) for t in make_plan(spec).trainers})), hosts


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


@pytest.mark.parametrize("var,mode", [("CLUSTERCTL_POD_SECRET", ""), ("CLUSTERCTL_POD_NAME", ""),
                                      ("JOB_COMPLETION_INDEX", ""), ("CLUSTERCTL_PS_MODE", "pserver"),
                                      ("CLUSTERCTL_PS_K_STEPS", "pserver")])
def test_env_names_every_pod_sets_itself_are_refused_in_job_env(var, mode):
    job = "mode: pserver, pservers: 1, " if mode else ""
    (found,) = problems_of(HEAD + f"job: {{{job}entrypoint: [python3, t.py], env: {{{var}: x}}}}\n" + KUBE)
    assert found.split(": ", 1)[1] == f"job.env.{var}: {var} is clusterctl's, set in every pod by its manifest; " \
                                      "remove it from job.env"


def test_the_pserver_mode_variables_are_the_users_in_a_collective_job():
    _, docs = rendered(HEAD + "job: {entrypoint: [python3, t.py], env: {CLUSTERCTL_PS_MODE: x}}\n" + KUBE)
    names = [e["name"] for e in docs[-1]["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert names.count("CLUSTERCTL_PS_MODE") == 1


def test_every_env_name_a_pod_sets_is_refused_in_job_env():
    """The refused names keep step with the manifests: a name a Job's container sets beside job.env's is in them."""
    from clusterctl.backends.k8s_content import POD_ENV
    from clusterctl.spec.checks import PSERVER_POD_ENV

    _, docs = rendered(HEAD.replace("{address: a}", "{address: a, gpus: 2}") + "job: {mode: pserver, pservers: 2, "
                       "entrypoint: [python3, t.py], trainers: gpu, env: {MINE: x}}\n" + KUBE)
    set_by_pods = {e["name"] for d in docs if d["kind"] == "Job"
                   for c in d["spec"]["template"]["spec"]["containers"] for e in c["env"]} - {"MINE"}
    assert set_by_pods and set_by_pods <= CONTRACT_ENV | POD_ENV | PSERVER_POD_ENV, \
        set_by_pods - (CONTRACT_ENV | POD_ENV | PSERVER_POD_ENV)


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


@pytest.mark.parametrize("case", sorted(AGREE))
def test_validate_plan_and_render_refuse_the_same_specs(case, tmp_path, capsys):
    spec = tmp_path / "c.yaml"
    spec.write_text(AGREE[case])
    said = set()
    for argv in (["validate"], ["plan", "--json"], ["plan"], ["k8s", "render", "-o", "-"]):
        rc, out, err = run(capsys, *argv, str(spec))
        assert (rc, out) == (2, ""), (argv, out, err)
        assert err.startswith(f"{spec}:") and "Traceback" not in err, (argv, err)
        said.add(err)
    assert len(said) == 1, said


# ------------------------------------------------------------------------------------- 16. plan's table


@pytest.mark.parametrize("head", ["name: fit\nhosts: [{address: a}]\n", HEAD])
def test_plan_shows_control_characters_of_args_escaped(head, tmp_path, capsys):
    spec = tmp_path / "c.yaml"
    spec.write_text(head + 'job: {entrypoint: [python3, t.py], args: ["\\x1b]0;TITLE\\x07\\x1b[31mred"]}\n'
                    + (KUBE if "kubernetes" in head else ""))
    rc, out, err = run(capsys, "plan", "--all", str(spec))
    assert rc == 0, err
    assert "\x1b" not in out and "\x07" not in out
    flat = "".join(line.strip(" │┃").strip() for line in out.splitlines())  # the argv column folds long cells
    assert "\\x1b]0;TITLE\\x07\\x1b[31mred" in flat.replace(" ", ""), out


# ------------------------------------------------------------------------------------- 17. render's hints


def test_render_hints_quote_the_spec_path_and_the_output_directory(tmp_path, capsys):
    where = tmp_path / "my specs; rm -rf ~"
    where.mkdir()
    spec = where / "c.yaml"
    spec.write_text(HEAD + JOB + KUBE)
    rc, out, err = run(capsys, "k8s", "render", str(spec))
    assert rc == 0, err
    assert f"  create: clusterctl k8s render '{spec}' | kubectl create -f -\n" in err
    rc, out, err = run(capsys, "k8s", "render", str(spec), "-o", str(where / "out $HOME"))
    assert rc == 0, err
    assert f"  create: kubectl create -f '{where}/out $HOME/fit.yaml'\n" in out


def rendered(text: str):
    docs = k8s.render(parse_spec(text), token="0" * 32)
    return None, list(yaml.safe_load_all(k8s.dump(docs)))
