"""Scalars YAML 1.1 reads as something else than their text: taken as written where a value is text (job.env, argv
items, labels, Kubernetes quantities), and the text kept for every non-string scalar (clusterctl.yamlpos)."""

import pytest

from clusterctl.spec import load_spec
from clusterctl.yamlpos import load_located

HEAD = "name: c\nssh: {config: none}\n"
JOB = "job:\n  entrypoint: [python]\n"

# (as written, what YAML 1.1 made of it, stringified: the value every process got before)
FORMS = [
    ("12.10", "12.1"),  # a version
    ("010", "8"),  # octal
    ("0x10", "16"),
    ("1:10", "70"),  # base 60
    ("1_000", "1000"),
    ("on", "true"),
    ("yes", "true"),
    ("Off", "false"),
    ("True", "true"),
    ("1.0e+3", "1000.0"),
    ("+5", "5"),
    (".inf", "inf"),
    ("0b11", "3"),
]


@pytest.mark.parametrize("written, misread", FORMS, ids=[w for w, _ in FORMS])
def test_env_values_are_the_text_as_written(write_spec, written, misread):
    spec = load_spec(write_spec(HEAD + "hosts: [{address: h1}]\n" + JOB + f"  env: {{V: {written}, W: '{written}'}}\n"))
    assert spec.job.env == {"V": written, "W": written}, misread


def test_argv_labels_and_quantities_are_the_text_as_written(write_spec):
    spec = load_spec(write_spec(
        HEAD + "hosts: [{address: h1, labels: {cuda: 12.10, rack: 010, ib: on}}]\n"
        "job:\n  entrypoint: [python, 1.10]\n  args: [--lr, 0.10, --every, 1:30, --flag, yes]\n"
        "kubernetes: {image: img, resources: {trainer: {limits: {cpu: 0.50, memory: 010}}}}\n"))
    assert spec.job.entrypoint == ("python", "1.10")
    assert spec.job.args == ("--lr", "0.10", "--every", "1:30", "--flag", "yes")
    assert spec.hosts[0].labels == {"cuda": "12.10", "rack": "010", "ib": "on"}
    assert spec.kubernetes.resources == {"trainer": {"limits": {"cpu": "0.50", "memory": "010"}}}


def test_mapping_keys_are_names_as_written(write_spec):
    # `env: {on: 1, NO: 2}` gave every process variables named True and False; `labels: {on: a, yes: b}` was "key
    # given twice" about a key named True; `{1.10: x}` named it 1.1
    spec = load_spec(write_spec(
        HEAD + "hosts: [{address: h1, labels: {on: a, yes: b, 1.10: c, 010: d}}]\n" + JOB + "  env: {on: 1, NO: 2}\n"))
    assert spec.job.env == {"on": "1", "NO": "2"}
    assert spec.hosts[0].labels == {"on": "a", "yes": "b", "1.10": "c", "010": "d"}
    with pytest.raises(Exception, match="key given twice"):  # the same text twice is still twice
        load_spec(write_spec(HEAD + "hosts: [{address: h1, labels: {on: a, 'on': b}}]\n" + JOB))


def test_env_through_an_alias_and_a_merge_key_is_as_written(write_spec):
    """An alias is built once, where its anchor is: its text is found there."""
    spec = load_spec(write_spec(
        HEAD + "hosts:\n  - {address: h1, labels: &l {CUDA: 12.10, N: &n 1:10}}\n  - {address: h2, labels: *l}\n"
        "job:\n  entrypoint: [python, *n]\n  env: {<<: *l, MODE: 010}\n"))
    assert spec.job.env == {"CUDA": "12.10", "N": "1:10", "MODE": "010"}
    assert spec.hosts[1].labels == {"CUDA": "12.10", "N": "1:10"}
    assert spec.job.entrypoint == ("python", "1:10")


def test_provision_versions_as_written_still(write_spec):
    """The float users of the written text (provision's WrittenFloat): 12.4 stays 12.4, 4.10 stays 4.10."""
    spec = load_spec(write_spec(HEAD + "hosts: [{address: h1}]\n" + JOB +
                                "provision:\n  cuda: 12.4\n  python: {}\n  mpi: {mpi4py: 4.10, version: 4.1}\n"))
    assert spec.provision.cuda.version == "12.4"
    assert (spec.provision.mpi.mpi4py, spec.provision.mpi.version) == ("4.10", "4.1")


def test_located_keeps_the_text_of_every_non_string_scalar():
    loc = load_located("a: 12.10\nb: [010, on, ~, x, '7']\nc: &c {d: 1:10}\ne: *c\nf: {<<: *c}\n")
    assert loc.texts == {("a",): "12.10", ("b", 0): "010", ("b", 1): "on", ("b", 2): "~", ("c", "d"): "1:10"}
    assert [loc.text(p) for p in [("a",), ("b", 0), ("b", 3), ("b", 4), ("e", "d"), ("f", "d"), ("e",), ("zz",)]] == [
        "12.10", "010", None, None, "1:10", "1:10", None, None]
