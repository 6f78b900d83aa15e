"""Reading the secrets a node or a client is given as files: the bearer token, TLS keys and certificates.

A secret file that other users can read (group or world permission bits) is refused, naming the file
and its mode: a token anyone on the machine can read authenticates anyone. Certificates are public and
may be readable by all.
"""

from __future__ import annotations

import os
import stat

_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def read_secret(path: str | os.PathLike[str], what: str) -> bytes:
    """The bytes of the secret file ``path``; refuses one that group or others may read or write."""
    mode = os.stat(path).st_mode
    if mode & _OTHERS:
        msg = (f"{what} file {str(path)!r} is accessible to other users (mode {stat.filemode(mode)}); "
               f"run `chmod 600 {path}`")
        raise PermissionError(msg)
    with open(path, "rb") as f:
        return f.read()


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped); refuses an empty file, a bad token,
    or a file other users may read."""
    token = read_secret(path, "auth token").decode("utf-8", errors="replace").strip()
    if not token:
        msg = f"auth token file {str(path)!r} is empty"
        raise ValueError(msg)
    if not (token.isascii() and token.isprintable()):
        msg = (f"the auth token in {str(path)!r} must be a non-empty string of printable ASCII characters "
               "(a gRPC header value)")
        raise ValueError(msg)
    return token


def read_public(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a public file (a certificate)."""
    with open(path, "rb") as f:
        return f.read()
