"""Secrets never leave the process: what the trainer writes or shows is redacted here first.

Three kinds of secret are recognised, in config trees and in free text (error messages, run names, terminal lines):

- **credentials in a URL**: the user and password before ``@`` (``postgresql://user:pw@host/db`` ->
  ``postgresql://***@host/db``: scheme, host, port and path stay) and the value of a query parameter whose name is
  secret (``?token=...`` -> ``?token=***``);
- **secret-named keys**: a string value under a key that names a credential (`secret_key`: ``hf_token``,
  ``api_key``, ``password``, ``client_secret``, ``basic_auth``; not ``max_new_tokens``, ``tokenizer``, ``pad_token``,
  ``sort_key``, ``token_budget``, ``keys``);
- **values taken from the environment**: the value of every variable a recipe reads with ``${oc.env:NAME}`` (6
  characters or more: shorter ones are settings such as ``cpu``, never credentials) is written back as the reference
  itself, ``${oc.env:NAME}``, wherever it appears; the config still says where the value comes from, and a rerun
  resolves it again. Values of secret variables the library reads itself (``reward_model.api_key_env``) are
  `remember`-ed the same way.

Pure functions and one process-wide set of remembered values; no imports of ours, so every layer may use it.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Iterable
from typing import Any

REDACTED = "***"
MIN_SECRET_CHARS = 6  # shorter remembered values (``cpu``, ``1``) are settings, and replacing them would garble text
# words that name a credential wherever they stand in a key
SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwords", "passwd", "passphrase", "credential",
                          "credentials", "apikey", "privatekey", "bearer", "cookie"})
# words that name a credential as a key's last word (``hf_token``, ``api_key``, ``basic_auth``), unless the word
# before says what else it is (``pad_token``: a vocabulary entry; ``sort_key``: a field name)
LAST_WORDS = frozenset({"token", "key", "auth", "authorization", "dsn"})
NOT_SECRET_BEFORE = {
    "token": frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask", "filler", "stop", "start", "end", "special",
                        "think", "answer", "image", "eot", "placeholder", "split", "separator", "boundary"}),
    "key": frozenset({"sort", "cache", "group", "answer", "dict", "primary", "foreign", "partition", "lookup", "metric",
                      "reward", "column", "field", "label", "prompt", "monitor", "hash", "seed", "rng", "join", "index",
                      "config", "row", "message", "content", "target", "id", "name"}),
}
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
# scheme://user[:password]@ (the userinfo part, RFC 3986: no '/', '@' or whitespace in it)
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.\-]*://)[^/\s@?#'\"]+@")
_QUERY = re.compile(r"([?&;])([^=&#;\s'\"]+)=([^&#;\s'\"]*)")
_ENV_REFERENCE = re.compile(r"\$\{oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)")

_remembered: dict[str, str] = {}  # secret value -> what is shown in its place (``***``)
_from_env: dict[str, str] = {}  # value of a variable read with oc.env -> ``${oc.env:NAME}``


def words(key: str) -> list[str]:
    """The lower-case words of a key: ``hfToken`` / ``hf-token`` / ``HF_TOKEN`` -> ``["hf", "token"]``."""
    return [word.lower() for word in _WORD.findall(str(key))]


def secret_key(key: str) -> bool:
    """Whether a value under `key` (a config key, a query parameter, a dotted path's last part) is a credential."""
    parts = words(str(key).rsplit(".", 1)[-1])
    if not parts:
        return False
    if SECRET_WORDS.intersection(parts):
        return True
    last = parts[-1]
    if last not in LAST_WORDS:
        return False
    return len(parts) == 1 or parts[-2] not in NOT_SECRET_BEFORE.get(last, frozenset())


def remember(value: str | None, shown_as: str = REDACTED) -> None:
    """Redact `value` from every text `redact_text` sees from now on (shown as `shown_as`); short values are ignored."""
    if value and len(value) >= MIN_SECRET_CHARS:
        _remembered[value] = shown_as


def env_references(texts: Iterable[str]) -> list[str]:
    """Names of the environment variables that `texts` (config files, command-line values) read with ``oc.env``."""
    found: list[str] = []
    for text in texts:
        found += [name for name in _ENV_REFERENCE.findall(str(text)) if name not in found]
    return found


def remember_env(texts: Iterable[str]) -> list[str]:
    """`remember` the value of each variable `texts` read with ``oc.env``, shown as ``${oc.env:NAME}``; their names."""
    names = env_references(texts)
    for name in names:
        value = os.environ.get(name)
        if value and len(value) >= MIN_SECRET_CHARS:
            _from_env[value] = f"${{oc.env:{name}}}"
    return names


def redact_url(text: str) -> str:
    """`text` with every URL's ``user:password@`` shown as ``***@`` and secret query parameters' values as ``***``."""
    text = _USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)

    def query(match: re.Match[str]) -> str:
        sep, name, value = match.groups()
        return f"{sep}{name}={REDACTED}" if value and secret_key(name) else match.group(0)

    return _QUERY.sub(query, text) if "=" in text else text


