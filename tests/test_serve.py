"""python -m fire_jax.serve on a free loopback port, through the official openai client."""

import base64
import concurrent.futures
import io
import os
import signal
import socket
import urllib.error
import urllib.request

import json
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from fire_jax.core.config import load_config, resolve_path
from fire_jax.core.config import DEFAULT_CONFIG
from fire_jax.convert.hf import load_hf_checkpoint
from fire_jax.data.chat import ChatTokenizer, Message
from fire_jax.data.images import preprocess
from fire_jax.infer.decode import generate
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.sampling import SamplingParams
from fire_jax.serving.defaults import default_models
from hf_reference import tiny_hf_model
from loopback import server as loopback_server

MAX_QUEUE = 40
MAX_IMAGE_BYTES = 20000


def http(url, body=None, raw=None, timeout=120):
    """(status, headers, JSON) of a GET (no body) or POST to the loopback server, 4xx/5xx included."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.headers, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def poll(condition, tries: int = 5000) -> None:
    """Ask the server until ``condition()`` holds; fail after ``tries`` asks (no sleeps, no clock)."""
    for _ in range(tries):
        if condition():
            return
    pytest.fail("the server never reached the state polled for")



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny HF LLaVA-NeXT directory (embeddings scaled so greedy outputs vary)."""
    directory = str(tmp_path_factory.mktemp("served"))
    hf = tiny_hf_model(directory)
    with torch.no_grad():
        hf.model.language_model.embed_tokens.weight.mul_(8.0)
    hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(checkpoint):
    args = ["--model", f"tiny={checkpoint}", "--cache_len", "512", "--max_queue", str(MAX_QUEUE), "--max_image_bytes",
            str(MAX_IMAGE_BYTES)]
    with loopback_server("fire_jax.serve", args, "/health") as (process, base):
        yield process, base


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[1])


def data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def picture(h, w, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), np.uint8))


def ask(client, content, **kw):
    kw = {"model": "tiny", "temperature": 0, "max_tokens": 8, **kw}
    return client.chat.completions.create(messages=[{"role": "user", "content": content}], **kw)


def test_models_health_and_default_choice(server, client, tmp_path):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = http(f"{server[1]}/health")[2]
    assert health["status"] == "ok" and "HF checkpoint" in health["models"]["tiny"]["description"]
    assert default_models(str(tmp_path))[0] == {"tiny-random": None}
    for role in ("student", "teacher"):
        os.makedirs(tmp_path / "runs" / "tiny" / role)
    specs, base, why = default_models(str(tmp_path))
    assert sorted(specs) == ["student", "teacher"] and base is None and why.endswith("runs/tiny")
    os.makedirs(tmp_path / "runs" / "smollm2" / "student")  # the default main job's run comes first
    os.makedirs(tmp_path / "runs" / "smollm2" / "base" / "export" / "hf_merged")
    specs, base, why = default_models(str(tmp_path))
    assert specs == {"student": str(tmp_path / "runs" / "smollm2" / "student")} and why.endswith("runs/smollm2")
    assert base == str(tmp_path / "runs" / "smollm2" / "base" / "export" / "hf_merged")


