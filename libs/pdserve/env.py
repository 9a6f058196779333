"""Every ``PDSERVE_*`` environment variable and every service flag, each declared once.

A service setting is one dataclass field of the service's config::

    @dataclass(frozen=True)
    class RouterConfig(ServiceConfig):
        SERVICE = "router"
        block_size: int = setting(16, BLOCK_SIZE, "tokens per KV block (as the engines)")

From that line come the ``--block-size`` flag and its ``--help`` text, its environment twin
``PDSERVE_ROUTER_BLOCK_SIZE``, its line in ``pdserve env``, and the check that runs whenever
the config is built, from flags or in code. A flag given on the command line wins over its
variable, which wins over the default. A config's ``__post_init__`` holds only the checks that
involve several fields. The variables every process reads (``COMMON_VARS``) are declared
below; nothing else reads ``os.environ`` for configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, TypeVar

C = TypeVar("C", bound="ServiceConfig")


class ConfigError(ValueError):
    """A setting with a value it does not accept; the message names the flag."""


@dataclass(frozen=True)
class Kind:
    """How to read one value from text, how to check (and normalize) a value, and what to say
    when it is wrong. ``check`` raises ValueError; ``parse`` is ``check(convert(text))``."""

    convert: Callable[[str], Any]
    check: Callable[[Any], Any]
    accepted: str

    def parse(self, text: str) -> Any:
        return self.check(self.convert(text))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_kind(lo: int, hi: int | None = None) -> Kind:
    def check(value: Any) -> int:
        if not _is_int(value) or value < lo or (hi is not None and value > hi):
            raise ValueError(value)
        return int(value)

    return Kind(int, check, f"an integer >= {lo}" if hi is None else f"an integer {lo}..{hi}")


def float_kind(lo: float = 0.0) -> Kind:
    def check(value: Any) -> float:
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value) \
                or value < lo:
            raise ValueError(value)
        return float(value)

    return Kind(float, check, f"a number >= {lo:g}")


def choice_kind(*choices: str) -> Kind:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(value)
        return str(value)

    return Kind(str, check, ", ".join(choices))


def _text_kind(ok: Callable[[str], bool], accepted: str) -> Kind:
    def check(value: Any) -> str:
        if not isinstance(value, str) or not ok(value):
            raise ValueError(value)
        return value

    return Kind(str, check, accepted)


def _list_kind(item: Kind) -> Kind:
    def convert(text: str) -> tuple[str, ...]:
        return tuple(part.strip() for part in text.split(",") if part.strip())

    def check(value: Any) -> tuple[Any, ...]:
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ValueError(value)
        return tuple(item.check(v) for v in value)

    return Kind(convert, check, f"a comma-separated list of {item.accepted}")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _check_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(value)
    return value


def is_host_port(text: str) -> bool:
    """``host:port`` with a port in 1..65535 (the form of every address flag)."""
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


STR = _text_kind(lambda _: True, "any text")
NAME = _text_kind(bool, "a non-empty text")
TOKEN = _text_kind(lambda s: bool(s) and not any(c.isspace() for c in s),
                   "a non-empty text without spaces")
BOOL = Kind(_parse_bool, _check_bool, "true, false, 1, 0, yes, no, on, off")
PORT = int_kind(0, 65535)
ADDRESS = _text_kind(is_host_port, "host:port")
EMBEDDED = "embedded"  # a peer run inside this process instead of at an address
ADDRESS_OR_EMBEDDED = _text_kind(lambda s: s == EMBEDDED or is_host_port(s),
                                 f"host:port, or {EMBEDDED}")
OPTIONAL_ADDRESS = _text_kind(lambda s: not s or is_host_port(s), "host:port, or empty")
ADDRESSES = _list_kind(ADDRESS)
TOKENS = _list_kind(TOKEN)
REDIS_URL = _text_kind(lambda s: not s or s.startswith(("redis://", "rediss://", "unix://")),
                       "a redis://, rediss:// or unix:// URL, or empty")
BLOCK_SIZE = int_kind(1, 1024)
LOG_FORMAT = choice_kind("text", "json")
LOG_LEVEL = choice_kind("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Setting:
    """What a config field declares besides its default: how to read it, and its help."""

    kind: Kind
    help: str
    env: str = ""  # "" = PDSERVE_<SERVICE>_<FIELD>; a shared variable (REDIS_URL) names itself
    aliases: tuple[str, ...] = ()  # further variables accepted, in order after ``env``


def setting(default: Any, kind: Kind, help: str, env: str = "",
            aliases: tuple[str, ...] = ()) -> Any:
    """A config field declared once: default, kind, help and (optionally) its variable."""
    return dataclasses.field(default=default,
                             metadata={"setting": Setting(kind, help, env, aliases)})


def port_setting(default: int, what: str = "gRPC") -> Any:
    return setting(default, PORT, f"{what} port; 0 picks a free one")


def redis_url_setting() -> Any:
    return setting("", REDIS_URL, "Redis URL of the prefix index and registry; empty = none",
                   env=REDIS_URL_VAR, aliases=("PDSERVE_REDIS_URL",))


@dataclass(frozen=True)
class Flag:
    """One declared setting as the command line and the environment see it."""

    name: str  # "max-queued" (no dashes in front)
    dest: str  # "max_queued", the config field
    default: Any
    setting: Setting
    env: str

    @property
    def variables(self) -> tuple[str, ...]:
        return (self.env, *self.setting.aliases)


@dataclass(frozen=True)
class ServiceConfig:
    """Base of every service's frozen config: its fields are its settings (see the module
    docstring); building one checks every field against its kind, naming the flag."""

    SERVICE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in flags_of(type(self)):
            value = getattr(self, f.dest)
            try:
                object.__setattr__(self, f.dest, f.setting.kind.check(value))
            except ValueError:
                raise ConfigError(f"--{f.name}: invalid value {value!r} "
                                  f"(accepted: {f.setting.kind.accepted})") from None

    @classmethod
    def from_argv(cls: type[C], argv: Sequence[str] | None = None,
                  environ: Mapping[str, str] | None = None) -> C:
        """Flags, then ``PDSERVE_*`` variables, then defaults; exit 2 with one line on a value
        its kind refuses (a ConfigError from a cross-field check is the caller's to report)."""
        return cls(**parse_flags(cls, argv, environ))


def flags_of(cls: type[ServiceConfig]) -> list[Flag]:
    prefix = f"PDSERVE_{cls.SERVICE.upper()}_"
    out = []
    for field in dataclasses.fields(cls):
        declared: Setting | None = field.metadata.get("setting")
        if declared is not None:
            out.append(Flag(field.name.replace("_", "-"), field.name, field.default, declared,
                            declared.env or prefix + field.name.upper()))
    return out


# Variables every process reads, whatever its service.
LOG_FORMAT_VAR = "PDSERVE_LOG_FORMAT"
LOG_LEVEL_VAR = "PDSERVE_LOG_LEVEL"
OTEL_ENDPOINT_VAR = "PDSERVE_OTEL_ENDPOINT"  # OTLP/gRPC collector; unset = traces stay local
PROFILE_DIR_VAR = "PDSERVE_PROFILE_DIR"  # write a cProfile file per process here on exit
UP_VERBOSE_VAR = "PDSERVE_UP_VERBOSE"  # pdserve up: pass every service's log lines through
KERNEL_CACHE_VAR = "PDSERVE_KERNEL_CACHE"  # where the native CPU kernels are built and found
REDIS_URL_VAR = "REDIS_URL"  # the services' --redis-url; pdserve up uses it instead of its own
# Credentials (pdserve.auth), each also from a file named by <name>_FILE; never flags.
SECRET_VAR = "PDSERVE_SECRET"  # the data planes: router <-> engines <-> kvds
ADMIN_SECRET_VAR = "PDSERVE_ADMIN_SECRET"  # Engine.Drain / SetRole / Abort
CLIENT_SECRET_VAR = "PDSERVE_CLIENT_SECRET"  # callers of the router (gateway, gRPC clients)
CACHE_SALT_SECRET_VAR = "PDSERVE_CACHE_SALT_SECRET"  # the gateway's key for tenants' cache salts
SECRET_VARS = (SECRET_VAR, ADMIN_SECRET_VAR, CLIENT_SECRET_VAR, CACHE_SALT_SECRET_VAR)

COMMON_VARS: dict[str, Kind] = {
    LOG_FORMAT_VAR: LOG_FORMAT,
    LOG_LEVEL_VAR: LOG_LEVEL,
    OTEL_ENDPOINT_VAR: STR,
    PROFILE_DIR_VAR: STR,
    UP_VERBOSE_VAR: BOOL,
    KERNEL_CACHE_VAR: STR,
    **{name: STR for var in SECRET_VARS for name in (var, f"{var}_FILE")},
}


def env_vars(configs: Sequence[type[ServiceConfig]]) -> dict[str, str]:
    """Every variable pdserve reads, with what it accepts (``pdserve env`` prints this)."""
    out = {name: kind.accepted for name, kind in COMMON_VARS.items()}
    for cls in configs:
        for f in flags_of(cls):
            for name in f.variables:
                out.setdefault(name, f.setting.kind.accepted)
    return out


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(prog: str, message: str) -> NoReturn:
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)


