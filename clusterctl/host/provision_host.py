"""Host-side fact gathering for `clusterctl doctor` (stdlib only; sent over ssh stdin to `python3 -`).

Prints one JSON object: OS, Python, the job's venv and its packages, mpi4py and its MPI library,
mpiexec, CUDA driver / toolkit / cuDNN / NCCL, GPUs, the job's ports on this host, and TCP reachability
of every peer (its sshd port, and a listener this script opens on one of this host's job ports while
the peers run the same script). Everything is bounded by timeouts.
"""

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time

_VENV_SNIPPET = r"""
import json, sys
from importlib import metadata
out = {"python": "%d.%d.%d" % sys.version_info[:3], "packages": {}}
for dist in metadata.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name:
        out["packages"][name] = dist.version
try:
    import mpi4py
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    out["mpi4py"] = mpi4py.__version__
    out["mpi_library"] = " ".join(MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].split())
    out["mpi_version"] = "%d.%d" % MPI.Get_version()
except ModuleNotFoundError:
    pass  # no mpi4py in this venv: doctor shows "-", and a problem only when the spec asks for mpi
except Exception as exc:  # reported, not hidden: doctor shows it as the host's mpi4py state
    out["mpi4py_error"] = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps(out))
"""


def _run(argv, timeout=15):
    """(exit code, stdout) of argv; (None, reason) when it cannot run."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return None, "not found"
    except subprocess.TimeoutExpired:
        return None, "timed out after %ss" % timeout
    except OSError as exc:
        return None, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


def login_facts():
    """The login user, uid and home, and whether passwordless sudo works: root | ok | password | missing | error: ..."""
    import pwd

    uid = os.getuid()
    try:
        entry = pwd.getpwuid(uid)
        user, home = entry.pw_name, entry.pw_dir
    except KeyError:
        user, home = str(uid), os.path.expanduser("~")
    if uid == 0:
        sudo = "root"
    else:
        try:
            proc = subprocess.run(["sudo", "-n", "true"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=10, check=False)
        except FileNotFoundError:
            sudo = "missing"
        except subprocess.TimeoutExpired:
            sudo = "error: sudo -n true did not answer in 10 s"
        else:
            err = (proc.stderr.strip().splitlines() or [""])[-1]
            sudo = "ok" if proc.returncode == 0 else ("password" if "password" in err else "error: " + (err or "exit %d" % proc.returncode))
    return {"user": user, "uid": uid, "home": home, "sudo": sudo}


def _os_release():
    try:
        with open("/etc/os-release") as fh:
            for line in fh:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform()


def _venv(path):
    if not path:
        return {"path": "", "exists": False}
    path = os.path.expanduser(path if path.startswith(("/", "~")) else os.path.join("~", path))
    python = os.path.join(path, "bin", "python")
    info = {"path": path, "exists": os.access(python, os.X_OK)}
    if not info["exists"]:
        return info
    code, out = _run([python, "-c", _VENV_SNIPPET], timeout=30)
    if code == 0:
        info.update(json.loads(out.strip().splitlines()[-1]))
    else:
        info["error"] = (out or "").strip().splitlines()[-1:] or ["exit %s" % code]
    mpiexec = os.path.join(path, "bin", "mpiexec")
    info["mpiexec"] = _mpiexec_version(mpiexec if os.access(mpiexec, os.X_OK) else shutil.which("mpiexec"))
    return info


def _mpiexec_version(path):
    if not path:
        return ""
    code, out = _run([path, "--version"], timeout=10)
    if code is None:
        return ""
    for line in out.splitlines():
        s = line.strip()
        if s.startswith("Version:") or s.startswith("mpiexec (OpenRTE)") or "Open MPI" in s:
            return s.replace("Version:", "").strip() if s.startswith("Version:") else s
    return out.strip().splitlines()[0] if out.strip() else ""


def _dpkg():
    code, out = _run(["dpkg-query", "-W", "-f", "${Package} ${Version} ${db:Status-Status}\n",
                      "cuda-toolkit-*", "libcudnn*", "libnccl2"], timeout=15)
    found = {}
    for line in (out or "").splitlines() if code is not None else []:
        parts = line.split()
        if len(parts) == 3 and parts[2] == "installed":
            found[parts[0]] = parts[1]
    return found


def _gpu_stack(venv_packages):
    info = {"driver": "", "gpus": [], "toolkit": "", "cudnn": "", "nccl": ""}
    if shutil.which("nvidia-smi"):
        code, out = _run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
                          "--format=csv,noheader"], timeout=20)
        if code == 0:
            for line in out.strip().splitlines():
                fields = [f.strip() for f in line.split(",")]
                if len(fields) == 4:
                    info["gpus"].append({"index": fields[0], "name": fields[1], "memory": fields[3]})
                    info["driver"] = fields[2]
        else:
            info["driver_error"] = (out or "").strip().splitlines()[-1:] or ["nvidia-smi exit %s" % code]
    # The job's venv first (what its processes load), then system packages, then nvcc.
    for name, ver in sorted((venv_packages or {}).items()):
        if name == "nvidia-cuda-runtime" or name.startswith("nvidia-cuda-runtime-cu"):  # CUDA 13+: no suffix
            info["toolkit"] = "%s (pip %s)" % (ver, name)
        elif name.startswith("nvidia-cudnn-cu"):
            info["cudnn"] = "%s (pip %s)" % (ver, name)
        elif name.startswith("nvidia-nccl-cu"):
            info["nccl"] = "%s (pip %s)" % (ver, name)
    pkgs = _dpkg()
    for name, ver in sorted(pkgs.items()):
        if name.startswith("cuda-toolkit-") and name.count("-") == 3 and not info["toolkit"]:
            info["toolkit"] = "%s (apt %s)" % (name[len("cuda-toolkit-"):].replace("-", "."), ver)
        elif name.startswith("libcudnn") and "-dev" not in name and not info["cudnn"]:
            info["cudnn"] = "%s (apt %s)" % (ver, name)
        elif name == "libnccl2" and not info["nccl"]:
            info["nccl"] = "%s (apt)" % ver
    if not info["toolkit"]:
        nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else "")
        if nvcc:
            code, out = _run([nvcc, "--version"], timeout=10)
            for line in (out or "").splitlines():
                if "release" in line:
                    info["toolkit"] = line.split("release", 1)[1].split(",")[0].strip() + " (nvcc)"
    return info


def _port_free(address, port):
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Like the job's servers: a TIME_WAIT left by an earlier connection does not make a port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as exc:
            return False, exc.strerror or str(exc)
    return True, ""


def _job_running(job_dir):
    """Whether the job's supervisor (its state.json under `job_dir`, relative to home) runs on this host: then the
    job's ports are in use by the job itself. The pid and its start time (/proc) must both match."""
    if not job_dir:
        return False
    try:
        with open(os.path.join(os.path.expanduser("~"), job_dir, "state.json")) as f:
            sup = json.load(f).get("supervisor") or {}
        pid, ticks = int(sup["pid"]), sup.get("start_ticks")
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return False
    return fields[0] not in ("Z", "X", "x") and (ticks is None or fields[19] == str(ticks))


