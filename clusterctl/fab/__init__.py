"""The fab workflow for an installed clusterctl: `clusterctl-fab -H ip1,ip2 start` is `fab` with clusterctl's fabfile.

The fabfile is package data (`clusterctl/fab/fabfile.py`, the repository's top-level fabfile.py), so it
works from any directory without a checkout. Plain `fab` finds it too:
`fab --search-root "$(clusterctl-fab --where)" -H ip1,ip2 start`. A `-r/--search-root` or `-c/--collection`
given on the command line wins (your own fabfile).

`guard` makes the refusals of Fabric's program one `clusterctl: error:` line and exit 1, never a traceback
nor Invoke's own wording: clusterctl-fab's program has it from the start; plain `fab` (Fabric's own script: clusterctl
does not install over it, which an uninstall of clusterctl would remove) gets it when it imports clusterctl's fabfile,
for the steps after that import (the command line after the task names, a command line with no task, Fabric's
`-S`/`-f`/`-i` loading), not for its core flags, parsed before (`fab --connect-timeout abc` is Invoke's own error).
"""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
from importlib import resources

from ..errors import _clip

__all__ = ["fabfile_dir", "main", "guard", "guard_fab"]

PREFIX = "clusterctl: error: "


def fabfile_dir() -> str:
    """The installed directory that holds clusterctl's fabfile.py."""
    return str(resources.files(__package__))


def main(argv: list[str] | None = None) -> None:
    """Run Fabric's `fab` program with clusterctl's fabfile (unless the command line names another)."""
    args = list(sys.argv[1:] if argv is None else argv)
    from ..console import hold_std_fds, to_devnull, tolerate_encoding

    hold_std_fds()
    tolerate_encoding()
    if sys.stdout is None:  # started with `>&-`: `--list`, `--where` and `--help` printed nothing and exited 0
        if sys.stderr is not None:
            sys.stderr.write(f"{PREFIX}standard output is closed\n")
        sys.exit(1)
    args = _task_help_first(args)
    twice = _given_twice(args)
    if twice:  # Invoke took the second one's value for a task name: "no task 'b'"
        sys.stderr.write(f"{PREFIX}{twice} given twice: give it once ({'-H a,b' if twice == '-H' else twice + ' X'})\n")
        sys.exit(1)
    try:
        if args[:1] == ["--where"]:
            if args[1:]:  # `--where extra`: the rest was dropped without a word
                sys.stderr.write(f"{PREFIX}--where takes nothing after it, not {_clip(' '.join(args[1:]), 80)!r}: "
                                 "clusterctl-fab --where\n")
                sys.exit(1)
            print(fabfile_dir(), flush=True)
            return
        _program().run(["fab", *args])
    except BrokenPipeError:  # `clusterctl-fab --list | head`: our reader went away, as clusterctl's write_text says
        to_devnull(sys.stdout)
    except OSError as exc:  # `--list`, `--help` (Invoke's own print) to a full disk or a device that fails: one line
        if exc.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG):
            raise
        to_devnull(sys.stdout)  # what is left in stdout's buffer goes nowhere at exit
        sys.stderr.write(f"{PREFIX}cannot write the output: {exc.strerror or exc}\n")
        sys.exit(1)


def _task_help_first(args: list[str]) -> list[str]:
    """`exec --help` (or `-h`) as `--help exec`: Invoke took the flag for exec's command and ran `--help` on every
    host; every other task's `--help` after its name is already its help. `exec --cmd --help` and a `--help` after
    `--` are left as written."""
    end = args.index("--") if "--" in args else len(args)
    for i in range(1, end):
        if args[i] in ("-h", "--help") and args[i - 1] == "exec":
            return [*args[:i - 1], "--help", "exec", *args[i + 1:]]
    return args


_ONCE = {"-H": "-H", "--hosts": "-H", "--spec": "--spec", "-S": "-S", "--ssh-config": "-S"}  # core options, one value


