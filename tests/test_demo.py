"""python -m fire_jax.demo in headless Debian chromium: example image, ask, ask the teacher, refine, download the
FIRE record, a bad image shown as an error, the answer shown as it grows; a screenshot is kept as a test
artifact. Its server-sent events are also read directly (progress on long generations), and bad input gets a
4xx JSON error before any work, with limits set low by flag.

The student is the random tiny model in process; the teacher is an ``api:`` spec pointing at a loopback
``fire_jax.serve`` scripted model, so its feedback (and score) is known exactly.
"""

import base64
import json
import os
import shutil
import urllib.error
import urllib.request

import pytest

from fire_jax.data.records import parse_record
from loopback import get_json, server

EXAMPLE = "test_00000.png"  # "How many green squares are in the image?" / "There are 2."
TEACHER_REPLY = "Score: 4.\nFeedback: Your count is off. Count the green squares again, one by one."
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Debian chromium + chromium-driver not found (.ci/run installs them: apt-get install -y chromium "
           "chromium-driver)")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    script = tmp_path_factory.mktemp("teacher") / "teacher.json"
    script.write_text(json.dumps({"rules": [{"contains": "Groundtruth: There are 2.", "reply": TEACHER_REPLY}]}))
    with server("fire_jax.serve", ["--plugin", "scripted_model", "--model", f"teacher=scripted:{script}"], "/health") as (_, teacher_base):
        with server("fire_jax.demo", ["--student", "random", "--teacher", f"api:{teacher_base}/v1#teacher",
                                      "--max_new_tokens", "12"], "/api/settings") as (_, base):
            yield base, teacher_base


def events(url: str, body: dict) -> list[dict]:
    """The server-sent events of a streamed POST, in order."""
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        text = reply.read().decode()
    return [json.loads(block[len("data: "):]) for block in text.split("\n\n") if block.startswith("data: ")]


def in_process_student():
    from fire_jax.core.config import load_config
    from fire_jax.core.config import DEFAULT_CONFIG
    from fire_jax.dialogue.agents import from_spec
    from fire_jax.infer.sampling import SamplingParams

    return from_spec(None, "student", SamplingParams(max_tokens=12), config=load_config(DEFAULT_CONFIG))


