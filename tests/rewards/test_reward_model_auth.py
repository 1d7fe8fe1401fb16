"""A served reward model behind credentials: ``api_key_env`` sends ``Authorization: Bearer`` with the variable's value,
a URL's ``user:password@`` goes as HTTP basic auth, and neither credential is in any error the client raises, against
a real HTTP server on localhost that refuses requests without them."""

import base64

import pytest
from auth_server import AuthServer
from conftest import TINY_MODEL

from rl_lightning.errors import ConfigError
from rl_lightning.rewards.reward_model import RewardModelConfig, RewardModelError

API_KEY = "sk-live-0123456789abcdef"
PASSWORD = "pw-9876543210"


@pytest.fixture
def server(request):
    served = AuthServer(request.param)
    yield served
    served.close()


CONVERSATION = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


@pytest.mark.parametrize("server", [f"Bearer {API_KEY}"], indirect=True)
def test_api_key_env_sends_a_bearer_token(server, monkeypatch):
    monkeypatch.setenv("RM_API_KEY", API_KEY)
    config = RewardModelConfig(url=f"http://127.0.0.1:{server.port}", api_key_env="RM_API_KEY", retries=0)
    assert API_KEY not in repr(config)  # the config holds the variable's name only
    assert config.build().score([CONVERSATION]) == [pytest.approx(float(len(_ids(CONVERSATION))))]
    assert set(server.seen) == {f"Bearer {API_KEY}"}
    with pytest.raises(ConfigError) as error:  # refused: the key is wrong
        RewardModelConfig(url=f"http://127.0.0.1:{server.port}", retries=0).build().start()
    assert "HTTP 401: unauthorised" in str(error.value)
    monkeypatch.delenv("RM_API_KEY")
    with pytest.raises(ConfigError, match="model.rollout.reward_model.api_key_env='RM_API_KEY': the environment "
                                          "variable RM_API_KEY is not set"):
        RewardModelConfig(url="http://127.0.0.1:1", api_key_env="RM_API_KEY")


@pytest.mark.parametrize("server", ["Basic " + base64.b64encode(f"rm-user:{PASSWORD}".encode()).decode()],
                         indirect=True)
def test_a_credentialed_url_works_and_is_never_shown(server):
    url = f"http://rm-user:{PASSWORD}@127.0.0.1:{server.port}"
    client = RewardModelConfig(url=url, retries=0).build()
    assert client.score([CONVERSATION]) == [pytest.approx(float(len(_ids(CONVERSATION))))]
    assert client.shown_url == f"http://***@127.0.0.1:{server.port}"
    client.close()
    server.close()  # now unreachable: the errors name the URL, without its credentials
    with pytest.raises(RewardModelError) as error:
        client.score([CONVERSATION])
    assert f"reward model at http://***@127.0.0.1:{server.port}/classify: cannot connect" in str(error.value)
    wrong = RewardModelConfig(url=f"http://rm-user:{PASSWORD}@127.0.0.1:1", retries=0).build()
    with pytest.raises(ConfigError) as refused:
        wrong.start()
    with pytest.raises(ConfigError) as bad:
        RewardModelConfig(url=f"ftp://rm-user:{PASSWORD}@rm")
    for message in (str(error.value), str(refused.value), str(bad.value)):
        assert PASSWORD not in message and "rm-user" not in message, message


def _ids(conversation):
    from rl_lightning.models.loading import load_tokenizer
    from rl_lightning.rewards.reward_model import conversation_tokens

    return conversation_tokens(load_tokenizer(str(TINY_MODEL)), conversation)
