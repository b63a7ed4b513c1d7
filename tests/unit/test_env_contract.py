"""The env contract, proven with a real framework: the plan's env alone lets stock torch gloo rendezvous."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, free_port_base

from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_stock_torch_gloo_script_allreduces_with_plan_env():
    pytest.importorskip("torch")
    master = free_port()
    spec = parse_spec(
        f"""
name: envproof
hosts: [{{address: 127.0.0.1}}]
job:
  entrypoint: [{sys.executable}, {ROOT / 'examples/torch_gloo/train.py'}]
  trainers: 2
  ports: {{trainer: {free_port_base(2)}, master: {master}, control: {free_port()}}}
  env: {{STEPS: 20}}
"""
    )
    plan = make_plan(spec)
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    procs = [
        subprocess.Popen(list(p.argv), env={**base, **p.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for p in plan.trainers
    ]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    # ranks 0 and 1 contributed 1 and 2: the all_reduce really crossed processes
    assert "done rank=0 world=2 allreduce=3" in outs[0]
    assert "done rank=1 world=2 allreduce=3" in outs[1]
    final = [float(o.rsplit("loss=", 1)[1]) for o in outs]
    assert final[0] < 0.05 and final[1] < 0.05


def _paddle_python() -> str | None:
    """An interpreter with paddlepaddle: $CLUSTERCTL_PADDLE_PYTHON, or this one if it has paddle."""
    explicit = os.environ.get("CLUSTERCTL_PADDLE_PYTHON")
    if explicit:
        return explicit
    try:
        import paddle  # noqa: F401
    except ImportError:
        return None
    return sys.executable


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stock_paddle_init_parallel_env_allreduces_with_plan_env(tmp_path):
    """paddle.distributed.init_parallel_env() on CPU (gloo) from the plan's env; PADDLE_DISTRI_BACKEND is job.env."""
    python = _paddle_python()
    if python is None:
        pytest.skip("no paddlepaddle: pip install paddlepaddle==3.3.1, or set CLUSTERCTL_PADDLE_PYTHON")
    spec = parse_spec(
        f"""
name: paddleproof
hosts: [{{address: 127.0.0.1}}]
job:
  entrypoint: [{python}, {ROOT / 'examples/paddle_collective/train.py'}]
  trainers: 2
  env: {{PADDLE_DISTRI_BACKEND: gloo}}
  ports: {{trainer: {free_port_base(2)}, master: {free_port()}, control: {free_port()}}}
"""
    )
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    procs = [
        subprocess.Popen(
            list(p.argv), env={**base, **p.env}, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )  # cwd: paddle's KV server writes http.log there
        for p in make_plan(spec).trainers
    ]
    outs = [p.communicate(timeout=200)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert "done rank=0 world=2 allreduce=3" in outs[0]
    assert "done rank=1 world=2 allreduce=3" in outs[1]
