"""The webhook address guard: IPv6 spellings that carry a non-public IPv4 address are refused."""

from __future__ import annotations

import pytest

from core.netguard import UnsafeAddress, is_public, resolve

EMBEDDING_PRIVATE = [
    "::ffff:127.0.0.1",          # IPv4-mapped
    "::7f00:1",                  # IPv4-compatible (deprecated)
    "::ffff:0:7f00:1",           # IPv4-translated (SIIT)
    "64:ff9b::7f00:1",           # NAT64 well-known prefix
    "64:ff9b::a9fe:a9fe",        # NAT64 to the cloud metadata address 169.254.169.254
    "64:ff9b::a00:1",            # NAT64 to 10.0.0.1
    "64:ff9b:1::7f00:1",         # RFC 8215 local-use NAT64
    "64:ff9b:1:7f00:1::",        # ... with the IPv4 address where a /48 prefix puts it
    "2002:7f00:1::1",            # 6to4 of 127.0.0.1
    "2002:c0a8:101::1",          # 6to4 of 192.168.1.1
    "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo whose client is 127.0.0.1
]


@pytest.mark.parametrize("address", EMBEDDING_PRIVATE)
def test_ipv6_forms_embedding_a_private_ipv4_are_not_public(address):
    assert not is_public(address)
    with pytest.raises(UnsafeAddress):
        resolve(address, 80, allow_private=False)


@pytest.mark.parametrize("address", ["8.8.8.8", "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1",
                                     "2606:4700:4700::1111"])
def test_public_addresses_and_ipv6_forms_of_public_ipv4_pass(address):
    assert is_public(address)
    assert resolve(address, 80, allow_private=False) == [address]


@pytest.mark.parametrize("address", ["::", "::1", "fe80::1", "fc00::1", "fec0::1", "feff::1", "ff02::1", "10.0.0.1",
                                     "169.254.169.254"])
def test_loopback_link_local_unique_local_and_multicast_are_not_public(address):
    assert not is_public(address)