def _given_twice(args: list[str]) -> str | None:
    """The core option (of _ONCE) given twice before `--`, if any."""
    seen = set()
    for arg in args[:args.index("--")] if "--" in args else args:
        name = _ONCE.get(arg.split("=", 1)[0] if arg.startswith("--") else arg)
        if name is not None:
            if name in seen:
                return name
            seen.add(name)
    return None


def _program():
    """Fabric's `fab` program, plus a `--spec FILE` before the task names (`clusterctl-fab --spec cluster.yaml
    provision`, as a task's own `--spec` after its name), with guard()'s one-line refusals."""
    from fabric import Config, Executor, __version__
    from fabric.main import Fab
    from invoke import Argument, Program

    class ClusterFab(Fab):
        def core_args(self):
            return [*super().core_args(), Argument(names=("spec",), help="a cluster spec (YAML) for every task")]

        def parse_core_args(self):
            """clusterctl's fabfile unless the core options name another (`-r`/`--search-root`, `-c`/`--collection`),
            as Fabric's own parser reads them: a task's `-c` or `-r`, or one after `--`, is the task's."""
            super().parse_core_args()
            if self.args["search-root"].value is None and self.args["collection"].value is None:
                self.args["search-root"].value = fabfile_dir()

        def no_tasks_given(self):
            """`-- ` with no command after it (or only blanks): refused, as `clusterctl exec` refuses it (Fabric
            printed its help, exit 0, and ran nothing)."""
            from invoke import Exit

            argv = list(getattr(self, "argv", None) or [])
            if "--" in argv and not self.core.remainder.strip() and not self.core.unparsed:
                raise Exit(PREFIX + "no command after --: give one (clusterctl-fab -H HOST -- uptime)", code=1)
            super().no_tasks_given()

        def load_collection(self):
            """The fabfile and its fabric.yaml also for a lone `-- command` (Fabric skips both then), so that
            clusterctl's executor runs it over clusterctl's connections, host keys checked."""
            Program.load_collection(self)

    guard(ClusterFab)
    return ClusterFab(name="Fabric", version=__version__, executor_class=Executor, config_class=Config)


# ------------------------------------------------------------------------- one-line refusals


def guard_fab() -> None:
    """guard() Fabric's own `fab` program (called when clusterctl's fabfile is imported); nothing if this
    Fabric has no `fabric.main.Fab`."""
    try:
        from fabric.main import Fab
    except ImportError:
        return
    guard(Fab)


def guard(program_class) -> None:
    """Wrap the steps of `program_class` (Fabric's Fab or a subclass) that refuse bad input so that each refusal
    is one `clusterctl: error:` line and exit 1. Idempotent; a step the class lacks is left alone."""
    for name, kwargs in _STEPS.items():
        step = getattr(program_class, name, None)
        if callable(step) and not getattr(step, "_clusterctl_guard", False):
            setattr(program_class, name, _one_line(step, **kwargs))


def _one_line(step, *, numbers=False, checks=False, loading=False, task_needed=False):
    """`step` with its refusals as one line (_refusal); `checks`: then the core flags' values are checked;
    `task_needed`: first a command line with words but no task is refused (_no_task)."""

    @functools.wraps(step)
    def guarded(self, *args, **kwargs):
        from invoke import Exit

        if task_needed:
            _no_task(self)
        try:
            result = step(self, *args, **kwargs)
        except Exception as exc:
            said = _refusal(self, exc, numbers=numbers, loading=loading)
            if said is None:
                raise
            raise Exit(PREFIX + said, code=exc.code if isinstance(exc, Exit) else 1) from None
        if checks:
            _check_core(self)
        return result

    guarded._clusterctl_guard = True
    return guarded