def redact_text(text: str, env: bool = True) -> str:
    """`text` without any secret this module knows: remembered values, then URL credentials (`redact_url`).

    With `env` false, values read with ``oc.env`` are kept (see `redact`).
    """
    text = str(text)
    known = {**_from_env, **_remembered} if env else _remembered
    for value in sorted(known, key=len, reverse=True):
        if value in text:
            text = text.replace(value, known[value])
    return redact_url(text)


def redact(value: Any, key: str = "", env: bool = True) -> Any:
    """A copy of `value` (a config tree: dicts, lists, tuples, dataclasses, strings) with every secret redacted.

    A non-empty string under a secret-named key (`secret_key`) becomes ``***`` (and is `remember`-ed, so it is
    redacted from free text too); any other string goes through `redact_text`. Other values are kept; an unchanged
    tree is returned as it is (the same object). With `env` false, values read with ``oc.env`` are kept: a
    checkpoint's hyperparameters, which a resume compares with the resolved config (a model path read with
    ``${oc.env:SCRATCH}`` is no credential, and must still match).
    """
    if isinstance(value, str):
        if value and key and secret_key(key) and not value.startswith("${oc.env:"):
            remember(value)
            return REDACTED
        return redact_text(value, env)
    if isinstance(value, dict):
        items = {k: redact(v, str(k), env) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else type(value)(items)
    if isinstance(value, list | tuple):
        items_ = [redact(v, key, env) for v in value]
        if all(a is b for a, b in zip(items_, value, strict=True)):
            return value
        return type(value)(items_) if not hasattr(value, "_fields") else type(value)(*items_)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: redact(getattr(value, f.name), f.name, env) for f in dataclasses.fields(value)}
        changed = {k: v for k, v in changes.items() if v is not getattr(value, k)}
        if not changed:
            return value
        new = copy.copy(value)  # not dataclasses.replace: its __post_init__ would check the redacted values again
        for name, field_value in changed.items():
            object.__setattr__(new, name, field_value)  # frozen dataclasses too
        return new
    return value


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line with secrets redacted: the value of a ``--secret_key`` and any URL's credentials."""
    out: list[str] = []
    for arg in argv:
        arg = str(arg)
        previous = out[-1] if out else ""
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            out.append(f"{key}={redact(value, key[2:])}")
        elif previous.startswith("--") and "=" not in previous and not arg.startswith("--"):
            out.append(redact(arg, previous[2:]))
        else:
            out.append(redact_text(arg))
    return out


def redact_yaml(text: str) -> str:
    """A YAML document (a dumped config) with its secrets redacted (`redact`); as it is when it holds none."""
    import yaml

    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        return redact_text(text)
    redacted = redact(loaded)
    if redacted is loaded:
        return text
    return yaml.safe_dump(redacted, sort_keys=False, allow_unicode=True, default_flow_style=False, width=120)
