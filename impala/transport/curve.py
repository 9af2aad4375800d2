"""ZeroMQ CURVE authentication and encryption for learners that bind a public address.

Layout of a keys directory (``--curve DIR``)::

    DIR/server.key, DIR/server.key_secret     the learner's keypair (made on first use)
    DIR/authorized/*.key                      public keys of actors allowed to connect
    DIR/local.key, DIR/local.key_secret       the keypair of the learner's own local actors

For a remote machine, copy ``DIR/server.key`` there and make it a client
keypair with ``impala-actors --curve DIR2 --make-keys``; then copy that
machine's ``DIR2/client.key`` into the learner's ``DIR/authorized/``. Only
holders of an authorized secret key can send trajectories or read weights.

Secret key files are created 0600 in directories created 0700, and a secret key file
that group or others can read is refused (``ConfigError``, saying how to fix it).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import stat
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.base import Authenticator
from zmq.auth.thread import ThreadAuthenticator

from impala.options import ConfigError


@dataclass(frozen=True)
class ClientKeys:
    """Picklable paths an actor needs to connect as a CURVE client."""

    server_public: str
    client_secret: str


@contextlib.contextmanager
def _private_files():
    """Files and directories made inside are for the owner only (no window where a secret is 0644)."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def check_secret_file(path: str) -> None:
    """Refuse a secret key that group or others can read."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise ConfigError(f"secret key {path} is readable by others (mode {mode:04o}); run: chmod 600 {path}")


def _ensure_pair(directory: str, name: str) -> tuple[str, str]:
    public, secret = os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret")
    if not (os.path.exists(public) and os.path.exists(secret)):
        with _private_files():
            os.makedirs(directory, exist_ok=True)
            public, secret = zmq.auth.create_certificates(directory, name)
    check_secret_file(secret)
    return public, secret


def prepare_server(directory: str) -> ClientKeys:
    """Create missing keys; authorize the learner's own local actors. Returns their client keys."""
    try:
        server_public, _ = _ensure_pair(directory, "server")
        local_public, local_secret = _ensure_pair(directory, "local")
        authorized = os.path.join(directory, "authorized")
        with _private_files():
            os.makedirs(authorized, exist_ok=True)
        shutil.copy(local_public, os.path.join(authorized, "local.key"))
    except OSError as e:
        raise ConfigError(f"--curve {directory}: cannot create its keys ({e.strerror or e})") from None
    return ClientKeys(server_public, local_secret)


def make_client_keys(directory: str) -> str:
    """Create ``DIR/client.key(_secret)``; returns the public key file to authorize on the learner."""
    try:
        public, _ = _ensure_pair(directory, "client")
    except OSError as e:
        raise ConfigError(f"--curve {directory}: cannot create a keypair there ({e.strerror or e})") from None
    return public


def client_keys(directory: str) -> ClientKeys:
    """An actor machine's CURVE keys in ``directory``; ConfigError naming a missing file and how to get it."""
    server_public = os.path.join(directory, "server.key")
    client_secret = os.path.join(directory, "client.key_secret")
    for path, hint in (
        (server_public, "copy the learner's server.key here"),
        (client_secret, "run impala-actors --curve DIR --make-keys"),
    ):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: {hint}")
    check_secret_file(client_secret)
    return ClientKeys(server_public, client_secret)


class _AuthorizedKeys:
    """Reads ``DIR/authorized`` at each connection, so keys added while the learner runs take effect."""

    def __init__(self, directory: str) -> None:
        self.location = os.path.join(directory, "authorized")

    def callback(self, domain: str, key: bytes) -> bool:
        return key in zmq.auth.load_certificates(self.location)


ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP protocol: one authenticator per context


class _ReleasesZapEndpoint(Authenticator):
    """Unbinds the ZAP endpoint before closing its socket. libzmq releases an inproc name only when its
    reaper thread destroys the closed socket, some time after close() returns, so a server started
    right after another one stopped could find the name still taken ('Address already in use');
    unbind releases it before returning."""

    def stop(self) -> None:
        if self.zap_socket is not None and not self.zap_socket.closed:
            with contextlib.suppress(zmq.ZMQError):  # never bound: start() failed at its bind
                self.zap_socket.unbind(ZAP_ENDPOINT)
        super().stop()


_PIPE_NAMES = itertools.count()


class _Authenticator(ThreadAuthenticator, _ReleasesZapEndpoint):
    """pyzmq's authenticator thread, stoppable and restartable at once in the same process.

    ThreadAuthenticator.stop joins its thread, then its super().stop() (the unbind above) closes the
    ZAP socket. Its control pipe is named after id(self), which Python reuses for the next object
    while libzmq may still hold the old name, so each pipe gets a name of its own instead."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(ctx)
        self.pipe_endpoint = f"inproc://impala.authenticator-pipe.{os.getpid()}.{next(_PIPE_NAMES)}"

    def stop(self) -> None:
        if self.pipe is not None and self.thread is None:
            # start() failed before its thread ran: nobody would ever read a TERMINATE sent here
            self.pipe.close(linger=0)
            self.pipe = None
        super().stop()


def start_authenticator(ctx: zmq.Context, directory: str) -> ThreadAuthenticator:
    """Accept CURVE clients whose public key is in ``DIR/authorized``."""
    keys = _AuthorizedKeys(directory)  # checks the directory before a thread (one per process) is started
    auth = _Authenticator(ctx)
    try:
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=keys)
    except BaseException:
        auth.stop()
        raise
    return auth


def make_server_socket(sock: zmq.Socket, directory: str) -> None:
    """Make ``sock`` a CURVE server with the learner's keypair in ``directory``."""
    public, secret = zmq.auth.load_certificate(os.path.join(directory, "server.key_secret"))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def make_client_socket(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``sock`` a CURVE client that trusts only the learner's public key."""
    public, secret = zmq.auth.load_certificate(keys.client_secret)
    server_public, _ = zmq.auth.load_certificate(keys.server_public)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public