def _listen(address, ports, until, expected):
    """Listen on the first port of `ports` that binds until `until` or `expected` connections; (port, thread)."""
    for port in ports:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
            s.listen(64)
        except OSError:
            s.close()
            continue
        s.settimeout(0.2)

        def serve(sock=s):
            accepted = 0
            with sock:
                while time.monotonic() < until and accepted < expected:
                    try:
                        conn, _ = sock.accept()
                    except (TimeoutError, OSError):
                        continue
                    # Let the peer close first, so TIME_WAIT stays on its side, not on this job port.
                    conn.settimeout(1.0)
                    try:
                        conn.recv(1)
                    except OSError:
                        pass  # a peer that does not close within 1 s: ours closes now
                    conn.close()
                    accepted += 1

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        return port, t
    return None, None


def _connect(address, port, deadline):
    """'ok', or why a TCP connection to address:port failed on every try until `deadline` (one try at least)."""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((address, port), timeout=min(1.0, max(left, 0.5))):
                return "ok"
        except TimeoutError:
            last = "timed out"
        except OSError as exc:
            last = exc.strerror or str(exc)
        if time.monotonic() + 0.2 >= deadline:
            return last
        time.sleep(0.2)


def main():
    """Gather this host's facts for doctor; argv[1] is a JSON object of parameters."""
    params = json.loads(sys.argv[1])
    start = time.monotonic()
    window = float(params.get("window", 3.0))
    address = params["address"]
    ports = {}
    running = _job_running(params.get("job_dir"))
    for port in params.get("ports", []):
        free, why = _port_free(address, port)
        # a running job holds its own ports: not a problem, said as the job's
        ports[str(port)] = "free" if free else "job: in use while the job runs" if running else "busy: %s" % why
    wanted = params.get("listen_port")
    listen_port, listener = None, None
    if wanted and ports.get(str(wanted)) == "free":
        listen_port, listener = _listen(address, [wanted], start + window + 1.0, len(params.get("peers", [])))
    reach = {}

    def probe_peers():
        deadline = start + window
        for peer in params.get("peers", []):
            entry = {"ssh": _connect(peer["address"], peer["ssh_port"], deadline)}
            if peer.get("job_port"):
                entry["job_port"] = _connect(peer["address"], peer["job_port"], deadline)
            reach[peer["label"]] = entry

    prober = threading.Thread(target=probe_peers, daemon=True)
    prober.start()  # while this host's own facts are gathered
    venv = _venv(params.get("venv", ""))
    facts = {
        "hostname": socket.gethostname(),
        "login": login_facts(),
        "os": _os_release(),
        "kernel": platform.release(),
        "python3": "%d.%d.%d" % sys.version_info[:3],
        "venv": venv,
        "gpu": _gpu_stack(venv.get("packages")),
        "ports": ports,
        "listen_port": listen_port,
    }
    prober.join(window * max(1, 2 * len(params.get("peers", []))) + 5)
    facts["reach"] = reach
    if listener is not None:
        listener.join(max(0.0, start + window + 1.0 - time.monotonic()))
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