def test_answers_stream_as_they_grow(demo):
    """/api/respond and /api/feedback with stream=true: the text arrives in pieces with a growing token count,
    the pieces add up to the answer, which is the in-process student's; a bad image is still a 4xx JSON error."""
    from fire_jax.data.records import Turn
    from fire_jax.serving.demo import EXAMPLES_DIR

    base, _ = demo
    path = os.path.join(EXAMPLES_DIR, "images", EXAMPLE)
    with open(path, "rb") as f:
        image = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    question = "How many green squares are in the image?"
    answers = []
    for turns in ([], [{"response": None, "feedback": TEACHER_REPLY}]):
        if turns:
            turns[0]["response"] = answers[0]
        got = events(f"{base}/api/respond", {"image": image, "question": question, "turns": turns})
        pieces, done = got[:-1], got[-1]
        assert done["done"] and len(pieces) >= 3 and all(set(p) == {"delta", "tokens"} for p in pieces)
        tokens = [p["tokens"] for p in pieces]
        assert tokens[0] == 1 and tokens == sorted(set(tokens))  # the demo's engine reports every 2 tokens
        assert "".join(p["delta"] for p in pieces).strip() == done["response"] and done["response"]
        answers.append(done["response"])
    history = [(), (Turn(answers[0], TEACHER_REPLY, 4),)]
    assert in_process_student().respond([path] * 2, [question] * 2, history) == answers

    got = events(f"{base}/api/feedback", {"image": image, "question": question, "groundtruth": "There are 2.",
                                          "turns": [{"response": answers[0], "feedback": ""}]})
    assert got[-1] == {"done": True, "feedback": TEACHER_REPLY, "score": 4}
    assert "".join(p["delta"] for p in got[:-1]) == TEACHER_REPLY

    bad = urllib.request.Request(f"{base}/api/respond", data=json.dumps(
        {"image": "data:image/png;base64,aGVsbG8=", "question": "Q", "stream": True}).encode(),
        headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(bad, timeout=60)
    assert error.value.code == 400 and "could not be decoded" in json.loads(error.value.read())["error"]["message"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    downloads = tmp_path_factory.mktemp("downloads")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1200,900", "--no-proxy-server"):
        options.add_argument(flag)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    yield driver, downloads
    driver.quit()


@needs_chromium
def test_demo_dialogue_in_browser(demo, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    base, teacher_base = demo
    driver, downloads = browser
    wait = WebDriverWait(driver, 60, poll_frequency=0.1)
    find = lambda css: driver.find_element(By.CSS_SELECTOR, css)
    settings = get_json(f"{base}/api/settings")
    asked = lambda: get_json(f"{teacher_base}/health")["models"]["teacher"]["requests"]["Groundtruth: There are 2."]
    asked_before = asked()
    assert settings["sampling"] == {"max_new_tokens": 12, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    assert settings["student"] == "random init (seed 0)" and settings["teacher"].startswith("endpoint api:")

    driver.get(base)
    wait.until(lambda d: find("body").get_attribute("data-ready") == "1")  # the static page read /api/settings
    assert "temperature = 0" in find("#sampling").text and "random init" in find("#models").text
    Select(find("#example")).select_by_value(EXAMPLE)
    wait.until(lambda d: find("#preview").get_attribute("src").startswith("data:image/png;base64,"))
    assert find("#question").get_attribute("value") == "How many green squares are in the image?"
    assert find("#groundtruth").get_attribute("value") == "There are 2."

    def press(button, done):
        find(button).click()
        wait.until(lambda d: find("#status").text == f"done: {done}" or find("#error").text)
        assert find("#error").text == ""

    press("#ask", "the student answers")
    first = find("#turn-1 .response").text
    shown = driver.execute_script("return window.progressLog")  # what the page showed while the answer grew
    assert len(shown) >= 3 and [s["tokens"] for s in shown] == sorted({s["tokens"] for s in shown})
    assert shown[0]["text"] != shown[-1]["text"] and shown[-1]["text"].strip() == first
    press("#teacher", "the teacher gives feedback")
    assert find("#turn-1 .score").text == "4" and find("#feedback").get_attribute("value") == TEACHER_REPLY
    press("#refine", "the student refines")
    second = find("#turn-2 .response").text
    assert find("#turn-1 .feedback").text == TEACHER_REPLY and find("#turn-2 .score").text == "-"
    press("#teacher", "the teacher gives feedback")
    assert find("#turn-2 .score").text == "4"
    screenshot = tmp_path / "demo.png"
    driver.save_screenshot(str(screenshot))
    print(f"\ndemo screenshot: {screenshot}")
    press("#download", "building the record")
    path = downloads / "fire_record.json"
    wait.until(lambda d: path.exists() and path.stat().st_size > 0)

    raw = json.loads(path.read_text())
    record = parse_record(raw, default_id="download")  # scores required: the teacher gave them
    assert record.image == EXAMPLE and record.question == "How many green squares are in the image?"
    assert record.groundtruth == "There are 2." and raw["round"] == 2 and raw["score"] == [4, 4]
    assert [t.response for t in record.turns] == [first, second] and first and second
    assert [t.feedback for t in record.turns] == [TEACHER_REPLY] * 2 and [t.score for t in record.turns] == [4, 4]
    # the teacher endpoint answered exactly the two "ask the teacher" presses
    assert asked() == asked_before + 2

    # the student's answers are those of the in-process tiny student on the same image and history
    from fire_jax.data.records import Turn
    from fire_jax.serving.demo import EXAMPLES_DIR

    student = in_process_student()
    image = os.path.join(EXAMPLES_DIR, "images", EXAMPLE)
    expected = student.respond([image] * 2, [record.question] * 2, [(), (Turn(first, TEACHER_REPLY, 4),)])
    assert expected == [first, second]

    # reset clears the page; an undecodable upload is an error in the page, and the server keeps going
    find("#reset").click()
    assert find("#turns").text == "" and find("#question").get_attribute("value") == ""
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"this is not a PNG")
    find("#upload").send_keys(str(bad))
    wait.until(lambda d: find("#preview").get_attribute("src").startswith("data:"))
    find("#question").send_keys("What is this?")
    find("#ask").click()
    wait.until(lambda d: find("#error").text)
    assert find("#error").text.startswith("Error: image could not be decoded")
    assert find("#turns").text == "" and get_json(f"{base}/api/settings")["student"] == "random init (seed 0)"


@pytest.fixture(scope="module")
def limited_demo():
    """The demo with both roles the random tiny model in process, a 256-column context and low limits."""
    with server("fire_jax.demo", ["--student", "random", "--teacher", "random", "--max_new_tokens", "8",
                                  "--cache_len", "256", "--max_pixels", "10000", "--max_body_bytes", "300000"],
                "/api/settings") as (_, base):
        yield base


def post_json(url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read()) if "json" in reply.headers["content-type"] else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_page_is_the_static_file(limited_demo):
    """GET / serves fire_jax/assets/demo/index.html byte for byte: the server's settings reach the page from
    /api/settings, not by templating."""
    from fire_jax.serving.demo import PAGE

    with urllib.request.urlopen(limited_demo + "/", timeout=60) as reply:
        assert reply.headers["content-type"].startswith("text/html")
        body = reply.read()
    with open(PAGE, "rb") as f:
        assert body == f.read()
    assert b"fetch('/api/settings')" in body


def test_bad_input_gets_4xx_not_a_model_failure(limited_demo):
    """Over-context prompts (by characters before tokenising, by tokens against the engine's context, streamed
    or not), an image bomb, deep nesting, a body over the limit, a non-boolean stream: each one 4xx JSON error,
    and the demo keeps answering."""
    import struct
    import zlib

    from fire_jax.serving.demo import EXAMPLES_DIR

    with open(os.path.join(EXAMPLES_DIR, "images", EXAMPLE), "rb") as f:
        image = "data:image/png;base64," + base64.b64encode(f.read()).decode()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)) + chunk(
        b"IEND", b"")
    ask = lambda **kw: {"image": image, "question": "How many?", **kw}
    cases = {
        "text over the context in characters": (ask(question="x" * 100_000), 400, "context_length_exceeded"),
        "prompt over the context in tokens": (ask(question="word " * 300), 400, "context_length_exceeded"),
        "the same, streamed": (ask(question="word " * 300, stream=True), 400, "context_length_exceeded"),
        "image bomb": (ask(image="data:image/png;base64," + base64.b64encode(bomb).decode()), 413,
                       "image_too_large"),
        "nested 100k deep": (b'{"image": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "json_too_deep"),
        "body over the limit": (ask(question="y" * 400_000), 413, "request_too_large"),
        "stream 'no'": (ask(stream="no"), 400, "invalid_request_error"),
    }
    for name, (body, status, code) in cases.items():
        got, reply = post_json(f"{limited_demo}/api/respond", body)
        assert (name, got, reply["error"]["code"]) == (name, status, code)
    got, reply = post_json(f"{limited_demo}/api/feedback", ask(groundtruth="z" * 100_000,
                                                               turns=[{"response": "Two.", "feedback": ""}]))
    assert (got, reply["error"]["code"]) == (400, "context_length_exceeded")
    got, reply = post_json(f"{limited_demo}/api/respond", ask())
    assert got == 200 and reply["response"]


def test_errors_say_what_is_wrong_without_python_and_the_api_docs_are_off(limited_demo):
    """A non-image upload gets a sentence, not PIL's "cannot identify image file <_io.BytesIO object at 0x...>";
    an unexpected failure's 500 names no exception class (the log does); /docs and /openapi.json answer 404
    unless --api_docs."""
    import io

    from PIL import Image

    from fire_jax.serving.demo import create_app
    from fire_jax.infer.sampling import SamplingParams

    not_an_image = "data:image/png;base64," + base64.b64encode(b"this is not a PNG").decode()
    got, reply = post_json(f"{limited_demo}/api/respond", {"image": not_an_image, "question": "What is this?"})
    assert (got, reply["error"]) == (400, {"message": "image could not be decoded: the data is not a PNG, JPEG, WebP "
                                                      "or GIF image", "code": "invalid_image"})
    for path in ("/docs", "/openapi.json"):
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(limited_demo + path, timeout=60)
        assert error.value.code == 404

    descriptions = {"student": "s", "teacher": "t"}
    app = create_app(None, None, descriptions, SamplingParams())
    assert (app.docs_url, app.openapi_url) == (None, None)

    class Failing:  # a generation that fails in a way no handler knows, its message naming an object
        max_text_chars = 0

        def start(self, *args):
            raise KeyError("slot 3 <Ticket object at 0x7f00>")

    from fastapi.testclient import TestClient

    client = TestClient(create_app(Failing(), Failing(), descriptions, SamplingParams()), raise_server_exceptions=False)
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buffer, format="PNG")
    png = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    reply = client.post("/api/respond", json={"image": png, "question": "What is this?"})
    assert reply.status_code == 500 and reply.json() == {"error": {
        "message": "the model failed to generate; the demo's log says why", "code": "model_failure"}}
    documented = create_app(None, None, descriptions, SamplingParams(), api_docs=True)
    assert (documented.docs_url, documented.openapi_url) == ("/docs", "/openapi.json")
