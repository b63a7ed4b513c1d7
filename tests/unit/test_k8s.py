"""`clusterctl k8s render` and what `backend: kubernetes` creates: the objects checked against the Kubernetes
OpenAPI schemas (offline, with kubernetes-validate), the environment and argv each pod's process gets compared
with the plan's over SSH (through the pod's own glue, clusterctl/host/pod.py), the token kept to its Secret."""

import base64
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
from fractions import Fraction

import pytest
import yaml

from clusterctl import cli, k8s
from clusterctl.errors import SpecError
from clusterctl.host import pod as hostpod
from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec

# the oldest release with every field used (backoffLimitPerIndex: 1.28 alpha, 1.29 beta) and the newest shipped
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())

PSERVER = """\
name: Fit_a.line
hosts:
  - {address: 10.0.0.1, gpus: 2}
  - {address: 10.0.0.2, gpus: [2, 3]}
  - {address: 10.0.0.3, gpus: 2}
job:
  mode: pserver
  entrypoint: [python3, train.py]
  args: ["{role}", "--id={id}", "--ep={current_endpoint}", "--ps={pserver_endpoints}", "{trainers}", "{host}",
         "{{literal}}", "$HOME", "$(NOT_A_REF)"]
  pservers: 2
  trainers: gpu
  sync: geo
  k_steps: 8
  env: {GLOG_v: 1, PRICE: "$(cheap) $$5"}
  ports: {pserver: 7000, trainer: 7100, master: 7200}
kubernetes:
  image: registry.example.com/fit:1.0
  namespace: ml
  workspace: {pvc: fit-ws, sub_path: runs/a}
  resources: {trainer: {requests: {cpu: 4, memory: 16Gi}}, pserver: {limits: {memory: 8Gi}}}
  node_selector: {pool: gpu}
  service_account: trainer
  image_pull_policy: IfNotPresent
  image_pull_secrets: [regcred]
"""

COLLECTIVE = """\
name: mlp
hosts: [{address: a}, {address: b, slots: 3}]
job: {entrypoint: [python3, mlp.py], trainers: 2, on_failure: continue, grace: 2.5}
kubernetes: {image: "python:3.12", workspace: {host_path: /srv/mlp, mount_path: /code}}
"""


TOKEN = "0123456789abcdef" * 2


def rendered(text):
    spec = parse_spec(text)
    docs = k8s.render(spec, token=TOKEN)
    # what kubectl would read: the YAML text, not the dicts
    return spec, list(yaml.safe_load_all(k8s.dump(docs)))


def by_kind(docs):
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def secrets_of(docs):
    """{(Secret, key): value}: what the kubelet reads for a secretKeyRef."""
    return {(d["metadata"]["name"], key): base64.b64decode(v).decode() for d in docs if d["kind"] == "Secret"
            for key, v in d["data"].items()}


def template_of(docs):
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return json.loads(cm["data"][k8s.TEMPLATE_KEY])


@pytest.mark.parametrize("text", [PSERVER, COLLECTIVE], ids=["pserver", "collective"])
@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_are_valid_kubernetes_objects(text, version):
    _, docs = rendered(text)
    assert [d["kind"] for d in docs] == ["Secret", "ConfigMap", "Service"] + ["Job"] * (len(docs) - 3)
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError


def test_the_validator_rejects_a_broken_job():
    """The schema check above can fail: a misspelt key, a wrong type and a missing image are caught."""
    _, docs = rendered(PSERVER)
    job = by_kind(docs)["Job", "fit-a-line-pserver"]
    bad = copy.deepcopy(job)
    bad["spec"]["completion"] = bad["spec"].pop("completions")
    with pytest.raises(kubernetes_validate.ValidationError, match="completion"):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)
    bad = copy.deepcopy(job)
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "seven thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)
    bad = copy.deepcopy(job)
    del bad["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(kubernetes_validate.ValidationError, match="name"):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)
    bad = copy.deepcopy(by_kind(docs)["Secret", "fit-a-line-token"])
    bad["data"]["token"] = 42
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_service_and_jobs_shape():
    _, docs = rendered(PSERVER)
    objs = by_kind(docs)
    svc = objs["Service", "fit-a-line"]
    assert svc["metadata"]["namespace"] == "ml"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"clusterctl.io/job": "fit-a-line"}
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
        "trainer": 7100, "master": 7200, "control": 6168, "pserver": 7000}
    glue = ["python3", "-S", "-E", "-X", "pycache_prefix=/var/lib/clusterctl/pycache", "-c", hostpod.RUN,
            "/opt/clusterctl", "clusterctl_host.pod", "start", "/opt/clusterctl/template.json", "--"]
    for role, count in (("pserver", 2), ("trainer", 6)):
        job = objs["Job", f"fit-a-line-{role}"]
        spec = job["spec"]
        # Kubernetes never retries a pod nor ends the others: restarts and fail-fast are the supervisors'
        assert {k: spec[k] for k in ("completionMode", "completions", "parallelism", "backoffLimitPerIndex",
                                     "maxFailedIndexes")} == {"completionMode": "Indexed", "completions": count,
                                                              "parallelism": count, "backoffLimitPerIndex": 0,
                                                              "maxFailedIndexes": count}
        assert "backoffLimit" not in spec
        pod = spec["template"]["spec"]
        assert spec["template"]["metadata"]["labels"] == {"clusterctl.io/job": "fit-a-line", "clusterctl.io/role": role}
        assert (pod["subdomain"], pod["restartPolicy"], pod["enableServiceLinks"]) == ("fit-a-line", "Never", False)
        assert pod["terminationGracePeriodSeconds"] == 10 + k8s.STOP_MARGIN_S
        host_items = [{"key": f, "path": f"clusterctl_host/{f}"} for f in sorted(k8s.host_package())]
        assert pod["volumes"] == [
            {"name": "clusterctl-host", "configMap": {"name": "fit-a-line-host", "defaultMode": 0o444,
                                                      "items": host_items + [{"key": "template.json",
                                                                              "path": "template.json"}]}},
            {"name": "clusterctl-state", "emptyDir": {}},
            {"name": "workspace", "persistentVolumeClaim": {"claimName": "fit-ws"}},
        ]
        assert (pod["nodeSelector"], pod["serviceAccountName"], pod["imagePullSecrets"]) == ({"pool": "gpu"}, "trainer", [{"name": "regcred"}])
        c = pod["containers"][0]
        assert (c["image"], c["imagePullPolicy"], c["workingDir"]) == ("registry.example.com/fit:1.0", "IfNotPresent", "/workspace")
        assert c["volumeMounts"] == [
            {"name": "clusterctl-host", "mountPath": "/opt/clusterctl", "readOnly": True},
            {"name": "clusterctl-state", "mountPath": "/var/lib/clusterctl"},
            {"name": "workspace", "mountPath": "/workspace", "subPath": "runs/a"},
        ]
        assert c["command"] == glue  # the pod's main process is the glue, which runs the supervisor
        assert c["args"][:2] == ["python3", "train.py"]  # ... which runs the job's entrypoint and args
        assert (c["terminationMessagePath"], c["terminationMessagePolicy"]) == ("/dev/termination-log", "File")
        env = {e["name"]: e for e in c["env"]}
        assert "CLUSTERCTL_JOB" not in env  # the supervisor tags its processes, and nothing else in the pod
        assert env["CLUSTERCTL_POD_SECRET"] == {"name": "CLUSTERCTL_POD_SECRET", "valueFrom": {
            "secretKeyRef": {"name": "fit-a-line-token", "key": "token"}}}
        assert env["CLUSTERCTL_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    trainer = objs["Job", "fit-a-line-trainer"]["spec"]["template"]["spec"]["containers"][0]
    assert trainer["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": "1"}}
    assert trainer["ports"] == [{"name": "trainer", "containerPort": 7100}, {"name": "master", "containerPort": 7200}]
    pserver = objs["Job", "fit-a-line-pserver"]["spec"]["template"]["spec"]["containers"][0]
    assert pserver["resources"] == {"limits": {"memory": "8Gi"}}


def test_the_token_is_in_the_secret_only():
    spec, docs = rendered(PSERVER)
    secret = by_kind(docs)["Secret", "fit-a-line-token"]
    assert secret["type"] == "Opaque" and secret["immutable"] is True
    assert secret["data"] == {"token": base64.b64encode(TOKEN.encode()).decode()}
    assert secret["metadata"]["labels"] == {"clusterctl.io/job": "fit-a-line"}
    others = json.dumps([d for d in docs if d["kind"] != "Secret"])
    assert TOKEN not in others and secret["data"]["token"] not in others
    # without a token, every render makes a new one (hex, 128 bits)
    a, b = (secrets_of(k8s.render(spec))["fit-a-line-token", "token"] for _ in range(2))
    assert a != b and len(a) == 32 and int(a, 16) >= 0


def test_the_configmap_carries_the_host_package_and_the_template():
    _, docs = rendered(PSERVER)
    cm = by_kind(docs)["ConfigMap", "fit-a-line-host"]
    assert cm["immutable"] is True
    host_dir = Path(hostpod.__file__).parent
    assert {k: v for k, v in cm["data"].items() if k != "template.json"} == {
        p.name: p.read_text() for p in host_dir.glob("*.py")}
    t = template_of(docs)
    assert (t["version"], t["job"], t["state_root"], t["termination_log"]) == (
        hostpod.TEMPLATE_VERSION, "Fit_a.line", "/var/lib/clusterctl/jobs", "/dev/termination-log")
    assert (t["on_failure"], t["grace"], t["restarts"], t["auth"]) == ("stop", 10.0, 0, "token")
    assert t["roles"] == {
        "pserver": {"count": 2, "id_env": "PADDLE_PSERVER_ID", "dns": "fit-a-line-pserver-{id}.fit-a-line", "port": 7000},
        "trainer": {"count": 6, "id_env": "PADDLE_TRAINER_ID", "dns": "fit-a-line-trainer-{id}.fit-a-line", "port": 7100},
    }
    assert t["coordinator"] == {"address": "fit-a-line-trainer-0.fit-a-line", "port": 6168, "pod": ["trainer", 0],
                                "hosts": 8, "trainers_total": 6, "timings": {"connect_timeout": 120.0}}
    assert t["start_trainers_after"] == {"endpoints": ["fit-a-line-pserver-0.fit-a-line:7000",
                                                       "fit-a-line-pserver-1.fit-a-line:7000"], "timeout": 120.0}
    assert "CLUSTERCTL_POD_SECRET" not in t["env"] and "CLUSTERCTL_POD_NAME" not in t["env"]
    assert {"RANK", "PADDLE_TRAINER_ID", "PADDLE_PSERVER_ID", "GLOG_v", "POD_IP"} <= set(t["env"])
    assert TOKEN not in cm["data"]["template.json"]


