"""`python -m gateway --broker tcp://HOST:PORT --port N`: the gateway under uvicorn."""

from __future__ import annotations

import argparse
import os
import sys


def add_options(parser: argparse.ArgumentParser) -> None:
    """The gateway's options, on `python -m gateway` and `flowmesh gateway` alike (cheap to
    import: FastAPI and uvicorn load only when it serves)."""
    parser.add_argument(
        "--broker",
        default=os.environ.get("FLOWMESH_BROKER", "tcp://127.0.0.1:5555"),
        help="the broker's frontend address (default: FLOWMESH_BROKER, else %(default)s)",
    )
    # Loopback unless told: without API keys (not in this slice) anyone who reaches the port
    # may call the mesh.
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (%(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (%(default)s)")
    parser.add_argument("--keys", default=None, help="client key file (default: FLOWMESH_KEYS)")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds a call to the broker may take"
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn's (%(default)s)")


def serve(args: argparse.Namespace) -> int:
    """Serve until stopped (SIGINT, SIGTERM)."""
    import uvicorn

    from gateway.app import create_app

    app = create_app(args.broker, keys=args.keys, timeout=args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_options(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