def _refusal(program, exc, *, numbers: bool, loading: bool) -> str | None:
    """The line for `exc`, raised by a step of `program`; None to let it through. Invoke's ParseError (a flag
    with no value, an unknown word) and an Exit message of its own; `numbers`: a word given for a number
    (Invoke's int(), a traceback otherwise); `loading`: an error reading the `-S` or `-f` file."""
    from invoke import Exit, ParseError

    if isinstance(exc, ParseError):
        return _parse_error(exc)
    if isinstance(exc, Exit):  # --help, --list (no message), or already one of ours: as it is
        return _exit_message(program, exc) if exc.message and exc.code and not exc.message.startswith(PREFIX) \
            else None
    if numbers and isinstance(exc, ValueError):
        return _not_a_number(getattr(program, "argv", None) or [], exc)
    return _loading_error(program, exc) if loading else None


def _no_task(program) -> None:
    """Refuse a command line that gave words but no task (`fab -H h1,h2`: Fabric printed its help and exited 0, as
    if something had run). `fab` alone keeps Fabric's help; a `--` is no_tasks_given's (a command, or none)."""
    from invoke import Exit

    argv = list(getattr(program, "argv", None) or [])
    if argv[1:] and "--" not in argv:
        raise Exit(f"{PREFIX}no task given after {_clip(' '.join(argv[1:]), 80)!r}: name one (--list shows them)",
                   code=1)


def _not_a_number(argv: list[str], exc: ValueError) -> str:
    """The line for a word Invoke's int() refused, naming the flag it was given to (Invoke's error does not)."""
    # Python's message holds the word's repr cut at 200 characters (no closing quote then): the word is the value
    # that starts so, clipped as said
    import ast

    found = re.fullmatch(r"invalid literal for int\(\) with base \d+: (['\"])(.*)", str(exc), re.S)
    if found is None:
        return f"a whole number was expected: {_clip(str(exc), 200)}"
    quoted = found.group(1) + found.group(2)
    try:
        word, whole = ast.literal_eval(quoted), True
    except (ValueError, SyntaxError):  # cut short: its characters up to the cut (an escape in them: not found)
        word, whole = found.group(2), False

    def given(value: str) -> bool:
        return value == word if whole else value.startswith(word)

    for before, arg in zip(argv, argv[1:]):
        if given(arg) and before.startswith("-"):
            return f"{before}: a whole number was expected, got {_clip(arg, 80)!r}"
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if eq and given(value) and flag.startswith("-"):
            return f"{flag}: a whole number was expected, got {_clip(value, 80)!r}"
    return f"a whole number was expected, got {_clip(word, 80)!r}"


# the program's steps, in Program.run's order: Fabric's core flags; the fabfile (clusterctl's is imported here);
# the task names and their flags (a core flag may come after them); --help TASK, --list; -f, -S, -i loaded
_STEPS = {
    "parse_core": {"numbers": True, "checks": True},
    "parse_collection": {},
    "parse_tasks": {"numbers": True, "checks": True},
    "parse_cleanup": {},
    "no_tasks_given": {"task_needed": True},  # called by parse_cleanup: words but no task (a forgotten task name)
    "update_config": {"loading": True},
    "create_config": {"loading": True},  # Invoke's look for ~/.fabric.* and /etc/fabric.*
}

_NEEDS_VALUE = re.compile(r"Flag <\w+: ([\w-]+)(?: \(([\w, -]+)\))?[^>]*> needed value and was not given one!")
_UNKNOWN = re.compile(r"No idea what (.*) is!")
_MISSING = re.compile(r"'(.+)' did not receive required positional arguments: (.+)")
_QUOTED = re.compile(r"'([^']*)'")


def _flags(names: list[str]) -> str:
    """Invoke's argument names as flags, short first: ['search-root', 'r'] -> '-r/--search-root' (several
    arguments' names, as for a task missing two, read the same way: '--a/--b')."""
    flags = [f"-{n}" if len(n) == 1 else f"--{n.replace('_', '-')}" for n in names]
    return "/".join(sorted(flags, key=len))


