"""clusterctl.docker passes a reference after `--`: `testcluster up --base-image=--help` reached docker as docker's own
`--help` (its usage text, then a JSONDecodeError traceback). The testcluster CLI checks the reference itself; this
is the layer below, for every caller."""

from __future__ import annotations

import os

import pytest

from clusterctl import docker
from clusterctl import testcluster as tc
from clusterctl.errors import ClusterctlError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def _docker() -> None:
    try:
        tc.ensure_docker()
    except ClusterctlError as exc:
        if os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}:
            pytest.fail(f"docker cannot be used: {exc}", pytrace=False)
        pytest.skip(f"docker cannot be used: {exc}")


@pytest.mark.parametrize("ref", ["--help", "--format={{.Id}}", "-f"])
def test_a_reference_that_looks_like_an_option_is_a_missing_object(ref):
    assert docker.inspect("image", [ref]) == []
    assert docker.inspect("network", [ref]) == []
    assert docker.image_exists(ref) is False
    assert docker.pull(ref, timeout=30) is False
