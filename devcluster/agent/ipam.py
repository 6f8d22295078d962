"""Pod IPs: a unique 127.<octet>.x.y per pod, which Linux routes to `lo` with no setup.

Addresses are handed out in order and reused only after wrapping around, so a new pod never
inherits an address that a client of a just-deleted pod may still be calling.
"""

from __future__ import annotations


class LoopbackIpam:
    def __init__(self, octet: int) -> None:
        if not 2 <= octet <= 253:
            raise ValueError(
                "the pod IP octet must be within 2..253 (127.0/16 and 127.1/16 are "
                "used by the host)"
            )
        self._octet = octet
        self._next = 0
        self._in_use: set[str] = set()

    def _address(self, index: int) -> str:
        return f"127.{self._octet}.{index // 254}.{index % 254 + 1}"

    def reserve(self, address: str) -> None:
        """Marks an address seen on an existing pod (after an agent restart) as taken."""
        self._in_use.add(address)

    def allocate(self) -> str:
        for _ in range(256 * 254):
            address = self._address(self._next)
            self._next = (self._next + 1) % (256 * 254)
            if address not in self._in_use:
                self._in_use.add(address)
                return address
        raise RuntimeError(f"all 65024 pod addresses in 127.{self._octet}.0.0/16 are in use")

    def release(self, address: str) -> None:
        self._in_use.discard(address)
