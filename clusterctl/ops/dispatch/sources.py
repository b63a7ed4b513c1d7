"""What dispatch reads on the controller besides the plan: the workspace directory and its excludes, the
data directory and where its shards go. From the loaded spec when there is one, else from the plan
cache's entry of the spec file (clusterctl.plancache.spec_facts), so that `clusterctl dispatch` on a
cached plan loads no spec models (pydantic, ~0.1 s of its start-up)."""

from __future__ import annotations

from dataclasses import dataclass

from ..session import Session

__all__ = ["Sources", "sources_of"]


@dataclass(frozen=True)
class Sources:
    """The controller's side of a dispatch: absolute paths, as the spec resolves them."""

    workspace: str
    exclude: tuple[str, ...]
    data_local: str | None = None  # None: the spec has no data section
    data_remote: str = "data"

    @classmethod
    def of_facts(cls, facts: dict) -> "Sources":
        """From clusterctl.plancache.spec_facts()."""
        data = facts["data"]
        return cls(facts["workspace"], tuple(facts["exclude"]), None if data is None else data["local"],
                   "data" if data is None else data["remote"])


def sources_of(session: Session) -> Sources:
    """The session's sources: its loaded spec's, else its spec file's cache entry's, else its spec's."""
    from ... import plancache

    if not session.spec_loaded and session.spec_path is not None:
        found = plancache.facts(session.spec_path)
        if found is not None:
            return Sources.of_facts(found)
    return Sources.of_facts(plancache.spec_facts(session.spec))
