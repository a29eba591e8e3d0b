"""Per-node upload limit: one token bucket shared by every bulk write the node makes (`sync.transfers`).

A volunteer's uplink must not be saturated by serving patch chunks, and
benchmarks emulate WAN links with the same limit (`network.upload_bytes_per_s`).
The bucket may go into debt: a frame larger than the burst is admitted and the
next writer waits until the debt is paid, so the long-run rate is exact for
any frame size while whole frames are still written in one call (large frames
are what keep per-chunk CPU low). Reservations are first come, first served.
"""

from __future__ import annotations


class TokenBucket:
    """Bytes per second with a burst allowance; `rate == 0` means unlimited."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float | None = None, now: float = 0.0) -> None:
        if rate_bytes_per_s < 0:
            raise ValueError("upload rate must be >= 0 (0 = unlimited)")
        self.rate = float(rate_bytes_per_s)
        # default burst: 50 ms of traffic, at least 16 KiB, so an idle link cannot bank a long burst
        self.burst = float(burst_bytes if burst_bytes is not None else max(16 * 1024, self.rate * 0.05))
        self.tokens = self.burst
        self.last = now
        self.total = 0  # bytes admitted

    def _refill(self, now: float) -> None:
        if now > self.last:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now

    def reserve(self, n: int, now: float) -> float:
        """Admit `n` bytes; returns how many seconds the caller must wait before writing them."""
        self.total += n
        if self.rate == 0:
            return 0.0
        self._refill(now)
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def refund(self, n: int, now: float) -> None:
        """Give back a reservation that was not used (the frame was cancelled meanwhile)."""
        self.total -= n
        if self.rate:
            self._refill(now)
            self.tokens = min(self.burst, self.tokens + n)