def _parse_error(exc) -> str:
    """Invoke's parse error in clusterctl's words (its own text for one not known here)."""
    text = str(exc)
    task = getattr(exc.context, "name", None)
    if match := _NEEDS_VALUE.fullmatch(text):
        names = [match[1], *(match[2].split(", ") if match[2] else [])]
        return f"{_flags(names)} needs a value"
    if match := _MISSING.fullmatch(text):
        return f"{match[1]} needs {_flags(_QUOTED.findall(match[2]))}"
    if match := _UNKNOWN.fullmatch(text):
        word = match[1]
        if word.strip("'\"").startswith("-"):
            return f"{task} has no option {word}" if task else f"no option {word}"
        return f"no task {word} (see --list)"
    return text


def _exit_message(program, exc) -> str:
    """An Exit message of Invoke's in clusterctl's words: a fabfile not found names where it was looked for."""
    from invoke.exceptions import CollectionNotFound

    missing = exc.__context__
    if isinstance(missing, CollectionNotFound):
        where = program.args["search-root"].value or os.getcwd()
        return f"no {missing.name!r} collection ({missing.name}.py) in {where} or a directory above it"
    return exc.message


# the core flags that name a file or directory: what an empty value is refused for
_NAMING = {"search-root": ("-r", "a directory holding a fabfile.py"), "collection": ("-c", "a collection name"),
           "config": ("-f", "a config file"), "ssh-config": ("-S", "an ssh config file"),
           "identity": ("-i", "a key file")}


def _check_core(program) -> None:
    """Refuse a core flag's value that Fabric or Invoke would drop without a word: an empty file name (`-i ''`:
    no key; `-r ''`: the current directory), `-i` with no value at the end (no key), a `-f` file that is not there
    (skipped), `--connect-timeout 0` or `-T 0` (no timeout); and Fabric's password prompts (a prompt, then a password no
    clusterctl task uses: they never take one)."""
    from invoke import Exit

    if sys.stdout is None:  # plain `fab --list >&-` (clusterctl-fab says it in main): the list went nowhere, exit 0
        raise Exit(f"{PREFIX}standard output is closed", code=1)
    args = program.args
    for name, (flag, what) in _NAMING.items():
        value = args[name].value if name in args else None
        for given in value if isinstance(value, list) else [value]:
            if isinstance(given, str) and not given.strip():
                raise Exit(f"{PREFIX}{flag} {given!r} names nothing: give {what}, or leave the option out", code=1)
    hosts = args["hosts"].value if "hosts" in args else None
    names = [h.strip() for h in hosts.split(",")] if isinstance(hosts, str) else []
    if any(names) and not all(names):
        # `-H "$A,$B"` with B unset ran on A alone (`-H ""` names nothing: said above, or by the task)
        raise Exit(f"{PREFIX}-H {hosts!r} has an empty host name: give -H host1,host2", code=1)
    argv = list(getattr(program, "argv", None) or [])
    words = argv[:argv.index("--")] if "--" in argv else argv
    if words[-1:] in (["-i"], ["--identity"]) and "identity" in args and not args["identity"].value:
        raise Exit(f"{PREFIX}{words[-1]} needs a value: give a key file, or leave the option out", code=1)
    for name in _PROMPTS:
        if name in args and args[name].value:
            raise Exit(f"{PREFIX}--{name}: clusterctl never takes a password: use a key (-i, your ssh config or the "
                       "ssh-agent), and passwordless (NOPASSWD) sudo on the hosts", code=1)
    runtime = args["config"].value if "config" in args else None
    if runtime and not os.path.isfile(runtime):
        said = "not a file" if os.path.exists(runtime) else "no such file"
        raise Exit(f"{PREFIX}-f {runtime}: {said}", code=1)
    if runtime:
        said = _runtime_config_problem(runtime)
        if said:  # also for --list, which exits before Invoke loads the file (a list in it passed)
            raise Exit(f"{PREFIX}-f {runtime}: {said}", code=1)
    root = args["search-root"].value if "search-root" in args else None
    if root and os.path.exists(root) and not os.path.isdir(root):  # Invoke's NotADirectoryError traceback (a file,
        # /dev/null, a FIFO); one that is not there is Invoke's "no fabfile" (_exit_message)
        raise Exit(f"{PREFIX}-r {root}: not a directory: give a directory holding a fabfile.py", code=1)
    shown = args["list-format"].value if "list-format" in args else None
    formats = [f for f in _LIST_FORMATS if callable(getattr(program, f"list_{f}", None))]
    if shown is not None and shown not in formats:  # Invoke's AttributeError ('list_bogus') traceback
        raise Exit(f"{PREFIX}-F/--list-format {_clip(shown, 80)!r}: give {', '.join(formats[:-1])} or {formats[-1]}",
                   code=1)
    for name, flag in (("connect-timeout", "--connect-timeout"), ("command-timeout", "-T/--command-timeout")):
        timeout = args[name].value if name in args else None
        if timeout is not None and timeout <= 0:  # Fabric reads 0 as no limit at all
            raise Exit(f"{PREFIX}{flag} must be more than 0 seconds, not {timeout}", code=1)