def test_text_and_image_equal_in_process_generate(checkpoint, client):
    """The served prompt is the training template with the expanded image placeholder: same tokens as generate."""
    model = load_hf_checkpoint(checkpoint)
    config = load_config(DEFAULT_CONFIG)
    chat = ChatTokenizer.from_file(resolve_path(config.data.tokenizer), model.cfg.geometry)
    sampling, shape = SamplingParams(max_tokens=8), EngineConfig(stop_ids=chat.stop_ids, pad_id=chat.pad_id)
    image = picture(40, 70, 0)
    tiles, size = preprocess(image, model.cfg.geometry)
    typed = "What is <image> here?"  # a typed "<image>" is text: one image part, one image block
    cases = [("How many squares?", None, None),
             ([{"type": "image_url", "image_url": {"url": data_uri(image)}}, {"type": "text", "text": "What is it?"}],
              "What is it?", size),
             ([{"type": "image_url", "image_url": {"url": data_uri(image)}}, {"type": "text", "text": typed}],
              typed, size)]
    for content, text, size in cases:
        encoded = chat.encode([Message("user", text or content, images=int(size is not None))], size,
                              add_generation_prompt=True)
        ref = generate(model, [encoded.input_ids.tolist()], sampling=sampling, engine=shape,
                       tokenizer=chat.tokenizer, pixel_values=None if size is None else tiles[None],
                       image_sizes=None if size is None else [size])
        out = ask(client, content)
        assert out.usage.prompt_tokens == len(encoded)
        assert (encoded.input_ids == chat.image_token_id).sum() == (0 if size is None else
                                                                     model.cfg.geometry.num_tokens(size))
        assert out.choices[0].message.content == ref.texts[0] and len(ref.texts[0]) > 3
        assert out.choices[0].finish_reason == ("length" if ref.lengths[0] == 8 else "stop")
    # ignore_eos (vLLM's field): the same sampled tokens, on past the end of turn and EOS to max_tokens
    sampled = dict(max_tokens=200, temperature=1.0, seed=2)  # seed 2 ends its turn after 30 tokens
    stopped = ask(client, "How many squares?", **sampled)
    out = ask(client, "How many squares?", **sampled, extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 200
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 200
    assert out.choices[0].message.content.startswith(stopped.choices[0].message.content)


def test_two_images_and_streaming(client):
    one = [{"type": "image_url", "image_url": {"url": data_uri(picture(40, 70, 0))}}, {"type": "text", "text": "Q"}]
    second = picture(64, 64, 1)
    two = one[:1] + [{"type": "image_url", "image_url": {"url": data_uri(second)}}] + one[1:]
    a, b = ask(client, one), ask(client, two)
    geometry_tokens = 4 * 4 + 8 * 8 + 8  # 64x64 on 32 px tiles, 8x8 patches: base + 2x2 grid + newlines
    assert b.usage.prompt_tokens - a.usage.prompt_tokens == geometry_tokens + 1  # + its "\n"
    assert b.choices[0].message.content != a.choices[0].message.content
    chunks = list(ask(client, two, stream=True, max_tokens=12))
    whole = ask(client, two, max_tokens=12).choices[0]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert len(chunks) >= 3 and chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_bad_input_gets_4xx_and_the_server_lives(server, client):
    def status(content=None, **kw):
        with pytest.raises(openai.APIStatusError) as e:
            ask(client, content, **kw)
        return e.value.status_code, e.value.body["code"]

    image = lambda url: [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Q"}]
    assert status(image("data:image/png;base64,aGVsbG8gd29ybGQ=")) == (400, "invalid_image")
    big = data_uri(picture(120, 120, 2))
    assert len(big) > MAX_IMAGE_BYTES * 4 // 3
    assert status(image(big)) == (413, "image_too_large")
    assert status(image("https://example.com/cat.png")) == (400, "remote_image_url")
    assert status("word " * 600) == (400, "context_length_exceeded")
    assert status("hi", max_tokens=600) == (400, "context_length_exceeded")
    assert status("hi", model="gpt-4o") == (404, "model_not_found")
    assert status("hi", temperature="hot") == (400, "invalid_request_error")
    assert status("hi", extra_body={"ignore_eos": 1}) == (400, "invalid_request_error")
    code, _, reply = http(f"{server[1]}/v1/chat/completions", raw=b'{"model": "tiny", "messages": [')
    assert code == 400 and reply["error"]["code"] == "invalid_json"
    assert http(f"{server[1]}/health")[0] == 200
    assert ask(client, "still there?").choices[0].message.content


def test_a_bad_request_fails_alone_beside_six_concurrent_ones(server, client):
    """top_k=2**31 (past int32) sent beside 6 normal requests: it gets 400 before reaching the engine, the six
    equal their outputs alone (a value the engine cannot hold used to fail every request in its decode chunk)."""
    prompts = [("word " * (3 * k)) + f"item {k}?" for k in range(6)]
    kw = lambda k: dict(max_tokens=24, temperature=0.7, seed=11 + k, extra_body={"top_k": 40})
    baseline = [ask(client, p, **kw(k)).choices[0].message.content for k, p in enumerate(prompts)]
    bad = {"model": "tiny", "messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 24,
           "temperature": 0.7, "seed": 11, "top_k": 2 ** 31}

    def one(k):
        if k == 6:
            return http(f"{server[1]}/v1/chat/completions", bad)
        return ask(client, prompts[k], **kw(k)).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        out = list(pool.map(one, [0, 1, 2, 6, 3, 4, 5]))
    status, _, reply = out.pop(3)
    assert status == 400 and "top_k" in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"
    assert out == baseline and len(set(baseline)) > 1


def test_omitted_sampling_fields_get_the_servers_defaults(client):
    """No temperature, top_p, top_k or max_tokens: the same completion as temperature 1, top_p 1, top_k 0 (off)
    and max_tokens 256 with the same seed (fire_jax.serving.limits.SAMPLING_DEFAULTS)."""
    def sampled(**kw):
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "defaults?"}],
                                              seed=5, **kw)

    omitted = sampled()
    explicit = sampled(temperature=1.0, top_p=1.0, max_tokens=256, extra_body={"top_k": 0})
    greedy = sampled(temperature=0.0, max_tokens=256)
    assert omitted.choices[0].message.content == explicit.choices[0].message.content
    assert omitted.usage == explicit.usage
    assert omitted.choices[0].message.content != greedy.choices[0].message.content


