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


# IPv6 ranges whose last 32 bits are an IPv4 address a gateway or the host's stack forwards to: IPv4-compatible
# (deprecated, ::/96), IPv4-translated (SIIT, ::ffff:0:0:0/96) and the well-known NAT64 prefix (64:ff9b::/96).
EMBEDDING_LOW_32 = tuple(ipaddress.IPv6Network(n) for n in ("::/96", "::ffff:0:0:0/96", "64:ff9b::/96"))
# RFC 8215's local-use NAT64 prefix: where the IPv4 address sits depends on the operator's prefix length, and it
# is only meaningful inside one network, so no address in it is public.
LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")
# Site-local unicast (RFC 3879 deprecated it, so Python's is_global no longer knows it) is still routed inside many
# sites as their private range.
SITE_LOCAL = ipaddress.IPv6Network("fec0::/10")


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries: mapped, compatible, translated, NAT64, 6to4 and Teredo."""
    found = [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)] if any(ip in n for n in EMBEDDING_LOW_32) else []
    if ip.ipv4_mapped is not None:
        found.append(ip.ipv4_mapped)
    if ip.sixtofour is not None:
        found.append(ip.sixtofour)
    if ip.teredo is not None:
        found.extend(ip.teredo)  # (server, client): a packet reaches both
    return found


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return ip.is_global and not ip.is_multicast


def is_public(address: str) -> bool:
    """Whether an IP address is globally routable unicast; an IPv6 address that embeds an IPv4 one (mapped,
    compatible, NAT64, 6to4, Teredo) is public only when every embedded address is."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv4Address):
        return _public(ip)
    if ip in LOCAL_NAT64 or ip in SITE_LOCAL:
        return False
    embedded = embedded_ipv4(ip)
    if any(not _public(v4) for v4 in embedded):
        return False
    if ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d is the IPv4 address itself, judged as such above
        return True
    return _public(ip) and ip not in EMBEDDING_LOW_32[0]  # IPv4-compatible is deprecated (RFC 4291): refused whole


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
