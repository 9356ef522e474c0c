"""The checks and parsers of `pdserve serve`'s HTTP settings (gateway/config.py ServeConfig, named as vLLM
names them): list flags as vLLM or pdserve takes them (--allowed-origins, ...), --root-path, and the TLS files
(--ssl-keyfile/--ssl-certfile, --ssl-ca-certs/--ssl-cert-reqs for client certificates), read at load so a
wrong file stops the server before any worker starts. What the settings become (uvicorn's options, the CORS
middleware, the base URL) is in gateway/serve_settings.py, with the other translations of ServeConfig.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path


def json_list(value: object) -> object:
    """A list setting as vLLM takes it, a JSON list ('["http://a.example"]'), or as pdserve's flags take lists
    (several values: http://a.example http://b.example; in an environment variable, separated by spaces);
    anything else is left for pydantic to judge."""
    if isinstance(value, str):
        value = [value] if value.lstrip().startswith("[") else value.split()
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) \
            and value[0].lstrip().startswith("["):
        try:
            return json.loads(value[0])
        except json.JSONDecodeError as error:
            raise ValueError(f"not a JSON list of strings: {value[0]!r} ({error})") from None
    return value


def check_root_path(root_path: str) -> str:
    """A proxy prefix: empty, or a path that starts with / (a trailing / is dropped: "/api/" → "/api")."""
    if root_path and not root_path.startswith("/"):
        raise ValueError(f"{root_path!r} is not a path: give the prefix the proxy serves under, e.g. /llm")
    return root_path.rstrip("/")


def check_tls(keyfile: str | None, certfile: str | None, ca_certs: str | None = None,
              cert_reqs: int = ssl.CERT_NONE) -> None:
    """Both files exist, and the key is the certificate's; the CA certificates for client certificates, if
    any, load: read here, as uvicorn will, so that a wrong file stops `pdserve serve` at once, naming the
    flag, before any worker starts.

    Raises:
        ValueError: the message names the flag.
    """
    if keyfile is None and (ca_certs is not None or cert_reqs != ssl.CERT_NONE):
        flag = "--ssl-ca-certs" if ca_certs is not None else "--ssl-cert-reqs"
        raise ValueError(f"{flag} checks client certificates over HTTPS: give --ssl-keyfile and "
                         "--ssl-certfile too")
    if cert_reqs != ssl.CERT_NONE and ca_certs is None:
        raise ValueError(f"--ssl-cert-reqs {cert_reqs} checks client certificates against --ssl-ca-certs: "
                         "give the CA certificates (PEM)")
    if ca_certs is not None:
        if not Path(ca_certs).is_file():
            raise ValueError(f"--ssl-ca-certs: {ca_certs} does not exist or is not a file")
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError) as error:
            raise ValueError(f"--ssl-ca-certs {ca_certs}: not PEM certificates ({error})") from None
    if (keyfile is None) != (certfile is None):
        given, missing = ("--ssl-keyfile", "--ssl-certfile") if certfile is None else (
            "--ssl-certfile", "--ssl-keyfile")
        raise ValueError(f"{given} serves HTTPS only with {missing} too: give both (the private key and its "
                         "certificate, PEM)")
    if keyfile is None or certfile is None:
        return
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if not Path(path).is_file():
            raise ValueError(f"{flag}: {path} does not exist or is not a file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as error:
        raise ValueError(f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile}: not a PEM certificate and "
                         f"its private key ({error})") from None