def test_32_concurrent_requests_equal_single_requests(client):
    prompts = [("word " * (1 + k)) + f"question {k}?" for k in range(32)]  # prompts of 52..160 tokens: 3 buckets
    lengths = [4 + (k * 5) % 13 for k in range(32)]
    single = [ask(client, p, max_tokens=m).choices[0].message.content for p, m in zip(prompts, lengths)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda a: ask(client, a[0], max_tokens=a[1]), zip(prompts, lengths)))
    assert [r.choices[0].message.content for r in together] == single
    assert len(set(single)) > 16 and len({r.id for r in together}) == 32


def test_full_queue_gets_503_with_retry_after(server):
    body = lambda k: {"model": "tiny", "messages": [{"role": "user", "content": f"tell me {k}"}], "max_tokens": 200,
                      "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(MAX_QUEUE + 12) as pool:
        replies = list(pool.map(lambda k: http(f"{server[1]}/v1/chat/completions", body(k)), range(MAX_QUEUE + 12)))
    codes = [r[0] for r in replies]
    assert set(codes) == {200, 503} and codes.count(200) >= MAX_QUEUE
    _, headers, full = next(r for r in replies if r[0] == 503)
    assert headers["Retry-After"] == "1" and full["error"]["code"] == "queue_full"


def test_a_client_that_disconnects_cancels_its_request(server):
    """Plain and streamed: the client closes its connection mid-generation; the engine frees the slot."""
    _, base = server
    port = int(base.rsplit(":", 1)[1])
    counts = lambda: http(f"{base}/health")[2]["models"]["tiny"]
    before = counts()
    for stream in (False, True):
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 380,
                           "temperature": 0, "stream": stream}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        if stream:  # the status line, the role event and a first content event
            received = b""
            while received.count(b"data: ") < 2:
                received += sock.recv(4096)
            assert received.startswith(b"HTTP/1.1 200")
        else:
            poll(lambda: counts()["in_flight"] == 1)  # it runs
        sock.close()
        poll(lambda: counts()["in_flight"] == 0)  # the engine lets it go
    after = counts()
    assert after["cancelled"] == before["cancelled"] + 2 and after["finished"] == before["finished"]
    assert ask(openai_client(base), "still there?").choices[0].message.content