def test_service_lists_a_port_shared_by_two_roles_once():
    # the pserver on another host than the master: the same port number is no conflict, over SSH or here
    text = PSERVER.replace("pservers: 2", "pservers: [10.0.0.3]")
    text = text.replace("ports: {pserver: 7000, trainer: 7100, master: 7200}", "ports: {pserver: 7200, trainer: 7100, master: 7200}")
    _, docs = rendered(text)
    assert by_kind(docs)["Service", "fit-a-line"]["spec"]["ports"] == [
        {"name": "trainer", "port": 7100}, {"name": "master", "port": 7200}, {"name": "control", "port": 6168}]
    for doc in docs:
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_on_failure_continue_and_host_path():
    _, docs = rendered(COLLECTIVE)
    assert [d["kind"] for d in docs] == ["Secret", "ConfigMap", "Service", "Job"]  # no pservers: no pserver Job
    job = docs[3]
    assert job["spec"]["backoffLimitPerIndex"] == 0 and job["spec"]["maxFailedIndexes"] == 5
    assert template_of(docs)["on_failure"] == "continue"  # the supervisors apply it, not Kubernetes
    pod = job["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 3 + k8s.STOP_MARGIN_S
    assert pod["volumes"][2] == {"name": "workspace", "hostPath": {"path": "/srv/mlp", "type": "Directory"}}
    assert pod["containers"][0]["workingDir"] == "/code" and "resources" not in pod["containers"][0]
    assert [p["name"] for p in docs[2]["spec"]["ports"]] == ["trainer", "master", "control"]
    assert template_of(docs)["start_trainers_after"] is None


def _as_on_kubernetes(spec, plan, name, env, role):
    """The plan's env for one process, with what necessarily differs on Kubernetes mapped: endpoints are
    the pods' DNS names on the base ports, one process per pod (local rank 0 of 1), GPUs renumbered."""
    base = {"trainer": spec.job.ports.trainer, "pserver": spec.job.ports.pserver}
    dns = {p.endpoint: f"{name}-{p.role}-{p.id}.{name}:{base[p.role]}" for p in plan.processes}
    out = dict(env)
    for key in ("PADDLE_TRAINER_ENDPOINTS", "PADDLE_PSERVERS_IP_PORT_LIST"):
        if key in out:
            out[key] = ",".join(dns[e] for e in out[key].split(","))
    own = dns[out["PADDLE_CURRENT_ENDPOINT"]]
    out.update(POD_IP=own.rsplit(":", 1)[0], PADDLE_PORT=own.rsplit(":", 1)[1], PADDLE_CURRENT_ENDPOINT=own)
    if role == "trainer":
        out.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=f"{name}-trainer-0.{name}")
        if "CUDA_VISIBLE_DEVICES" in out:
            out["CUDA_VISIBLE_DEVICES"] = out["FLAGS_selected_gpus"]
    return out


def pod_job_file(docs, role, index):
    """The job file pod `index` of `role` writes (its glue, from the template and what the kubelet gives it)."""
    job = by_kind(docs)["Job", f"{docs[2]['metadata']['name']}-{role}"]
    pod_name = f"{job['metadata']['name']}-{index}-abcde"
    env = k8s.pod_env(job, index, pod_name=pod_name, secrets=secrets_of(docs))
    return hostpod.pod_job(template_of(docs), env, k8s.process_argv(job, index, secrets=secrets_of(docs)), "/workspace")


@pytest.mark.parametrize("text", [PSERVER, COLLECTIVE], ids=["pserver", "collective"])
def test_every_pods_process_gets_the_plans_env_contract(text):
    spec, docs = rendered(text)
    plan = make_plan(spec)
    name = k8s.object_name(spec)
    for proc in plan.processes:
        jobfile = pod_job_file(docs, proc.role, proc.id)
        (entry,) = jobfile["processes"]
        # the supervisor adds the job's tag (and CLUSTERCTL_JOBDIR, the attempt, the derived token) when it spawns
        got = {**entry["env"], "CLUSTERCTL_JOB": jobfile["job"]}
        assert got == _as_on_kubernetes(spec, plan, name, proc.env, proc.role), proc.name


def test_pod_env_spelled_out_for_one_trainer_and_one_pserver():
    """The mapping above is not the only check: the values a Paddle or PyTorch script reads, literally."""
    _, docs = rendered(PSERVER)
    objs = by_kind(docs)
    t3 = k8s.pod_env(objs["Job", "fit-a-line-trainer"], 3, secrets=secrets_of(docs))
    assert {k: t3[k] for k in ("PADDLE_TRAINER_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "POD_IP", "PADDLE_CURRENT_ENDPOINT",
                               "MASTER_ADDR", "MASTER_PORT", "TRAINING_ROLE", "CUDA_VISIBLE_DEVICES",
                               "CLUSTERCTL_POD_NAME", "CLUSTERCTL_POD_SECRET")} == {
        "PADDLE_TRAINER_ID": "3", "RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "0",
        "POD_IP": "fit-a-line-trainer-3.fit-a-line", "PADDLE_CURRENT_ENDPOINT": "fit-a-line-trainer-3.fit-a-line:7100",
        "MASTER_ADDR": "fit-a-line-trainer-0.fit-a-line", "MASTER_PORT": "7200", "TRAINING_ROLE": "TRAINER",
        "CUDA_VISIBLE_DEVICES": "0", "CLUSTERCTL_POD_NAME": "fit-a-line-trainer-3-xxxxx", "CLUSTERCTL_POD_SECRET": TOKEN,
    }
    assert t3["PADDLE_PSERVERS_IP_PORT_LIST"] == "fit-a-line-pserver-0.fit-a-line:7000,fit-a-line-pserver-1.fit-a-line:7000"
    assert t3["PRICE"] == "$(cheap) $$5"  # the user's text, not expanded
    p1 = k8s.pod_env(objs["Job", "fit-a-line-pserver"], 1, secrets=secrets_of(docs))
    assert (p1["PADDLE_PSERVER_ID"], p1["POD_IP"], p1["PADDLE_PORT"]) == ("1", "fit-a-line-pserver-1.fit-a-line", "7000")
    # Paddle's role maker finds a pserver's id as the index of POD_IP:PADDLE_PORT in the list
    assert p1["PADDLE_PSERVERS_IP_PORT_LIST"].split(",").index(f"{p1['POD_IP']}:{p1['PADDLE_PORT']}") == 1
    with pytest.raises(ValueError, match="no value given for Secret fit-a-line-token key token"):
        k8s.pod_env(objs["Job", "fit-a-line-pserver"], 1)


