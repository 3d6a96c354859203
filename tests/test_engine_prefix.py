"""Prefix caching in the continuous-batching engine: a prompt that begins with a cached prefix (the same dialogue's
previous turn, or another request's prompt) prefills only the rest, and greedy tokens are those of the engine
without the cache."""

import numpy as np
import pytest
from PIL import Image

from fire_jax.core.config import DEFAULT_CONFIG, load_config
from fire_jax.data.chat import Message
from fire_jax.data.images import preprocess
from fire_jax.infer.decode import generate
from fire_jax.infer.engine import Engine
from fire_jax.infer.engine_config import EngineConfig
from fire_jax.infer.loading import load
from fire_jax.infer.requests import Request
from fire_jax.infer.sampling import SamplingParams

#: Cached keys and values come from another prefill (another bucket) or from decode steps, so they may differ
#: from a whole-prompt prefill's in the last bits; the log-probs of the chosen tokens stay within this.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def loaded():
    loaded = load(load_config(DEFAULT_CONFIG))
    embed = loaded.model.language_model.model.embed_tokens.embedding
    embed.set_value(embed.get_value() * 50)  # unit-scale embeddings: greedy outputs vary instead of repeating one token
    return loaded


def engine(loaded, on=True, **kwargs):
    config = EngineConfig(**dict(dict(slots=4, cache_len=512, chunk=8), **kwargs), bucket_step=None,
                          pad_id=loaded.chat.pad_id, prefix_cache=on)
    return Engine(loaded.model, config, tokenizer=loaded.chat.tokenizer)


def counts(engine):
    return tuple(engine.stats[k] for k in ("prompt_tokens", "reused_tokens", "prefilled_tokens"))