def test_free_dialogues_through_api_specs_equal_in_process(checkpoint, server, tmp_path):
    """FIRE-Bench free dialogues with api: student and teacher on the loopback server == the in-process run."""
    from fire_jax.eval.fire_bench import build_agents, evaluate
    from test_fire_bench import eval_config

    from fire_jax.data.items import item_of, load_conversations
    from fire_jax.dialogue.fire1m import make_fire_records
    from fire_jax.dialogue.stop import StopRule

    runs, generated = {}, {}
    for kind, init in [("in_process", checkpoint), ("api", f"api:{server[1]}/v1#tiny")]:
        config = eval_config("free", max_examples=2)
        config.decode.update(max_new_tokens=6)
        config.student.init = config.teacher.init = init
        agents = build_agents(config, config.free.teacher_history)
        assert type(agents[0].backend).__name__ == ("ApiBackend" if kind == "api" else "InProcess")
        results = evaluate(config, str(tmp_path / kind), agents=agents)
        with open(results["outputs"]) as f:
            runs[kind] = [json.loads(line) for line in f]
        # FIRE-1M-style generation (tools/make_fire1m.py) with the same agents, every dialogue kept or dropped
        items = [item_of(record, image) for record, image in load_conversations(eval_config("free",
                                                                                           max_examples=6).test)]
        out = tmp_path / kind / "fire_1m.jsonl"
        kept, dropped = make_fire_records(items, *agents, str(out), rule=StopRule(max_turns=3, threshold=11,
                                                                                  stop_on_no_increase=False),
                                         batch_size=config.decode.batch_size)
        assert kept + sum(dropped.values()) == 6
        generated[kind] = [out.read_text() if out.exists() else "", (tmp_path / kind / "fire_1m.jsonl.dropped.jsonl")
                           .read_text()]
        if kind == "api":
            assert not agents[0].backend.failures and not agents[1].backend.failures
    assert len(runs["api"]) == 2 and sum(len(r["turns"]) for r in runs["api"]) >= 2
    assert runs["api"] == runs["in_process"]
    assert generated["api"] == generated["in_process"] and generated["api"][1].count("\n") >= 1
    assert sum(len(json.loads(line)["scores"]) for line in generated["api"][1].splitlines()) >= 6

    from fire_jax.dialogue.agents import Student
    from fire_jax.infer.factory import generator
    from fire_jax.infer.api import ApiError
    unknown = generator(f"api:{server[1]}/v1#gpt-4o", retries=3, backoff=0)
    with pytest.raises(ApiError, match="http_404"):
        Student(unknown).respond([picture(40, 70, 0)], ["Q"])
    assert unknown.failures == {"http_404": 1}  # a 4xx is counted and not retried


def test_chat_and_batch_generation_through_api_specs_equal_in_process(checkpoint, server, tmp_path):
    """python -m fire_jax.chat --auto and python -m fire_jax.batch_infer (student and teacher) with api: specs."""
    from fire_jax import batch_infer, chat

    spec = f"api:{server[1]}/v1#tiny"
    dialogues = {}
    for kind, model in (("in_process", checkpoint), ("api", spec)):
        out = []
        dialogues[kind] = chat.main(["--auto", "--max_turns", "3", "--solved", "11", "--max_new_tokens", "6",
                                     "--student", model, "--teacher", model], print_fn=out.append)
        assert out[0] == ("student: endpoint " + spec if kind == "api" else f"student: HF checkpoint {checkpoint}")
    assert len(dialogues["api"]) == 3 and dialogues["api"] == dialogues["in_process"]
    assert len({t.response for t in dialogues["api"]}) > 1

    picture(40, 70, 3).save(tmp_path / "p.png")
    prompts = tmp_path / "prompts.jsonl"
    earlier = [dict(response="Answer: 1.", feedback="Score: 2.\nFeedback: No.")]
    prompts.write_text("".join(json.dumps(dict(id=k, image="p.png", question=f"Question {k}?", groundtruth="Two.",
                                               answer=f"Answer: {k}.", history=earlier * (k % 2))) + "\n"
                               for k in range(5)))
    texts = set()
    for role in ("student", "teacher"):
        outputs = {}
        for kind, model in (("in_process", checkpoint), ("api", spec)):
            path = tmp_path / f"{role}_{kind}.jsonl"
            summary = batch_infer.main(["--input", str(prompts), "--output", str(path), "--image_root", str(tmp_path),
                                     "--role", role, "--checkpoint", model, "--batch_size", "2", "--max_new_tokens",
                                     "6"], print_fn=lambda *_: None)
            assert summary == {"written": 5, "already_done": 0, "bad": {}}
            outputs[kind] = [json.loads(line) for line in path.read_text().splitlines()]
        assert outputs["api"] == outputs["in_process"]
        texts |= {r["output"] for r in outputs["api"]}
    assert len(texts) >= 3  # answers differ with the prompt: the comparison can fail


