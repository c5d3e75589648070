"""`python -m gateway --broker tcp://HOST:PORT --port N`: the gateway under uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from flowmesh.errors import FlowmeshError
from flowmesh.units import parse_size
from gateway import MAX_BODY, MAX_STREAMS_PER_KEY


def add_options(parser: argparse.ArgumentParser) -> None:
    """The gateway's options, on `python -m gateway` and `flowmesh gateway` alike (cheap to
    import: FastAPI and uvicorn load only when it serves)."""
    parser.add_argument(
        "--broker",
        default=os.environ.get("FLOWMESH_BROKER", "tcp://127.0.0.1:5555"),
        help="the broker's frontend address (default: FLOWMESH_BROKER, else %(default)s)",
    )
    # Loopback unless told: without API keys anyone who reaches the port may call the mesh.
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (%(default)s; another needs API keys, or --insecure-open)",
    )
    parser.add_argument("--port", type=int, default=8000, help="port to bind (%(default)s)")
    parser.add_argument("--keys", default=None, help="client key file (default: FLOWMESH_KEYS)")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds a call to the broker may take"
    )
    parser.add_argument(
        "--api-keys",
        default=os.environ.get("FLOWMESH_API_KEYS"),
        metavar="FILE",
        help="API key file (flowmesh keys add NAME --role ROLE --api --dir DIR writes "
        "DIR/api_keys.json): callers need 'Authorization: Bearer KEY' (default: "
        "FLOWMESH_API_KEYS, else api_keys.json next to --keys if there is one)",
    )
    parser.add_argument(
        "--insecure-open",
        action="store_true",
        help="without API keys, serve every caller (not only loopback ones) and allow a "
        "non-loopback --host: anyone who reaches the port may call the mesh",
    )
    parser.add_argument(
        "--max-body",
        type=parse_size,
        default=MAX_BODY,
        metavar="SIZE",
        help="largest request body (bytes, or 64MiB and the like; default 64MiB): 413 beyond",
    )
    parser.add_argument(
        "--max-streams-per-key",
        type=int,
        default=MAX_STREAMS_PER_KEY,
        metavar="N",
        help="event streams one API key may hold open at once (%(default)s): 429 beyond",
    )
    parser.add_argument("--ssl-certfile", default=None, help="TLS certificate (uvicorn's)")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS private key (uvicorn's)")
    parser.add_argument("--log-level", default="warning", help="uvicorn's (%(default)s)")


def serve(args: argparse.Namespace) -> int:
    """Serve until stopped (SIGINT, SIGTERM)."""
    import uvicorn

    from gateway.app import create_app
    from gateway.guard import find_api_keys

    try:
        api_keys = find_api_keys(args.api_keys, args.keys or os.environ.get("FLOWMESH_KEYS"))
    except FlowmeshError as exc:
        raise SystemExit(f"flowmesh gateway: {exc.reason}") from None
    if api_keys is None and not args.insecure_open and not _loopback(args.host):
        raise SystemExit(
            f"flowmesh gateway: refusing to bind {args.host} without API keys: anyone who "
            "reaches it could call the mesh. Give it --api-keys FILE (flowmesh keys add NAME "
            "--role client --api), bind a loopback address, or pass --insecure-open"
        )
    try:
        app = create_app(
            args.broker,
            keys=args.keys,
            timeout=args.timeout,
            api_keys=api_keys,
            insecure_open=args.insecure_open,
            max_body=args.max_body,
            max_streams_per_key=args.max_streams_per_key,
        )
    except FlowmeshError as exc:  # an API key file that does not read
        raise SystemExit(f"flowmesh gateway: {exc.reason}") from None
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: only "localhost" is known to stay on the machine
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_options(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
