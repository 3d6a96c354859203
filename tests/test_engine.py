"""Continuous batching: a request's greedy tokens alone, among 31 others, and from generate."""

import numpy as np
import pytest
from PIL import Image

from fire_jax.core.config import load_config
from fire_jax.core.config import DEFAULT_CONFIG
from fire_jax.data.chat import Message
from fire_jax.data.images import preprocess
from fire_jax.infer.buckets import Buckets
from fire_jax.infer.decode import generate
from fire_jax.infer.engine import Engine
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.kernels import TRACE_COUNTS
from fire_jax.infer.loading import load
from fire_jax.infer.requests import Request
from fire_jax.infer.sampling import SamplingParams

NEW = 20  # the longest max_tokens


@pytest.fixture(scope="module")
def loaded():
    loaded = load(load_config(DEFAULT_CONFIG))
    embed = loaded.model.language_model.model.embed_tokens.embedding
    embed.set_value(embed.get_value() * 50)  # unit-scale embeddings: greedy outputs vary instead of repeating one token
    return loaded


def image_request(loaded, size, question, max_tokens):
    image = Image.fromarray(np.random.default_rng(size[0]).integers(0, 255, (*size, 3), np.uint8))
    tiles, hw = preprocess(image, loaded.model.cfg.geometry)
    prompt = loaded.chat.encode([Message("user", question, images=1)], hw, add_generation_prompt=True).input_ids
    return Request(prompt.tolist(), SamplingParams(max_tokens=max_tokens, stop_ids=()), pixel_values=tiles,
                   image_sizes=[hw])


@pytest.fixture(scope="module")
def requests(loaded):
    """32 requests: text prompts of 5..200 tokens (three buckets), three with an image, max_tokens 3..20."""
    rng = np.random.default_rng(0)
    out = [Request(rng.integers(1, 500, int(rng.integers(5, 200))).tolist(),
                   SamplingParams(max_tokens=int(rng.integers(3, NEW)), stop_ids=())) for _ in range(29)]
    out += [image_request(loaded, size, q, m) for size, q, m in
            [((40, 70), "What is this?", NEW), ((64, 64), "Describe it.", 7), ((30, 90), "Colour?", 12)]]
    return out


def shape(loaded, **fields) -> EngineConfig:
    """The tests' engines: the server's fine prompt buckets, the tokenizer's pad id."""
    return EngineConfig(bucket_step=None, pad_id=loaded.chat.pad_id, **fields)


@pytest.fixture(scope="module")
def engine(loaded):
    return Engine(loaded.model, shape(loaded, slots=32, cache_len=320, prefill_batch=4, chunk=8),
                  tokenizer=loaded.chat.tokenizer)


@pytest.fixture(scope="module")
def traces_before(loaded):
    """Compiles counted before this module's engine ran (other modules' engines count too)."""
    return dict(TRACE_COUNTS)


@pytest.fixture(scope="module")
def together(traces_before, engine, requests):
    return engine.generate(requests)


def test_greedy_alone_equals_among_31_others_and_generate(loaded, engine, requests, together, traces_before):
    assert len(set(len(r.prompt) for r in requests)) > 20
    for request, result in zip(requests, together):
        alone = engine.generate([request])[0]
        assert alone.tokens == result.tokens
        assert len(result.tokens) == request.sampling.max_tokens and result.finish_reason == "length"
    assert len({t for r in together for t in r.tokens}) > 50  # outputs vary: the comparison can fail
    # Decode shapes per (width 1, 2, 4, ..., 32 slots; window 64 * 2^j columns or all 320) met; prefills per
    # (bucket, image tiles) x rows 1, 2, 4, ... of at most prefill_tokens.
    compiled = {k: TRACE_COUNTS[k] - traces_before.get(k, 0) for k in ("engine_decode", "engine_admit")}
    keys = {(engine.bucket(r), engine.scheduler.tiles(r)) for r in requests}
    assert sorted(b for b, tiles in keys if not tiles) == [64, 128, 192, 256]  # fine buckets
    rows = lambda bucket: [n for n in (1, 2, 4, 8)
                           if n == 1 or (n <= engine.config.prefill_batch
                                         and n * bucket <= engine.config.prefill_tokens)]
    assert compiled["engine_decode"] <= 6 and compiled["engine_admit"] <= sum(len(rows(b)) for b, _ in keys)
    # generate: a one-row engine of its own, prompts in power-of-two buckets, no prefix cache
    for request, result in zip(requests, together):
        ref = generate(loaded.model, [request.prompt], sampling=SamplingParams(max_tokens=NEW, stop_ids=()),
                       pixel_values=None if request.pixel_values is None else request.pixel_values[None],
                       image_sizes=[request.image_sizes] if request.image_sizes else None)
        assert result.tokens == ref.tokens[0, :request.sampling.max_tokens].tolist()
        np.testing.assert_allclose(result.logprobs, ref.logprobs[0, :request.sampling.max_tokens], atol=1e-4)