def test_pod_argv_matches_the_plans_argv():
    spec, docs = rendered(PSERVER)
    plan = make_plan(spec)
    objs = by_kind(docs)
    t4 = k8s.process_argv(objs["Job", "fit-a-line-trainer"], 4, secrets=secrets_of(docs))
    assert t4 == [
        "python3", "train.py", "trainer", "--id=4", "--ep=fit-a-line-trainer-4.fit-a-line:7100",
        "--ps=fit-a-line-pserver-0.fit-a-line:7000,fit-a-line-pserver-1.fit-a-line:7000", "6",
        "fit-a-line-trainer-4.fit-a-line", "{literal}", "$HOME", "$(NOT_A_REF)",
    ]
    ssh = plan.trainers[4].argv
    assert (ssh[2], ssh[3], ssh[6], ssh[8:]) == (t4[2], t4[3], t4[6], tuple(t4[8:]))  # same where nothing is host-bound
    p0 = k8s.process_argv(objs["Job", "fit-a-line-pserver"], 0, secrets=secrets_of(docs))
    assert p0[2:5] == ["pserver", "--id=0", "--ep=fit-a-line-pserver-0.fit-a-line:7000"]
    full = k8s.pod_argv(objs["Job", "fit-a-line-pserver"], 0, secrets=secrets_of(docs))
    assert TOKEN not in " ".join(full)  # the token is never in an argv


def test_each_pods_job_file_names_the_coordinator_and_its_own_part():
    _, docs = rendered(PSERVER)
    t0, t5, p1 = (pod_job_file(docs, r, i) for r, i in (("trainer", 0), ("trainer", 5), ("pserver", 1)))
    assert t0["coordinator"]["is_coordinator"] is True and t5["coordinator"]["is_coordinator"] is False
    for jf, host in ((t0, "fit-a-line-trainer-0-abcde"), (t5, "fit-a-line-trainer-5-abcde"), (p1, "fit-a-line-pserver-1-abcde")):
        c = jf["coordinator"]
        assert (jf["host"], jf["token"], c["token"], jf["auth"]) == (host, TOKEN, TOKEN, "token")
        assert (c["address"], c["port"], c["hosts"], c["trainers_total"], c["connect_timeout"]) == (
            "fit-a-line-trainer-0.fit-a-line", 6168, 8, 6, 120.0)
        (proc,) = jf["processes"]
        assert proc["cwd"] == "/workspace" and proc["log"].startswith("/var/lib/clusterctl/jobs/Fit_a.line/logs/")
    assert t5["processes"][0]["ports"] == ["fit-a-line-trainer-5.fit-a-line:7100"]
    assert t5["start_trainers_after"]["endpoints"] == ["fit-a-line-pserver-0.fit-a-line:7000",
                                                      "fit-a-line-pserver-1.fit-a-line:7000"]
    assert p1["start_trainers_after"] is None and p1["processes"][0]["role"] == "pserver"


