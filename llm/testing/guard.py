"""Keep tests off the real network: loopback and unix sockets only, and no provider credentials.

`install_network_guard()` patches `socket.socket.connect`/`connect_ex` and `socket.getaddrinfo` so that
connecting to anything but 127.0.0.0/8, ::1 (or 0.0.0.0/::) and resolving any name but `localhost` or
this host's own name raises `NetworkBlockedError`. It subclasses `ConnectionRefusedError`, so HTTP
clients classify it as "nothing was sent"; each blocked attempt is also recorded, so a test fixture can
fail a test that tried, even when the code under test swallowed the error (`blocked_attempts()`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from typing import Any

_ALLOWED_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
_lock = threading.Lock()
_blocked: list[str] = []
_original: dict[str, Any] = {}


class NetworkBlockedError(ConnectionRefusedError):
    """A test tried to reach a non-loopback address."""


def _is_loopback_host(host: object) -> bool:
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not isinstance(host, str):
        return False
    name = host.strip("[]").split("%", 1)[0].lower()
    if name in _ALLOWED_NAMES or name.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def _block(what: str) -> NetworkBlockedError:
    with _lock:
        _blocked.append(what)
    return NetworkBlockedError(f"network guard: {what} blocked (tests may only use loopback addresses)")


def _check_address(sock: socket.socket, address: Any) -> None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # unix sockets and the like
    host = address[0] if isinstance(address, tuple) and address else address
    if not _is_loopback_host(host):
        port = address[1] if isinstance(address, tuple) and len(address) > 1 else "?"
        raise _block(f"connection to {host}:{port}")


def _guarded_connect(self: socket.socket, address: Any) -> None:
    _check_address(self, address)
    _original["connect"](self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    _check_address(self, address)
    result: int = _original["connect_ex"](self, address)
    return result


def _guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    name = host.decode("ascii", "replace") if isinstance(host, bytes) else host
    if not _is_loopback_host(name) and str(name).lower() != socket.gethostname().lower():
        raise _block(f"DNS lookup of {name}")
    return _original["getaddrinfo"](host, *args, **kwargs)


def install_network_guard() -> None:
    """Block non-loopback connections and DNS lookups in this process (idempotent)."""
    with _lock:
        if _original:
            return
        _original["connect"] = socket.socket.connect
        _original["connect_ex"] = socket.socket.connect_ex
        _original["getaddrinfo"] = socket.getaddrinfo
        socket.socket.connect = _guarded_connect  # type: ignore[method-assign,assignment]
        socket.socket.connect_ex = _guarded_connect_ex  # type: ignore[method-assign,assignment]
        socket.getaddrinfo = _guarded_getaddrinfo


def uninstall_network_guard() -> None:
    """Undo `install_network_guard` (idempotent)."""
    with _lock:
        if not _original:
            return
        socket.socket.connect = _original.pop("connect")  # type: ignore[method-assign]
        socket.socket.connect_ex = _original.pop("connect_ex")  # type: ignore[method-assign]
        socket.getaddrinfo = _original.pop("getaddrinfo")


def blocked_attempts() -> list[str]:
    """What the guard blocked since the last `clear_blocked_attempts()`, e.g. 'DNS lookup of api.anthropic.com'."""
    with _lock:
        return list(_blocked)


def clear_blocked_attempts() -> None:
    with _lock:
        _blocked.clear()


def clear_anthropic_env(environ: Any = None) -> list[str]:
    """Remove every `ANTHROPIC_*` variable (keys, base URL, profiles) from `environ` (default `os.environ`)
    so nothing under test can pick up real credentials. Returns the names removed, never their values."""
    env = os.environ if environ is None else environ
    names = sorted(name for name in env if name.startswith("ANTHROPIC_"))
    for name in names:
        del env[name]
    return names


def clear_openai_env(environ: Any = None) -> list[str]:
    """Remove every `OPENAI_*` and `AZURE_OPENAI_*` variable (keys, base URL, organisation, API
    version) from `environ` (default `os.environ`), which the OpenAI SDK would otherwise read.
    Returns the names removed, never their values."""
    env = os.environ if environ is None else environ
    names = sorted(name for name in env if name.startswith(("OPENAI_", "AZURE_OPENAI_")))
    for name in names:
        del env[name]
    return names
