"""Render the per-host step scripts from the package data clusterctl/templates/provision/*.sh.j2.

Every `{{ value }}` is shell-quoted by clusterctl.quoting on output (the environment's `finalize`), so a
template cannot forget to quote; `Shell` marks text that is already a shell fragment.
"""

from __future__ import annotations

import jinja2

from ..quoting import join, quote

__all__ = ["Shell", "TEMPLATE_DIR", "render_step", "environment"]

TEMPLATE_DIR = "templates/provision"  # package data of clusterctl, read through importlib.resources


class Shell(str):
    """A string that is already valid shell (quoted by clusterctl.quoting); emitted verbatim."""


def _finalize(value):
    if isinstance(value, Shell):
        return value
    if value is None:
        raise ValueError("template rendered an undefined value (None)")
    if isinstance(value, bool):
        return "1" if value else "0"
    return quote(str(value))


def _qjoin(values) -> Shell:
    return Shell(join(str(v) for v in values))


_ENV: jinja2.Environment | None = None


def environment() -> jinja2.Environment:
    """The Jinja2 environment for provisioning templates (strict undefined, quoting finalize)."""
    global _ENV
    if _ENV is None:
        _ENV = jinja2.Environment(
            loader=jinja2.PackageLoader("clusterctl", TEMPLATE_DIR),
            undefined=jinja2.StrictUndefined,
            finalize=_finalize,
            autoescape=False,
            keep_trailing_newline=True,
            trim_blocks=True,
            lstrip_blocks=True,
            comment_start_string="{##",  # bash's ${#array[@]} must not open a Jinja comment
            comment_end_string="##}",
        )
        _ENV.filters["qjoin"] = _qjoin
    return _ENV


def render_step(template: str, context: dict) -> str:
    """Render one step script; raises ProvisionError-friendly jinja errors as ValueError."""
    try:
        return environment().get_template(template).render(**context)
    except jinja2.TemplateNotFound as exc:
        raise ValueError(f"provisioning template {exc.name} not found in clusterctl/{TEMPLATE_DIR}") from None
