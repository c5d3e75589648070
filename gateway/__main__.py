"""`python -m gateway --broker tcp://HOST:PORT --port N`: the gateway under uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import sys
from typing import Any

from flowmesh.config import BOOL, FLOAT, INT, SIZE, TEXT, Option, Options
from flowmesh.errors import FlowmeshError
from gateway import BODY_TIMEOUT_S, MAX_BODY, MAX_HEADER, MAX_STREAMS_PER_KEY

# Declared once: they make the flags of `python -m gateway` and `flowmesh gateway`, and read the
# `[gateway]` table of the config file (flowmesh.config), as the other services' do.
OPTIONS = Options(
    section="gateway",
    prog="python -m gateway",
    description=__doc__ or "",
    options=[
        Option(
            "--broker",
            TEXT,
            os.environ.get("FLOWMESH_BROKER", "tcp://127.0.0.1:5555"),
            "the broker's frontend address (default: FLOWMESH_BROKER, else tcp://127.0.0.1:5555)",
        ),
        # Loopback unless told: without API keys anyone who reaches the port may call the mesh.
        Option(
            "--host",
            TEXT,
            "127.0.0.1",
            "address to bind (127.0.0.1; another needs API keys, or --insecure-open)",
        ),
        Option("--port", INT, 8000, "port to bind (8000)", least=0, most=65535),
        Option("--keys", TEXT, None, "client key file (default: FLOWMESH_KEYS)"),
        Option("--timeout", FLOAT, 60.0, "seconds a call to the broker may take (60)", above=0),
        Option(
            "--body-timeout",
            FLOAT,
            BODY_TIMEOUT_S,
            f"seconds a request's head, then its body, may take to arrive ({BODY_TIMEOUT_S:g}): "
            "408 past it, so that a client sending slowly, or not at all, does not hold its "
            "connection open; and an event stream's client to take each event (cut off past "
            "it)",
            above=0,
        ),
        Option(
            "--api-keys",
            TEXT,
            os.environ.get("FLOWMESH_API_KEYS"),
            "API key file (flowmesh keys add NAME --role ROLE --api --dir DIR writes "
            "DIR/api_keys.json): callers need 'Authorization: Bearer KEY' (default: "
            "FLOWMESH_API_KEYS, else api_keys.json next to --keys if there is one)",
        ),
        Option(
            "--insecure-open",
            BOOL,
            False,
            "without API keys, serve every caller (not only loopback ones) and allow a "
            "non-loopback --host: anyone who reaches the port may call the mesh",
        ),
        Option(
            "--max-body",
            SIZE,
            MAX_BODY,
            "largest request body (bytes, or 64MiB and the like; default 64MiB): 413 beyond",
        ),
        Option(
            "--max-header",
            SIZE,
            MAX_HEADER,
            "largest request headers, all together (bytes, or 32KiB and the like; default "
            "16KiB): 431 beyond",
        ),
        Option(
            "--max-streams-per-key",
            INT,
            MAX_STREAMS_PER_KEY,
            f"event streams one API key may hold open at once ({MAX_STREAMS_PER_KEY}): 429 beyond",
        ),
        Option("--ssl-certfile", TEXT, None, "TLS certificate (uvicorn's)"),
        Option("--ssl-keyfile", TEXT, None, "TLS private key (uvicorn's)"),
        Option("--log-level", TEXT, "warning", "uvicorn's (warning)"),
    ],
)


def add_options(parser: argparse.ArgumentParser) -> None:
    """The gateway's options on `flowmesh gateway`'s parser (cheap to import: FastAPI and
    uvicorn load only when it serves). Only flags given land in the namespace: `resolve` then
    takes the rest from the `--config` file, else the declared defaults."""
    for option in OPTIONS.options:
        option.add_to(parser, defaults=False)
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML file; its [gateway] table sets defaults (flags win)",
    )


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """`args` (from `add_options`' flags) completed: a flag given wins, then the `--config`
    file's `[gateway]` table, then the declared default."""
    from flowmesh.config import ConfigError

    given = vars(args)
    try:
        values = OPTIONS.read(given["config"]) if given.get("config") else {}
    except ConfigError as exc:
        raise SystemExit(f"flowmesh gateway: {exc}") from None
    for option in OPTIONS.options:
        if option.dest in given:
            continue
        default = option.default
        if isinstance(default, str) and option.kind is not TEXT:  # as argparse converts them
            default = option.kind.flag(default)
        setattr(args, option.dest, values.get(option.dest, default))
    return args


def serve(args: argparse.Namespace) -> int:
    """Serve until stopped (SIGINT, SIGTERM); `args` from `add_options` (resolved here)."""
    args = resolve(args)
    import uvicorn

    from gateway.app import create_app
    from gateway.guard import find_api_keys
    from gateway.http_protocol import bounded_head_protocol

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
            max_header=args.max_header,
            body_timeout=args.body_timeout,
            max_streams_per_key=args.max_streams_per_key,
        )
    except FlowmeshError as exc:  # an API key file that does not read
        raise SystemExit(f"flowmesh gateway: {exc.reason}") from None
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        # What "auto" picks here (uvloop and httptools are dependencies), said outright.
        loop="uvloop",
        http=bounded_head_protocol(args.max_header, args.body_timeout),
        # The access log's lines are INFO: below that level none is written, and without it
        # uvicorn skips building each request's.
        access_log=_access_logged(args.log_level),
    )
    _server_class()(config).run()  # uvicorn.run's, with systemd's notify protocol
    return 0


def _server_class() -> type:
    import uvicorn

    from flowmesh.lifecycle import _watchdog, stop_with_parent
    from flowmesh.sdnotify import notify, watchdog_interval

    class Server(uvicorn.Server):
        """uvicorn's, speaking systemd's `Type=notify` as the other services do: READY=1 once
        the socket is bound and the app started, WATCHDOG=1 while serving, STOPPING=1 on the
        way out; and stopping by itself when the launcher in $FLOWMESH_PARENT_PID is gone
        (`flowmesh up` killed without its chance to stop its children)."""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if not self.started:  # the bind or the app's startup failed: uvicorn exits
                return
            self._tasks = [asyncio.create_task(stop_with_parent(self._stop))]
            if (interval := watchdog_interval()) is not None:
                self._tasks.append(asyncio.create_task(_watchdog(interval)))
            notify("READY=1")

        def _stop(self) -> None:
            self.should_exit = True

        async def shutdown(self, sockets: Any = None) -> None:
            notify("STOPPING=1")
            for task in getattr(self, "_tasks", []):
                task.cancel()
            await super().shutdown(sockets)
            # uvicorn raises the SIGTERM/SIGINT it caught again once done, for a program that
            # embeds it; this process is the program: a stop asked for exits 0, as the others.
            self._captured_signals.clear()

    return Server


def _access_logged(level: str) -> bool:
    """Whether uvicorn at log level `level` writes access lines (INFO ones, or finer)."""
    import logging

    from uvicorn.config import LOG_LEVELS

    return LOG_LEVELS.get(level.lower(), logging.INFO) <= logging.INFO


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: only "localhost" is known to stay on the machine
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=OPTIONS.prog, description=OPTIONS.description)
    add_options(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
