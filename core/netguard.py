"""Outbound URLs the service calls on a tenant's behalf (webhooks): only public addresses, checked every time.

A URL is checked when it is registered and again before every delivery, on the addresses it resolves to
then; the request goes to the checked address itself, so a DNS answer that changes in between (rebinding)
cannot point a delivery at the service's own network.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from core.errors import ValidationFailed

SCHEMES = {"http": 80, "https": 443}


class UnsafeAddress(ValidationFailed):
    """The URL is malformed, or resolves to a private, loopback, link-local or otherwise non-public address."""

    def __init__(self, message: str) -> None:
        super().__init__("url", message)


def split_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL without credentials; UnsafeAddress otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UnsafeAddress(f"not a valid URL: {exc}") from None
    if parts.scheme not in SCHEMES:
        raise UnsafeAddress("the URL must start with http:// or https://")
    if not parts.hostname:
        raise UnsafeAddress("the URL has no host")
    if parts.username or parts.password:
        raise UnsafeAddress("the URL must not carry credentials; verify deliveries by their signature")
    return parts.scheme, parts.hostname, port or SCHEMES[parts.scheme]


def is_public(address: str) -> bool:
    """Whether an IP address is globally routable unicast (IPv4-mapped IPv6 judged by its IPv4 address)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def resolve(host: str, port: int, *, allow_private: bool) -> list[str]:
    """The addresses `host` resolves to now; UnsafeAddress if it resolves to none, or to any non-public one."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UnsafeAddress(f"cannot resolve {host!r}: {exc}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise UnsafeAddress(f"{host!r} resolves to no address")
    blocked = [a for a in addresses if not is_public(a)]
    if blocked and not allow_private:
        raise UnsafeAddress(f"{host!r} resolves to a private, loopback or link-local address ({blocked[0]}); "
                            "such endpoints are refused unless TRAINSERVE_WEBHOOK_ALLOW_PRIVATE is set")
    return addresses
