"""A sandbox's own certificate authority, for the hosts its proxy injects a secret for.

Theory of operation (docs/egress.md, "Secret injection"). To set a header inside HTTPS,
the proxy must be the server the sandbox's client talks TLS with. Each egress sandbox
whose profile has `egress_inject` gets a `SandboxAuthority` of its own when it is made:
an EC P-256 key that lives only in the daemon's memory (never on disk, never in the
sandbox) and a self-signed CA certificate whose name constraints permit exactly the
injecting hosts, so that even this CA can vouch for no other name. Its certificate is
appended to the sandbox's CA bundle (`ca_bundle`); `server_context(host)` is the TLS
context the proxy answers that host with: a leaf certificate for `host`, signed on
first use and cached (one per injecting host, so bounded by the profile's table).

Both certificates are valid from an hour ago (clock skew) for `VALIDITY`, longer than
any sandbox lives. TLS 1.2 at least; ALPN offers only `http/1.1` (the proxy reads
HTTP/1.1; HTTP/2 is not spoken). The private keys are handed to OpenSSL through an
anonymous memory file (`memfd_create`): `ssl` loads a chain only from a path.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import ssl
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: How long the CA and its leaf certificates are valid.
VALIDITY = datetime.timedelta(days=400)
#: Backdating, for a sandbox whose clock is a little behind the daemon's.
SKEW = datetime.timedelta(hours=1)
#: The one application protocol offered on either side.
ALPN = ["http/1.1"]


class SandboxAuthority:
    """One sandbox's CA for `hosts` (normalised names). `cert_pem` goes into the
    sandbox's bundle; `fingerprint` is the `egress_ca` fact. Cost: one EC key and one
    signature (about 1 ms), and as much again per host on first use."""

    def __init__(self, hosts: Iterable[str]) -> None:
        self.hosts = frozenset(hosts)
        if not self.hosts:
            raise ValueError("an authority for no host")
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "substrate"),
                x509.NameAttribute(NameOID.COMMON_NAME, "substrate egress CA of one sandbox"),
            ]
        )
        self._name = name
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - SKEW)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.NameConstraints(
                    permitted_subtrees=[x509.DNSName(h) for h in sorted(self.hosts)],
                    excluded_subtrees=None,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert_pem = self.cert.public_bytes(serialization.Encoding.PEM)
        der = self.cert.public_bytes(serialization.Encoding.DER)
        self.fingerprint = "sha256:" + hashlib.sha256(der).hexdigest()
        self._contexts: dict[str, ssl.SSLContext] = {}

    def server_context(self, host: str) -> ssl.SSLContext:
        """The TLS server context that answers as `host` (one of `hosts`), made on first
        use and kept. Raises ValueError for another host."""
        found = self._contexts.get(host)
        if found is not None:
            return found
        if host not in self.hosts:
            raise ValueError(f"{host} is not a host this authority vouches for")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(ALPN)
        _load_chain(context, self._leaf(host))
        self._contexts[host] = context
        return context

    def _leaf(self, host: str) -> bytes:
        """PEM of a leaf key and certificate for `host`, then the CA's certificate."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - SKEW)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return key_pem + cert.public_bytes(serialization.Encoding.PEM) + self.cert_pem


def _load_chain(context: ssl.SSLContext, pem: bytes) -> None:
    """`load_cert_chain` from bytes, through an anonymous memory file (never a path on
    disk that another process could read)."""
    fd = os.memfd_create("substrate-egress-leaf", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def upstream_context(cafile: str | None = None) -> ssl.SSLContext:
    """The TLS client context the proxy reaches an injecting host's real server with:
    verified against the host's own store (or `cafile`), ALPN `http/1.1` only."""
    context = ssl.create_default_context(cafile=cafile)
    context.set_alpn_protocols(ALPN)
    return context
