"""The agent as an OpenAI-compatible Serve app: the openai client, the eval job against it, bad input."""

from __future__ import annotations

import base64
import http.client
import io
import json
import shutil
import time
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


@pytest.fixture(scope="module")
def streaming_agent(agent):
    """The tiny *agent* (it calls tools) as a second app on the same Serve instance, under /stream, with every
    tool call 1.5 s slower: long enough to tell a chunk sent before a tool answered from one sent after."""
    from ray import serve

    from serve.agent_app import AgentServeConfig, make_agent_app

    cfg = AgentServeConfig(model="tiny-agent", token_env="OSVL_AGENT_TEST_TOKEN", tool_latency_s=1.5)
    cfg.agent.max_turns = 4
    serve.run(make_agent_app(cfg), name="osvl_agent_stream", route_prefix="/stream")
    yield agent + "/stream"
    serve.delete("osvl_agent_stream")


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/healthz", timeout=30) as r:
        return json.loads(r.read())


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
    # the untrained tiny model's turns do not parse: each is answered with an error and the loop goes on, until
    # the third in a row makes the episode fatal, which finish_reason says
    assert len(traj["turns"]) == 3 and traj["turns"][0]["error_kind"] == "invalid_call"
    assert traj["stop_reason"] == "fatal" and out.choices[0].finish_reason == "fatal"
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
    ("a field it does not read", json.dumps({"model": "osvl-agent", "top_p": 0.5, "messages": [
        {"role": "user", "content": "x"}]}).encode(), TOKEN, 400, "unsupported_field"),
    ("n=2", json.dumps({"model": "osvl-agent", "n": 2, "messages": [{"role": "user", "content": "x"}]}).encode(),
     TOKEN, 400, "invalid_field"),
    ("temperature 5", json.dumps({"model": "osvl-agent", "temperature": 5, "messages": [
        {"role": "user", "content": "x"}]}).encode(), TOKEN, 400, "invalid_field"),
    ("earlier turns", json.dumps({"model": "osvl-agent", "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]})
     .encode(), TOKEN, 400, "unsupported_conversation"),
    ("two system messages", json.dumps({"model": "osvl-agent", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "system", "content": "x"}, {"role": "user", "content": "x"}
    ]}).encode(), TOKEN, 400, "unsupported_conversation"),
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
def test_unsupported_fields_are_named_and_a_host_off_loopback_needs_the_token(agent, monkeypatch):
    got, answer = post(agent, json.dumps({"model": "osvl-agent", "top_p": 0.5, "logprobs": True,
                                          "messages": [{"role": "user", "content": "x"}]}).encode())
    assert got == 400 and "'logprobs', 'top_p'" in answer["error"]["message"]
    from osvl.errors import ConfigError
    from serve.agent_app import AgentServeConfig, check_host

    monkeypatch.delenv("OSVL_AGENT_OPEN_TOKEN", raising=False)
    open_cfg = AgentServeConfig(host="0.0.0.0", token_env="OSVL_AGENT_OPEN_TOKEN")
    with pytest.raises(ConfigError, match="without a bearer token"):
        check_host(open_cfg)
    monkeypatch.setenv("OSVL_AGENT_OPEN_TOKEN", "t")
    check_host(open_cfg)  # with a token it may bind beyond loopback (not done here: tests stay on loopback)


