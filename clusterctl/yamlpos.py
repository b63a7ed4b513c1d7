"""Load YAML while remembering where every key and value came from (for FILE:LINE:COL messages).

Hostile input is bounded (docs/security.md): the text's size, the nesting depth, and the number of
nodes that aliases expand to are limited; every alias is built once (a ``billion laughs`` spec is
refused in milliseconds, not expanded); an alias that refers to itself, an unknown tag, a bad merge
key or an over-long number is a :class:`YamlSyntaxError` at its line and column, never a traceback.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import yaml

from .files import SPEC_LIMIT

__all__ = ["Located", "load_located", "YamlSyntaxError", "MAX_BYTES", "MAX_DEPTH", "MAX_NODES"]

Path = tuple  # a tuple of str keys / int indices

MAX_BYTES = SPEC_LIMIT  # a spec larger than 1 MiB is refused before parsing
MAX_DEPTH = 64  # nesting of mappings / lists
MAX_NODES = 100_000  # nodes after aliases are expanded (what validation walks)


class YamlSyntaxError(Exception):
    """The text is not YAML (or not acceptable YAML); carries a 1-based line and column."""

    def __init__(self, message: str, line: int, column: int):
        super().__init__(message)
        self.message, self.line, self.column = message, line, column


@dataclass
class Located:
    """Plain Python data plus the 1-based (line, column) of each value and each mapping key."""

    data: object
    values: dict = field(default_factory=dict)  # path -> (line, col) of the value
    keys: dict = field(default_factory=dict)  # path -> (line, col) of the key naming it
    duplicates: list = field(default_factory=list)  # paths given twice in one mapping
    # path -> the text of a scalar YAML did not read as a string (`12.10`, `010`, `1:10`, `on`): YAML 1.1 made
    # it a number or a truth value (12.1, 8, 70, True), and the text is what a version or an env value means
    texts: dict = field(default_factory=dict)
    aliases: dict = field(default_factory=dict)  # path of an alias (or a merged `<<` value) -> where its node was built
    # path -> (file, line, col) of a value read from another file (a hostfile's hosts); see where()
    elsewhere: dict = field(default_factory=dict)

    def position(self, path: Path) -> tuple[int, int]:
        """Best position for `path` in the spec: its key, else its value, else the nearest located parent."""
        path = tuple(path)
        while path:
            if path in self.keys:
                return self.keys[path]
            if path in self.values:
                return self.values[path]
            path = path[:-1]
        return self.values.get((), (1, 1))

    def where(self, path: Path) -> tuple[str | None, int, int]:
        """(file, line, column) for `path`: file None for the spec itself (at position()); a value read from
        another file (`elsewhere`, or a part of one) at its place in that file."""
        part = tuple(path)
        while part:
            if part in self.elsewhere:
                return self.elsewhere[part]
            if part in self.keys or part in self.values:
                break
            part = part[:-1]
        return (None, *self.position(path))

    def text(self, path: Path) -> str | None:
        """The text a non-string scalar at `path` was written as (through aliases and merge keys), else None."""
        path = tuple(path)
        for _ in range(MAX_DEPTH):  # each round replaces an alias by where its node was built
            if path in self.texts:
                return self.texts[path]
            if not self.aliases:
                return None
            for i in range(len(path), 0, -1):
                if path[:i] in self.aliases:
                    path = self.aliases[path[:i]] + path[i:]
                    break
            else:
                return None
        return None


# libyaml's parser when PyYAML was built with it: ~10x faster on a spec of 1,250 hosts, same nodes and
# marks. Bad YAML is parsed again by the pure-Python parser, whose messages say what it expected.
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STR_TAG = "tag:yaml.org,2002:str"


def _mark(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _one_line(text: object) -> str:
    """A message from PyYAML or Python on one line, control characters escaped."""
    s = " ".join(str(text).split())
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)[:300]


def load_located(text: str) -> Located:
    """Parse YAML `text` safely into data plus positions; raise YamlSyntaxError on bad or hostile YAML."""
    if len(text) > MAX_BYTES:
        raise YamlSyntaxError(f"spec is larger than {MAX_BYTES // 1024} KiB", 1, 1)
    _check_flow_depth(text)  # PyYAML's scanner is quadratic in flow nesting: refuse deep nesting first
    limit = sys.getrecursionlimit()
    loader = None
    try:
        # PyYAML's composer recurses once per nesting level: a spec nested thousands deep would
        # exhaust the stack; the recursion limit is raised a little so MAX_DEPTH is what decides.
        sys.setrecursionlimit(max(limit, 3000))
        loader = _FAST_LOADER(text)  # libyaml where installed: 10x faster on 10,000-host specs
        try:
            root = loader.get_single_node()
        except yaml.YAMLError:
            if _FAST_LOADER is yaml.SafeLoader:
                raise
            loader.dispose()  # parse errors are worded by the pure-Python loader, as always
            loader = None
            loader = yaml.SafeLoader(text)  # the reader rejects NUL and other non-printable characters here
            root = loader.get_single_node()
        located = Located(data=None)
        if root is not None:
            located.data = _Builder(loader, located).build(root, (), 0)
        return located
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise YamlSyntaxError(f"YAML syntax error: {_one_line(exc.problem or exc)}", line, col) from None
    except yaml.reader.ReaderError as exc:
        char = exc.character if isinstance(exc.character, str) else chr(exc.character or 0)
        raise YamlSyntaxError(f"character {char!r} is not allowed in a spec (binary data?)",
                              *_reader_position(exc, text)) from None
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(f"YAML syntax error: {_one_line(exc)}", *_reader_position(exc, text)) from None
    except RecursionError:
        raise YamlSyntaxError(f"YAML nested too deeply (limit {MAX_DEPTH})", 1, 1) from None
    finally:
        sys.setrecursionlimit(limit)
        if loader is not None:
            loader.dispose()


def _check_flow_depth(text: str) -> None:
    """Raise YamlSyntaxError if `[`/`{` nest deeper than MAX_DEPTH (quoted scalars and comments skipped)."""
    depth, i, n = 0, 0, len(text)
    line, line_start = 1, 0
    prev = "\n"  # the previous character outside a scalar
    while i < n:
        c = text[i]
        if c == "\n":
            line, line_start = line + 1, i + 1
        elif c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise YamlSyntaxError(f"YAML nested too deeply (limit {MAX_DEPTH})", line, i - line_start + 1)
        elif c in "]}":
            depth = max(0, depth - 1)
        elif c == "#" and prev in " \t\n":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif c in "'\"" and prev in " \t\n[{,:-?":
            j = i + 1
            while j < n:  # to the closing quote ('' and \" are escapes)
                if c == '"' and text[j] == "\\":
                    j += 2
                    continue
                if text[j] == c:
                    if c == "'" and j + 1 < n and text[j + 1] == "'":
                        j += 2
                        continue
                    break
                if text[j] == "\n":
                    line, line_start = line + 1, j + 1
                j += 1
            i = j + 1
            prev = c
            continue
        prev = c
        i += 1


def _reader_position(exc: yaml.YAMLError, text: str) -> tuple[int, int]:
    """Line and column of a ReaderError (it carries a character offset, not a mark)."""
    pos = getattr(exc, "position", None)
    if not isinstance(pos, int):
        return 1, 1
    before = text[:pos]
    return before.count("\n") + 1, pos - (before.rfind("\n") + 1) + 1


class _Builder:
    """Builds plain data from the node graph once per node: aliases share the built value."""

    def __init__(self, loader: yaml.SafeLoader, out: Located):
        self.loader, self.out = loader, out
        self.done: dict[int, tuple[object, int, Path]] = {}  # id(node) -> (value, expanded node count, its path)
        self.active: set[int] = set()  # nodes being built (an alias to one of them refers to itself)
        self.nodes = 0

    def _count(self, n: int, node: yaml.Node) -> None:
        self.nodes += n
        if self.nodes > MAX_NODES:
            raise YamlSyntaxError(f"spec has more than {MAX_NODES} values (its aliases expanded)", *_mark(node))

    def build(self, node: yaml.Node, path: Path, depth: int) -> object:
        """The value of `node` at `path`; positions are recorded on first use of a node only."""
        key = id(node)
        if key in self.active:
            raise YamlSyntaxError("an alias refers to a node that contains it", *_mark(node))
        if key in self.done:  # an alias: reuse the value, count what it expands to
            value, size, built = self.done[key]
            self._count(size, node)
            self.out.aliases[path] = built
            return value
        if depth > MAX_DEPTH:
            raise YamlSyntaxError(f"YAML nested too deeply (limit {MAX_DEPTH})", *_mark(node))
        self.out.values[path] = _mark(node)
        start = self.nodes
        self._count(1, node)
        self.active.add(key)
        try:
            value = self._build(node, path, depth)
        finally:
            self.active.discard(key)
        self.done[key] = (value, self.nodes - start, path)
        return value

    def _build(self, node: yaml.Node, path: Path, depth: int) -> object:
        loader = self.loader
        if isinstance(node, yaml.MappingNode):
            if node.tag not in ("tag:yaml.org,2002:map", "tag:yaml.org,2002:omap"):
                raise YamlSyntaxError(f"unsupported tag {_one_line(node.tag)} on a mapping", *_mark(node))
            loader.flatten_mapping(node)  # merge keys (<<); ConstructorError on a bad one
            result: dict = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    raise YamlSyntaxError("a mapping key must be a plain value, not a list or mapping",
                                          *_mark(key_node))
                key = self._scalar(key_node)
                if key is None or not isinstance(key, (str, int, float, bool)):
                    raise YamlSyntaxError(f"a mapping key must be a name, not {_one_line(repr(key))}",
                                          *_mark(key_node))
                if type(key) is not str:  # `on:` read as True, `1.10:` as 1.1, `010:` as 8: a key is a name, as written
                    key = key_node.value
                child = path + (key,)
                if key in result:
                    self.out.duplicates.append(child)
                self.out.keys[child] = _mark(key_node)
                result[key] = self.build(value_node, child, depth + 1)
            return result
        if isinstance(node, yaml.SequenceNode):
            if node.tag != "tag:yaml.org,2002:seq":
                raise YamlSyntaxError(f"unsupported tag {_one_line(node.tag)} on a list", *_mark(node))
            return [self.build(item, path + (i,), depth + 1) for i, item in enumerate(node.value)]
        value = self._scalar(node)
        if type(value) is not str:  # `12.10` reads as 12.1, `010` as 8, `on` as True: the text is kept (Located.text)
            self.out.texts[path] = node.value
        return value

    def _scalar(self, node: yaml.Node) -> object:
        if node.tag == _STR_TAG and isinstance(node, yaml.ScalarNode):
            return node.value  # what SafeConstructor.construct_yaml_str returns, without its per-node bookkeeping
        try:
            return self.loader.construct_object(node, deep=True)
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            # e.g. an integer with more than 4300 digits, or `!!timestamp` on a word
            why = "number too long" if "digits" in str(exc) else f"not a valid {_one_line(node.tag)}"
            raise YamlSyntaxError(f"cannot read value: {why}", *_mark(node)) from None
