"""The key that two hosts hold to migrate between them: a folder with a certificate and its
private key (`pos migrate --new-key` makes one; the other host gets a copy, over SSH).

Each side of a migration presents the certificate and accepts only a peer that presents it too
(TLS 1.3, Python's ssl on the control connection, CRIU's GnuTLS on its page server): whoever
lacks the private key cannot send a process to be restored as root, nor read one in flight. The
certificate is its own and only trust anchor, so no name is checked, and no outside authority
can vouch for anyone.
"""

import os
import ssl
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pos.errors import BadInput, PosError

DEFAULT_DIR = "/etc/pos/migrate"
ENV = "POS_MIGRATE_KEY"           # another folder than DEFAULT_DIR
CERT, KEY = "cert.pem", "key.pem"
DAYS = 3650                       # the certificate's life: replacing it is replacing the key
HANDSHAKE_S = 15.0                # a peer that starts no handshake is not waited for longer


def default_dir() -> Path:
    return Path(os.environ.get(ENV) or DEFAULT_DIR)


@dataclass(frozen=True)
class MigrateKey:
    """A key folder, checked: its certificate and private key exist, and no one but its owner,
    root, can read the key."""

    folder: Path

    @property
    def cert(self) -> Path:
        return self.folder / CERT

    @property
    def key(self) -> Path:
        return self.folder / KEY

    def server(self) -> ssl.SSLContext:
        """What the receiving host wraps each connection in: the peer must present the key's
        certificate."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        return self._pinned(ctx)

    def client(self) -> ssl.SSLContext:
        """What the sending host connects with: the receiver must present the key's
        certificate."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False       # the pinned certificate is the identity, not a name
        return self._pinned(ctx)

    def _pinned(self, ctx: ssl.SSLContext) -> ssl.SSLContext:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(cafile=str(self.cert))
        return ctx

    def criu_argv(self) -> list[str]:
        """CRIU's options for its page server and for a dump that sends pages to one: the same
        certificate required of both ends (CRIU's GnuTLS reads absolute paths: a daemonised
        CRIU changes folder to /)."""
        return ["--tls", "--tls-no-cn-verify", "--tls-cacert", str(self.cert.absolute()),
                "--tls-cert", str(self.cert.absolute()), "--tls-key", str(self.key.absolute())]


def load(folder: Path) -> MigrateKey:
    """The key in `folder`, refused in one sentence where it is missing, unreadable, or where
    anyone but its owner could read the private key (then it authenticates no one)."""
    k = MigrateKey(folder)
    for path in (k.cert, k.key):
        if not path.is_file():
            raise BadInput(f"there is no migration key in {folder} ({path.name} is missing)",
                           "make one with `pos migrate --new-key` on one host and copy the "
                           f"folder to the other (e.g. `scp -rp {folder} HOST:{folder}`), or give "
                           "its folder with --key")
    st = k.key.stat()
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or st.st_uid != os.geteuid():
        raise BadInput(f"the migration key {k.key} can be read by others than its owner "
                       f"(mode {stat.filemode(st.st_mode)}, owner {st.st_uid})",
                       f"chmod 600 {k.key} and chown it to root, or make a new key")
    try:
        k.server()
    except (ssl.SSLError, OSError) as e:
        raise BadInput(f"{folder} does not hold a usable certificate and private key ({e})",
                       "make a new one with `pos migrate --new-key`") from None
    return k


def create(folder: Path) -> MigrateKey:
    """A new key in `folder` (made 0700; the key 0600): an EC P-256 private key and a
    self-signed certificate, by openssl. Refused where a key is already there: replacing it
    would lock out the hosts that hold it."""
    if (folder / KEY).exists() or (folder / CERT).exists():
        raise BadInput(f"{folder} already holds a migration key",
                       "copy that one to the other host, or give another folder with --key")
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
    except OSError as e:
        raise BadInput(f"cannot create {folder} ({e.strerror})",
                       "run as root, or give a writable folder with --key") from None
    tmp_key = folder / f".{KEY}.new"
    argv = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-days", str(DAYS), "-subj", "/CN=pos migration key",
            "-keyout", str(tmp_key), "-out", str(folder / f".{CERT}.new")]
    old = os.umask(0o077)
    try:
        p = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise PosError("openssl is not installed, which makes the migration key",
                       "install it (apt-get install openssl), then try again") from None
    finally:
        os.umask(old)
    if p.returncode != 0:
        said = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise PosError(f"openssl could not make a key ({said})", "see openssl's message")
    os.chmod(tmp_key, 0o600)
    os.replace(tmp_key, folder / KEY)
    os.replace(folder / f".{CERT}.new", folder / CERT)
    return load(folder)