_LIST_FORMATS = ("flat", "nested", "json")  # Invoke's list_flat, list_nested, list_json

# a `-f` config file larger than this is refused before it is parsed (as a spec is: a 20 MB one took 26 s)
RUNTIME_CONFIG_LIMIT = 1 << 20


def _runtime_config_problem(path: str) -> str | None:
    """What is wrong with the `-f` config file `path` (a file), or None: too large, or YAML or JSON that is not a
    mapping (`- a`: Invoke's AttributeError traceback while it merges it). A .py file is Python, run by Invoke
    (its errors: _loading_error); any other suffix is said by Invoke's own check."""
    import json

    from ..files import read_limited

    try:
        data = read_limited(path, RUNTIME_CONFIG_LIMIT)
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".yaml", ".yml", ".json"):
        return None
    from invoke.util import yaml  # Invoke's copy, as it loads the file

    try:
        loaded = json.loads(data) if suffix == ".json" else yaml.safe_load(data)
    except (ValueError, yaml.YAMLError) as exc:  # a JSON error, a YAML error (spans lines), bytes not UTF-8
        return f"cannot read it: {_clip(' '.join(str(exc).split()), 300)}"
    if loaded is not None and not isinstance(loaded, dict):
        return f"holds {_kind(loaded)}, not a mapping of Fabric's settings (key: value)"
    return None