def test_weights_committed_to_a_device_run_the_programs_already_compiled(loaded, requests, together,
                                                                          backend_compiles):
    """A model restored from a checkpoint holds arrays committed to a device (orbax places them), one built in
    process does not: an engine over either meets the programs the other compiled, with the same tokens.
    (Before, each evaluation of the main job that loaded a trained adapter compiled every engine program again.)"""
    import jax
    from flax import nnx

    state = nnx.state(loaded.model)
    assert not any(x.committed for x in jax.tree.leaves(state))
    committed = jax.device_put(state, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    restored_like = nnx.merge(nnx.graphdef(loaded.model), committed)
    with backend_compiles() as compiles:
        results = Engine(restored_like, shape(loaded, slots=32, cache_len=320, prefill_batch=4, chunk=8),
                         tokenizer=loaded.chat.tokenizer).generate(requests)
    assert [r.tokens for r in results] == [r.tokens for r in together]
    assert compiles == []


def test_few_slots_reuse_freed_slots(loaded, requests, together):
    short = [k for k, r in enumerate(requests) if len(r.prompt) <= 64 and r.pixel_values is None][:10]
    assert len(short) >= 6
    small = Engine(loaded.model, shape(loaded, slots=3, cache_len=320, prefill_batch=4, chunk=8))
    results = small.generate([requests[k] for k in short])
    assert [r.tokens for r in results] == [together[k].tokens for k in short]
    assert small.stats["requests"] == len(short) and small.stats["prefills"] >= len(short) // 3  # through 3 slots


def test_requests_that_fill_the_context_run_in_freed_slots_as_alone(loaded):
    """2 slots of 128 columns: prompts of 40 tokens (bucket 64) and up to 64 new tokens fill a slot's whole
    row. Each slot writes its own columns, so a request goes in as soon as a slot is free, whatever its
    neighbour's length: four requests, three prefills (the first two together), and every request equals
    generate."""
    rng = np.random.default_rng(1)
    requests = [Request(rng.integers(1, 500, 40).tolist(), SamplingParams(max_tokens=m, stop_ids=()))
                for m in (8, 64, 64, 30)]
    engine = Engine(loaded.model, shape(loaded, slots=2, cache_len=128, prefill_batch=2, chunk=4))
    results = engine.generate(requests)
    assert engine.stats["requests"] == 4 and engine.stats["prefills"] == 3
    # Decode steps: the first request's 7 (two chunks of 4: 8); the third goes into its slot at once,
    # and the second's last 55 steps run beside it; then the fourth's 29 beside the third's last 8.
    assert engine.stats["decode_steps"] == 8 + 55 + 29
    for request, result in zip(requests, results):
        ref = generate(loaded.model, [request.prompt], sampling=SamplingParams(max_tokens=request.sampling.max_tokens,
                                                                               stop_ids=()))
        assert result.tokens == ref.tokens[0].tolist()


def test_rows_left_running_move_down_to_a_narrower_width(loaded):
    """4 slots: four prompts of one bucket go in as one 4-row prefill; when the first three finish, the
    fourth (slot 3) moves to slot 0 and decodes as a batch of one, and still equals generate."""
    rng = np.random.default_rng(2)
    requests = [Request(rng.integers(1, 500, 40).tolist(), SamplingParams(max_tokens=m, stop_ids=()))
                for m in (5, 5, 5, 30)]
    engine = Engine(loaded.model, shape(loaded, slots=4, cache_len=128, chunk=4))
    widths = []
    decode = engine._decode
    engine._decode = lambda: (widths.append(engine.scheduler.width(engine.slots_state.live()[-1])), decode())
    results = engine.generate(requests)
    assert engine.stats["prefills"] == 1 and engine.stats["moved_rows"] == 1
    assert widths == [4] + [1] * 7  # 4 steps of 4 rows, then the last 25 of one row
    for request, result in zip(requests, results):
        ref = generate(loaded.model, [request.prompt], sampling=SamplingParams(max_tokens=request.sampling.max_tokens,
                                                                               stop_ids=()))
        assert result.tokens == ref.tokens[0].tolist()


def test_first_tokens_come_before_the_chunk_and_a_request_they_finish_frees_its_slot(loaded):
    """2 slots: A (max_tokens 1) and B go in as one 2-row prefill and get their first tokens from one product;
    A is done by it, so C takes its slot and gets its first token before any decode step: B and C then
    finish in one chunk of 4 steps. A never takes a decode step; every request equals generate."""
    rng = np.random.default_rng(4)
    requests = [Request(rng.integers(1, 500, 40).tolist(), SamplingParams(max_tokens=m, stop_ids=()))
                for m in (1, 5, 5)]
    engine = Engine(loaded.model, shape(loaded, slots=2, cache_len=128, chunk=4))
    results = engine.generate(requests)
    assert [len(r.tokens) for r in results] == [1, 5, 5]
    stats = engine.stats
    assert (stats["prefills"], stats["first_products"], stats["decode_chunks"], stats["decode_steps"]) == (2, 2, 1, 4)
    for request, result in zip(requests, results):
        ref = generate(loaded.model, [request.prompt], sampling=SamplingParams(max_tokens=request.sampling.max_tokens,
                                                                               stop_ids=()))
        assert result.tokens == ref.tokens[0].tolist()


def test_a_server_waits_a_moment_for_answered_clients_to_send_again(loaded):
    """A started engine: when a request finishes, its client's next request goes in before the next decode
    chunk (the engine waits up to admit_wait for it) instead of a chunk later. (When no request comes, the
    engine decodes on after admit_wait, 2 ms by default; stopping the engine ends the wait at once.)"""
    rng = np.random.default_rng(3)
    prompt = lambda: rng.integers(1, 500, 30).tolist()
    engine = Engine(loaded.model, shape(loaded, slots=2, cache_len=128, chunk=4, admit_wait=60.0))
    engine.start()
    try:
        seen = {}
        long = engine.submit(Request(prompt(), SamplingParams(max_tokens=40, stop_ids=())))
        first = engine.submit(Request(prompt(), SamplingParams(max_tokens=3, stop_ids=())),
                              on_update=lambda t, d, reason: reason and seen.setdefault("first", len(long.tokens)))
        first.wait(60)
        second = engine.submit(Request(prompt(), SamplingParams(max_tokens=3, stop_ids=())),
                               on_update=lambda t, d, reason: seen.setdefault("second", len(long.tokens)))
        assert len(second.wait(60).tokens) == 3
    finally:
        engine.stop()  # drains: the long request runs to its end
    assert seen["second"] == seen["first"] < 40 and len(long.wait(0).tokens) == 40  # no chunk ran in between


def test_warm_up_compiles_every_decode_shape_a_run_can_meet(loaded, requests, together):
    """4 slots of 128 columns: widths 1, 2, 4 x windows 64, 128. After warm_up, a run of requests arriving
    in any order compiles no decode chunk, and its tokens are unchanged."""
    engine = Engine(loaded.model, shape(loaded, slots=4, cache_len=128, chunk=8))
    assert engine.widths_and_windows() == [(w, c) for w in (1, 2, 4) for c in (64, 128)]
    before = TRACE_COUNTS["engine_decode"]
    assert engine.warm_up() == 6 and TRACE_COUNTS["engine_decode"] - before <= 6
    short = [k for k, r in enumerate(requests) if len(r.prompt) <= 64 and r.pixel_values is None][:6]
    assert len(short) == 6
    counts = lambda: [TRACE_COUNTS[k] for k in ("engine_decode", "engine_move", "engine_first")]
    compiled = counts()
    assert [r.tokens for r in engine.generate([requests[k] for k in short])] == [together[k].tokens for k in short]
    assert counts() == compiled
    assert Engine(loaded.model, shape(loaded, slots=1, cache_len=128, chunk=8)).warm_up() == 2


def test_stop_ids_strings_and_sampling(engine, requests, together):
    base = requests[0]
    tokens = together[0].tokens
    stop_id = next(t for k, t in enumerate(tokens) if k >= 2 and t not in tokens[:k])
    cut = engine.generate([Request(base.prompt, SamplingParams(max_tokens=base.sampling.max_tokens,
                                                               stop_ids=(stop_id,)))])[0]
    assert cut.tokens == tokens[:tokens.index(stop_id) + 1] and cut.finish_reason == "stop"

    text = together[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    by_string = engine.generate([Request(base.prompt, SamplingParams(max_tokens=base.sampling.max_tokens, stop_ids=(),
                                                                     stop=[stop]))])[0]
    assert by_string.text == text[:text.index(stop)] and by_string.finish_reason == "stop"

    sampled = lambda seed, **kw: Request(base.prompt, SamplingParams(max_tokens=12, stop_ids=(), temperature=1.0,
                                                                     seed=seed, **kw))
    alone = engine.generate([sampled(7)])[0].tokens
    crowd = engine.generate([sampled(8)] + requests[1:20] + [sampled(7), sampled(7, top_k=1)])
    assert crowd[-2].tokens == alone != crowd[0].tokens  # a request's seed, not its neighbours, decides its draws
    assert crowd[-1].tokens == engine.generate([Request(base.prompt, SamplingParams(max_tokens=12,
                                                                                    stop_ids=()))])[0].tokens


def test_fine_buckets_and_when_a_cache_window_pays(loaded):
    assert [Buckets(64).prompt(n) for n in (1, 64, 65, 400, 512, 513, 1025, 3000)] == [64, 64, 128, 448, 512, 640, 1280,
                                                                                 3072]
    engine = Engine(loaded.model, shape(loaded, slots=2, cache_len=576))
    # A window is copied out and back (4 column passes) and saves steps * (576 - window) column reads.
    windows = engine.buckets
    assert windows.decode_window(100) == 128 and windows.decode_window(100, steps=16) == 128  # 16 * 448 > 4 * 128
    assert engine.buckets.decode_window(100, steps=1) == 576  # 448 <= 512: reading all 576 columns once is cheaper
    assert engine.buckets.decode_window(500, steps=16) == 576  # 16 * 64 <= 4 * 512
    assert engine.buckets.decode_window(600) == 576


def test_rejects_what_cannot_run(engine):
    with pytest.raises(ValueError, match="exceeds the context of 320"):
        engine.submit(Request(list(range(1, 300)), SamplingParams(max_tokens=64)))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(Request([1, 2], SamplingParams(max_tokens=0)))


def test_cancel_frees_the_slot_and_leaves_the_others_alone(engine, requests, together):
    long = next(k for k, r in enumerate(requests) if r.sampling.max_tokens >= 12 and r.pixel_values is None)
    other = next(k for k, r in enumerate(requests) if k != long and r.pixel_values is None)
    before = engine.stats["cancelled"]
    waiting = engine.submit(requests[other])
    assert engine.cancel(waiting) and not engine.busy()  # a waiting request leaves the queue at once
    assert waiting.wait(0).finish_reason == "cancelled" and waiting.wait(0).tokens == []

    running, neighbour = engine.submit(requests[long]), engine.submit(requests[other])
    while not running.tokens:
        engine.step()
    assert engine.cancel(running)
    while engine.busy():
        engine.step()
    cut = running.wait(0)
    assert cut.finish_reason == "cancelled" and 0 < len(cut.tokens) < requests[long].sampling.max_tokens
    assert cut.tokens == together[long].tokens[:len(cut.tokens)]
    assert neighbour.wait(0).tokens == together[other].tokens and not engine.cancel(neighbour)
    assert engine.stats["cancelled"] == before + 2 and all(t is None for t in engine.slots_state.occupant)


@pytest.mark.parametrize("bad", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(top_k=2 ** 31), dict(top_k=1.5), dict(top_p=float("nan")), dict(seed=-1),
                                 dict(seed=2 ** 32), dict(stop_ids=(2 ** 31,)), dict(stop_ids=(-1,))])
def test_settings_a_decode_chunk_cannot_hold_are_refused_at_submit(engine, requests, bad):
    """A setting that would not fit the chunk's per-row arrays fails its own request at submit, never the chunk
    of every request decoding beside it."""
    good = requests[0]
    with pytest.raises(ValueError):
        engine.submit(Request(good.prompt, SamplingParams(max_tokens=3, **{"stop_ids": (), **bad})))
    assert engine.in_flight == 0
