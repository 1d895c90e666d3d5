"""API key lookup (argument, Colab secret, environment) and the Secret wrapper that never shows its value."""

from __future__ import annotations

import copy
import logging
import pickle
import sys
import types

import pytest

from art_nb.secrets import MissingSecretError, Secret, find_secret

VALUE = "sk-unit-3f9a1c77e2"


@pytest.fixture
def colab(monkeypatch):
    """A stand-in for google.colab.userdata: `secrets` maps names to values, a missing one raises."""
    secrets: dict[str, str] = {}

    class SecretNotFoundError(Exception):
        pass

    def get(name: str) -> str:
        if name not in secrets:
            raise SecretNotFoundError(name)
        return secrets[name]

    userdata = types.ModuleType("google.colab.userdata")
    userdata.get = get
    google, colab_module = types.ModuleType("google"), types.ModuleType("google.colab")
    google.colab, colab_module.userdata = colab_module, userdata
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab_module)
    monkeypatch.setitem(sys.modules, "google.colab.userdata", userdata)
    return secrets


def test_argument_beats_colab_beats_environment(colab, monkeypatch):
    monkeypatch.setenv("MY_KEY", "from-env")
    colab["MY_KEY"] = "from-colab"
    assert find_secret("from-arg", name="MY_KEY").reveal() == "from-arg"
    found = find_secret(None, name="MY_KEY")
    assert found.reveal() == "from-colab" and found.source == "Colab secret MY_KEY"
    del colab["MY_KEY"]  # userdata.get raises SecretNotFoundError: fall through to the environment
    found = find_secret(None, name="MY_KEY")
    assert found.reveal() == "from-env" and found.source == "environment variable MY_KEY"


def test_missing_key_says_where_to_put_it(monkeypatch):
    monkeypatch.delenv("MY_KEY", raising=False)
    with pytest.raises(MissingSecretError, match="pass api_key=.*Colab secret named MY_KEY.*MY_KEY"):
        find_secret(None, name="MY_KEY", purpose="the test")
    assert find_secret(None, name="MY_KEY", required=False) is None


def test_empty_key_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        Secret("  ")


def test_the_value_is_never_shown(caplog):
    secret = Secret(VALUE, "argument")
    caplog.set_level(logging.DEBUG)
    logging.getLogger("art_nb").info("using %s / %r", secret, secret)
    shown = [repr(secret), str(secret), f"{secret}", f"{secret!r}", "%s" % (secret,), repr([secret]),
             repr({"key": secret}), caplog.text]
    for text in shown:
        assert VALUE not in text
    assert "********" in repr(secret) and "argument" in repr(secret)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(secret)
    assert copy.deepcopy(secret) is secret


def test_reveal_redact_and_constant_time_match():
    secret = Secret(VALUE)
    assert secret.reveal() == VALUE
    assert secret.redact(f"error: key {VALUE} invalid") == "error: key ******** invalid"
    assert secret.redact("nothing here") == "nothing here"
    assert secret.matches(VALUE) and secret.matches(VALUE.encode())
    assert not secret.matches(VALUE[:-1]) and not secret.matches(b"")