def _kind(value) -> str:
    """`value`'s kind as a config file's reader says it: 'a list', 'a number', 'a string'."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


# Fabric's flags that ask for a password on the terminal before any task runs
_PROMPTS = ("prompt-for-login-password", "prompt-for-passphrase", "prompt-for-sudo-password")


def _loading_error(program, exc) -> str | None:
    """The line for an error of Fabric loading the `-S` ssh config (or your own, without -S) or Invoke loading
    the `-f` config file; None for any other error."""
    from invoke.exceptions import UnknownFileType
    from invoke.util import yaml  # Invoke's vendored copy, if it has one: its errors are not PyYAML's
    from paramiko.ssh_exception import ConfigParseError

    home = os.path.expanduser("~")
    if isinstance(exc, OSError) and exc.filename and os.path.dirname(str(exc.filename)) in (home, "/etc"):
        # Invoke reads ~/.fabric.* and /etc/fabric.*: a HOME that is a file (HOME=/dev/null) fails the lookup itself
        return f"cannot look for Fabric's config file {exc.filename}: {exc.strerror} (HOME={home})"
    ssh = getattr(program.config, "_runtime_ssh_path", None)
    runtime = _core_value(program, "config")
    if isinstance(exc, OSError) and ssh is not None and exc.filename in (ssh, os.path.expanduser(ssh)):
        return f"ssh config {ssh}: no such file" if isinstance(exc, FileNotFoundError) else \
            f"ssh config {ssh}: {exc.strerror}"
    if isinstance(exc, ConfigParseError):  # it quotes the line, which may be megabytes long
        return f"ssh config {ssh or '~/.ssh/config or /etc/ssh/ssh_config'}: {_clip(str(exc), 300)}"
    if isinstance(exc, UnicodeDecodeError):  # paramiko reads the ssh config as UTF-8 (-S, else ~/.ssh/config)
        said = _not_utf8(program, ssh)
        if said:
            return said
    if runtime and isinstance(exc, UnknownFileType):
        return f"-f {runtime}: not a .yaml, .yml, .json or .py file"
    if runtime and runtime.endswith(".py") and not isinstance(exc, OSError):
        said = _python_config_error(runtime, exc)  # your own code, run by Invoke: its line, not a traceback
        if said:
            return said
    if isinstance(exc, AttributeError):  # Invoke merged a config file that holds no mapping (`- a`)
        said = _not_a_mapping(program.config)
        if said:
            return said
    if runtime and isinstance(exc, (OSError, ValueError, yaml.YAMLError)):  # a YAML error spans lines
        return f"-f {runtime}: cannot read it: {_clip(' '.join(str(exc).split()), 300)}"
    return None


def _core_value(program, name: str):
    """The value of the core flag `name`; None before the core flags are parsed (Invoke reads ~/.fabric.yaml
    first: `program.args` is an AttributeError then)."""
    core = getattr(program, "core", None)
    args = core[0].args if core else None
    return args[name].value if args is not None and name in args else None


def _not_utf8(program, ssh: str | None) -> str | None:
    """The line for an ssh config Fabric could not read as UTF-8: the file (-S, else the first of ~/.ssh/config and
    /etc/ssh/ssh_config that is not UTF-8), the line and the byte; None if none of them is found so."""
    from ..files import read_limited
    from ..sshconfigfile import CONFIG_LIMIT

    for path in [ssh] if ssh else [os.path.expanduser("~/.ssh/config"), "/etc/ssh/ssh_config"]:
        try:
            data = read_limited(os.path.expanduser(path), CONFIG_LIMIT)
            data.decode("utf-8")
        except UnicodeDecodeError as bad:
            line = data.count(b"\n", 0, bad.start) + 1
            return f"ssh config {path}: line {line}: not UTF-8 text (byte {data[bad.start]:#04x})"
        except OSError:
            continue
    return None


def _python_config_error(path: str, exc: BaseException) -> str | None:
    """The line for a `-f` Python config file that failed as Python: FILE:LINE: the error; None when the error
    did not come from that file."""
    from invoke.exceptions import UnpicklableConfigMember

    if isinstance(exc, UnpicklableConfigMember):
        return f"-f {path}: {_clip(str(exc), 300)}"
    mine = os.path.realpath(path)
    line = None
    if isinstance(exc, SyntaxError) and exc.filename and os.path.realpath(exc.filename) == mine:
        line, what = exc.lineno, f"{type(exc).__name__}: {exc.msg}"
    else:
        tb = exc.__traceback__
        while tb is not None:  # the innermost frame of the file: where it raised, or called what raised
            if os.path.realpath(tb.tb_frame.f_code.co_filename) == mine:
                line = tb.tb_lineno
            tb = tb.tb_next
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if line is None:
            return None
    return f"-f {path}:{line or 1}: {_clip(' '.join(what.split()), 300)}"


def _not_a_mapping(config) -> str | None:
    """The line for a config file of Fabric's that Invoke loaded but that holds no mapping (a list, a number):
    -f's, the project's fabric.yaml, ~/.fabric.yaml or /etc/fabric.yaml; None if all of them are mappings."""
    for level in ("runtime", "project", "user", "system"):
        data, path = getattr(config, f"_{level}", None), getattr(config, f"_{level}_path", None)
        if path and data is not None and not isinstance(data, dict):
            where = f"-f {path}" if level == "runtime" else f"Fabric's config file {path}"
            return f"{where}: holds {_kind(data)}, not a mapping of Fabric's settings (key: value)"
    return None