def test_dialogue_turns_reuse_their_previous_turn_and_generate_the_same_tokens(loaded):
    """Four dialogues of three turns: the prompt of turn k is turn k-1's prompt, its generated tokens and new
    ones. With the cache, turn k reuses all but the last generated token of turn k-1 (its keys were never
    computed) in place, in the same slot, and prefills the rest; tokens equal the engine's without the cache
    and generate's, log-probs within LOGPROB_ATOL."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 500, n).tolist() for n in (70, 100, 130, 160)]
    on, off = engine(loaded), engine(loaded, on=False)
    holding = lambda held: [next(s for s in range(on.slots) if on.prefix.tokens[s, :on.prefix.length[s]].tolist() == h)
                            for h in held]
    expected, slots = 0, None
    for turn in range(3):
        requests = [Request(p, SamplingParams(max_tokens=12, stop_ids=())) for p in prompts]
        with_cache, without = on.generate(requests), off.generate(requests)
        assert [r.tokens for r in with_cache] == [r.tokens for r in without]
        for a, b in zip(with_cache, without):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_ATOL)
        if turn:
            expected += sum(map(len, held))
        held = [p + r.tokens[:-1] for p, r in zip(prompts, with_cache)]  # what each row holds now
        assert slots is None or holding(held) == slots  # reused in place
        slots = holding(held)
        prompts = [p + r.tokens + rng.integers(1, 500, 10).tolist() for p, r in zip(prompts, with_cache)]
    prompt_tokens = counts(off)[0]
    assert counts(off) == (prompt_tokens, 0, prompt_tokens)
    ref = generate(loaded.model, [prompts[0]], sampling=SamplingParams(max_tokens=12, stop_ids=()))
    assert on.generate([Request(prompts[0], SamplingParams(max_tokens=12,
                                                           stop_ids=()))])[0].tokens == ref.tokens[0].tolist()
    expected += len(held[0])
    prompt_tokens += len(prompts[0])
    assert counts(on) == (prompt_tokens, expected, prompt_tokens - expected)
    assert on.stats["prefix_hits"] == 4 * 2 + 1


def image_request(loaded, seed, question, max_tokens=8):
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 70, 3), np.uint8))
    tiles, hw = preprocess(image, loaded.model.cfg.geometry)
    prompt = loaded.chat.encode([Message("user", question, images=1)], hw, add_generation_prompt=True).input_ids
    return Request(prompt.tolist(), SamplingParams(max_tokens=max_tokens, stop_ids=()), pixel_values=tiles,
                   image_sizes=[hw])


def test_a_prefix_with_image_tokens_is_reused_only_for_the_same_image(loaded):
    """The image's placeholder ids are the same for every image of its size: a follow-up on the same image
    reuses the prefix through its image tokens, one on another image of that size (the same ids) reuses
    nothing (what would follow the text before the image is an image), and both equal the engine without
    the cache."""
    first = image_request(loaded, 0, "What is this?")
    on, off = engine(loaded), engine(loaded, on=False)
    answer = on.generate([first])[0]
    assert answer.tokens == off.generate([first])[0].tokens
    follow = lambda request: Request(request.prompt + answer.tokens + list(range(5, 25)),
                                     SamplingParams(max_tokens=8, stop_ids=()), pixel_values=request.pixel_values,
                                     image_sizes=request.image_sizes)
    other = image_request(loaded, 1, "What is this?")
    assert other.prompt == first.prompt and not np.array_equal(other.pixel_values, first.pixel_values)
    for request, reused in ((follow(other), 0), (follow(first), len(first.prompt) + len(answer.tokens) - 1)):
        before = counts(on)
        assert on.generate([request])[0].tokens == off.generate([request])[0].tokens
        assert counts(on)[1] - before[1] == reused
    assert on.stats["prefix_hits"] == 1


def test_a_shared_prefix_is_copied_into_other_slots(loaded):
    """A finished request's row holds a prefix two new requests share: one goes into that row, the other
    gets a copy of it in another slot; both reuse it and equal the engine without the cache."""
    rng = np.random.default_rng(2)
    shared = rng.integers(1, 500, 100).tolist()
    on, off = engine(loaded), engine(loaded, on=False)
    on.generate([Request(shared + [7, 8, 9], SamplingParams(max_tokens=4, stop_ids=()))])
    requests = [Request(shared + rng.integers(10, 500, 20).tolist(), SamplingParams(max_tokens=10,
                                                                                    stop_ids=())) for _ in range(2)]
    before = counts(on)
    assert [r.tokens for r in on.generate(requests)] == [r.tokens for r in off.generate(requests)]
    assert counts(on)[1] - before[1] == 2 * len(shared)
    assert on.stats["prefix_hits"] == 2 and on.stats["prefills"] == 2  # the two rests prefilled together


def test_free_rows_are_evicted_least_recently_used_first(loaded):
    """Two slots, three dialogues A, B, C one request at a time: C's prompt shares nothing, so it overwrites
    the row used longest ago (A's); then B's second turn reuses its row and A's reuses nothing."""
    rng = np.random.default_rng(3)
    prompts = {name: rng.integers(1, 500, 80).tolist() for name in "ABC"}
    on = engine(loaded, slots=2, cache_len=256)
    tokens = {name: on.generate([Request(prompts[name], SamplingParams(max_tokens=6,
                                                                       stop_ids=()))])[0].tokens for name in "ABC"}
    assert counts(on)[1] == 0
    for name, reused in (("B", 80 + 5), ("A", 0)):
        before = counts(on)[1]
        on.generate([Request(prompts[name] + tokens[name] + [3, 4], SamplingParams(max_tokens=6, stop_ids=()))])
        assert counts(on)[1] - before == reused


def test_an_engine_adopts_a_smaller_engines_prefixes(loaded):
    """An agent whose call needs a larger engine builds one that takes over the old engine's rows: a
    follow-up prompt reuses its prefix there and equals an engine without the cache."""
    small, large = engine(loaded, slots=2, cache_len=256), engine(loaded, slots=4, cache_len=512)
    prompt = np.random.default_rng(4).integers(1, 500, 150).tolist()
    answer = small.generate([Request(prompt, SamplingParams(max_tokens=10, stop_ids=()))])[0]
    large.adopt(small)
    follow = Request(prompt + answer.tokens + list(range(30, 230)), SamplingParams(max_tokens=10, stop_ids=()))
    assert large.generate([follow])[0].tokens == engine(loaded, on=False).generate([follow])[0].tokens
    assert counts(large)[1] == len(prompt) + len(answer.tokens) - 1


def test_free_dialogues_of_agents_reuse_every_turn_and_say_the_same(loaded, monkeypatch):
    """run_dialogues with the model as student and teacher (the teacher's reply to turn k scored k, so every
    dialogue runs three turns), with and without the cache (EngineConfig.prefix_cache): the same texts; the
    engines with the cache prefill less than half the prompt tokens, the others all of them. Each dialogue's
    image is decoded and tiled once for both agents, all turns and both runs."""
    from fire_jax.core.config import resolve_path
    from fire_jax.data.images import TileCache
    from fire_jax.data.items import load_triplets
    from fire_jax.infer import backends
    from fire_jax.dialogue.agents import Feedback, Student, Teacher
    from fire_jax.infer.backends import InProcess
    from fire_jax.dialogue.loop import run_dialogues
    from fire_jax.dialogue.stop import StopRule

    tiles = TileCache()
    monkeypatch.setattr(backends, "TILES", tiles)

    class RisingTeacher(Teacher):
        def feedback(self, images, questions, groundtruths, answers, histories=None, *, rng=None):
            out = super().feedback(images, questions, groundtruths, answers, histories, rng=rng)
            return [Feedback(f.text, float(len(h) + 1)) for f, h in zip(out, histories)]

    items = load_triplets(resolve_path("assets:synthetic_fire/test.json"), "assets:synthetic_fire/images")[:3]
    runs = {}
    for on in (False, True):
        sampling, shape = SamplingParams(max_tokens=12), EngineConfig(prefix_cache=on)
        student = Student(InProcess(loaded.model, loaded.chat, sampling, engine=shape))
        teacher = RisingTeacher(InProcess(loaded.model, loaded.chat, sampling, engine=shape), history="latest")
        finished = []
        run_dialogues(items, student, teacher, StopRule(max_turns=3), batch_size=3, on_finish=finished.append)
        assert sorted(len(d.turns) for d in finished) == [3, 3, 3]
        runs[on] = ({d.item.id: d.turns for d in finished}, [counts(a.backend._engine) for a in (student, teacher)])
        assert all(a.backend._engine.prefix.enabled == on for a in (student, teacher))
    assert runs[True][0] == runs[False][0]
    assert tiles.misses == 3 and tiles.hits == 2 * 3 * 3 * 2 - 3  # runs x dialogues x turns x agents
    for (prompt, reused, prefilled), (prompt_off, reused_off, _) in zip(runs[True][1], runs[False][1]):
        assert prompt == prompt_off and reused_off == 0 and prefilled == prompt - reused < prompt / 2
