"""Why the main job's tiny teacher never learns to score: the comparison alone, isolated and short.

The FD teacher must say whether the student's answer equals the groundtruth. On the synthetic set neither value
alone predicts that (right and wrong answers are balanced for every value), so the target is an *interaction* of
two tokens, with no marginal signal for gradient descent to follow. This script strips the task to that core:

    user:      Groundtruth: There are 4.  <1-4 unrelated questions>  Answer: There are 3.
               Is the answer the same as the groundtruth?
    assistant: Yes.  |  No. The groundtruth comes later on its scale.  |  ... earlier ...

(text only, about 60 tokens instead of the teacher's 370), trains the main job's LLM (configs/main_job.py's
PIPELINE_LLM, tiny tokenizer, every weight, AdamW + warm-up + cosine, as the main job trains) from scratch with
fire_jax's own trainer, and scores greedy answers on held-out items. ``--trainers`` adds a transformers
LlamaForCausalLM of the same shape on the same token ids with the same schedule, the reference: if both sit at
the majority answer, the plateau is the task's, not a fire_jax bug.

    python experiments/compare_plateau.py --steps 1500 --batch 8                 # both trainers, as the main job
    python experiments/compare_plateau.py --steps 3000 --batch 32 --lr 1e-3 --max_filler 0 --trainers transformers
"""

import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fire_jax.data.synthetic import TASKS, parse_answer  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "main_job.py")
QUESTION = "Is the answer the same as the groundtruth?"


