"""The agent as an OpenAI-compatible Serve app: the openai client, the eval job against it, bad input."""

from __future__ import annotations

import base64
import io
import json
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from osvl.kg.schema import SAMPLE_DIR

EIFFEL = SAMPLE_DIR / "images" / "categorization_monuments_eiffeltower.jpg"
TOKEN = "s3cret-agent-token"


def data_url(path=EIFFEL, fmt="png") -> str:
    buf = io.BytesIO()
    with Image.open(path) as im:
        im.convert("RGB").save(buf, format=fmt.upper())
    return f"data:image/{fmt};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def agent(ray_cluster):
    """Base URL of the agent app serving the tiny checkpoint, token required (Serve shut down after)."""
    import os

    from ray import serve

    from osvl.cluster import start_serve
    from serve.agent_app import AGENT_APP, AgentServeConfig, make_agent_app

    os.environ["OSVL_AGENT_TEST_TOKEN"] = TOKEN
    cfg = AgentServeConfig(model="tiny", token_env="OSVL_AGENT_TEST_TOKEN", max_body_bytes=2 * 2**20,
                           max_pixels=2_000_000)
    cfg.agent.max_turns = 3
    port = start_serve()
    serve.run(make_agent_app(cfg), name=AGENT_APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    os.environ.pop("OSVL_AGENT_TEST_TOKEN")


def post(url: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def user(*parts, model="osvl-agent") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": list(parts)}]}).encode()


TEXT = {"type": "text", "text": "Which tower is shown in the image?"}


@pytest.mark.slow
def test_the_openai_client_gets_an_answer_and_the_trajectory(agent):
    import openai

    client = openai.OpenAI(base_url=agent + "/v1", api_key=TOKEN, timeout=120, max_retries=0)
    out = client.chat.completions.create(model="osvl-agent", messages=[{"role": "user", "content": [
        TEXT, {"type": "image_url", "image_url": {"url": data_url()}}]}])
    assert out.object == "chat.completion" and isinstance(out.choices[0].message.content, str)
    traj = out.model_extra["osvl_trajectory"]
    assert traj["turns"] and traj["stop_reason"] in ("response", "fatal", "max_turns", "max_tokens",
                                                     "context_overflow")
    # the untrained tiny model's turns do not parse: each is answered with an error and the loop goes on
    assert len(traj["turns"]) == 3 and traj["turns"][0]["error_kind"] == "invalid_call"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=agent + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="osvl-agent", messages=[{"role": "user", "content": "hi"}])


def _big_png() -> str:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((1500, 1500, 3), np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


BAD = [  # (why, body, token, expected status, expected code)
    ("no token", user(TEXT, {"type": "image_url", "image_url": {"url": data_url()}}), None, 401, "invalid_token"),
    ("wrong token", user(TEXT), "nope", 401, "invalid_token"),
    ("not JSON", b"{not json", TOKEN, 400, "invalid_json"),
    ("JSON list", b"[1, 2]", TOKEN, 400, "invalid_body"),
    ("unknown model", user(TEXT, model="gpt-5"), TOKEN, 404, "model_not_found"),
    ("no messages", json.dumps({"model": "osvl-agent", "messages": []}).encode(), TOKEN, 400, "invalid_messages"),
    ("no user message", json.dumps({"model": "osvl-agent", "messages": [{"role": "system", "content": "x"}]}).encode(),
     TOKEN, 400, "no_user_message"),
    ("no image", user(TEXT), TOKEN, 400, "no_image"),
    ("no question", user({"type": "image_url", "image_url": {"url": data_url()}}), TOKEN, 400, "no_question"),
    ("bad part", user(TEXT, {"type": "audio", "audio": "x"}), TOKEN, 400, "invalid_content"),
    ("garbage base64", user(TEXT, {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}), TOKEN,
     400, "unreadable_image"),
    ("not an image", user(TEXT, {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"hello world").decode()}}), TOKEN, 400, "unreadable_image"),
    ("http URL, fetching off", user(TEXT, {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}),
     TOKEN, 400, "url_fetch_disabled"),
    ("file URL", user(TEXT, {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}), TOKEN, 400,
     "bad_image_url"),
    ("image over max_pixels", user(TEXT, {"type": "image_url", "image_url": {"url": _big_png()}}), TOKEN, 413,
     "image_too_large"),
    ("body over the limit", user(TEXT, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                           + "A" * (3 * 2**20)}}), TOKEN, 413,
     "body_too_large"),
    ("too many images", user(TEXT, *[{"type": "image_url", "image_url": {"url": data_url()}}] * 5), TOKEN, 413,
     "too_many_images"),
    ("stream", json.dumps({"model": "osvl-agent", "stream": True, "messages": [{"role": "user", "content": "x"}]})
     .encode(), TOKEN, 400, "stream_unsupported"),
]


@pytest.mark.slow
def test_bad_requests_get_typed_4xx_and_the_app_stays_healthy(agent):
    for why, body, token, status, code in BAD:
        got, answer = post(agent, body, token)
        assert (got, answer.get("error", {}).get("code")) == (status, code), why
    with urllib.request.urlopen(agent + "/healthz", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"
    got, answer = post(agent, user(TEXT, {"type": "image_url", "image_url": {"url": data_url()}}))
    assert got == 200 and answer["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.slow
def test_the_eval_job_scores_the_service_as_an_openai_model(agent, tmp_path, monkeypatch):
    from jobs.eval import main

    shutil.copy(EIFFEL, tmp_path / "tower.jpg")
    (tmp_path / "b.jsonl").write_text(json.dumps({"id": "t", "question": "Which tower is shown in the image?",
                                                  "answer": "Eiffel Tower", "images": ["tower.jpg"]}) + "\n")
    monkeypatch.setenv("AGENT_KEY", TOKEN)
    summary = main([f"--run.root={tmp_path / 'runs'}", f"--benchmarks={tmp_path / 'b.jsonl'}",
                    "--modes=direct,agentic", "--model=openai:osvl-agent", f"--endpoint.base_url={agent}/v1",
                    "--endpoint.api_key_env=AGENT_KEY", "--text_search.dense_rerank=false"])
    modes = summary["benchmarks"]["b"]["modes"]
    # the service answered every request (an engine error would be a failure of kind engine_error)
    assert all(t["items"] == 1 and "engine_error" not in t["failures"] for t in modes.values()), modes
