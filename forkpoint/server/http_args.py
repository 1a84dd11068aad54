"""`forkpoint serve`'s HTTP transport options under vLLM's names (uvicorn's logging, TLS, a proxy's root
path) and the uvicorn keyword arguments they become, shared by the one-engine server (cli.py) and the
replicas' front end (replicas/launch.py).
"""

from __future__ import annotations

import argparse
from typing import Any

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_http_args(group: argparse._ArgumentGroup) -> None:
    """vLLM's transport flags, on `forkpoint serve`'s server group."""
    group.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None,
                       help="uvicorn's own log level (default: --log-level)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no access-log line per HTTP request (default: uvicorn's access log at info)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="accepted for vLLM command lines: forkpoint logs no request content, and a request's "
                            "time-to-first-token parts only at --log-level debug")
    group.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key")
    group.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS with this certificate")
    group.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                       help="CA certificates to verify clients' certificates against")
    group.add_argument("--root-path", default=None, metavar="PATH",
                       help="the path prefix a reverse proxy serves the API under (ASGI root_path)")


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """`uvicorn.run(app, **uvicorn_options(args))` for `forkpoint serve`'s parsed arguments. A TLS key
    without a certificate (or the reverse) is a ValueError naming both flags."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: pass both to serve HTTPS")
    options: dict[str, Any] = {
        "host": args.host, "port": args.port, "log_level": args.uvicorn_log_level or args.log_level,
        "access_log": not args.disable_uvicorn_access_log, "timeout_graceful_shutdown": args.shutdown_timeout,
        "timeout_keep_alive": args.timeout_keep_alive,
        "ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile, "ssl_ca_certs": args.ssl_ca_certs,
    }
    if args.root_path is not None:
        options["root_path"] = args.root_path
    return options