def test_init_container_waits_for_its_own_and_the_coordinators_names():
    """The init container's real program, run here: it returns once the names resolve, fails after its timeout."""
    import socket

    _, docs = rendered(PSERVER)
    objs = by_kind(docs)
    trainer = objs["Job", "fit-a-line-trainer"]
    argv = k8s.pod_argv(trainer, 3, container="wait")
    assert argv[:2] == ["python3", "-c"] and argv[3:] == [
        "fit-a-line-trainer-3.fit-a-line,fit-a-line-trainer-0.fit-a-line", "", "120",
    ]
    assert k8s.pod_argv(objs["Job", "fit-a-line-pserver"], 1, container="wait")[3:] == [
        "fit-a-line-pserver-1.fit-a-line,fit-a-line-trainer-0.fit-a-line", "", "120"]
    script = argv[2]
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        ok = subprocess.run([sys.executable, "-c", script, "localhost", f"127.0.0.1:{port}", "10"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    t0 = time.monotonic()
    bad = subprocess.run([sys.executable, "-c", script, "localhost", f"127.0.0.1:{port}", "1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "clusterctl: gave up after 1s waiting for" in bad.stderr and "Connection refused" in bad.stderr
    assert time.monotonic() - t0 < 10
    no_name = subprocess.run([sys.executable, "-c", script, "no-such-host.invalid", "", "0"], capture_output=True, text=True, timeout=30)
    assert no_name.returncode == 1 and "no-such-host.invalid" in no_name.stderr


def test_wait_timeout_zero_means_no_init_container():
    _, docs = rendered(COLLECTIVE.replace("kubernetes: {", "kubernetes: {wait_timeout: 0, "))
    assert "initContainers" not in docs[3]["spec"]["template"]["spec"]
    assert template_of(docs)["coordinator"]["timings"] == {"connect_timeout": 120.0}


@pytest.mark.parametrize("text,env,want", [
    ("plain", {}, "plain"),
    ("$$", {}, "$"),
    ("a$$(B)c", {"B": "x"}, "a$(B)c"),
    ("$(B)", {"B": "x"}, "x"),
    ("$(B)$(B)", {"B": "x"}, "xx"),
    ("$(MISSING)", {}, "$(MISSING)"),
    ("$(unterminated", {"unterminated": "x"}, "$(unterminated"),
    ("$x and $", {}, "$x and $"),
    ("$$$$", {}, "$$"),
    ("$$$(B)", {"B": "x"}, "$x"),
])
def test_expand_follows_kubernetes_rules(text, env, want):
    assert k8s.expand(text, env) == want


def test_pod_env_only_sees_variables_listed_before():
    job = {"metadata": {"name": "j"}, "spec": {"template": {"spec": {"containers": [{"env": [
        {"name": "A", "value": "$(B)-a"},
        {"name": "B", "value": "b"},
        {"name": "C", "value": "$(B)-$(A)-$(JOB_COMPLETION_INDEX)"},
    ]}]}}}}
    assert k8s.pod_env(job, 2) == {"A": "$(B)-a", "B": "b", "C": "b-$(B)-a-$(JOB_COMPLETION_INDEX)", "JOB_COMPLETION_INDEX": "2"}


@pytest.mark.parametrize("patch,where,message", [
    (lambda t: t.split("kubernetes:")[0], "kubernetes", "the spec has no kubernetes: section"),
    (lambda t: t.replace("job: {", "job: {launcher: mpi, "), "job.launcher", "launcher: mpi is not supported under Kubernetes"),
    (lambda t: t.replace("kubernetes: {", "kubernetes: {name: " + "x" * 60 + ", "), "kubernetes.name",
     "must be 1-63 characters; set a shorter kubernetes.name"),
    (lambda t: t.replace("{address: a}", "{address: a, gpus: 2}").replace("{address: b, slots: 3}", "{address: b, slots: 3, gpus: 6}"),
     "kubernetes", "the plan gives trainers 1 or 2 GPUs"),
    (lambda t: t.replace("mount_path: /code", "mount_path: /opt/clusterctl/"),
     "kubernetes.workspace.mount_path", "/opt/clusterctl/ is where clusterctl mounts its own volume in every pod"),
    # a Service named `1-2-3` the API server refuses (an RFC 1035 label starts with a letter)
    (lambda t: "name: 1.2.3\n" + t.split("\n", 1)[1], "name",
     "the job's Service would be named '1-2-3', and a Service's name starts with a letter; set kubernetes.name"),
])
def test_render_errors_name_the_key(tmp_path, patch, where, message):
    path = tmp_path / "c.yaml"
    text = patch(COLLECTIVE)
    path.write_text(text)
    from clusterctl.spec import load_spec

    with pytest.raises(SpecError) as info:
        k8s.render(load_spec(path))
    (problem,) = info.value.problems
    assert problem.path == where and message in problem.message, problem
    assert str(problem).startswith(f"{path}:{problem.line}:")


@pytest.mark.parametrize("kube,message", [
    ("{image: x, namespace: ML}", "kubernetes.namespace: 'ML' is not a Kubernetes name"),
    ("{image: x, name: 9x}", "kubernetes.name: '9x': the job's Service takes this name, and a Service's name starts"),
    ("{image: x, workspace: {pvc: a, host_path: /b}}", "kubernetes.workspace: give exactly one of pvc"),
    ("{image: x, workspace: {}}", "kubernetes.workspace: give exactly one of pvc"),
    ("{namespace: a}", "kubernetes.image: required key is missing"),
    ("{image: x, gpu: 2}", "kubernetes.gpu: unknown key"),
    ("{image: x, resources: {worker: {requests: {cpu: 1}}}}", "kubernetes.resources.worker"),
    # what the API server refuses, said at the key by validate and `k8s render` rather than by kubectl apply
    ("{image: 'a b'}", "kubernetes.image: an image reference has no spaces or control characters"),
    ("{image: x, resources: {trainer: {requests: {cpu: -4}}}}", "cpu: '-4' is not a Kubernetes quantity"),
    ("{image: x, resources: {trainer: {limits: {memory: lots}}}}", "memory: 'lots' is not a Kubernetes quantity"),
    ("{image: x, resources: {trainer: {limits: {'gpu!': 1}}}}", "'gpu!' is not a Kubernetes resource name"),
    # more requested than the limit: the API server creates no such pod (kubectl create failed at `start`)
    ("{image: x, resources: {trainer: {requests: {cpu: 1500m}, limits: {cpu: 1}}}}",
     "kubernetes.resources: trainer: requests.cpu 1500m is more than limits.cpu 1 (Kubernetes creates no such pod)"),
    ("{image: x, resources: {pserver: {requests: {memory: 3Gi}, limits: {memory: 3G}}}}",
     "pserver: requests.memory 3Gi is more than limits.memory 3G"),
    ("{image: x, resources: {trainer: {requests: {memory: 2e9}, limits: {memory: 1.5G}}}}",
     "requests.memory 2e9 is more than limits.memory 1.5G"),
    ("{image: x, gpu_resource: 'not a resource!'}", "kubernetes.gpu_resource: 'not a resource!' is not a Kub"),
    ("{image: x, workspace: {host_path: rel/dir}}", "kubernetes.workspace.host_path: expected an absolute path"),
    ("{image: x, workspace: {pvc: c, sub_path: ../../etc}}", "kubernetes.workspace.sub_path: expected a relative"),
    ("{image: x, workspace: {pvc: c, sub_path: /etc}}", "kubernetes.workspace.sub_path: expected a relative"),
    ("{image: x, workspace: {pvc: Claim_1}}", "kubernetes.workspace.pvc: 'Claim_1' is not a Kubernetes object"),
    ("{image: x, node_selector: {'bad key!': a}}", "'bad key!' is not a Kubernetes label key"),
    ("{image: x, node_selector: {gpu: 'a b'}}", "gpu: 'a b' is not a Kubernetes label value"),
    ("{image: x, service_account: 'Ops Team'}", "kubernetes.service_account: 'Ops Team' is not a Kubernetes"),
    ("{image: x, image_pull_secrets: [Regcred]}", "kubernetes.image_pull_secrets: 'Regcred' is not a Kubernetes"),
])
def test_kubernetes_section_is_validated_with_the_spec(kube, message):
    with pytest.raises(SpecError) as info:
        parse_spec(COLLECTIVE.split("kubernetes:")[0] + f"kubernetes: {kube}\n")
    assert any(message in str(p) for p in info.value.problems), [str(p) for p in info.value.problems]


def test_requests_up_to_their_limits_are_taken():
    from clusterctl.spec.backends import _amount

    parse_spec(COLLECTIVE.split("kubernetes:")[0] + "kubernetes: {image: x, resources: {trainer: {requests: "
               "{cpu: 500m, memory: 1Gi, nvidia.com/gpu: 1}, limits: {cpu: '0.5', memory: 1024Mi, nvidia.com/gpu: 1}}}}\n")
    assert [_amount(q) for q in ("500m", "1Gi", "1.5k", "2e3", "1E-3", ".5", "1e99999")] == [
        Fraction(1, 2), 2 ** 30, 1500, 2000, Fraction(1, 1000), Fraction(1, 2), 10 ** 64]


def test_what_kubernetes_takes_is_taken():
    spec = parse_spec(COLLECTIVE.split("kubernetes:")[0] + "kubernetes: {image: 'registry.example:5000/ml/train:v1@sha256:"
                      + "ab" * 32 + "', resources: {trainer: {requests: {cpu: 500m, memory: 1Gi, nvidia.com/gpu: 1},"
                      " limits: {memory: 1.5e9, ephemeral-storage: 10G, nvidia.com/gpu: 1}}}, gpu_resource: amd.com/gpu,"
                      " node_selector: {kubernetes.io/arch: amd64, gpu: 'true', pool: ''},"
                      " workspace: {pvc: data.claim-1, sub_path: runs/a, mount_path: /ws}, service_account: trainer,"
                      " image_pull_secrets: [regcred]}\n")
    assert spec.kubernetes.resources["trainer"]["limits"]["memory"] == "1.5e9"


def test_gpus_per_trainer_overrides_a_mixed_plan():
    text = COLLECTIVE.replace("{address: a}", "{address: a, gpus: 2}").replace(
        "{address: b, slots: 3}", "{address: b, slots: 3, gpus: 6}").replace("kubernetes: {", "kubernetes: {gpus_per_trainer: 2, ")
    _, docs = rendered(text)
    c = docs[3]["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert k8s.pod_env(docs[3], 0, secrets=secrets_of(docs))["FLAGS_selected_gpus"] == "0,1"


def test_cli_render_to_a_place_it_cannot_write_says_so_in_one_line(tmp_path, capsys):
    spec = tmp_path / "c.yaml"
    spec.write_text(PSERVER)
    (tmp_path / "file").write_text("")
    for out, said in ((tmp_path / "file", f"-o {tmp_path / 'file'} is not a directory"),
                      (tmp_path / "file" / "sub", f"cannot write {tmp_path / 'file' / 'sub' / 'fit-a-line.yaml'}: "),
                      (Path("/proc/no-such-dir"), "cannot write /proc/no-such-dir/fit-a-line.yaml: No such file")):
        assert cli.main(["k8s", "render", str(spec), "-o", str(out)]) == 1  # was a traceback
        got = capsys.readouterr()
        assert got.out == "" and got.err.startswith(f"clusterctl: error: k8s render: {said}") \
            and got.err.count("\n") == 1, got


def test_cli_render_o_nothing_is_a_usage_error_not_the_token_on_stdout(tmp_path, capsys):
    spec = tmp_path / "c.yaml"
    spec.write_text(PSERVER)
    for given in ("", " "):  # `-o "$DIR"`, DIR unset: printed every manifest, the Secret's token with them
        assert cli.main(["k8s", "render", str(spec), "-o", given]) == 2
        got = capsys.readouterr()
        assert (got.out, got.err) == ("", f"clusterctl: error: k8s render: -o {given!r} names no directory: give -o DIR\n")


def test_cli_render_o_dash_prints_to_stdout(tmp_path, capsys, monkeypatch):
    # `-o -` made a directory named `-` in the current one and wrote the manifests, the token with them, there
    spec = tmp_path / "c.yaml"
    spec.write_text(PSERVER)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["k8s", "render", str(spec), "-o", "-"]) == 0
    assert "kind: Secret" in capsys.readouterr().out and not (tmp_path / "-").exists()


def test_cli_render_replaces_a_symlink_at_its_file_and_never_writes_through_it(tmp_path, capsys):
    """-o DIR where DIR/<name>.yaml is a symlink to another file: that file was overwritten with the manifests
    (the token in them) and made 0600. The link itself is replaced now; what it pointed at is untouched."""
    spec = tmp_path / "c.yaml"
    spec.write_text(PSERVER)
    victim, out_dir = tmp_path / "victim.txt", tmp_path / "out"
    victim.write_text("keep me\n")
    victim.chmod(0o644)
    out_dir.mkdir()
    (out_dir / "fit-a-line.yaml").symlink_to(victim)
    assert cli.main(["k8s", "render", str(spec), "-o", str(out_dir)]) == 0
    capsys.readouterr()
    assert victim.read_text() == "keep me\n" and oct(victim.stat().st_mode & 0o777) == "0o644"
    written = out_dir / "fit-a-line.yaml"
    assert not written.is_symlink() and "kind: Secret" in written.read_text()
    assert oct(written.stat().st_mode & 0o777) == "0o600" and sorted(p.name for p in out_dir.iterdir()) == [written.name]


def test_cli_render_writes_the_file_and_says_how_to_apply(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(PSERVER)
    out_dir = tmp_path / "manifests"
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "k8s", "render", str(spec), "-o", str(out_dir)],
                         capture_output=True, text=True, timeout=60, env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    written = out_dir / "fit-a-line.yaml"
    assert written.stat().st_mode & 0o777 == 0o600  # it holds the job's token
    docs = list(yaml.safe_load_all(written.read_text()))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Secret", "fit-a-line-token"), ("ConfigMap", "fit-a-line-host"), ("Service", "fit-a-line"),
        ("Job", "fit-a-line-pserver"), ("Job", "fit-a-line-trainer")]
    token = secrets_of(docs)["fit-a-line-token", "token"]
    assert len(token) == 32 and token not in res.stdout + res.stderr
    lines = [ln.strip() for ln in res.stdout.splitlines()]
    assert lines == [
        f"wrote {written} (0600: it holds the token): Secret fit-a-line-token, ConfigMap fit-a-line-host, "
        "Service fit-a-line (headless), Job fit-a-line-pserver (2 pods), Job fit-a-line-trainer (6 pods)",
        f"create: kubectl create -f {written}",
        "watch:  kubectl get pods -n ml -l clusterctl.io/job=fit-a-line -w",
        "logs:   kubectl logs -n ml -f -l clusterctl.io/job=fit-a-line --prefix --max-log-requests 8",
        "wait:   kubectl wait -n ml --for=condition=complete job/fit-a-line-trainer --timeout=24h",
        "delete: kubectl delete -n ml job,service,configmap,secret -l clusterctl.io/job=fit-a-line",
    ]
    # without -o: the manifests alone on stdout (pipe them to kubectl), the rest on stderr; a new token each time
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "k8s", "render", str(spec)], capture_output=True, text=True, timeout=60)
    again = list(yaml.safe_load_all(res.stdout))
    assert res.returncode == 0 and again[1:] == docs[1:] and secrets_of(again) != secrets_of(docs)
    assert f"clusterctl k8s render {spec} | kubectl create -f -" in res.stderr


def test_plan_of_a_kubernetes_spec_lists_the_pods_not_the_ssh_hosts(tmp_path):
    # `plan` showed the SSH plan (processes on 10.0.0.1-3, endpoints there) and a table of SSH connections the pods
    # never use: now each pod as the manifests make it, its endpoint and its argv with the placeholders filled in
    import os

    spec = tmp_path / "c.yaml"
    spec.write_text("backend: kubernetes\n" + PSERVER)
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "plan", str(spec)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "400", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in res.stdout.splitlines() if line.startswith("│")]
    assert [r[:5] for r in rows] == [
        ["fit-a-line-pserver-0.fit-a-line", "pserver", "0", "", "fit-a-line-pserver-0.fit-a-line:7000"],
        ["fit-a-line-pserver-1.fit-a-line", "pserver", "1", "", "fit-a-line-pserver-1.fit-a-line:7000"],
        *[[f"fit-a-line-trainer-{i}.fit-a-line", "trainer", str(i), str(i), f"fit-a-line-trainer-{i}.fit-a-line:7100"]
          for i in range(6)]]
    assert rows[2][6].startswith("python3 train.py trainer --id=0 --ep=fit-a-line-trainer-0.fit-a-line:7100 "), rows[2]
    assert "connections" not in res.stdout and "10.0.0.1" not in res.stdout, res.stdout
    assert f"one pod per process; `clusterctl k8s render {spec} -o -` prints every object" in res.stdout


