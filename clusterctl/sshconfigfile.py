"""Which host names an OpenSSH client config can change, read from the config itself (no `ssh -G`).

`ssh -G NAME` costs a process (~10 ms of CPU) per name: 45 s for a 5,000-host spec. But which lines of a
config apply to a name is decided by its Host and Match lines alone, and most names of a big fleet meet
the same ones (`Host *`, or none at all). So the config is read once here, as ssh_config(5) and OpenSSH's
readconf.c read it (Host patterns with `*`, `?` and `!`; Match host/originalhost/user/localuser/all, negated or
not, their criteria ANDed left to right; Include, nested, globbed, relative to ~/.ssh or /etc/ssh, its files starting
in the including block's state and matching nothing under an inactive one; first obtained value wins),
and each name is given a *class*: the outcome of every Host and Match line for it. Names of one class get
the same option lines, so `ssh -G` is asked for one of them (and a second, to check) and the others
differ only in the host name, which is computed here (HostName with `%h`, lower-cased, as ssh does).

Whatever this reader does not model exactly is left to `ssh -G`, per name: `Match exec` and criteria it
does not know (tagged, localnetwork, version, ...) where a name reaches them (a criterion found false
before them decides the line); names with
upper-case or unusual characters; values with %-tokens other than HostName's `%h` in the options whose
`ssh -G` output would carry them expanded (User, ProxyJump, UserKnownHostsFile); CanonicalizeHostname
set for a name. For the whole config: `Match canonical`/`final`, %-tokens in Host patterns or Include
paths, a line it cannot split. clusterctl.sshconfig.resolve uses it and checks it against ssh.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
from dataclasses import dataclass, field

from .errors import ClusterctlError
from .files import NotAFile, TooLarge, read_limited

__all__ = ["ConfigModel", "read_config", "NameClass", "expand_tokens", "expand_path", "local_tokens", "match_pattern"]

MAX_INCLUDE_DEPTH = 16  # readconf.c's READCONF_MAX_DEPTH
CONFIG_LIMIT = 16 << 20  # an ssh config file (or one it includes) larger than 16 MiB is refused
# options whose first obtained value decides what `ssh -G` prints for a name (or whether we can know it)
_TRACKED = {"hostname", "user", "proxyjump", "userknownhostsfile", "canonicalizehostname"}
_SAFE_NAME = re.compile(r"[a-z0-9_.:-]+")  # names whose matching and lower-casing we reproduce exactly
_KEYWORD = re.compile(r"\s*([A-Za-z][A-Za-z0-9]*)(?:\s*=\s*|\s+|$)(.*)$", re.S)
_PATTERN_CACHE: dict[str, re.Pattern] = {}


class Dynamic(Exception):
    """The config has a form this reader does not reproduce: ask ssh (for the name, or for every name)."""


def _pattern(pat: str) -> re.Pattern:
    """OpenSSH's match_pattern: `*` any run, `?` one character, everything else literal."""
    found = _PATTERN_CACHE.get(pat)
    if found is None:
        found = _PATTERN_CACHE[pat] = re.compile(
            "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pat), re.S)
    return found


def match_pattern(name: str, pat: str) -> bool:
    """Whether `name` matches the one pattern `pat` as OpenSSH's match_pattern has it (case as given)."""
    if "*" not in pat and "?" not in pat:  # a plain name (most of a known_hosts file): no expression to build
        return name == pat
    return _pattern(pat).fullmatch(name) is not None


def _match_list(name: str, patterns: str) -> int:
    """OpenSSH's match_pattern_list over a comma-separated list: -1 a negated pattern matched, 1 a
    positive one did, 0 none."""
    got = 0
    for sub in patterns.split(","):
        if sub.startswith("!"):
            if match_pattern(name, sub[1:]):
                return -1
        elif match_pattern(name, sub):
            got = 1
    return got


def _split(text: str) -> list[str]:
    """A line's arguments as OpenSSH's argv_split takes them: whitespace-separated, "double" or 'single'
    quoted, backslash escapes, a `#` starting a word ends the line. Raises Dynamic on an unclosed quote."""
    args: list[str] = []
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n or text[i] == "#":
            break
        word, quote = [], None
        while i < n:
            c = text[i]
            if quote is None and c in " \t\r\n":
                break
            if c == "\\" and i + 1 < n and (quote is None or text[i + 1] in (quote, "\\")):
                word.append(text[i + 1])
                i += 2
                continue
            if quote is None and c in "\"'":
                quote = c
            elif c == quote:
                quote = None
            else:
                word.append(c)
            i += 1
        if quote is not None:
            raise Dynamic("unclosed quote")
        args.append("".join(word))
    return args


@dataclass
class _Cond:
    """A Host or Match line: its criteria, evaluated per name."""

    kind: str  # "host" | "match"
    args: list[str]
    where: str


@dataclass
class _Block:
    """One file's lines in order: conditions, tracked options and Includes (other lines never matter here)."""

    items: list = field(default_factory=list)  # ("cond", _Cond) | ("opt", keyword, value) | ("include", [_Block])


@dataclass(frozen=True)
class NameClass:
    """A name's class (names of one class get the same option lines) and the values it tells us."""

    key: tuple  # the outcome of every Host/Match line, in order, with the explicit user
    hostname: str  # what `ssh -G` prints as hostname
    dynamic: str | None = None  # why ssh must be asked for this very name (None: the class decides)


class ConfigModel:
    """The Host/Match structure of the files `ssh -G -F config` (or without -F) reads. `dynamic`: why
    every name must be asked of ssh (None when the model holds); `files`, `dirs`: what was read (files)
    and listed for Include globs (dirs), for cache stamps."""

    def __init__(self, config: str | None, home: str | None = None):
        self.home = home or _home()
        self.local_user = _local_user()
        self.files: list[str] = []
        self.dirs: list[str] = []
        self.dynamic: str | None = None
        self.roots: list[_Block] = []
        self.conditions = 0
        self.keywords: set[str] = set()  # every keyword the files use (lower-case)
        try:
            if config is not None:
                self.roots.append(self._read(os.path.expanduser(config), user=True, depth=0))
            else:  # ssh's default files: the user's, then the system's
                self.roots.append(self._read(os.path.join(self.home, ".ssh", "config"), user=True, depth=0))
                self.roots.append(self._read("/etc/ssh/ssh_config", user=False, depth=0))
        except Dynamic as exc:
            self.dynamic = str(exc)

    # ------------------------------------------------------------------ reading

    def _read(self, path: str, user: bool, depth: int) -> _Block:
        block = _Block()
        self.files.append(path)
        try:
            text = read_limited(path, CONFIG_LIMIT).decode("utf-8", errors="surrogateescape")
        except FileNotFoundError:
            return block
        except (TooLarge, NotAFile) as exc:  # `ssh -G` would wait on it, or read it forever
            raise ClusterctlError(f"ssh config {path}: {exc.strerror}") from None
        except OSError as exc:
            raise Dynamic(f"{path}: {exc.strerror}") from None
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            m = _KEYWORD.match(line)
            if m is None:
                raise Dynamic(f"{path}:{number}: cannot read the line")
            keyword, rest = m.group(1).lower(), m.group(2)
            self.keywords.add(keyword)
            where = f"{path}:{number}"
            if keyword in ("host", "match"):
                args = _split(rest)
                if keyword == "host" and any("%" in a for a in args):
                    raise Dynamic(f"{where}: a Host pattern with a token")
                if keyword == "match":
                    self._check_match(args, where)
                block.items.append(("cond", _Cond(keyword, args, where)))
                self.conditions += 1
            elif keyword == "include":
                if depth + 1 > MAX_INCLUDE_DEPTH:
                    raise Dynamic(f"{where}: Include nested too deep")
                included = []
                for arg in _split(rest):
                    if any(c in arg for c in "%$"):
                        raise Dynamic(f"{where}: an Include path with a token or variable")
                    arg = self._tilde(arg)
                    if not os.path.isabs(arg):
                        arg = os.path.join(os.path.join(self.home, ".ssh") if user else "/etc/ssh", arg)
                    if glob.has_magic(arg):
                        self.dirs.append(os.path.dirname(arg))
                    for found in sorted(glob.glob(arg)):
                        included.append(self._read(found, user, depth + 1))
                    if not glob.has_magic(arg) and not os.path.exists(arg):
                        self.files.append(arg)  # its appearing later changes the config
                block.items.append(("include", included))
            elif keyword in _TRACKED:
                args = _split(rest)
                block.items.append(("opt", keyword, " ".join(args)))
        return block

    def _tilde(self, path: str) -> str:
        if path == "~" or path.startswith("~/"):
            return self.home + path[1:]
        if path.startswith("~"):
            raise Dynamic("an Include path with ~user")
        return path

    @staticmethod
    def _check_match(args: list[str], where: str) -> None:
        for arg in args:
            if arg.lower() in ("canonical", "final"):
                raise Dynamic(f"{where}: Match {arg.lower()} (a second reading of the config)")
        if not args:
            raise Dynamic(f"{where}: Match without criteria")

    # ------------------------------------------------------------------ evaluating

    def classify(self, name: str, user: str | None) -> NameClass:
        """The class of `name` (as given to ssh) with the explicit `user` (-l), and its host name."""
        if self.dynamic is not None:
            return NameClass(("dynamic", name, user), "", self.dynamic)
        if not _SAFE_NAME.fullmatch(name):
            return NameClass(("dynamic", name, user), "", "a name this reader does not match as ssh does")
        state = _State(name, user, self.local_user)
        try:
            for root in self.roots:
                self._run(root, state, active=True, never=False)
            hostname = state.hostname_of()
            for keyword in ("user", "proxyjump", "userknownhostsfile"):
                if "%" in (state.opts.get(keyword) or ""):
                    raise Dynamic(f"{keyword} with a %-token")
            if (state.opts.get("canonicalizehostname") or "no").lower() not in ("no", "false"):
                raise Dynamic("CanonicalizeHostname")
        except Dynamic as exc:
            return NameClass(("dynamic", name, user), "", str(exc))
        return NameClass((tuple(state.outcomes), user), hostname)

    def _run(self, block: _Block, state: "_State", active: bool, never: bool) -> None:
        for item in block.items:
            kind = item[0]
            if kind == "cond":
                result = state.evaluate(item[1])
                state.outcomes.append(result)
                active = False if never else result
            elif kind == "opt":
                if active and item[1] not in state.opts:
                    state.opts[item[1]] = item[2]
            else:
                for inner in item[1]:
                    self._run(inner, state, active, never or not active)


class _State:
    """One name's evaluation: the options obtained so far and every condition's outcome."""

    def __init__(self, name: str, user: str | None, local_user: str):
        self.name, self.user, self.local_user = name, user, local_user
        self.opts: dict[str, str] = {}
        self.outcomes: list[bool] = []

    def hostname_of(self) -> str:
        """The host name as ssh has it at this point: HostName with %h expanded, else the name, lower-cased."""
        value = self.opts.get("hostname")
        if value is None:
            return self.name.lower()
        try:
            return expand_tokens(value, {"h": self.name}).lower()
        except KeyError:
            raise Dynamic("HostName with a token other than %h") from None

    def evaluate(self, cond: _Cond) -> bool:
        """A Host line: a pattern matched and no negated one; a Match line: every criterion, left to right."""
        if cond.kind == "host":
            matched = False
            for pat in cond.args:
                if pat.startswith("!"):
                    if match_pattern(self.name, pat[1:]):
                        return False
                elif match_pattern(self.name, pat):
                    matched = True
            return matched
        args, i = cond.args, 0
        while i < len(args):
            crit = args[i].lower()
            negate = crit.startswith("!")
            crit = crit[1:] if negate else crit
            if crit == "all" and not negate:
                i += 1
                continue
            if crit not in ("host", "originalhost", "user", "localuser"):
                raise Dynamic(f"{cond.where}: Match {args[i]}")  # exec, tagged, localnetwork, ...
            if i + 1 >= len(args):
                raise Dynamic(f"{cond.where}: Match {args[i]} without an argument")
            value = args[i + 1]
            if "%" in value:
                raise Dynamic(f"{cond.where}: a Match pattern with a token")
            if crit == "host":  # the HostName obtained so far (%h expanded), else the name; case-insensitive
                subject, value = self.hostname_of(), value.lower()
            elif crit == "originalhost":
                subject, value = self.name.lower(), value.lower()
            elif crit == "user":  # -l, else the User obtained so far, else the local user
                subject = self.user if self.user is not None else self.opts.get("user", self.local_user)
                if "%" in subject:
                    raise Dynamic("User with a %-token before a Match user")
            else:
                subject = self.local_user
            if (_match_list(subject, value) == 1) == negate:
                # false: nothing after it can make the line true, and readconf.c runs no exec after it
                return False
            i += 2
        return True


def expand_tokens(value: str, tokens: dict[str, str]) -> str:
    """`value` with ssh_config(5)'s `%X` tokens replaced by tokens[X] and `%%` by `%`; KeyError(X) for a token not
    in `tokens` (a lone `%` at the end: KeyError(''))."""
    out, i = [], 0
    while i < len(value):
        c = value[i]
        if c != "%":
            out.append(c)
            i += 1
            continue
        token = value[i + 1:i + 2]
        out.append("%" if token == "%" else tokens[token])
        i += 2
    return "".join(out)


def local_tokens() -> dict[str, str]:
    """The tokens ssh_config(5) takes from this machine: %d (home, the password database's), %i (uid), %u (user),
    %l (host name) and %L (up to its first dot)."""
    import socket

    here = socket.gethostname()
    return {"d": _home(), "i": str(os.getuid()), "u": _local_user(), "l": here, "L": here.split(".", 1)[0]}


def expand_path(value: str, tokens: dict[str, str]) -> str:
    """A file name of the ssh config (IdentityFile, CertificateFile) as ssh opens it: a leading `~` or `~user`
    first, then `${VAR}` and the %-tokens in one pass (percent_dollar_expand). KeyError(X) for a token not in
    `tokens`, LookupError for `${VAR}` unset or unclosed: ssh refuses both."""
    if value == "~" or value.startswith("~/"):
        value = _home() + value[1:]
    elif value.startswith("~"):
        value = os.path.expanduser(value)  # ~user: the password database's home
    out, at = [], 0
    while (i := value.find("${", at)) >= 0:
        close = value.find("}", i)
        if close < 0 or value[i + 2:close] not in os.environ:
            raise LookupError(value[i:close + 1] if close >= 0 else value[i:])
        out += [expand_tokens(value[at:i], tokens), os.environ[value[i + 2:close]]]
        at = close + 1
    return "".join([*out, expand_tokens(value[at:], tokens)])


def read_config(config: str | None) -> ConfigModel:
    """The Host/Match structure of `config` (None: ssh's default files; not "none")."""
    return ConfigModel(config)


def _home() -> str:
    """The home directory ssh uses for ~ and ~/.ssh: the password database's, not $HOME."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return os.path.expanduser("~")


def _local_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())