def scripted_picture_url() -> str:
    """The first picture the tiny agent was fine-tuned on (osvl.agent.scripted), as a data URL: on it, greedy, the
    agent crops, searches and answers; on a photo it has never seen it writes turns that do not parse."""
    from osvl.agent.scripted import PLANS, picture

    assert PLANS[0][0] == EIFFEL_QUESTION["text"]
    buf = io.BytesIO()
    Image.fromarray(picture(0)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


EIFFEL_QUESTION = {"type": "text", "text": "Which tower is shown in the image?"}


@pytest.mark.slow
def test_streaming_sends_turns_as_they_happen_then_the_answer(streaming_agent):
    import openai

    client = openai.OpenAI(base_url=streaming_agent + "/v1", api_key=TOKEN, timeout=120, max_retries=0)
    t0 = time.monotonic()
    stream = client.chat.completions.create(model="osvl-agent", stream=True, temperature=0, messages=[
        {"role": "user", "content": [EIFFEL_QUESTION, {"type": "image_url",
                                                       "image_url": {"url": scripted_picture_url()}}]}])
    got = [(time.monotonic() - t0, chunk) for chunk in stream]
    first_at, first = got[0]
    assert first.object == "chat.completion.chunk" and first.choices[0].delta.role == "assistant"
    events = [(t, c.model_extra["osvl_event"]) for t, c in got if (c.model_extra or {}).get("osvl_event")]
    calls = [(t, e) for t, e in events if e["action"] == "tool_call"]
    assert calls, [e for _, e in events]
    # the first chunk left before the first tool call could have answered (each takes >= 1.5 s), and each
    # turn's event came as it happened, not all at the end
    assert first_at < calls[0][0] - 1.0
    assert calls[0][0] < got[-1][0] - 1.0
    last = got[-1][1]
    finish = last.choices[0].finish_reason
    assert finish in ("stop", "length", "fatal") and last.usage.total_tokens > last.usage.completion_tokens > 0
    assert last.model_extra["osvl_trajectory"]["stop_reason"] in ("response", "max_turns", "fatal")
    pieces = [c.choices[0].delta.content for _, c in got[1:] if c.choices and c.choices[0].delta.content]
    print(f"first chunk {first_at:.2f} s, tool events at {[round(t, 2) for t, _ in calls]}, end {got[-1][0]:.2f} s, "
          f"finish {finish}, answer chunks {pieces}")
    if finish == "stop":  # the tiny agent answers after crop and text_search: the answer came in word chunks
        assert "".join(pieces).strip() and len(pieces) == len("".join(pieces).split())
    else:
        assert not pieces


@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_stops_the_episode(streaming_agent):
    before = health(streaming_agent)
    host, rest = streaming_agent.removeprefix("http://").split("/", 1)
    conn = http.client.HTTPConnection(*host.split(":"), timeout=60)
    body = json.dumps({"model": "osvl-agent", "stream": True, "messages": [{"role": "user", "content": [
        EIFFEL_QUESTION, {"type": "image_url", "image_url": {"url": scripted_picture_url()}}]}]})
    conn.request("POST", f"/{rest}/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")  # the role chunk: the episode runs
    conn.sock.close()  # gone, mid-episode (its first tool call alone takes 1.5 s)
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = health(streaming_agent)
        if now["cancelled"] > before["cancelled"]:
            break
        time.sleep(0.2)
    assert now["cancelled"] == before["cancelled"] + 1 and now["served"] == before["served"], now
    assert now["engine_running"] == 0  # no turn of it is generating


@pytest.mark.slow
def test_tools_and_agent_are_two_apps_of_one_serve_instance(agent):
    """``tools: handle`` as ``python -m serve.agent_app --tools=handle`` runs it (``deploy``): the tool app beside the
    agent on the one HTTP port, at its own prefix, and the agent calling its deployments through handles."""
    from ray import serve

    from serve.agent_app import AgentServeConfig, deploy
    from serve.app import APP_NAME, ServeConfig

    cfg = AgentServeConfig(model="tiny-agent", token_env="OSVL_AGENT_TEST_TOKEN", tools="handle",
                           app_name="osvl_agent_handle", route_prefix="/handle")
    cfg.agent.max_turns = 4
    deploy(cfg, ServeConfig(tools=["crop", "text_search"]))
    try:
        with urllib.request.urlopen(agent + "/tools/v1/tools", timeout=30) as r:  # the tool API, at /tools
            assert sorted(t["function"]["name"] for t in json.loads(r.read())["tools"]) == ["crop", "text_search"]
        got, answer = post(agent + "/handle", user(EIFFEL_QUESTION, {"type": "image_url",
                                                                     "image_url": {"url": scripted_picture_url()}}))
        assert got == 200, answer
        calls = [t for t in answer["osvl_trajectory"]["turns"] if t["action"] == "tool_call"]
        # answered by the tool app's deployments (no tool runs in the agent's replica with tools=handle)
        assert [t["tool"] for t in calls][:2] == ["crop", "text_search"] and all(t["status"] == "ok" for t in calls)
        assert answer["choices"][0]["finish_reason"] == "stop" and answer["choices"][0]["message"]["content"]
    finally:
        serve.delete("osvl_agent_handle")
        serve.delete(APP_NAME)


@pytest.mark.slow
def test_the_eval_job_scores_the_service_as_an_openai_model(agent, tmp_path, monkeypatch):
    from jobs.eval import main

    shutil.copy(EIFFEL, tmp_path / "tower.jpg")
    (tmp_path / "b.jsonl").write_text(json.dumps({"id": "t", "question": "Which tower is shown in the image?",
                                                  "answer": "Eiffel Tower", "images": ["tower.jpg"]}) + "\n")
    monkeypatch.setenv("AGENT_KEY", TOKEN)
    summary = main([f"--run.root={tmp_path / 'runs'}", f"--benchmarks={tmp_path / 'b.jsonl'}",
                    "--modes=direct", "--model=openai:osvl-agent", f"--endpoint.base_url={agent}/v1",
                    "--endpoint.api_key_env=AGENT_KEY", "--text_search.dense_rerank=false"])
    modes = summary["benchmarks"]["b"]["modes"]
    # the service answered every request (an engine error would be a failure of kind engine_error)
    assert all(t["items"] == 1 and "engine_error" not in t["failures"] for t in modes.values()), modes