def test_cli_render_bad_spec_is_one_line_and_exit_2(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(COLLECTIVE.split("kubernetes:")[0])
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "k8s", "render", str(spec)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == f"{spec}:1:1: kubernetes: the spec has no kubernetes: section (at least kubernetes.image)"


def test_ten_thousand_trainers_render_quickly():
    """1,250 hosts x 8 GPUs: five objects whatever the count (no per-pod objects); a sanity bound in CPU seconds."""
    lines = ["name: scale", "hosts:"] + [f"  - {{address: 10.{i >> 8}.{i & 255}.1, gpus: 8}}" for i in range(1250)]
    lines += ["job: {mode: pserver, pservers: 16, trainers: gpu, entrypoint: [python3, train.py]}", "kubernetes: {image: x}"]
    t0 = time.process_time()
    docs = k8s.render(parse_spec("\n".join(lines) + "\n"))
    text = k8s.dump(docs)
    assert time.process_time() - t0 < 5.0
    assert [d["spec"].get("completions") for d in docs if d["kind"] in ("Service", "Job")] == [None, 16, 10000]
    # the endpoint list twice (one per Job), the host package once (the ConfigMap, under Kubernetes' 1 MiB for
    # one object whatever the fleet), nothing per pod
    sizes = {d["kind"] + " " + d["metadata"]["name"]: len(k8s.dump([d])) for d in docs}
    assert len(text) < 1_400_000 and sizes["ConfigMap scale-host"] < k8s.CONFIGMAP_LIMIT, sizes
    assert all(n < 400_000 for name, n in sizes.items() if not name.startswith("ConfigMap")), sizes
    env = k8s.pod_env(docs[4], 9999, secrets=secrets_of(docs))
    assert env["PADDLE_CURRENT_ENDPOINT"] == "scale-trainer-9999.scale:6180"
    # 10,000 pod names (298,889 bytes) are over the 128 KiB one environment string may take: left out, and said
    assert "PADDLE_TRAINER_ENDPOINTS" not in env and env["PADDLE_TRAINERS_NUM"] == "10000"
    assert k8s.notes(parse_spec("\n".join(lines) + "\n"), 10000) == (
        "PADDLE_TRAINER_ENDPOINTS is left out of every process's environment: its 10000 endpoints take 298889 bytes, "
        "over the 128 KiB Linux passes in one environment string (PaddlePaddle's collective mode reads it; PyTorch "
        "and mpi4py do not)",)


def test_a_trainer_list_over_what_execve_takes_is_left_out_of_the_pods_and_render_says_so(tmp_path):
    def spec_of(hosts):  # 8 trainers a host, pods named `scale-trainer-I.scale`: 30 bytes an endpoint
        lines = ["name: scale", "hosts:"] + [f"  - {{address: 10.{i >> 8}.{i & 255}.1, gpus: 8}}" for i in range(hosts)]
        lines += ["job: {trainers: gpu, entrypoint: [python3, train.py]}", "kubernetes: {image: x}"]
        return "\n".join(lines) + "\n"

    fits = k8s.render(parse_spec(spec_of(500)))  # 4,000 trainers: 118,889 bytes
    assert k8s.pod_env(fits[-1], 0, secrets=secrets_of(fits))["PADDLE_TRAINER_ENDPOINTS"].count(",") == 3999
    assert k8s.notes(parse_spec(spec_of(500)), 4000) == ()
    spec = tmp_path / "big.yaml"
    spec.write_text(spec_of(560))  # 4,480 trainers: 133,289 bytes
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "k8s", "render", str(spec)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "name: PADDLE_TRAINER_ENDPOINTS\n" not in res.stdout and "name: PADDLE_TRAINERS_NUM\n" in res.stdout
    assert (" note: PADDLE_TRAINER_ENDPOINTS is left out of every process's environment: its 4480 endpoints take "
            "133289 bytes, over the 128 KiB") in " ".join(res.stderr.split()), res.stderr  # however rich wraps it


def test_an_argument_over_what_execve_takes_with_the_pods_endpoints_is_refused_at_its_line(tmp_path):
    """`{trainer_endpoints}` in job.args is the pods' DNS names under Kubernetes (30 bytes an endpoint here), not the
    hosts' addresses (~15): an argument that fits over SSH can be over execve's 128 KiB in every pod."""
    def spec_of(hosts, backend="backend: kubernetes\n"):
        lines = ["name: scale", "hosts:"] + [f"  - {{address: 10.{i >> 8}.{i & 255}.1, gpus: 8}}" for i in range(hosts)]
        lines += ["job: {trainers: gpu, entrypoint: [python3, train.py], args: ['--eps={trainer_endpoints}']}",
                  "kubernetes: {image: x}"]
        return backend + "\n".join(lines) + "\n"

    said = ("job.args: an argument (after its placeholders) would be 133295 bytes in a trainer pod: Linux starts no "
            "process with an argument or environment string over 128 KiB (E2BIG)")
    # 4,480 trainers: the hosts' endpoints fit (the same spec without its kubernetes: section plans)
    assert make_plan(parse_spec(spec_of(560, "").replace("kubernetes: {image: x}\n", ""))).trainers
    spec, ssh = tmp_path / "big.yaml", tmp_path / "ssh.yaml"
    spec.write_text(spec_of(560))
    ssh.write_text(spec_of(560, ""))  # an SSH spec that keeps the section for `k8s render`: checked as well
    for argv in (["k8s", "render"], ["validate"], ["plan", "--json"]):  # every command refuses it, in the same words
        for path, line in ((spec, 564), (ssh, 563)):
            res = subprocess.run([sys.executable, "-m", "clusterctl.cli", *argv, str(path)], capture_output=True,
                                 text=True, timeout=120, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
            assert res.returncode == 2 and res.stdout == "", (argv, res.stdout[:300])
            assert res.stderr.strip() == f"{path}:{line}:55: {said}", (argv, res.stderr)
    with pytest.raises(SpecError) as info:  # another backend's spec: `k8s render` (render's own check) refuses it
        k8s.render(parse_spec(spec_of(560, ""), "ssh.yaml"))
    assert [str(p) for p in info.value.problems] == [f"ssh.yaml:563:55: {said}"]
    docs = k8s.render(parse_spec(spec_of(500)))  # 4,000 trainers: 118,895 bytes, rendered
    assert docs[-1]["spec"]["template"]["spec"]["containers"][0]["args"][-1].count(",") == 3999