def test_api_agents_retry_429_and_5xx_and_count_every_failure(tmp_path):
    """A flaky scripted endpoint: 503 then 429 are retried and counted; a 500 that persists fails once retries
    are spent, by reason."""
    from fire_jax.dialogue.agents import Student, Teacher
    from fire_jax.infer.api import ApiBackend, ApiError
    from loopback import get_json

    script = tmp_path / "flaky.json"
    script.write_text(json.dumps({"rules": [
        {"contains": "flaky", "reply": "Score: 9.\nFeedback: Right.", "errors": [503, 429]},
        {"contains": "down", "reply": "never sent", "errors": [500] * 5}]}))
    args = ["--plugin", "scripted_model", "--model", f"m=scripted:{script}"]
    with loopback_server("fire_jax.serve", args, "/health") as (_, base):
        teacher = Teacher(ApiBackend(f"api:{base}/v1#m", retries=3, backoff=0))
        feedback = teacher.feedback([picture(40, 70, 0)], ["flaky?"], ["2"], ["Answer: 2."])[0]
        assert (feedback.text, feedback.score) == ("Score: 9.\nFeedback: Right.", 9)
        assert teacher.backend.failures == {"http_503": 1, "http_429": 1}

        student = Student(ApiBackend(f"api:{base}/v1#m", retries=2, backoff=0))
        with pytest.raises(ApiError) as failed:
            student.respond([picture(40, 70, 0)], ["down?"])
        assert failed.value.reason == "http_500" and student.backend.failures == {"http_500": 3}
        assert get_json(f"{base}/health")["models"]["m"]["requests"] == {"flaky": 3, "down": 3}


def test_a_dialogues_next_turn_reuses_the_cached_prefix_and_says_the_same(server, client):
    """Across requests the engine reuses the KV of a prompt's longest cached prefix (a dialogue's previous
    request, then the same prompt again): the reply is the same whichever part is reused, and /health counts
    the reused tokens (identity with the cache off: tests/test_engine_prefix.py)."""
    image = data_uri(picture(40, 72, seed=11))  # an image no other test sends: nothing cached covers it yet
    first = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]
    answer = ask(client, first).choices[0].message.content
    messages = [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "Look again."}]

    def second_turn():
        before = http(f"{server[1]}/health")[2]["models"]["tiny"]
        reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8)
        after = http(f"{server[1]}/health")[2]["models"]["tiny"]
        return reply.choices[0].message.content, {k: after[k] - before[k] for k in ("prompt_tokens", "reused_tokens")}

    cold, cold_stats = second_turn()  # reuses the first turn's prompt, before the answer and "Look again."
    warm, warm_stats = second_turn()  # the same prompt again: more of it is cached
    assert warm == cold
    assert 0 < cold_stats["reused_tokens"] < cold_stats["prompt_tokens"]
    assert cold_stats["reused_tokens"] < warm_stats["reused_tokens"] < warm_stats["prompt_tokens"]


