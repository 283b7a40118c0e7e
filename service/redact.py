"""No secret reaches a log line: every log record made in the process passes `redact_text` before any handler sees
it (a LogRecord factory, so uvicorn's access log, the service's own loggers and tracebacks alike).

Redacted: the value of every query or form parameter whose name looks like a credential (`api_key`, `key`,
`token`, `access_token`, `password`, `secret`, `auth`, `signature`, `session`, ...: the name, any case, without
`_`/`-`/`.`, ends with one of `SECRET_SUFFIXES`; `max_tokens` does not), `Bearer`/`Basic` credentials, the
password of a URL (`redis://user:pw@host`) and, literally, every configured API key (`install(keys)`). uvicorn's
access records keep their five arguments (its formatter reads them by position): only the path is rewritten.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from urllib.parse import unquote

MASK = "[REDACTED]"
# a parameter is a credential when its name, lower-cased without separators, ends with one of these
SECRET_SUFFIXES = ("key", "keys", "token", "password", "passwords", "passwd", "pwd", "secret", "secrets", "auth",
                   "authorization", "credential", "credentials", "signature", "sig", "session", "sessionid", "jwt",
                   "bearer", "cookie", "otp", "code", "pass", "passphrase")
# name=value in a query string or in text: the value runs to the next separator
PARAM = re.compile(r"(?<![A-Za-z0-9_.%\-])(?P<name>[A-Za-z%][A-Za-z0-9_.%\-]{0,63})=(?P<value>[^&;\s\"'#,)]+)")
SCHEME = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=\-]+", re.I)
URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.\-]*://[^:/@\s]*:)[^@/\s]+@", re.I)

_lock = threading.Lock()
_secrets: set[str] = set()  # configured keys, replaced wherever they appear
_installed = False


def is_secret_name(name: str) -> bool:
    """`api_key`, `X-Api-Key`, `access_token`, `client_secret`, `password`: yes; `max_tokens`, `model`: no."""
    name = unquote(name) if "%" in name else name
    return name.lower().replace("_", "").replace("-", "").replace(".", "").endswith(SECRET_SUFFIXES)


def _mask(m: re.Match) -> str:
    return f"{m['name']}={MASK}" if is_secret_name(m["name"]) else m.group(0)


def redact_query(query: str) -> str:
    """`a=1&api_key=k` -> `a=1&api_key=[REDACTED]`: the value of each credential-like parameter masked."""
    return PARAM.sub(_mask, query) if "=" in query else query


def redact_text(text: str) -> str:
    """`text` with credential-like parameters, authorization credentials, URL passwords and configured keys
    masked. O(len(text)) per pattern."""
    if "=" in text:
        text = PARAM.sub(_mask, text)
    text = SCHEME.sub(lambda m: f"{m.group(1)} {MASK}", text)
    if "://" in text:
        text = URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", text)
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    if "%" in text and _secrets:  # a configured key sent percent-encoded: everything after the first '?' goes
        plain = unquote(text)
        if any(secret in plain for secret in _secrets):
            head, sep, _ = text.partition("?")
            text = f"{head}?{MASK}" if sep else MASK
    return text


def redact_record(record: logging.LogRecord) -> logging.LogRecord:
    """Rewrite one record in place: uvicorn's access records by their path argument, others by their message
    (formatted now, arguments dropped, only when something was masked) and their traceback."""
    args = record.args
    if record.name == "uvicorn.access" and isinstance(args, tuple) and len(args) == 5:
        path = str(args[2])
        clean = redact_text(path)
        if clean != path:
            record.args = (args[0], args[1], clean, args[3], args[4])
        return record
    try:
        message = record.getMessage()
    except Exception:  # a malformed record: the logging module reports it as it would have
        return record
    clean = redact_text(message)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and not record.exc_text:
        record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
    return record


def install(secrets: Iterable[str] = ()) -> None:
    """Redact every log record made from now on in this process (idempotent); `secrets` (e.g. the configured
    API keys) are added to the strings masked wherever they appear."""
    global _installed
    with _lock:
        _secrets.update(s for s in secrets if s)
        if _installed:
            return
        previous = logging.getLogRecordFactory()

        def factory(*args, **kwargs) -> logging.LogRecord:
            return redact_record(previous(*args, **kwargs))

        logging.setLogRecordFactory(factory)
        _installed = True
