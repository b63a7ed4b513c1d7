"""clusterctl/host/record.py: the records the host package uses instead of `dataclasses` (whose import, with
inspect's, cost every host ~13 ms of CPU per `agent up`). They must behave as the dataclasses they replace."""

import dataclasses
import subprocess
import sys

import pytest

from clusterctl.host.record import FrozenInstanceError, asdict, dataclass, field, fields, replace


@dataclass(frozen=True)
class Point:
    x: int
    y: int = 0
    tags: list = field(default_factory=list, repr=False)


@dataclass
class Box:
    name: str
    items: dict = field(default_factory=dict)
    inner: Point = None

    def __post_init__(self):
        self.name = self.name.strip()


@dataclasses.dataclass(frozen=True)
class DPoint:
    x: int
    y: int = 0
    tags: list = dataclasses.field(default_factory=list, repr=False)


def test_init_defaults_factories_and_post_init():
    assert (Point(1).x, Point(1).y, Point(1, 2).y, Point(x=3, y=4).x) == (1, 0, 2, 3)
    a, b = Point(1), Point(1)
    a.tags.append("t")
    assert b.tags == []  # a fresh list per record
    assert Box("  b ").name == "b"
    with pytest.raises(TypeError, match="missing argument 'x'"):
        Point()
    with pytest.raises(TypeError, match="unexpected"):
        Point(1, z=2)
    with pytest.raises(TypeError, match="two values"):
        Point(1, x=2)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        Point(1, 2, [], 4)


def test_the_same_repr_equality_and_hashing_as_dataclasses():
    assert repr(Point(1, 2, ["t"])) == repr(DPoint(1, 2, ["t"])).replace("DPoint", "Point") == "Point(x=1, y=2)"
    assert Point(1, 2) == Point(1, 2) and Point(1, 2) != Point(2, 1) and Point(1) != DPoint(1)
    assert hash(Point(1, 2, ())) == hash(Point(1, 2, ())) and len({Point(1, 2, ()), Point(1, 2, ())}) == 1
    with pytest.raises(TypeError):
        hash(Box("b"))  # mutable and compared by value: unhashable, like a dataclass
    with pytest.raises(FrozenInstanceError):
        Point(1).x = 2
    with pytest.raises(AttributeError):
        del Point(1).x
    box = Box("b")
    box.name = "c"
    assert box.name == "c"


def test_fields_asdict_and_replace():
    assert [f.name for f in fields(Point)] == ["x", "y", "tags"] == [f.name for f in fields(Point(1))]
    assert fields(Point)[1].default == 0 and fields(Point)[2].default_factory is list
    box = Box("b", {"k": [Point(1, 2)]}, Point(3))
    assert asdict(box) == {"name": "b", "items": {"k": [{"x": 1, "y": 2, "tags": []}]},
                           "inner": {"x": 3, "y": 0, "tags": []}}
    assert asdict(box)["items"] is not box.items
    moved = replace(Point(1, 2, ["t"]), y=5)
    assert moved == Point(1, 5, ["t"])
    with pytest.raises(TypeError, match="no field z"):
        replace(Point(1), z=1)
    with pytest.raises(TypeError):
        fields(object())
    with pytest.raises(TypeError, match="follows a default"):
        @dataclass
        class Bad:
            a: int = 1
            b: int


def test_agent_up_imports_neither_dataclasses_nor_inspect():
    """What every start runs on every host (the point of record.py)."""
    code = ("import sys; import clusterctl.host.agent, clusterctl.host.up, clusterctl.host.launch, "
            "clusterctl.host.preflight, clusterctl.host.supervisor; "
            "print(sorted(m for m in ('dataclasses', 'inspect', 'ast') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-S", "-c", "import sys; sys.path[:0] = %r; %s" % (sys.path, code)],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