def test_sigterm_drains_requests_in_flight(server):  # stops the module's server: keep it after its users
    process, base = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a long one"}], "max_tokens": 300,
            "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(http, f"{base}/v1/chat/completions", body)
        while http(f"{base}/health")[2]["models"]["tiny"]["in_flight"] == 0:  # poll until it runs
            assert not reply.done()
        process.send_signal(signal.SIGTERM)
        answer = reply.result()
    assert answer[0] == 200 and answer[2]["usage"]["completion_tokens"] >= 1
    assert process.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained


def test_default_context_holds_the_served_models_real_prompts():
    """--cache_len 0: 4 images of the model's largest grid + 16,384 characters of text in the model's tokens (the
    prompt's engine bucket) + 256; every shipped VLRMBench IC prompt fits, whatever the tokenizer."""
    from tokenizers import Tokenizer

    from fire_jax.core.geometry import ImageGeometry
    from fire_jax.serving.server import default_cache_len, prompt_text_tokens
    from fire_jax.vlrmbench.data import load_task
    from fire_jax.vlrmbench.tasks import build_prompt

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # LLaVA-NeXT-8B: 576 + 48 * 49 = 2,928 tokens for a 672 x 672 image; 4 * 2,928 + 3,427 (Llama-3's tokens of
    # 16,384 characters) = 15,139, whose bucket (multiples of 2,048 past 8,192) is 16,384.
    assert default_cache_len(ImageGeometry(), 3427) == 16384 + 256
    assert default_cache_len(ImageGeometry(mode="pad"), 3427) == 6144 + 256  # 4 * 576 + 3,427 = 5,731 -> 6,144
    tiny_tokenizer = Tokenizer.from_file(os.path.join(repo, "fire_jax", "assets", "tiny_tokenizer.json"))
    text_tokens = prompt_text_tokens(tiny_tokenizer)
    assert 16384 / 1.5 > text_tokens > 16384 / 2  # ~1.7 characters a token in the 512-piece tokenizer
    tiny = ImageGeometry(tile_size=32, patch_size=8, pinpoints=((32, 64), (64, 32), (64, 64), (96, 32), (32, 96)))
    cache_len = default_cache_len(tiny, text_tokens)
    assert cache_len == 10240 + 256  # 4 * 88 + 9,442 = 9,794 -> 10,240
    records = load_task(os.path.join(repo, "tests", "fixtures", "vlrmbench", "image_ref_error.jsonl"), "IC")
    longest = max(len(tiny_tokenizer.encode(build_prompt(s, "IC", "official")).ids) + 88 * len(s.images)
                  for s in records)
    assert longest + 256 <= cache_len  # 5,716 text tokens at most: the old fixed 4,096 left one record out


def test_servers_under_test_bind_port_0_and_a_failing_test_shows_their_log(tmp_path):
    """loopback.server starts a server with --port 0: it binds a free port itself and its listening line names it
    (no port picked by the test and released first, for another test's server to take); while it runs, a failing
    test's report carries its log (tests/conftest.py)."""
    import types

    import conftest
    from loopback import LOGS, get_json

    script = tmp_path / "m.json"
    script.write_text(json.dumps({"rules": [], "default": "hello"}))
    with loopback_server("fire_jax.serve", ["--plugin", "scripted_model", "--model", f"m=scripted:{script}"],
                         "/health") as (process, base):
        port = int(base.rsplit(":", 1)[1])
        assert port > 0 and get_json(f"{base}/health")["status"] == "ok"
        assert f"listening on http://127.0.0.1:{port}/v1\n" in open(process.log_path).read()
        report = types.SimpleNamespace(failed=True, sections=[])
        hook = conftest.pytest_runtest_makereport(None, None)  # a hook wrapper: a generator
        next(hook)
        with pytest.raises(StopIteration):
            hook.send(types.SimpleNamespace(get_result=lambda: report))
        (title, log), = [(title, log) for title, log in report.sections if str(process.pid) in title]
        assert title.startswith("log of fire_jax.serve --plugin scripted_model") and f":{port}/v1" in log
    assert not any(str(process.pid) in name for name in LOGS)  # a stopped server's log is no longer shown
