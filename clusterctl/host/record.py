"""Record classes for the host package: the part of `dataclasses` it uses, without importing it.

`agent up` runs on every host at every start, and `dataclasses` (with the `inspect`, `ast`, `dis` and
`tokenize` it imports) plus the code it generates for each class cost ~13 ms of the host's CPU, a third of
the command's (docs/benchmarks.md, "Start over new connections"). The same decorator, fields, defaults,
`__post_init__`, equality, `frozen` and the helpers `fields`, `asdict` and `replace` are built here from plain
functions instead: nothing is compiled at import.

    @dataclass(frozen=True)
    class Verdict:
        outcome: str
        reason: str = ""
        failures: list = field(default_factory=list, repr=False)
"""

__all__ = ["dataclass", "field", "fields", "asdict", "replace", "FrozenInstanceError"]

_MISSING = object()


class FrozenInstanceError(AttributeError):
    """An attribute of a frozen record was set or deleted."""


class Field:
    """One field: its name, default or default factory, and whether repr() shows it."""

    __slots__ = ("name", "default", "default_factory", "repr", "init")

    def __init__(self, default=_MISSING, default_factory=None, repr=True):
        if default is not _MISSING and default_factory is not None:
            raise ValueError("cannot specify both default and default_factory")
        self.name = None
        self.default = default
        self.default_factory = default_factory
        self.repr = repr
        self.init = True

    def __repr__(self):
        return "Field(%r)" % (self.name,)


def field(*, default=_MISSING, default_factory=None, repr=True):
    """A field with a default factory (a fresh list or dict per record) or not shown by repr()."""
    return Field(default, default_factory, repr)


def fields(record_or_class):
    """The record's fields, in order (Field objects: name, default, default_factory)."""
    cls = record_or_class if isinstance(record_or_class, type) else type(record_or_class)
    try:
        return cls.__record_fields__
    except AttributeError:
        raise TypeError("%s is not a record class" % cls.__name__) from None


def _plain(value):
    if hasattr(type(value), "__record_fields__"):
        return asdict(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


def asdict(record):
    """{field name: value}, nested records, lists and dicts copied as dicts, lists and dicts."""
    return {f.name: _plain(getattr(record, f.name)) for f in fields(record)}


def replace(record, **changes):
    """A new record: this one's fields, `changes` applied."""
    values = {f.name: getattr(record, f.name) for f in fields(record)}
    unknown = set(changes) - set(values)
    if unknown:
        raise TypeError("%s has no field %s" % (type(record).__name__, ", ".join(sorted(unknown))))
    values.update(changes)
    return type(record)(**values)


def _frozen_setattr(self, name, value):
    raise FrozenInstanceError("cannot assign to field %r" % name)


def _frozen_delattr(self, name):
    raise FrozenInstanceError("cannot delete field %r" % name)


def _build(cls, frozen):
    specs = []
    for name in cls.__dict__.get("__annotations__", {}):
        value = cls.__dict__.get(name, _MISSING)
        f = value if isinstance(value, Field) else Field(value)
        f.name = name
        if isinstance(value, Field):  # the class keeps plain defaults as attributes, as dataclasses does
            if f.default is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, f.default)
        if specs and f.default is _MISSING and f.default_factory is None and (
                specs[-1].default is not _MISSING or specs[-1].default_factory is not None):
            raise TypeError("%s: non-default field %r follows a default one" % (cls.__name__, name))
        specs.append(f)
    specs = tuple(specs)
    names = tuple(f.name for f in specs)
    count = len(specs)
    post_init = getattr(cls, "__post_init__", None)
    setter = object.__setattr__

    def __init__(self, *args, **kwargs):
        if len(args) > count:
            raise TypeError("%s() takes %d arguments, %d given" % (cls.__name__, count, len(args)))
        for i, f in enumerate(specs):
            if i < len(args):
                value = args[i]
                if f.name in kwargs:
                    raise TypeError("%s() got two values for %r" % (cls.__name__, f.name))
            elif f.name in kwargs:
                value = kwargs.pop(f.name)
            elif f.default_factory is not None:
                value = f.default_factory()
            elif f.default is not _MISSING:
                value = f.default
            else:
                raise TypeError("%s() missing argument %r" % (cls.__name__, f.name))
            setter(self, f.name, value)
        if kwargs:
            raise TypeError("%s() got unexpected argument(s) %s" % (cls.__name__, ", ".join(sorted(kwargs))))
        if post_init is not None:
            self.__post_init__()

    def __repr__(self):
        return "%s(%s)" % (type(self).__qualname__,
                           ", ".join("%s=%r" % (f.name, getattr(self, f.name)) for f in specs if f.repr))

    def _values(self):
        return tuple(getattr(self, n) for n in names)

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return _values(self) == _values(other)

    cls.__init__ = __init__
    cls.__repr__ = __repr__
    cls.__eq__ = __eq__
    if frozen:
        cls.__setattr__ = _frozen_setattr
        cls.__delattr__ = _frozen_delattr
        cls.__hash__ = lambda self: hash(_values(self))
    else:
        cls.__hash__ = None  # mutable and compared by value: unhashable, as a dataclass is
    cls.__record_fields__ = specs
    return cls


def dataclass(cls=None, *, frozen=False):
    """Make `cls` a record: __init__ from its annotated fields (in order, with their defaults), __repr__, __eq__;
    `frozen`: fields cannot be set after __init__, and the record hashes by its values."""
    if cls is None:
        return lambda c: _build(c, frozen)
    return _build(cls, frozen)