def compare_records(train: list[dict], num: int, seed: int, max_filler: int = 4) -> list[dict]:
    """``num`` text-only instruction records: a groundtruth, 1..``max_filler`` filler questions (none when 0), an
    answer, right half the time."""
    rng, out = random.Random(seed), []
    for k in range(num):
        record = rng.choice(train)
        name, truth = parse_answer(record["groundtruth"]["value"])
        task = TASKS[name]()
        value = truth if rng.random() < 0.5 else rng.choice([v for v in range(task.size) if v != truth])
        filler = [rng.choice(train)["question"]["value"] for _ in range(rng.randint(min(1, max_filler), max_filler))]
        prompt = "\n".join([f"Groundtruth: {task.answer(truth)}", *filler, f"Answer: {task.answer(value)}", QUESTION])
        reply = "Yes." if value == truth else \
            f"No. The groundtruth comes {'later' if truth > value else 'earlier'} on its scale."
        out.append({"id": f"compare_{seed}_{k:05d}", "source": "compare", "split": "compare",
                    "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]})
    return out


def train_config(data_path: str, steps: int, batch: int, lr: float):
    from fire_jax.core.config import load_config

    config = load_config(CONFIG + ":tiny").base_train  # the tiny main job's base model: PIPELINE_LLM, every weight trains
    config.data.sources = dict(compare=dict(json=data_path, weight=1.0))
    config.data.update(dict(buckets=(128, 256), max_len=256, batch_size=batch))
    config.train.update(dict(total_steps=steps, lr=lr, batch_size=batch, checkpoint_every=steps, export=False,
                             export_merged=False))
    return config


def right_share(records: list[dict]) -> float:
    return sum(r["conversations"][1]["value"] == "Yes." for r in records) / len(records)


def score(texts: list[str], records: list[dict]) -> dict:
    wants = [r["conversations"][1]["value"] for r in records]
    return {"exact": sum(t.strip() == w for t, w in zip(texts, wants)) / len(texts),
            "says_yes": sum(t.strip() == "Yes." for t in texts) / len(texts), "right_share": right_share(records)}


def run_fire_jax(config, workdir: str, test: list[dict]) -> dict:
    from fire_jax.data.chat import instruction_messages
    from fire_jax.data.records import parse_record
    from fire_jax.infer.decode import generate
    from fire_jax.infer.engine_config import EngineConfig
    from fire_jax.infer.sampling import SamplingParams
    from fire_jax.infer.loading import load, workdir_config
    from fire_jax.train.loop import train

    start = time.perf_counter()
    summary = train(config, workdir)
    minutes = (time.perf_counter() - start) / 60
    loaded = load(workdir_config(workdir), workdir)
    chat = loaded.chat
    prompts = []
    for i, raw in enumerate(test):
        messages = instruction_messages(parse_record(raw, default_id=str(i)))[:1]  # the user turn only
        prompts.append(chat.encode(messages, None, add_generation_prompt=True).input_ids)
    sampling = SamplingParams(max_tokens=24, stop_ids=(chat.eot_id, chat.eos_id))
    texts = generate(loaded.model, prompts, sampling=sampling, engine=EngineConfig(pad_id=chat.pad_id),
                     tokenizer=chat.tokenizer).texts
    return {"loss": summary["metrics"]["loss"], "minutes": minutes, **score(texts, test), "samples": texts[:6]}


def run_hf(config, train_records: list[dict], test: list[dict], seed: int) -> dict:
    """The same model shape, data, optimizer and schedule in transformers + PyTorch."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fire_jax.data.chat import ChatTokenizer, instruction_messages
    from fire_jax.core.config import resolve_path
    from fire_jax.data.records import parse_record
    from fire_jax.models import LlavaNextConfig

    chat = ChatTokenizer.from_file(resolve_path(config.data.tokenizer),
                                   LlavaNextConfig.from_dict(config.model).geometry)

    def encode(records, labelled=True):
        out = []
        for i, raw in enumerate(records):
            messages = instruction_messages(parse_record(raw, default_id=str(i)))
            encoded = chat.encode(messages if labelled else messages[:1], None, add_generation_prompt=not labelled)
            out.append((np.asarray(encoded.input_ids), np.asarray(encoded.loss_mask)))
        return out

    llm, t = config.model.llm, config.train
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=llm.vocab_size, hidden_size=llm.dim, num_hidden_layers=llm.layers, num_attention_heads=llm.heads,
        num_key_value_heads=llm.kv_heads, head_dim=llm.head_dim, intermediate_size=llm.mlp_dim,
        rope_theta=llm.rope_theta, max_position_embeddings=1024, tie_word_embeddings=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.b1, t.b2), eps=t.eps,
                                  weight_decay=t.weight_decay)
    warmup = max(1, int(t.warmup_frac * t.total_steps))
    def lr_factor(step):  # linear warm-up, then cosine to 0, as the trainer's schedule
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (t.total_steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    data, rng = encode(train_records), random.Random(seed)
    start = time.perf_counter()
    for _ in range(t.total_steps):
        items = rng.sample(data, t.batch_size)
        length = max(len(ids) for ids, _ in items)
        ids = torch.zeros((len(items), length), dtype=torch.long)
        labels = torch.full((len(items), length), -100, dtype=torch.long)
        attention = torch.zeros((len(items), length), dtype=torch.long)
        for b, (x, mask) in enumerate(items):
            ids[b, :len(x)], attention[b, :len(x)] = torch.from_numpy(x), 1
            labels[b, :len(x) - 1] = torch.from_numpy(np.where(mask[1:], x[1:], -100))
        logits = model(input_ids=ids, attention_mask=attention).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm)
        optimizer.step()
        schedule.step()
    minutes = (time.perf_counter() - start) / 60
    texts = []
    with torch.no_grad():
        for ids, _ in encode(test, labelled=False):
            out = model.generate(torch.from_numpy(ids)[None], max_new_tokens=24, do_sample=False,
                                 eos_token_id=[chat.eot_id, chat.eos_id], pad_token_id=chat.pad_id)
            texts.append(chat.decode(out[0, len(ids):].tolist()).split("<|eot_id|>")[0])
    return {"loss": loss.item(), "minutes": minutes, **score(texts, test), "samples": texts[:6]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num_train", type=int, default=2160)
    parser.add_argument("--num_test", type=int, default=64)
    parser.add_argument("--max_filler", type=int, default=4, help="unrelated questions between the two (0: none)")
    parser.add_argument("--trainers", default="fire_jax,transformers",
                        help="comma-separated: fire_jax (this repo's trainer), transformers (the reference)")
    parser.add_argument("--out", default="runs/compare_plateau")
    args = parser.parse_args()
    from fire_jax.core.config import resolve_path

    with open(resolve_path("assets:synthetic_fire/train.json"), encoding="utf-8") as f:
        shipped = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    train_records = compare_records(shipped, args.num_train, 1, args.max_filler)
    test = compare_records(shipped, args.num_test, 7, args.max_filler)
    data_path = os.path.join(args.out, "compare_train.json")
    with open(data_path, "w", encoding="utf-8") as f:
        json.dump(train_records, f)
    config = train_config(data_path, args.steps, args.batch, args.lr)
    trainers, rows = args.trainers.split(","), {}
    if "fire_jax" in trainers:
        rows["fire_jax"] = run_fire_jax(config, os.path.join(args.out, "fire_jax"), test)
    if "transformers" in trainers:
        rows["transformers"] = run_hf(config, train_records, test, config.seed)
    print(f"\nisolated comparison, {args.steps} steps x batch {args.batch}, lr {args.lr}, up to {args.max_filler} "
          f"filler questions, {args.num_test} held-out items ({right_share(test):.0%} right)")
    print("| trainer | final loss | exact | says 'Yes.' | minutes |\n|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['loss']:.4f} | {row['exact']:.3f} | {row['says_yes']:.3f} | {row['minutes']:.1f} |")
    for name, row in rows.items():
        print(f"{name} samples: {row['samples']}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
