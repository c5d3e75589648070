"""CURVE keys, the broker's ZAP authenticator, and who may do what.

A key directory (`flowmesh keys init DIR`, `flowmesh keys add NAME --role ROLE --dir DIR`) holds
zmq.auth certificates, each with its `name` and `role` in the certificate's metadata:

    DIR/broker.key            the broker's public key: every peer and client needs it
    DIR/broker.key_secret     the broker's secret key: the broker only
    DIR/NAME.key              NAME's public key: its presence in DIR is what allows NAME in
    DIR/NAME.key_secret       NAME's secret key: give it to NAME only
    DIR/api_keys.json         the HTTP gateway's API keys (`keys add NAME --api`), hashed

With `--keys DIR` the broker's two ROUTERs are CURVE servers and a ZAP handler (`MeshAuthenticator`,
on the broker's event loop) lets in only the public keys of DIR: worker and partitioner keys on the
backend, client and operator keys on the frontend. A refused key never gets a message through to
the broker. Each connection's ZAP User-Id is its certificate's name; the broker reads it from every
message (`user_id`) and `authorize_client` / `check_registration` bind what the connection may do
to it. Removing NAME.key refuses NAME's new connections and every further message of its open ones.

A worker or partitioner given `--keys DIR` uses DIR/<its name>.key_secret (or `--keys` names the
secret file itself); the broker's public key is broker.key next to it.

A worker's peer socket (direct runs) is a CURVE server with the worker's own key and a ZAP handler
of its own (`PeerKeys`): it lets in only the keys the broker named lately as a run's previous
stage, or as a stage of a pipelined job open on the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.certs import create_certificates
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from flowmesh.errors import Code, FlowmeshError

log = logging.getLogger("flowmesh.auth")

BROKER = "broker"
PEER_ROLES = ("worker", "partitioner")  # backend
CLIENT_ROLES = ("client", "operator")  # frontend
ROLES = (*PEER_ROLES, *CLIENT_ROLES)
# ZAP domains of the broker's two sockets: a key is let in on the one its role belongs to.
FRONTEND_DOMAIN = "flowmesh-frontend"
BACKEND_DOMAIN = "flowmesh-backend"
# ZAP domain of a worker's peer socket, where the previous stage's worker sends activations.
PEERS_DOMAIN = "flowmesh-peers"
# Client calls every client key may make; everything else (deploy, undeploy, train_*) needs the
# operator role.
READ_ONLY = frozenset(
    {"infer", "status", "plan", "jobs", "generate", "stop_generate", "tokenizer_info"}
)


@dataclass(frozen=True)
class Identity:
    """Who a connection is, by the certificate its key belongs to."""

    name: str
    role: str
    public: str = ""  # the key itself (z85 text)


@dataclass(frozen=True)
class CurveKeys:
    """The keys a connecting side (worker, partitioner, client) needs: its own pair and the
    broker's public key, all z85 text."""

    public: bytes
    secret: bytes
    server_public: bytes
    name: str = ""


# ---------------------------------------------------------------------- certificate files


def read_cert(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None, dict[str, str]]:
    """(public key, secret key or None, metadata) of a zmq.auth certificate file."""
    public: bytes | None = None
    secret: bytes | None = None
    meta: dict[str, str] = {}
    section = ""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise FlowmeshError(Code.UNAUTHORIZED, f"cannot read key file {path}: {exc}") from None
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            section = line.strip()
            continue
        key, sep, value = line.strip().partition("=")
        if not sep:
            continue
        key, value = key.strip(), value.strip().strip('"')
        if section == "curve" and key == "public-key":
            public = value.encode("ascii")
        elif section == "curve" and key == "secret-key":
            secret = value.encode("ascii")
        elif section == "metadata":
            meta[key] = value
    if public is None or len(public) != 40 or (secret is not None and len(secret) != 40):
        raise FlowmeshError(Code.UNAUTHORIZED, f"{path} is not a CURVE certificate")
    return public, secret, meta