def parse_flags(cls: type[ServiceConfig], argv: Sequence[str] | None = None,
                environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Parse ``argv`` and the environment for ``cls``; exit 2 with one line on a bad value."""
    environ = os.environ if environ is None else environ
    prog = f"pdserve {cls.SERVICE}"
    flags = flags_of(cls)
    parser = _OneLineParser(prog=prog, description=f"pdserve {cls.SERVICE} service")
    for f in flags:
        parser.add_argument(f"--{f.name}", dest=f.dest, default=None, metavar=f.dest.upper(),
                            help=f"{f.setting.help} [env {f.env}; default {f.default!r}]")
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    for f in flags:
        raw, origin = args[f.dest], f"--{f.name}"
        if raw is None:
            origin = next((name for name in f.variables if name in environ), "")
            raw = environ.get(origin)
        if raw is None:
            continue  # the dataclass default
        try:
            values[f.dest] = f.setting.kind.parse(raw)
        except ValueError:
            _fail(prog, f"{origin}: invalid value {raw!r} (accepted: {f.setting.kind.accepted})")
    check_common_env(prog, environ)
    return values


def check_common_env(prog: str, environ: Mapping[str, str]) -> None:
    for name, kind in COMMON_VARS.items():
        raw = environ.get(name)
        if raw is not None:
            try:
                kind.parse(raw)
            except ValueError:
                _fail(prog, f"{name}: invalid value {raw!r} (accepted: {kind.accepted})")


def common(name: str, default: str, environ: Mapping[str, str] | None = None) -> str:
    """One of ``COMMON_VARS`` (checked at startup by ``check_common_env``)."""
    assert name in COMMON_VARS, name
    return (os.environ if environ is None else environ).get(name, default)


def log_format() -> str:
    return common(LOG_FORMAT_VAR, "text")


def log_level() -> str:
    return common(LOG_LEVEL_VAR, "info")


def otel_endpoint() -> str:
    return common(OTEL_ENDPOINT_VAR, "")


def profile_dir() -> str:
    return common(PROFILE_DIR_VAR, "")


def kernel_cache() -> str:
    """The directory for the native CPU kernels ("" = ``~/.cache/pdserve/kernels``)."""
    return common(KERNEL_CACHE_VAR, "")


def secret(var: str, environ: Mapping[str, str] | None = None) -> str:
    """A credential from ``var``, else from the file ``<var>_FILE`` names (its first line);
    "" when neither is set. A file that cannot be read is a ConfigError naming it."""
    environ = os.environ if environ is None else environ
    value = environ.get(var, "")
    path = environ.get(f"{var}_FILE", "")
    if value or not path:
        return value
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().strip()
    except OSError as exc:
        raise ConfigError(f"{var}_FILE: cannot read {path!r}: {exc.strerror}") from exc


def up_verbose() -> bool:
    return BOOL.parse(common(UP_VERBOSE_VAR, "0"))
