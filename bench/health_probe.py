"""Probe a server's /health from a process of its own: `python bench/health_probe.py URL INTERVAL_S`.

Sends GET /health over one keep-alive connection, then waits INTERVAL_S, until its stdin closes
(the request in flight when it does still completes and is reported). Prints one line per probe,
`<start> <latency ms> <status>`, start on `time.monotonic()` (CLOCK_MONOTONIC: comparable across
processes on Linux); status 0 when the request failed.

Why a process of its own: a probe sharing the bench's event loop measures that loop too. With 80
requests and 8 streams in flight the bench's own httpx work delays its probes by 100 ms and more
while the server answers /health in a few milliseconds (docs/server.md, "Hostile clients").
"""

from __future__ import annotations

import http.client
import select
import sys
import time
from urllib.parse import urlsplit


def main() -> int:
    url, interval = urlsplit(sys.argv[1]), float(sys.argv[2])
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    while True:
        begin = time.monotonic()
        try:
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException):
            connection.close()  # reconnects on the next request
            status = 0
        print(f"{begin:.6f} {1000 * (time.monotonic() - begin):.3f} {status}", flush=True)
        readable, _, _ = select.select([sys.stdin], [], [], interval)
        if readable and not sys.stdin.read(1):
            return 0


if __name__ == "__main__":
    sys.exit(main())
