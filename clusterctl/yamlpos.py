"""Load YAML while remembering where every key and value came from (for FILE:LINE:COL messages)."""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

__all__ = ["Located", "load_located", "YamlSyntaxError"]

Path = tuple  # a tuple of str keys / int indices


class YamlSyntaxError(Exception):
    """The text is not YAML; carries a 1-based line and column."""

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

    def position(self, path: Path) -> tuple[int, int]:
        """Best position for `path`: its key, else its value, else the nearest located parent."""
        path = tuple(path)
        while path:
            if path in self.keys:
                return self.keys[path]
            if path in self.values:
                return self.values[path]
            path = path[:-1]
        return self.values.get((), (1, 1))


# libyaml's parser when PyYAML was built with it: ~10x faster on a spec of 1,250 hosts, same nodes and
# marks. Bad YAML is parsed again by the pure-Python parser, whose messages say what it expected.
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _mark(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def load_located(text: str) -> Located:
    """Parse YAML `text` safely into data plus positions; raise YamlSyntaxError on bad YAML."""
    loader = _FAST_LOADER(text)
    try:
        try:
            root = loader.get_single_node()
        except yaml.YAMLError:
            if _FAST_LOADER is yaml.SafeLoader:
                raise
            loader.dispose()
            loader = yaml.SafeLoader(text)
            root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise YamlSyntaxError(f"YAML syntax error: {exc.problem or exc}", line, col) from None
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(f"YAML syntax error: {exc}", 1, 1) from None
    finally:
        loader.dispose()
    located = Located(data=None)
    if root is None:
        return located
    located.data = _build(loader, root, (), located)
    return located


def _build(loader, node: yaml.Node, path: Path, out: Located) -> object:
    out.values[path] = _mark(node)
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)
        result: dict = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)) or key is None:
                key = str(key)
            child = path + (key,)
            if key in result:
                out.duplicates.append(child)
            out.keys[child] = _mark(key_node)
            result[key] = _build(loader, value_node, child, out)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_build(loader, item, path + (i,), out) for i, item in enumerate(node.value)]
    return loader.construct_object(node, deep=True)