def _create(directory: Path, name: str, role: str) -> Path:
    """NAME.key and NAME.key_secret, both carrying (name, role) as metadata (pyzmq writes it
    in the secret file only); the secret file's path. Both are made in a directory of their own
    beside DIR and renamed in, the public file last: a broker reading DIR meanwhile (`KeyRing`)
    never sees a public file without its role, which it would skip."""
    staging = Path(tempfile.mkdtemp(prefix=".new-key-", dir=directory))
    try:
        public_file, secret_file = (
            Path(f)
            for f in create_certificates(staging, name, metadata={"name": name, "role": role})
        )
        os.chmod(secret_file, 0o600)
        public, _, _ = read_cert(secret_file)
        text = public_file.read_text(encoding="utf-8")
        head, sep, tail = text.partition("metadata\n")
        assert sep, f"{public_file}: unexpected certificate layout"
        meta = f'    name = "{name}"\n    role = "{role}"\n'
        public_file.write_text(head + sep + meta + tail, encoding="utf-8")
        if read_cert(public_file)[0] != public:
            raise FlowmeshError(Code.INTERNAL, f"{public_file} does not match {secret_file}")
        os.replace(secret_file, directory / secret_file.name)
        os.replace(public_file, directory / public_file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory / secret_file.name


def init_keys(directory: str | os.PathLike[str]) -> Path:
    """Create DIR and the broker's key pair in it; refuses to replace an existing one."""
    d = Path(directory)
    if (d / f"{BROKER}.key_secret").exists():
        raise FlowmeshError(Code.BAD_REQUEST, f"{d} already holds a broker key pair")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    _create(d, BROKER, BROKER)
    return d


def add_key(directory: str | os.PathLike[str], name: str, role: str) -> Path:
    """Create NAME's key pair in DIR (which allows it in); the secret file's path."""
    d = Path(directory)
    if role not in ROLES:
        raise FlowmeshError(Code.BAD_REQUEST, f"role {role!r}: one of {', '.join(ROLES)}")
    if not name or name == BROKER or "/" in name or name.startswith(".") or name != name.strip():
        raise FlowmeshError(Code.BAD_REQUEST, f"bad key name {name!r}")
    if not (d / f"{BROKER}.key").exists():
        raise FlowmeshError(
            Code.BAD_REQUEST, f"{d} has no broker key: run 'flowmesh keys init {d}' first"
        )
    if (d / f"{name}.key").exists() or (d / f"{name}.key_secret").exists():
        raise FlowmeshError(Code.BAD_REQUEST, f"{d} already holds a key named {name!r}")
    return _create(d, name, role)


def ensure_key(directory: str | os.PathLike[str], name: str, role: str) -> Path:
    """NAME's secret file in DIR, created if missing (for the processes `flowmesh up` starts)."""
    secret = Path(directory) / f"{name}.key_secret"
    if secret.exists():
        _, _, meta = read_cert(secret)
        if meta.get("role") != role:
            raise FlowmeshError(
                Code.BAD_REQUEST, f"{secret} has role {meta.get('role')!r}, not {role!r}"
            )
        return secret
    return add_key(directory, name, role)


def load_keys(keys: Any, name: str | None = None) -> CurveKeys:
    """The keys of a connecting side from `keys`: a (public, secret, server_public) triple; a
    secret certificate file (broker.key next to it); or a key directory, where the certificate
    is DIR/<name>.key_secret."""
    if isinstance(keys, CurveKeys):
        return keys
    if isinstance(keys, tuple | list):
        if len(keys) != 3:
            raise FlowmeshError(Code.BAD_REQUEST, "keys: (public, secret, server_public)")
        public, secret, server = (k.encode("ascii") if isinstance(k, str) else k for k in keys)
        return CurveKeys(public, secret, server)
    path = Path(os.path.expanduser(str(keys)))
    if path.is_dir():
        if not name:
            raise FlowmeshError(
                Code.BAD_REQUEST,
                f"keys: {path} is a key directory; name the secret file (DIR/NAME.key_secret)",
            )
        path = path / f"{name}.key_secret"
    public, secret, meta = read_cert(path)
    if secret is None:
        raise FlowmeshError(Code.UNAUTHORIZED, f"{path} holds no secret key (a .key_secret file)")
    server, _, _ = read_cert(path.parent / f"{BROKER}.key")
    return CurveKeys(public, secret, server, meta.get("name", ""))


# ---------------------------------------------------------------------- HTTP API keys

# The gateway's bearer tokens, kept next to the CURVE keys: one JSON file of {name, role, sha256}
# rows. Only the hash is stored, so the file lets keys in without holding any of them.
API_KEYS = "api_keys.json"
API_KEY_PREFIX = "fm-"


def api_key_hash(secret: str) -> str:
    """What `api_keys.json` stores of API key `secret` (hex sha256)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def read_api_keys(path: str | os.PathLike[str]) -> dict[str, Identity]:
    """The API keys a key file allows: each key's hash to whose it is (`public` is empty)."""
    try:
        rows = json.loads(Path(path).read_text(encoding="utf-8"))["keys"]
        out = {}
        for row in rows:
            out[str(row["sha256"])] = Identity(str(row["name"]), str(row["role"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FlowmeshError(Code.UNAUTHORIZED, f"{path} is not an API key file: {exc!r}") from None
    return out


def add_api_key(directory: str | os.PathLike[str], name: str, role: str) -> tuple[Path, str]:
    """A new API key for NAME (role client or operator) in DIR/api_keys.json: (the file, the key).
    The key is returned once and stored only hashed; DIR needs no broker key (a gateway may
    stand in front of a mesh without CURVE)."""
    if role not in CLIENT_ROLES:
        raise FlowmeshError(Code.BAD_REQUEST, f"API key role {role!r}: one of client, operator")
    if not name or name != name.strip() or any(c in name for c in "\n\r\t"):
        raise FlowmeshError(Code.BAD_REQUEST, f"bad key name {name!r}")
    d = Path(directory)
    if not d.exists():
        d.mkdir(parents=True)
        os.chmod(d, 0o700)
    path = d / API_KEYS
    known = read_api_keys(path) if path.exists() else {}
    if any(i.name == name for i in known.values()):
        raise FlowmeshError(Code.BAD_REQUEST, f"{path} already holds an API key named {name!r}")
    secret = API_KEY_PREFIX + secrets.token_urlsafe(32)
    known[api_key_hash(secret)] = Identity(name, role)
    _write_api_keys(path, known)
    return path, secret


def remove_api_key(directory: str | os.PathLike[str], name: str) -> Path:
    """Revoke NAME's API key in DIR/api_keys.json (a gateway reading the file refuses it from
    its next request on); the file."""
    path = Path(directory) / API_KEYS
    known = read_api_keys(path) if path.exists() else {}
    kept = {h: i for h, i in known.items() if i.name != name}
    if len(kept) == len(known):
        raise FlowmeshError(Code.BAD_REQUEST, f"{path} holds no API key named {name!r}")
    _write_api_keys(path, kept)
    return path


def _write_api_keys(path: Path, known: dict[str, Identity]) -> None:
    rows = [{"name": i.name, "role": i.role, "sha256": h} for h, i in known.items()]
    # Written whole then renamed, so that a gateway reading it never sees half a file.
    tmp = path.with_name(f".{API_KEYS}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump({"keys": rows}, out, indent=1)
    os.replace(tmp, path)


def remove_key(directory: str | os.PathLike[str], name: str) -> Path:
    """Revoke NAME's CURVE key in DIR: its public file goes (a broker on DIR refuses the key
    from then on, `KeyRing.refresh`), then its secret file if it is there; the public file."""
    d = Path(directory)
    public = d / f"{name}.key"
    if name == BROKER or not name or "/" in name or name.startswith("."):
        raise FlowmeshError(Code.BAD_REQUEST, f"bad key name {name!r} (the broker's stays)")
    if not public.exists():
        raise FlowmeshError(Code.BAD_REQUEST, f"{d} holds no key named {name!r}")
    public.unlink()
    (d / f"{name}.key_secret").unlink(missing_ok=True)
    return public


# ---------------------------------------------------------------------- sockets


def curve_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before it connects) a CURVE client of the broker."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


def curve_server(sock: zmq.Socket, secret: bytes, domain: str) -> None:
    """Make `sock` (before it binds) a CURVE server whose peers ZAP checks in `domain`."""
    sock.curve_server = True
    sock.curve_secretkey = secret
    sock.zap_domain = domain.encode()


def user_id(frame: Any) -> str | None:
    """The ZAP User-Id of the connection `frame` came in on (None without ZAP)."""
    try:
        return frame.get("User-Id")  # type: ignore[no-any-return]
    except (zmq.ZMQError, AttributeError):
        return None


def _why(kind: int, keyed: bool) -> str:
    if not keyed:
        return "the broker requires a CURVE key (it runs with --keys): give this side keys"
    return {
        zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the broker refused this key",
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the broker takes no CURVE keys (no --keys?)",
    }.get(kind, "the CURVE handshake failed (the wrong broker.key?)")


def handshake_events(link: bool = False) -> int:
    """The monitor events `watch_handshakes` reads; with the link's ups and downs (`link`)."""
    events = (
        zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_MONITOR_STOPPED
    )
    if link:
        events |= zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
    return int(events)


async def watch_handshakes(
    sock: zmq.asyncio.Socket,
    on_refused: Callable[[str], None],
    where: str,
    keyed: bool = True,
    on_link: Callable[[bool], None] | None = None,
) -> None:
    """Call `on_refused(reason)` on each failed handshake of `sock` (a refused key, a key for a
    broker without keys or none for one with them), until its monitor stops (`stop_watching`).
    Without it a refused DEALER only queues, silently. `on_link(up)`, when given, hears of the
    connection itself: False when it is lost, True when a handshake (again) succeeds (a socket
    has one monitor, so this one watcher tells both).

    Start the monitor before the socket connects (`connect_dealer(monitor=handshake_events(
    ...))`): a handshake refused before this coroutine first runs is otherwise never seen, and
    ZeroMQ may not try again, so a call waits for its timeout instead of failing at once. The
    monitor started there is the one read here (pyzmq keeps a socket's monitor socket)."""
    mon = sock.get_monitor_socket(handshake_events(on_link is not None))
    try:
        while True:
            event = parse_monitor_message(await mon.recv_multipart())
            kind = event["event"]
            if kind == zmq.EVENT_MONITOR_STOPPED:
                return
            if on_link is not None and kind in (
                zmq.EVENT_DISCONNECTED,
                zmq.EVENT_HANDSHAKE_SUCCEEDED,
            ):
                on_link(kind == zmq.EVENT_HANDSHAKE_SUCCEEDED)
                continue
            status = (
                f", ZAP status {int(event['value'])}"
                if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                else ""
            )
            on_refused(f"{where}: {_why(kind, keyed)} (CURVE handshake failed{status})")
    finally:
        # The monitor first: stopping it sends a last event to `mon`, a PAIR socket, and a
        # send to a PAIR whose peer is closed blocks for ever (a loop torn down with the
        # client open cancels this watcher before the socket's owner stops the monitor).
        stop_watching(sock)
        mon.close(linger=0)


def stop_watching(sock: zmq.Socket) -> None:
    """Stop `sock`'s monitor (before closing it), so that its watcher ends."""
    if not sock.closed:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()


# ---------------------------------------------------------------------- the broker's side


class KeyRing:
    """The broker's view of a key directory: its own secret key and the allowed public keys,
    by key and by name. Read again when the directory changes, so `flowmesh keys add` (or
    removing NAME.key) takes effect without a restart."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(os.path.expanduser(str(directory)))
        self.public, secret, _ = read_cert(self.dir / f"{BROKER}.key_secret")
        if secret is None:
            raise FlowmeshError(Code.UNAUTHORIZED, f"{self.dir}: the broker has no secret key")
        self.secret = secret
        self.by_key: dict[bytes, Identity] = {}
        self.by_name: dict[str, Identity] = {}
        self._stamp: tuple[Any, ...] | None = None
        self.refresh()

    def refresh(self) -> None:
        # Each key file's name, size and time, not the directory's time alone: a file changed
        # in place leaves that as it was, and two made within one tick of its clock share it.
        # (os.listdir raises for a directory gone or unreadable: the keys loaded are kept.)
        paths = [self.dir / n for n in sorted(os.listdir(self.dir)) if n.endswith(".key")]
        stamp = tuple((p.name, st.st_size, st.st_mtime_ns, st.st_ino) for p in paths
                      if (st := _stat(p)) is not None)  # fmt: skip
        if stamp == self._stamp:
            return
        self._stamp = stamp
        by_key: dict[bytes, Identity] = {}
        for path in paths:
            if path.stem == BROKER:
                continue
            try:
                public, _, meta = read_cert(path)
            except FlowmeshError as exc:
                log.warning("key %s skipped: %s", path, exc.reason)
                continue
            name, role = meta.get("name", path.stem), meta.get("role", "")
            if role not in ROLES:
                log.warning("key %s skipped: role %r is not one of %s", path, role, ROLES)
                continue
            by_key[public] = Identity(name, role, public.decode("ascii"))
        self.by_key = by_key
        self.by_name = {i.name: i for i in by_key.values()}
        log.info("keys from %s: %d allowed", self.dir, len(by_key))

    def domains(self) -> dict[str, dict[bytes, Identity]]:
        """The allowed keys of each ZAP domain (the shape `Authenticator.certs` takes)."""
        return {
            FRONTEND_DOMAIN: {k: i for k, i in self.by_key.items() if i.role in CLIENT_ROLES},
            BACKEND_DOMAIN: {k: i for k, i in self.by_key.items() if i.role in PEER_ROLES},
        }

    def identity(self, name: str | None) -> Identity | None:
        return self.by_name.get(name) if name else None


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:  # removed since it was listed
        return None


class MeshAuthenticator(AsyncioAuthenticator):
    """ZAP on the broker's loop: a key is let in only on the socket its role belongs to, and
    its connection's User-Id is its certificate's name."""

    def __init__(self, context: zmq.asyncio.Context, keyring: KeyRing) -> None:
        super().__init__(context, log=logging.getLogger("flowmesh.zap"))
        self.keyring = keyring
        self.refused = 0
        self._load()

    def _load(self) -> None:
        self.certs = self.keyring.domains()  # type: ignore[assignment]

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        try:
            self.keyring.refresh()
            self._load()
        except Exception:  # an unreadable directory: keep the keys already loaded
            log.exception("could not read the key directory %s", self.keyring.dir)
        await super().handle_zap_message(msg)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:
            self.refused += 1
            if self.refused <= 20 or self.refused % 1000 == 0:
                log.warning(
                    "refused a connection on %s: %s (%d refused so far)",
                    domain,
                    reason.decode(errors="replace"),
                    self.refused,
                )
        return allowed, reason

    def curve_user_id(self, client_public_key: bytes) -> str:
        ident = self.keyring.by_key.get(z85.encode(client_public_key))
        return ident.name if ident else ""


# ---------------------------------------------------------------------- between workers


# How long a key stays allowed on a worker's peer socket after the last Run that named it: past
# a burst's reconnects, and short enough that a worker whose key left the broker's directory
# (which then names it in no Run) is refused again soon after, without a restart.
RUN_KEY_S = 300.0


class PeerKeys:
    """Who may connect to a worker's peer socket (direct runs under CURVE): the workers the
    broker named as a run's previous stage (`Run.from_key`), for RUN_KEY_S after the last Run
    that named them, and the stages' workers of a pipelined job open here (`PipeOpen.peers`),
    for as long as it is open; nobody else.

    The keys come from the broker, which takes them from its key directory. A handshake from a
    key not named yet waits a little for the Run that names it (the Run and the first
    activations travel on different connections), then is refused. A connection is checked at
    its handshake; what comes through it later is checked against the run or job it is for
    (`gpu_worker.direct`, `WorkerCore`)."""

    def __init__(
        self,
        wait_s: float = 2.0,
        keep_s: float = RUN_KEY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wait_s = wait_s
        self.keep_s = keep_s
        self.clock = clock
        self.until: dict[str, float] = {}  # key -> when the last Run's leave ends
        # key -> the opens of pipelined jobs (`gpu_worker.core.pipe_holder`) open here naming it
        self.held: dict[str, set[str]] = {}
        self.refused = 0
        self._changed = asyncio.Event()

    def allows(self, key: str) -> bool:
        return key in self.held or self.until.get(key, -math.inf) > self.clock()

    def allow(self, key: str, holder: str = "") -> None:
        """`key` may connect: for RUN_KEY_S from now, or while `holder` (a pipelined job's
        open) holds it, until `release(holder)`."""
        if not key:
            return
        new = not self.allows(key)
        if holder:
            self.held.setdefault(key, set()).add(holder)
        else:
            now = self.clock()
            if new:  # the expired ones go as new ones come: the map stays the keys in use
                self.until = {k: t for k, t in self.until.items() if t > now}
            self.until[key] = now + self.keep_s
        if new:
            self._changed.set()
            self._changed = asyncio.Event()

    def release(self, holder: str) -> None:
        """What `holder` opened is closed here: its keys are allowed no longer on its account."""
        for key in [k for k, holders in self.held.items() if holder in holders]:
            self.held[key].discard(holder)
            if not self.held[key]:
                del self.held[key]

    async def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: may this z85 `key` connect?"""
        text = key.decode("ascii")
        if domain == PEERS_DOMAIN:
            deadline = asyncio.get_running_loop().time() + self.wait_s
            while not self.allows(text):
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
            if self.allows(text):
                return True
        self.refused += 1
        if self.refused <= 20 or self.refused % 1000 == 0:
            log.warning(
                "refused a connection to the peer socket: key %s was named by no recent run or "
                "open job (%d refused so far)",
                text,
                self.refused,
            )
        return False


def peer_authenticator(ctx: zmq.asyncio.Context, keys: PeerKeys) -> AsyncioAuthenticator:
    """Started ZAP on a worker's context for its peer socket (start it before binding: a CURVE
    socket with no ZAP handler lets every key in). A connection's User-Id is its z85 key."""
    auth = AsyncioAuthenticator(ctx, log=logging.getLogger("flowmesh.zap.peers"))
    auth.configure_curve_callback(PEERS_DOMAIN, credentials_provider=keys)
    auth.start()
    return auth


# ---------------------------------------------------------------------- who may do what


def authorize_client(identity: Identity | None, call: str) -> None:
    """Raise FORBIDDEN unless `identity` may make client call `call` (a message TYPE)."""
    if identity is None:
        raise FlowmeshError(Code.UNAUTHORIZED, f"{call} refused: this connection has no known key")
    if identity.role not in CLIENT_ROLES:
        raise FlowmeshError(
            Code.FORBIDDEN, f"{call} refused: key {identity.name!r} has role {identity.role!r}"
        )
    if call not in READ_ONLY and identity.role != "operator":
        raise FlowmeshError(
            Code.FORBIDDEN,
            f"{call} refused: key {identity.name!r} has role {identity.role!r}; "
            f"{call} needs an operator key",
        )


def check_registration(identity: Identity | None, name: str, role: str) -> None:
    """Raise FORBIDDEN unless `identity`'s certificate grants registering as `name` (`role`)."""
    if identity is None:
        raise FlowmeshError(
            Code.UNAUTHORIZED, f"registration as {name!r} refused: this connection has no key"
        )
    if identity.name != name or identity.role != role:
        raise FlowmeshError(
            Code.FORBIDDEN,
            f"registration as {role} {name!r} refused: this key belongs to "
            f"{identity.role} {identity.name!r}",
        )
