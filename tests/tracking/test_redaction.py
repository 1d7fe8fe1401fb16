"""Redaction (`rl_lightning.redaction`): which keys are secret (and the near misses that are not), URL credentials and
secret query parameters, values read with ``${oc.env:...}``, config trees and command lines."""

import dataclasses

import pytest

from rl_lightning import redaction
from rl_lightning.redaction import redact, redact_argv, redact_text, redact_url, remember_env, secret_key


@pytest.fixture(autouse=True)
def _forget():
    saved = dict(redaction._remembered)
    yield
    redaction._remembered.clear()
    redaction._remembered.update(saved)


SECRET = ["token", "hf_token", "HF_TOKEN", "hfToken", "api_key", "apiKey", "x-api-key", "APIKEY", "access_key",
          "secret", "client_secret", "secret_name", "password", "db_password", "passwd", "passphrase", "credentials",
          "auth", "basic_auth", "Authorization", "private_key", "key", "sentry_dsn", "model.rollout.reward_model.token"]
NOT_SECRET = ["max_new_tokens", "tokenizer", "tokenizer_name", "token_budget", "tokens", "num_tokens", "pad_token",
              "eos_token", "filler_token", "pad_token_id", "stop_token_ids", "keys", "sort_key", "cache_key",
              "kl_coef", "kl", "author", "api_key_env", "monkey", "keyboard", "max_completion_tokens", "url", "path",
              "tokens_cap", "inflight_segment_tokens", "key_points", ""]


@pytest.mark.parametrize("key", SECRET)
def test_secret_keys(key):
    assert secret_key(key)


@pytest.mark.parametrize("key", NOT_SECRET)
def test_near_misses_are_not_secret(key):
    assert not secret_key(key)


def test_url_credentials_and_secret_query_parameters():
    assert redact_url("postgresql://user:pw@db.example:5432/mlflow") == "postgresql://***@db.example:5432/mlflow"
    assert redact_url("see http://rm-user:sk-live-123@rm:8000/v1 and https://h/x") == (
        "see http://***@rm:8000/v1 and https://h/x")
    assert redact_url("https://token@github.com/o/r.git") == "https://***@github.com/o/r.git"
    assert redact_url("sqlite:///file:m.db?uri=true&access_token=abc123&mode=rwc") == (
        "sqlite:///file:m.db?uri=true&access_token=***&mode=rwc")
    assert redact_url("http://h/?key=1&keys=2&max_new_tokens=3&sig=x") == "http://h/?key=***&keys=2&max_new_tokens=3&sig=x"
    for plain in ("sqlite:///mlflow.db", "http://127.0.0.1:5000", "a user@example.org mail", "x=1 y@z", "asset:tiny"):
        assert redact_url(plain) == plain


def test_env_values_are_shown_as_their_reference(monkeypatch):
    monkeypatch.setenv("RM_SECRET", "hunter2-long-value")
    monkeypatch.setenv("ACCEL", "cpu")  # short: a setting, never replaced in text
    names = remember_env(["url: http://u:${oc.env:RM_SECRET}@h", "x: ${oc.env: ACCEL}", "${oc.env:UNSET_VAR,dflt}"])
    assert names == ["RM_SECRET", "ACCEL", "UNSET_VAR"]
    assert redact_text("failed: hunter2-long-value on cpu") == "failed: ${oc.env:RM_SECRET} on cpu"
    assert redact({"webhook": "https://hooks/T0/hunter2-long-value"}) == {"webhook": "https://hooks/T0/${oc.env:RM_SECRET}"}


def test_config_trees_and_dataclasses_are_copied_redacted():
    @dataclasses.dataclass(frozen=True)
    class RM:
        url: str
        api_key_env: str | None = None

        def __post_init__(self):
            assert "***" not in self.url  # never re-run on the redacted copy

    config = {"model": {"init_args": {"hf_token": "hf_abcdefgh", "max_new_tokens": 24, "tokenizer": "tok",
                                      "rm": RM("http://u:p@rm:1", "RM_KEY"), "auth": None, "token": ""}},
              "callbacks": [{"class_path": "X", "init_args": {"password": "pw123456"}}]}
    redacted = redact(config)
    inner = redacted["model"]["init_args"]
    assert inner["hf_token"] == "***" and inner["max_new_tokens"] == 24 and inner["tokenizer"] == "tok"
    assert inner["auth"] is None and inner["token"] == ""
    assert inner["rm"].url == "http://***@rm:1" and inner["rm"].api_key_env == "RM_KEY"
    assert redacted["callbacks"][0]["init_args"]["password"] == "***"
    assert config["model"]["init_args"]["rm"].url == "http://u:p@rm:1"  # the original is untouched
    assert redact_text("error: hf_abcdefgh refused") == "error: *** refused"  # a redacted key's value is remembered
    plain = {"a": [1, "x", {"b": "sqlite:///mlflow.db"}]}
    assert redact(plain) is plain


def test_command_lines():
    argv = ["fit", "--config", "recipes/grpo.yaml", "--model.hf_token", "hf_secret_1", "--data.token=abcdefgh",
            "--model.rollout.reward_model.url", "http://u:pw@rm:8000", "--model.rollout.max_new_tokens", "24"]
    assert redact_argv(argv) == ["fit", "--config", "recipes/grpo.yaml", "--model.hf_token", "***", "--data.token=***",
                                 "--model.rollout.reward_model.url", "http://***@rm:8000",
                                 "--model.rollout.max_new_tokens", "24"]
