"""TLS and bearer-token auth: a secured node serves only callers with the right token over TLS.

A self-signed certificate (SAN localhost + 127.0.0.1) is generated at test time with ``cryptography``.
"""

from __future__ import annotations

import datetime as dt
import hmac
import ipaddress
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from flight_store.client import StoreAdmin
from flight_store.config import ServerConfig
from flight_store.reading import StoreReader
from flight_store.server import StoreServer
from flight_store.writing import StoreWriter
from schemas.plan import PlannedSlice
from schemas.wire import GroupRef, MetadataTicket, PutGroup, ReadChannelDescriptor, ReleaseBody, SliceRef, SlicesTicket

TOKEN = "s3cret-T0ken_with.symbols~+/="


def _self_signed() -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert_pem, key_pem


@pytest.fixture(scope="module")
def cert() -> tuple[bytes, bytes]:
    return _self_signed()


def _secured_config(directory: Path, cert: tuple[bytes, bytes]) -> ServerConfig:
    """A node config serving TLS with ``cert`` and requiring :data:`TOKEN` (its file ends in a newline)."""
    cert_file, key_file, token_file = directory / "cert.pem", directory / "key.pem", directory / "token"
    cert_file.write_bytes(cert[0])
    key_file.write_bytes(cert[1])
    token_file.write_text(TOKEN + "\n", encoding="utf-8")
    key_file.chmod(0o600)
    token_file.chmod(0o600)
    return ServerConfig(tls_cert_file=str(cert_file), tls_key_file=str(key_file), auth_token_file=str(token_file))


def _token_config(directory: Path, token: str) -> ServerConfig:
    """A plaintext node config requiring the bearer token in a file holding exactly ``token``."""
    token_file = directory / "token"
    token_file.write_text(token, encoding="utf-8")
    token_file.chmod(0o600)
    return ServerConfig(auth_token_file=str(token_file))


@pytest.fixture
def secured(cert, make_group, tmp_path: Path):  # type: ignore[no-untyped-def]
    with StoreServer(_secured_config(tmp_path, cert)) as server:
        with StoreWriter(server.location, token=TOKEN, tls_root_certs=cert[0]) as client:
            client.put_group(make_group("secret-group", size=4))
        yield server


def test_tls_location_and_authorized_client_round_trip(secured, cert, make_group) -> None:
    assert secured.location.startswith("grpc+tls://127.0.0.1:")
    with StoreReader(secured.location, token=TOKEN, tls_root_certs=cert[0]) as client, \
            StoreAdmin.sharing(client) as admin:
        assert admin.health()[secured.location].ok is True
        frame = client.scan_metadata(columns=["group_id", "sample_idx"])
        assert frame["group_id"].to_list() == ["secret-group"] * 4
        table = client.fetch([PlannedSlice(node=secured.location, group_id="secret-group", start=1, stop=3)])
        assert table.column("sample_idx").to_pylist() == [1, 2]


def _read_on_channel(raw: flight.FlightClient, ticket: bytes, options: flight.FlightCallOptions) -> None:
    """A read channel opened by hand, asked for ``ticket``'s rows."""
    writer, reader = raw.do_exchange(flight.FlightDescriptor.for_command(ReadChannelDescriptor().to_bytes()), options)
    writer.begin(pa.schema([]))
    writer.write_metadata(ticket)
    reader.read_chunk()


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", TOKEN[:-1], ""])
def test_missing_or_wrong_token_is_unauthenticated_and_sees_nothing(
    secured, cert, token, monkeypatch, make_group
) -> None:
    monkeypatch.delenv("KNIT_TOKEN", raising=False)
    loc = secured.location
    options = flight.FlightCallOptions(
        timeout=10, headers=[] if token is None else [(b"authorization", b"Bearer " + token.encode())]
    )
    raw = flight.FlightClient(loc, tls_root_certs=cert[0])
    meta = MetadataTicket(since=0).to_bytes()
    slices = SlicesTicket(slices=[SliceRef(group_id="secret-group", start=0, stop=4)]).to_bytes()
    calls = {
        "do_get metadata": lambda: raw.do_get(flight.Ticket(meta), options).read_all(),
        "do_get slices": lambda: raw.do_get(flight.Ticket(slices), options).read_all(),
        "health": lambda: list(raw.do_action(flight.Action("health", b""), options)),
        "stats": lambda: list(raw.do_action(flight.Action("stats", b""), options)),
        "release": lambda: list(
            raw.do_action(flight.Action("release", ReleaseBody(group_ids=["secret-group"]).to_bytes()), options)
        ),
        "list_flights": lambda: list(raw.list_flights(b"", options)),
        "list_actions": lambda: raw.list_actions(options),
        "get_flight_info": lambda: raw.get_flight_info(
            flight.FlightDescriptor.for_command(GroupRef(group_id="secret-group").to_bytes()), options
        ),
        "do_exchange reads": lambda: _read_on_channel(raw, slices, options),
    }
    for what, call in calls.items():
        with pytest.raises(flight.FlightUnauthenticatedError, match="unauthenticated"):
            call()
            pytest.fail(f"{what} succeeded without the right token")
    table = pa.Table.from_batches([make_group("intruder", size=2)])
    errors: list[flight.FlightError] = []
    try:  # the refusal surfaces at do_put or at a later step, depending on timing
        writer, reader = raw.do_put(
            flight.FlightDescriptor.for_command(PutGroup(group_id="intruder", rows=2).to_bytes()), table.schema, options
        )
    except flight.FlightError as exc:
        errors.append(exc)
    else:
        for step in (lambda: writer.write_table(table), writer.done_writing, reader.read, writer.close):
            try:
                step()
            except flight.FlightError as exc:
                errors.append(exc)
    assert errors and all(isinstance(e, flight.FlightUnauthenticatedError) for e in errors), errors
    raw.close()
    # nothing changed: the group is still there, unreleased, and nothing was written
    assert secured.store.group_ids() == ["secret-group"]
    # the project client raises the same typed error
    with StoreReader(loc, token=token or None, tls_root_certs=cert[0]) as client, StoreAdmin.sharing(client) as admin:
        with pytest.raises(flight.FlightUnauthenticatedError):
            client.scan_metadata()
        with pytest.raises(flight.FlightUnauthenticatedError):
            client.fetch([PlannedSlice(node=loc, group_id="secret-group", start=0, stop=1)])
        assert admin.health()[loc].ok is False


