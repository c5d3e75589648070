"""Where clients' paths may lead: the directories an operator opens to the mesh's clients.

A worker reads clients' weights files, Hugging Face directories and checkpoints to resume under
its data roots (`--data-root`, repeatable) and its checkpoint roots (`--checkpoint-root`), and
writes checkpoints under its checkpoint roots only; the partitioner reads Hugging Face
directories under its data roots. Each defaults to the process's working directory.

A path is taken as the operating system takes it: relative to the working directory, with `..`
and symbolic links followed. It is allowed when the path as written (made absolute, `..` folded)
and its real path (`os.path.realpath`) both lie inside a root, so neither `..` nor a symbolic
link leads out, and a path written outside the roots is refused before anything on the host is
looked at. The refusal names the path as the client gave it and the roots, in the same words
whatever the host has there: a client learns nothing of the host outside the roots.

A read or write the operating system fails (a full disk, a permission) is an `io_error` that
names the path and what the system says (`io_error`), never any byte of the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flowmesh.errors import Code, FlowmeshError

Paths = Iterable[str | os.PathLike[str]]


def _written(path: str | os.PathLike[str]) -> str:
    return os.path.normpath(os.path.abspath(path))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class Roots:
    """A process's roots, absolute; `who` names the process in refusals ("worker gpu-1")."""

    data: tuple[str, ...]
    checkpoints: tuple[str, ...] = ()
    who: str = "this process"

    @classmethod
    def of(
        cls, data: Paths | None, checkpoints: Paths | None = None, who: str = "this process"
    ) -> Roots:
        """Roots as flags give them; None (a flag not given): the working directory."""
        here = [os.getcwd()]
        return cls(
            tuple(_written(r) for r in (here if data is None else data)),
            tuple(_written(r) for r in (here if checkpoints is None else checkpoints)),
            who,
        )

    def readable(self, path: Any, what: str) -> str:
        """The real path of `path` (`what`: "weights", "hf directory", ...), which a client
        wants read; NOT_ALLOWED unless under a data or checkpoint root."""
        kind = "data and checkpoint roots" if self.checkpoints else "data roots"
        roots = (*self.data, *self.checkpoints)
        return self._check(path, what, roots, f"reads only under its {kind}")

    def writable(self, path: Any, what: str) -> str:
        """The real path of `path`, where a client wants a checkpoint written; NOT_ALLOWED
        unless under a checkpoint root."""
        return self._check(path, what, self.checkpoints, "writes only under its checkpoint roots")

    def _check(self, path: Any, what: str, roots: tuple[str, ...], rule: str) -> str:
        if not isinstance(path, str) or not path:
            raise FlowmeshError(Code.BAD_REQUEST, f"{what} must be a path, got {path!r}")
        if "\0" in path:
            raise FlowmeshError(Code.BAD_REQUEST, f"{what} {path!r}: a path holds no NUL byte")
        # As written first: a path written outside is refused without a look at the host.
        if any(_inside(_written(path), r) or _inside(_written(path), _real(r)) for r in roots):
            real = os.path.realpath(path)
            if any(_inside(real, _real(r)) for r in roots):
                return real
        raise FlowmeshError(
            Code.NOT_ALLOWED,
            f"{self.who} refused {what} {path!r}: it {rule} "
            f"({', '.join(roots) or 'none'}; an operator adds one with --data-root or "
            "--checkpoint-root)",
        )

    def warnings(self) -> list[str]:
        """What an operator should hear at start: a root that opens the whole host."""
        return [
            f"{kind} root {r} lets clients {verb} every file this process can"
            for kind, verb, roots in (
                ("data", "read", self.data),
                ("checkpoint", "write", self.checkpoints),
            )
            for r in roots
            if _real(r) == os.sep
        ]


def _real(root: str) -> str:
    return os.path.realpath(root)


def io_error(exc: OSError, what: str) -> FlowmeshError:
    """`exc`, raised reading or writing `what` (e.g. "checkpoint '/ckpt/a'"), as an io_error
    with the operating system's words for it."""
    words = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
    return FlowmeshError(Code.IO_ERROR, f"{what}: {words}")


def not_safetensors(what: str) -> FlowmeshError:
    """The error for a file that does not read as a safetensors file. It never quotes the file
    (nor a parser's words about it, which may): what is wrong, not what is there."""
    return FlowmeshError(Code.BAD_REQUEST, f"{what} is not a safetensors file")
