"""Scoring conversations with a trained reward model (the RM task's Hugging Face export), served or in-process.

`RewardModelClient` talks to a reward model served outside the trainer over HTTP (``vllm serve <rm folder>``: vLLM's
``/classify`` endpoint, the RL2 way), `LocalRewardModel` loads the folder with transformers and scores in the trainer
process (colocated). Both format a conversation exactly as the RM task did for training: the RM's own chat template,
tokenised message by message (`rl_lightning.data.tokenization.tokenize_messages`), and send token ids, never text, so
tokenisation cannot drift between training and serving. The score is the head's raw output at the last token (the
logit transformers returns; vLLM is asked for it with ``use_activation: false``, since by default it applies a
sigmoid to single-label classifiers).

Either can be called from a user's ``reward_fn`` (a module-level instance in the environment file, see
``rl_lightning/recipes/envs/rm_env.py``) or configured as a reward component, ``model.rollout.reward_model`` (`RewardModelConfig`),
which scores every rollout's trajectories once, batched, in the trainer process, next to ``reward_fn``.
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rl_lightning.errors import ConfigError, UserError
from rl_lightning.redaction import redact_text, redact_url, remember

KEY = "model.rollout.reward_model"
RETRY_STATUS = (429,)  # and every 5xx: the server is busy or failing, a later try may be answered


class RewardModelError(UserError):
    """The reward model server did not score a batch: unreachable, timed out, or answered with an HTTP error."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class RewardModelConfig:
    """A reward model scoring every trajectory as one more reward component: ``model.rollout.reward_model.*``.

    Args:
        url: base URL of a served reward model (``vllm serve <rm folder> --runner pooling``), e.g.
            ``http://localhost:8000``; exclusive with `path`. Credentials in it (``https://user:password@host``:
            HTTP basic auth) work, and are shown as ``***`` wherever the URL is (errors, logs, MLflow, run names).
        path: an RM folder (the RM task's export) scored in the trainer process, on the trainer's device; exclusive
            with `url`.
        model: ``url``: the served model name (default: the only model the server lists); its tokenizer formats the
            conversations unless `tokenizer` is set.
        tokenizer: tokenizer folder or hub name to format conversations with (default: `model`, or `path`).
        name: the reward component's name, logged as ``train/reward/<name>``.
        weight: its weight in the combined reward (added to a scalar ``reward_fn``'s value, or one more component of
            ``reward_weights``' combination).
        batch_size: conversations per request (``url``) or forward pass (``path``).
        timeout_s: ``url``: seconds to wait to connect, to send, and for the answer, before retrying.
        retries: ``url``: further attempts after a connection failure, timeout, 429 or 5xx answer (exponential
            backoff from 0.5 s; see `RewardModelClient`).
        concurrency: ``url``: requests in flight at once.
        on_error: a batch the server did not score: ``raise`` (stop with the URL and the fix) or ``zero`` (its
            trajectories get 0 for this component and count as reward failures).
        api_key_env: ``url``: the name of an environment variable holding the server's API key, sent as
            ``Authorization: Bearer <key>`` (``vllm serve --api-key``); the key itself is never logged or stored.
    """

    url: str | None = None
    path: str | None = None
    model: str | None = None
    tokenizer: str | None = None
    name: str = "reward_model"
    weight: float = 1.0
    batch_size: int = 32
    timeout_s: float = 60.0
    retries: int = 2
    concurrency: int = 4
    on_error: str = "raise"
    api_key_env: str | None = None

    def __post_init__(self) -> None:
        errors = []
        if self.api_key_env is not None and (self.url is None or not os.environ.get(self.api_key_env)):
            errors.append(f"api_key_env={self.api_key_env!r}: " + (
                "an API key is sent to a served model only: set url, or api_key_env: null" if self.url is None else
                f"the environment variable {self.api_key_env} is not set (or empty): export it with the API key"))
        if (self.url is None) == (self.path is None):
            errors.append(f"url and path are exclusive and one is needed, got url={redact_url(repr(self.url))}, "
                          f"path={self.path!r}: "
                          "set url to a served RM (vllm serve) or path to an RM folder")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            errors.append(f"url must start with http:// or https://, got {redact_url(repr(self.url))}")
        if self.path is not None and not (Path(self.path).is_dir() or self.path.startswith("asset:")):
            errors.append(f"path '{self.path}' is not a folder (resolved to {Path(self.path).resolve()})")
        if not self.name or not math.isfinite(self.weight) or self.weight < 0:
            errors.append(f"name must be non-empty and weight finite and >= 0, got {self.name!r}, {self.weight}")
        if self.batch_size < 1 or self.concurrency < 1 or self.retries < 0 or not self.timeout_s > 0:
            errors.append(f"batch_size and concurrency must be >= 1, retries >= 0 and timeout_s > 0, got "
                          f"{self.batch_size}, {self.concurrency}, {self.retries}, {self.timeout_s}")
        if self.on_error not in ("raise", "zero"):
            errors.append(f"on_error must be raise or zero, got {self.on_error!r}")
        if errors:
            raise ConfigError("; ".join(f"{KEY}.{e}" for e in errors))

    def build(self) -> RewardModelClient | LocalRewardModel:
        """The scorer this configures (not started: `start` it on the trainer's device)."""
        if self.url is not None:
            return RewardModelClient(self.url, self.model, self.tokenizer, self.batch_size, self.timeout_s,
                                     self.retries, self.concurrency,
                                     api_key=os.environ.get(self.api_key_env) if self.api_key_env else None)
        return LocalRewardModel(str(self.path), self.tokenizer, self.batch_size)  # __post_init__: one of them is set


