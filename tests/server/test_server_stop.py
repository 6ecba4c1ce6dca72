"""Stop strings through a real server: the engine process owns the text and stop strings, so it never
generates a token past a stop string (no abort round trip from the API server)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import MODEL_NAME, serving

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig
from radixserve.runtime.engine_client import EngineClient
from radixserve.runtime.messages import Abort, ToEngine

PROMPT = "Count the tokens of a stopped request"
MAX_TOKENS = 96


def _stop_string(engine: Engine) -> str:
    """A 3-character piece of the greedy text that first occurs about a quarter of the way in, so the
    request would go on for many tokens after it."""
    free = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]
    text = free.outputs[0].text
    for i in range(len(text) // 4, len(text) - 3):
        piece = text[i : i + 3]
        if text.find(piece) == i:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_the_engine_generates_no_token_past_a_stop_string(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=1024)
    offline = Engine(config.model, page_size=config.page_size, num_pages=config.num_pages)
    stop = _stop_string(offline)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[stop])
    expected = offline.generate([PROMPT], params)[0].outputs[0]
    assert expected.finish_reason == "stop" and 0 < len(expected.token_ids) < MAX_TOKENS // 2

    sent: list[ToEngine] = []
    send = EngineClient.send

    def recording_send(self: EngineClient, msg: ToEngine) -> bool:
        sent.append(msg)
        return send(self, msg)

    monkeypatch.setattr(EngineClient, "send", recording_send)
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stop": [stop],
    }
    with serving(config) as served, httpx.Client(base_url=served.url, timeout=60) as client:
        before = served.engine.stats().generation_tokens
        r = client.post("/v1/completions", json=body)
        r.raise_for_status()
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert (choice["finish_reason"], choice["text"]) == ("stop", expected.text)
        assert usage["completion_tokens"] == len(expected.token_ids)
        # The request's last step is reported with its outputs; a step past the stop would come after.
        stats = served.engine.stats()
        for _ in range(50):
            if stats.num_running == 0:
                break
            time.sleep(0.02)
            stats = served.engine.stats()
        generated = stats.generation_tokens - before
    assert stats.num_running == 0
    # Every token the engine generated for the request was sent to the client, the last one completing
    # the stop string; none came after it, and the API server sent no abort for it.
    assert generated == len(expected.token_ids)
    assert not [m for m in sent if isinstance(m, Abort)]
