"""Where `distengine serve` listens, settled before the engine starts (minutes for a large model):
the address taken at once, so that a port in use is refused before anything loads and nothing
else can take it meanwhile; the TLS files read, so that a missing or wrong one is named then."""
from __future__ import annotations

import errno
import os
import socket
import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TLSFiles:
    """uvicorn's TLS settings (vLLM's flags): the server's certificate chain and key, and the CAs
    a client's certificate must come from when `cert_reqs` asks for one."""
    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = int(ssl.CERT_NONE)

    @property
    def enabled(self) -> bool:
        return self.certfile is not None

    def check(self) -> None:
        """Raises ValueError naming the flag of a file missing, unreadable or not what it should be."""
        for flag, path in (("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
                           ("--ssl-ca-certs", self.ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r}: no such file")
        if not self.enabled:
            if self.keyfile or self.ca_certs or self.cert_reqs != ssl.CERT_NONE:
                raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
            return
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            # A key with a passphrase would make OpenSSL ask for it on the terminal; an empty one fails instead.
            ctx.load_cert_chain(self.certfile, self.keyfile, password=lambda: b"")
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-certfile {self.certfile!r}"
                             + (f" with --ssl-keyfile {self.keyfile!r}" if self.keyfile else "")
                             + f": not a PEM certificate and its unencrypted key ({e})") from None
        if self.ca_certs:
            try:
                ctx.load_verify_locations(self.ca_certs)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"--ssl-ca-certs {self.ca_certs!r}: not PEM certificates ({e})") from None


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port as uvicorn binds one (SO_REUSEADDR; IPv6 for an address
    with a colon), not yet listening. ValueError names host:port when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        what = "is already in use" if getattr(e, "errno", None) == errno.EADDRINUSE else "cannot be listened on"
        raise ValueError(f"{host}:{port} {what} ({reason}): give another --host or --port") from None
    return sock