def conversation_tokens(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The token ids the RM task trains on for the conversation `messages` (prompt and assistant turns).

    The chat template's rendering, tokenised message by message (`rl_lightning.data.preference.PreferenceDataModule`).
    """
    from rl_lightning.data.tokenization import tokenize_messages

    return tokenize_messages(tokenizer, messages, last_turn_only=True).input_ids


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class RewardModelClient:
    """A reward model served by vLLM (``vllm serve <rm folder> --runner pooling``), scored over HTTP with httpx.

    Conversations are tokenised here with the RM's tokenizer and sent as token ids to ``POST /classify`` with
    ``use_activation: false`` (the raw score), `batch_size` per request, `concurrency` requests at once over one
    pooled `httpx.Client` (`concurrency` connections, kept alive between requests). `timeout_s` bounds connecting,
    sending and each wait for the answer. A request is tried at most ``1 + retries`` times:

    - a connection that cannot be made (refused, or not made within `timeout_s`) is retried by the transport
      (``httpx.HTTPTransport(retries=retries)``, with httpcore's backoff of 0 s, 0.5 s, 1 s...);
    - an answer that does not come within `timeout_s`, a connection dropped mid-request, and a 429 or 5xx answer are
      retried here (`RETRY_STATUS`), after ``backoff_s * 2 ** (attempt - 1)`` seconds;
    - any other HTTP error is not retried.

    A server that stops mid-run and comes back needs nothing more: while it is down, requests fail (scored per
    ``on_error`` and counted in `failed_requests`), and the first request after it is back opens a fresh connection.

    `start` checks the server (``GET /v1/models``) and loads the tokenizer. In a ``reward_fn``:
    ``client = RewardModelClient("http://localhost:8000")`` at module level, then ``client.score([messages])[0]`` (it
    starts itself on first use).

    Credentials: `api_key` goes as ``Authorization: Bearer <api_key>``; a URL's ``user:password@`` as HTTP basic
    auth. Messages show the URL as `shown_url` (credentials as ``***``), and neither is ever logged.
    """

    def __init__(self, url: str, model: str | None = None, tokenizer: str | None = None, batch_size: int = 32,
                 timeout_s: float = 60.0, retries: int = 2, concurrency: int = 4, backoff_s: float = 0.5,
                 key: str = KEY, api_key: str | None = None) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        self.shown_url = redact_url(self.url)
        self.api_key = api_key
        remember(api_key)
        self.model, self.tokenizer_name, self.key = model, tokenizer, key
        self.batch_size, self.timeout_s, self.retries, self.concurrency = batch_size, timeout_s, retries, concurrency
        self.backoff_s = backoff_s
        self.tokenizer: Any = None
        self._http: httpx.Client | None = None
        self.failed_requests = 0  # scoring requests that failed after their retries (``rollout/reward_model_failures``)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_http": None}  # a connection pool does not travel: the copy opens its own

    def http(self) -> httpx.Client:
        """The pooled HTTP client (made on first use), with the transport that retries connections."""
        if self._http is None:
            limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(self.timeout_s), headers=headers,
                                      transport=httpx.HTTPTransport(retries=self.retries, limits=limits))
        return self._http

    def close(self) -> None:
        """Close the pooled connections (a later request opens new ones)."""
        if self._http is not None:
            self._http.close()
            self._http = None

    def start(self, device: Any = None) -> None:
        """Check the server lists the model (one-line `ConfigError` otherwise) and load the tokenizer.

        `device` is ignored (the server has its own).
        """
        if self.tokenizer is not None:
            return
        try:
            served = [m["id"] for m in self._request("GET", "/v1/models", None, self.timeout_s, startup=True)["data"]]
        except RewardModelError as e:
            raise ConfigError(str(e)) from None
        if self.model is None:
            if len(served) != 1:
                raise ConfigError(f"{self.key}.model is not set and {self.shown_url} serves {served}: name one")
            self.model = served[0]
        elif self.model not in served:
            raise ConfigError(f"{self.key}.model={self.model!r} is not served by {self.shown_url} (it serves {served}): "
                              "set it to one of those")
        from rl_lightning.models.loading import load_tokenizer

        self.tokenizer = load_tokenizer(self.tokenizer_name or self.model)

    def score(self, conversations: list[list[dict]]) -> list[float]:
        """The reward of each conversation (prompt messages and the assistant's turns).

        Raises `RewardModelError` if a batch could not be scored.
        """
        scores = self.score_each(conversations)
        for value in scores:
            if isinstance(value, RewardModelError):
                raise value
        return [value for value in scores if not isinstance(value, RewardModelError)]

    def score_each(self, conversations: list[list[dict]]) -> list[float | RewardModelError]:
        """Like `score`, but a batch that could not be scored gives its error in place of each of its scores."""
        self.start()
        return self.score_tokens([conversation_tokens(self.tokenizer, c) for c in conversations])

    def score_tokens(self, token_ids: list[list[int]]) -> list[float | RewardModelError]:
        """Scores of already formatted sequences, `batch_size` per request (errors in place, as in `score_each`)."""
        batches = _chunks(token_ids, self.batch_size)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(batches), 1))) as pool:
            results = list(pool.map(self._score_batch, batches))
        self.failed_requests += sum(isinstance(result, RewardModelError) for result in results)
        return [value for batch, result in zip(batches, results, strict=True)
                for value in (result if isinstance(result, list) else [result] * len(batch))]

    def _score_batch(self, token_ids: list[list[int]]) -> list[float] | RewardModelError:
        body = {"model": self.model, "input": token_ids, "use_activation": False}
        try:
            answer = self._request("POST", "/classify", body, self.timeout_s)
        except RewardModelError as e:
            return e
        rows = sorted(answer["data"], key=lambda row: row["index"])
        if len(rows) != len(token_ids) or any(len(row["probs"]) != 1 for row in rows):
            raise ConfigError(f"{self.key}: {self.shown_url} model {self.model!r} did not return one score per sequence "
                              "(is it a num_labels=1 reward model, e.g. the RM task's export?)")
        return [float(row["probs"][0]) for row in rows]

    def _request(self, method: str, route: str, body: Any, timeout_s: float, startup: bool = False) -> Any:
        """One JSON request under the retry policy; `RewardModelError` (one line: URL, cause, key, fix) if all failed."""
        attempts, timed_out, cause = 0, False, ""
        while attempts <= self.retries:
            if attempts:
                time.sleep(self.backoff_s * 2 ** (attempts - 1))
            attempts += 1
            try:
                response = self.http().request(method, route, json=body, timeout=timeout_s)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # the transport has spent the retries on it
                timed_out, attempts = isinstance(e, httpx.ConnectTimeout), attempts + self.retries
                cause = f"no answer within timeout_s={timeout_s}" if timed_out else f"cannot connect ({e})"
                break
            except httpx.TimeoutException:
                timed_out, cause = True, f"no answer within timeout_s={timeout_s}"
                continue
            except httpx.TransportError as e:  # the connection dropped mid-request
                timed_out, cause = False, f"cannot connect ({e})"
                continue
            if response.is_success:
                return response.json()
            timed_out, cause = False, f"HTTP {response.status_code}: {_first_line(response.text)}"
            if response.status_code not in RETRY_STATUS and response.status_code < 500:
                break
        fix = (f"raise {self.key}.timeout_s or check the server" if timed_out else
               f"check {self.key}.url and that the server runs (vllm serve <rm folder> --runner pooling)")
        if not startup:  # the start-up check always stops: a run must not train on zeros from a wrong URL
            fix += f", or set {self.key}.on_error: zero to score such trajectories 0"
        raise RewardModelError(redact_text(f"reward model at {self.shown_url}{route}: {cause} after {attempts} attempt(s) "
                                           f"({self.key}.url={self.shown_url}, timeout_s={timeout_s}); {fix}"), timed_out)


def _first_line(text: str) -> str:
    try:  # vLLM answers errors as {"error": {"message": ...}}
        text = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return str(text).strip().splitlines()[0][:300] if str(text).strip() else "(empty body)"


class LocalRewardModel:
    """An RM folder (``AutoModelForSequenceClassification``, one label) scored in this process, without gradients.

    `batch_size` conversations per forward (right-padded, read where transformers pools: the last non-pad token, as
    the RM task trains). `start` loads it on `device` (the trainer's).
    """

    def __init__(self, path: str, tokenizer: str | None = None, batch_size: int = 8) -> None:
        self.path, self.tokenizer_name, self.batch_size = path, tokenizer, batch_size
        self.model: Any = None
        self.tokenizer: Any = None

    def start(self, device: Any = None) -> None:
        """Load the model (once) and move it to `device` (default: CPU)."""
        if self.model is None:
            from transformers import AutoModelForSequenceClassification

            from rl_lightning.models.loading import load_tokenizer, resolve_model

            self.model = AutoModelForSequenceClassification.from_pretrained(resolve_model(self.path)).eval()
            self.model.requires_grad_(False)
            if self.model.config.num_labels != 1:
                raise ConfigError(f"{KEY}.path '{self.path}' has num_labels={self.model.config.num_labels}; a reward "
                                  "model has 1 (the RM task's export)")
            self.tokenizer = load_tokenizer(self.tokenizer_name or self.path)
            if self.model.config.pad_token_id is None:
                self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if device is not None:
            self.model.to(device)

    def score(self, conversations: list[list[dict]]) -> list[float]:
        """The reward of each conversation (prompt messages and the assistant's turns)."""
        self.start()
        return self.score_tokens([conversation_tokens(self.tokenizer, c) for c in conversations])

    def score_each(self, conversations: list[list[dict]]) -> list[float]:
        """`score` (in-process scoring has no partial failures)."""
        return self.score(conversations)

    def score_tokens(self, token_ids: list[list[int]]) -> list[float]:
        """Scores of already formatted sequences."""
        import torch

        scores: list[float] = []
        device, pad = next(self.model.parameters()).device, self.model.config.pad_token_id
        with torch.no_grad():
            for batch in _chunks(token_ids, self.batch_size):
                width = max(len(ids) for ids in batch)
                input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in batch], device=device)  # (B, T)
                mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in batch], device=device)
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits  # (B, 1)
                scores += logits[:, 0].float().cpu().tolist()
        return scores
