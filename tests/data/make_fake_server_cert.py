"""Writes fake_server.crt and fake_server.key: a self-signed certificate for 127.0.0.1 and localhost, valid from 2000
to 2999 (whatever the clock of the machine that runs the tests), for tests/test_vllm_server_client.py's HTTPS fake
vLLM server. Run once with any Python that has `cryptography`: python tests/data/make_fake_server_cert.py"""

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

here = Path(__file__).parent
key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gfpo test server")])
certificate = (
    x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
    .serial_number(x509.random_serial_number())
    .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc))
    .not_valid_after(datetime.datetime(2999, 1, 1, tzinfo=datetime.timezone.utc))
    .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                x509.DNSName("localhost")]), critical=False)
    .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False)
    .sign(key, hashes.SHA256())
)
(here / "fake_server.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
(here / "fake_server.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