def test_token_from_environment(secured, cert, monkeypatch) -> None:
    monkeypatch.setenv("KNIT_TOKEN", TOKEN)
    with StoreReader(secured.location, tls_root_certs=cert[0]) as client:
        assert client.scan_metadata().height == 4


def test_tls_is_required_and_verified(secured, cert) -> None:
    port = secured.port
    # plaintext gRPC against a TLS port, and TLS without trusting the self-signed root: no answer
    for loc, roots in ((f"grpc://127.0.0.1:{port}", None), (secured.location, None)):
        with StoreReader(loc, token=TOKEN, tls_root_certs=roots, timeout=5, retries=0) as client, \
                StoreAdmin.sharing(client) as admin:
            assert admin.health()[loc].ok is False
            with pytest.raises(flight.FlightError):
                client.scan_metadata()


def test_tokens_are_compared_in_constant_time(cert, monkeypatch, tmp_path: Path) -> None:
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with StoreServer(_token_config(tmp_path, "tok")) as server:
        with StoreAdmin(server.location, token="bad") as client:
            assert client.health()[server.location].ok is False
        with StoreAdmin(server.location, token="tok") as client:
            assert client.health()[server.location].ok is True
    assert (b"Bearer bad", b"Bearer tok") in seen and (b"Bearer tok", b"Bearer tok") in seen


def test_server_refuses_half_a_tls_config_and_bad_tokens(cert, tmp_path: Path) -> None:
    cert_file = tmp_path / "cert.pem"
    cert_file.write_bytes(cert[0])
    with pytest.raises(ValueError, match="together"):
        ServerConfig(tls_cert_file=str(cert_file))
    for bad in ("caf\u00e9", "line\nbreak", "tab\tinside"):
        with pytest.raises(ValueError, match="printable ASCII"):
            StoreServer(_token_config(tmp_path, bad))
    for empty in ("", " \n"):
        with pytest.raises(ValueError, match="is empty"):
            StoreServer(_token_config(tmp_path, empty))
    with pytest.raises(ValueError, match="printable ASCII"):
        StoreReader("grpc://127.0.0.1:1", token="caf\u00e9")


def test_secured_node_process(tmp_path: Path, cert, make_group, node_process) -> None:
    proc, loc = node_process(_secured_config(tmp_path, cert))
    assert loc.startswith("grpc+tls://127.0.0.1:")
    with StoreReader(loc, token=TOKEN, tls_root_certs=cert[0]) as client, StoreWriter.sharing(client) as writer:
        node = writer.put_group(make_group("g", size=2))
        assert client.fetch([PlannedSlice(node=node, group_id="g", start=0, stop=2)]).num_rows == 2
    with StoreReader(loc, token="nope", tls_root_certs=cert[0]) as client, pytest.raises(
        flight.FlightUnauthenticatedError
    ):
        client.scan_metadata()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0


def test_secret_files_readable_by_others_are_refused(cert, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok", encoding="utf-8")
    token_file.chmod(0o644)
    with pytest.raises(PermissionError, match=r"accessible to other users \(mode -rw-r--r--\); run `chmod 600"):
        StoreServer(ServerConfig(auth_token_file=str(token_file)))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert[0])  # a certificate is public: mode 644 is fine
    key_file.write_bytes(cert[1])
    key_file.chmod(0o640)
    with pytest.raises(PermissionError, match="TLS key file"):
        StoreServer(ServerConfig(tls_cert_file=str(cert_file), tls_key_file=str(key_file)))
    from flight_store.config import ClientConfig

    with pytest.raises(PermissionError, match="auth token file"):
        StoreReader.from_config("grpc://127.0.0.1:1", ClientConfig(token_file=str(token_file)))
