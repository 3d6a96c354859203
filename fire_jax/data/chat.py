"""Student and teacher sequences (FIRE Eq. 5, 6) rendered with the model's chat template, with loss masks.

A sequence is a list of :class:`Message`; ``turn > 0`` marks a labelled
assistant message (r_i for the student, f_i for the teacher, Eq. 5 / Eq. 6).
The prompt strings (:data:`SYSTEM`, :data:`TEACHER_INSTRUCTION`) are the
paper's whatever the template. :class:`ChatTokenizer` renders messages with the
tokenizer's chat template (:mod:`fire_jax.data.templates`: Llama-3, ChatML,
Vicuna v1 or any Jinja template) and tokenises the pieces one by one, so every
labelled span decodes back to exactly the turn text + the template's end token.
Images are placed by the caller (``Message.images``), never by text: each
becomes ``geometry.num_tokens(image_size)`` copies of the image token id (the
Hugging Face "expanded" convention), and a ``<image>`` typed in a text is text.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

import numpy as np

from fire_jax.data.records import IMAGE_PLACEHOLDER, Conversation, Instruction, Record
from fire_jax.data.templates import LLAMA3_FAMILY, SHIPPED, ChatTemplate, template_source
from fire_jax.core.geometry import ImageGeometry
from fire_jax.core.config import InputError
from fire_jax.core.results import read_json_object

#: Llama-3's special tokens (the tiny test tokenizer has them too).
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
LLAMA3_SPECIAL_TOKENS = (BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT)

SYSTEM = ("You are a helpful language and vision assistant. You are able to understand the visual content that "
          "the user provides, and assist the user with a variety of tasks using natural language.")

TEACHER_INSTRUCTION = (
    "Please compare my answer with the groundtruth answer and provide helpful, detailed, and polite feedback to "
    "help me improve my answer.\n"
    "Formulate the feedback as:\n"
    "'''\n"
    "Score: <compare my answer with the groundtruth answer in terms of accuracy, relevance, helpfulness, and level "
    "of detail, and provide an overall score on a scale of 1 to 10, where a higher score indicates better overall "
    "performance.>\n"
    "Feedback: <provide feedback on my answer. Do NOT directly tell the groundtruth answer. The feedback should "
    "identify which parts of my answer are incorrect, what is missing in my answer, and how to improve my answer.>\n"
    "'''")

#: What the release's fixed-dialogue evaluation appends to the teacher's first turn under a template other than its
#: teacher templates (MM-FIRE/FIRE ``llava/eval/eval_feedback.py``, ``prompt()``; no closing quotes, as written).
RELEASE_TEACHER_REQUEST = (
    "Can you provide me a feedback based on the groundtruth and the answer?\n"
    "The feedback is formatted as:\n"
    "'''\n"
    "Score: <compare the human's answer with the groundtruth answer in terms of accuracy, relevance, helpfulness, "
    "and level of detail, and provide an overall score on a scale of 1 to 10, where a higher score indicates better "
    "overall performance.>\n"
    "Feedback: <provide feedback on the human's answer. Do NOT directly tell the groundtruth answer. The feedback "
    "should identify which parts of the human's answer are incorrect, what is missing in the human's answer, and how "
    "to improve the human's answer.>")
#: The templates under which ``eval_feedback.py`` feeds the teacher's turns as they are (``llama_v3_student``
#: renders the same text as ``llama_v3_teacher``; ``llava_v1_teacher_feedback`` holds the format in its system
#: prompt).
RELEASE_TEACHER_TEMPLATES = ("llama_v3_teacher", "llama_v3_student", "llava_v1_teacher_feedback")

ROLES = ("student", "teacher")
TEACHER_HISTORIES = ("full", "latest")
#: The teacher's prompt in fixed dialogues: "paper" (FIRE Eq. 6: question and groundtruth, the instruction
#: message, then the answers, :func:`teacher_messages`) or "release" (:func:`release_teacher_messages`).
TEACHER_PROMPTS = ("paper", "release")


def check_teacher_prompt(prompt: str) -> str:
    """``prompt`` when it is one of :data:`TEACHER_PROMPTS`, else ValueError."""
    if prompt not in TEACHER_PROMPTS:
        raise ValueError(f"teacher prompt must be one of {TEACHER_PROMPTS}, got {prompt!r}")
    return prompt


def check_teacher_history(history: str) -> str:
    """``history`` when it is one of :data:`TEACHER_HISTORIES` (the teacher's prompt sees every earlier turn,
    or only the latest answer), else ValueError: the one check of every teacher."""
    if history not in TEACHER_HISTORIES:
        raise ValueError(f"teacher history must be one of {TEACHER_HISTORIES}, got {history!r}")
    return history


@dataclasses.dataclass(frozen=True)
class Message:
    role: str  # "user" or "assistant"
    text: str
    turn: int = -1  # i > 0: labelled, the span of r_i / f_i; -1: not labelled
    images: int = 0  # images of this message, placed before its text as the template places them
    inline: bool = False  # the images are where the text has IMAGE_PLACEHOLDER ("<image>"), not before it


def student_messages(conv: Conversation, *, first_turn_labelled: bool = False,
                     until_turn: int | None = None) -> list[Message]:
    """Student sequence (Eq. 5): user [image] q, assistant r_1, user f_1, assistant r_2, ...

    Labels r_i for i >= 2 (and r_1 with ``first_turn_labelled``). The sequence
    ends with r_n: f_n is never a target. With ``until_turn=k`` it is the prompt
    for r_k instead (through user f_{k-1}; encode with ``add_generation_prompt``).
    """
    messages = [Message("user", conv.question, images=1)]
    if until_turn is not None:
        for turn in conv.turns[:until_turn - 1]:
            messages += [Message("assistant", turn.response), Message("user", turn.feedback_text)]
        return messages
    for i, turn in enumerate(conv.turns, 1):
        if i > 1:
            messages.append(Message("user", conv.turns[i - 2].feedback_text))
        messages.append(Message("assistant", turn.response, i if (i >= 2 or first_turn_labelled) else -1))
    return messages


def teacher_messages(conv: Conversation, *, history: str = "full", until_turn: int | None = None,
                     image_inline: bool = False, short: bool = False) -> list[Message]:
    """Teacher sequence (Eq. 6): user [image] Question/Groundtruth, user TEACHER_INSTRUCTION, user r_1, assistant f_1, ...

    Labels every f_i (whole, score line included). ``history="latest"`` keeps only
    the last turn (or turn ``until_turn``), as the teacher sees it in free
    dialogues. With ``until_turn=k`` it is the prompt for f_k (ends with user r_k).
    ``image_inline``: the image after "Question: ", as the release's free-dialogue teacher prompt has it
    (MM-FIRE/FIRE ``llava/eval/model_fire_chat_loader.py``: ``Question: <image>\n{q}``); else before the text.
    ``short``: no instruction message, each judged response cut to its "Answer:" line, so that the groundtruth
    stands a few tokens before the answer (``data.short_teacher_share``, an ablation of the teacher's prompt).
    """
    check_teacher_history(history)
    if image_inline:
        first = Message("user", f"Question: {IMAGE_PLACEHOLDER}\n{conv.question}\nGroundtruth: {conv.groundtruth}",
                        images=1, inline=True)
    else:
        first = Message("user", f"Question: {conv.question}\nGroundtruth: {conv.groundtruth}", images=1)
    messages = [first] if short else [first, Message("user", TEACHER_INSTRUCTION)]
    last = len(conv.turns) if until_turn is None else until_turn
    first = last if history == "latest" else 1
    for i in range(first, last + 1):
        turn = conv.turns[i - 1]
        response = f"Answer: {answer_of(turn.response)}" if short and "\nAnswer:" in turn.response else turn.response
        messages.append(Message("user", response))
        if until_turn is None or i < until_turn:
            messages.append(Message("assistant", turn.feedback, i))
    return messages


def release_teacher_messages(conv: Conversation, *, until_turn: int, history: str = "full",
                             request: bool = False) -> list[Message]:
    """The prompt for f_k (k = ``until_turn``) as the release's fixed-dialogue evaluation feeds its teacher.

    ``eval_feedback.py`` (MM-FIRE/FIRE ``llava/eval/``) feeds a test record's turns as they are: no instruction
    message. The teacher's first turn is written as the release's own dialogue code writes it
    (``feedback_chat.py``, ``FeedbackChat.invoke``: ``"{question}\\nGroundtruth: {groundtruth}\\n{response}\\n"``,
    the image first), every later user turn is the answer alone, every assistant turn the feedback as written.
    ``request``: ``eval_feedback.py``'s ``prompt()`` appends :data:`RELEASE_TEACHER_REQUEST` to that first turn,
    which it does under every template but :data:`RELEASE_TEACHER_TEMPLATES`. ``history="latest"``: the first
    turn carries answer k and nothing earlier.
    """
    check_teacher_history(history)
    first = until_turn if history == "latest" else 1
    text = f"{conv.question}\nGroundtruth: {conv.groundtruth}\n{conv.turns[first - 1].response}\n"
    messages = [Message("user", f"{text}\n{RELEASE_TEACHER_REQUEST}" if request else text, images=1)]
    for i in range(first, until_turn):
        messages += [Message("assistant", conv.turns[i - 1].feedback, i), Message("user", conv.turns[i].response)]
    return messages


def answer_of(response: str) -> str:
    """The text after the last "Answer:" of a student's response, up to the end of its line (the whole text if
    none)."""
    index = response.rfind("Answer:")
    text = response if index < 0 else response[index + len("Answer:"):]
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def instruction_messages(record: Instruction) -> list[Message]:
    """LLaVA-665K-style record: every assistant message labelled (turn k for the k-th answer)."""
    messages, answers = [], 0
    for role, text in record.messages:
        if role == "assistant":
            answers += 1
        images = int(not messages and record.image is not None)
        messages.append(Message(role, text, answers if role == "assistant" else -1, images))
    return messages


def training_messages(record: Record, role: str, *, first_turn_labelled: bool = False,
                      teacher_history: str = "full", short_teacher_share: float = 0.0) -> list[Message]:
    """The labelled sequence of one record for a model of ``role`` ("student" or "teacher"); a share
    ``short_teacher_share`` of teacher records, drawn by record id (a rerun draws the same), rendered short
    (:func:`teacher_messages`)."""
    if isinstance(record, Instruction):
        return instruction_messages(record)
    if role == "student":
        return student_messages(record, first_turn_labelled=first_turn_labelled)
    if role == "teacher":
        short = bool(short_teacher_share) and random.Random(f"{record.id}/short").random() < short_teacher_share
        return teacher_messages(record, history=teacher_history, short=short)
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def llama3_template(special_tokens: Sequence[str] = LLAMA3_SPECIAL_TOKENS) -> ChatTemplate:
    """LLaVA-NeXT-8B's Llama-3 template (the tiny test models use it too)."""
    return ChatTemplate(template_source("llama3"), special_tokens=special_tokens, bos_token=BOS, eos_token=EOS,
                        name="llama3")


def render(messages: Sequence[Message], *, add_generation_prompt: bool = False, template: ChatTemplate | None = None,
           system: str = SYSTEM) -> str:
    """The rendered chat string (Llama-3's template unless one is given), image tokens not expanded."""
    return (template or llama3_template()).render(messages, system=system, add_generation_prompt=add_generation_prompt)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One tokenised sequence, image placeholder expanded."""

    input_ids: np.ndarray  # int32 [seq]
    loss_mask: np.ndarray  # float32 [seq], 1 on labelled tokens
    turn_ids: np.ndarray  # int32 [seq], i on tokens of r_i / f_i, -1 elsewhere
    image_start: int  # position of the first image token, -1 without image
    image_tokens: int  # number of image tokens

    def __len__(self) -> int:
        return len(self.input_ids)


class ChatTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer, its chat template and the image geometry of one model.

    ``template``: a :class:`ChatTemplate`, a shipped template's name (``llama3``, ``chatml``, ``vicuna_v1``) or a
    ``.jinja`` path; ``None`` reads ``tokenizer_config.json`` beside a tokenizer file (its ``chat_template``,
    ``bos_token``, ``eos_token``), else Llama-3's. Stop ids (:attr:`stop_ids`) are the template's end-of-turn
    token and EOS. ``pad_token`` falls back to EOS.

    A vocabulary without ``image_token`` (the original LLaVA format's: its prompts carry -200 where the image
    goes) gets it appended as a special token, the next free id, as llava-hf's conversion appends ``<image>``;
    the model's ``image_token_id`` must be that id (:mod:`fire_jax.convert.llava` sets it so).
    """

    def __init__(self, tokenizer, geometry: ImageGeometry, *, template: ChatTemplate | str | None = None,
                 image_token: str = IMAGE_PLACEHOLDER, pad_token: str = "<pad>", name: str = "tokenizer",
                 bos_token: str | None = None, eos_token: str | None = None, input_cut: int = 0):
        import tokenizers

        self.tokenizer, self.geometry, self.image_token = tokenizer, geometry, image_token
        # a shipped template's name (the release's conv_mode of the same name), else None
        self.template_name = template if isinstance(template, str) and template in SHIPPED else None
        specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
        if isinstance(template, ChatTemplate):
            self.template = template
        else:
            bos, eos = (BOS, EOS) if template in (None, *LLAMA3_FAMILY) else (bos_token or "", eos_token or "")
            source = template_source(template or "llama3")
            self.template = ChatTemplate(source, special_tokens=specials, bos_token=bos_token or bos,
                                         eos_token=eos_token or eos, name=f"{name} ({template or 'llama3'})")
        if tokenizer.token_to_id(image_token) is None:  # the original LLaVA format's vocabulary (see class doc)
            from tokenizers import AddedToken

            tokenizer.add_special_tokens([AddedToken(image_token, special=True, normalized=False)])
        missing = [t for t in (self.template.end_token, self.template.eos_token)
                   if t and tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"{name}: tokens {missing} are not in the vocabulary")
        self.image_token_id = tokenizer.token_to_id(image_token)
        self.eot_id = tokenizer.token_to_id(self.template.end_token)
        self.eos_id = tokenizer.token_to_id(self.template.eos_token) if self.template.eos_token else self.eot_id
        bos = self.template.bos_token
        self.bos_id = tokenizer.token_to_id(bos) if bos else None
        pad = tokenizer.token_to_id(pad_token)
        self.pad_id = self.eos_id if pad is None else pad
        # The release's conventions (geometry.conventions): its tokenizer's own BOS before the rendered text
        # (MM-FIRE/FIRE llava/mm_utils.py tokenizer_image_token: Llama-3's tokenizer adds <|begin_of_text|> in front
        # of the template's, Vicuna's adds <s> to a template that writes none), and every input cut at
        # ``input_cut`` tokens, image features included (llava_arch.py, tokenizer_model_max_length).
        self.input_cut = int(input_cut or 0)
        self.leading_bos = None
        if geometry.release:
            token = next((t for t in (bos, "<s>") if t and tokenizer.token_to_id(t) is not None), None)
            if token is None:
                raise ValueError(f"{name}: the release's conventions put the tokenizer's BOS first, and the "
                                 f"vocabulary has neither {bos!r} nor '<s>'")
            self.leading_bos = tokenizer.token_to_id(token)
        self._plain = tokenizers.Tokenizer.from_str(tokenizer.to_str())  # message texts: special strings are text
        self._plain.encode_special_tokens = True
        self._cache: dict[tuple[str, str], list[int]] = {}

    @classmethod
    def from_file(cls, path: str, geometry: ImageGeometry, *, template: ChatTemplate | str | None = None,
                  **kwargs) -> "ChatTokenizer":
        """A tokenizer.json; with ``template=None`` a ``tokenizer_config.json`` beside it names the chat template
        (its ``chat_template`` text, ``bos_token``, ``eos_token``), else Llama-3's is used."""
        import os

        import tokenizers

        tokenizer = tokenizers.Tokenizer.from_file(path)
        config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if template is None and os.path.exists(config_path):
            config = read_json_object(config_path)
            if not isinstance(config.get("chat_template"), str):
                raise InputError(f"{config_path}: field 'chat_template' = {config.get('chat_template')!r}: expected "
                                 "the template's Jinja text (or give data.template)")
            specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
            template = ChatTemplate(config["chat_template"], special_tokens=specials,
                                    bos_token=config.get("bos_token") or "", eos_token=config.get("eos_token") or "",
                                    name=config_path)
        return cls(tokenizer, geometry, template=template, name=path, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Generation stops at the template's end-of-turn token or EOS."""
        return tuple(dict.fromkeys((self.eot_id, self.eos_id)))

    def _ids(self, piece) -> list[int]:
        if piece.kind in ("image", "eos"):
            return [self.image_token_id if piece.kind == "image" else self.eos_id]
        key = (piece.kind, piece.text)  # template pieces and the system prompt recur in every sequence
        ids = self._cache.get(key)
        if ids is None:
            tokenizer = self._plain if piece.kind == "text" else self.tokenizer
            ids = tokenizer.encode(piece.text, add_special_tokens=False).ids
            if len(piece.text) < 2048 and len(self._cache) < 4096:  # bounded: a dataset's texts do not recur
                self._cache[key] = ids
        return ids

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
               system: str | None = SYSTEM) -> str:
        """The rendered chat string (image tokens not expanded)."""
        return self.template.render(messages, system=system, add_generation_prompt=add_generation_prompt)

    def encode(self, messages: Sequence[Message], image_size: Sequence[int] | None = None, *,
               add_generation_prompt: bool = False, image_sizes: Sequence[Sequence[int]] | None = None,
               system: str | None = None) -> Encoded:
        """Token ids, loss mask and turn ids of a message list.

        ``image_size`` (h, w): the messages hold one image; ``image_sizes``: one size per image of the
        messages, in order (VLRMBench's multi-image samples, a served chat). Each image expands to
        ``geometry.num_tokens(size)`` image tokens; ``image_start`` is the first image's position and
        ``image_tokens`` all images' count. ``system`` replaces the system prompt's text.
        """
        sizes = list(image_sizes) if image_sizes is not None else ([] if image_size is None else [image_size])
        count = sum(m.images for m in messages)
        if count != len(sizes):
            raise ValueError(f"the messages hold {count} image(s) but {len(sizes)} image size(s) were given")
        pieces = self.template.pieces(messages, system=SYSTEM if system is None else system,
                                      add_generation_prompt=add_generation_prompt)
        ids, labels, image_start, image_tokens, k = [], [], -1, 0, 0
        if self.leading_bos is not None:
            ids, labels = [self.leading_bos], [-1]
        for piece in pieces:
            piece_ids = self._ids(piece)
            if piece.kind == "image":
                n = self.geometry.num_tokens(sizes[k])
                image_start = len(ids) if image_start < 0 else image_start
                image_tokens, k = image_tokens + n, k + 1
                piece_ids = piece_ids * n
            ids += piece_ids
            labels += [piece.turn] * len(piece_ids)
        if self.input_cut and len(ids) > self.input_cut:
            ids, labels = self._cut(ids, labels, image_start, image_tokens)
        turn_ids = np.asarray(labels, np.int32)
        return Encoded(input_ids=np.asarray(ids, np.int32), loss_mask=(turn_ids > 0).astype(np.float32),
                       turn_ids=turn_ids, image_start=image_start, image_tokens=image_tokens)

    def _cut(self, ids: list[int], labels: list[int], image_start: int, image_tokens: int):
        """The first ``input_cut`` tokens, as the release cuts its inputs (the end is lost, labels with it). A
        cut inside or before an image's features, which the release would make too, is refused: no FIRE prompt
        meets one (its image comes first, at most 2,928 features under 3,072)."""
        cut = self.input_cut
        if image_start >= 0 and cut < image_start + image_tokens:
            raise ValueError(f"the input of {len(ids)} tokens is cut at {cut} (the checkpoint's "
                             f"tokenizer_model_max_length) inside its image features ({image_start} to "
                             f"{image_start + image_tokens})")
        return ids[:cut], labels[:cut]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def image_summary(self, image_size: Sequence[int]) -> str:
        """"<image x 212: base 16 + grid 2x3 unpadded 8x12 + 8 newlines>" for one image."""
        g = self.geometry
        n = g.num_tokens(image_size)
        if g.mode == "pad":
            return f"<image x {n}: pad {g.tokens_per_tile}" + (" + 1 newline>" if g.pad_newline else ">")
        rows, cols = g.grid_shape(image_size)
        h, w = g.unpadded(image_size)
        return f"<image x {n}: base {g.tokens_per_tile} + grid {rows}x{cols} unpadded {h}x{w} + {h} newlines>"

    def show(self, encoded: Encoded, image_size: Sequence[int] | None = None, *, color: bool = False) -> str:
        """Human-readable rendering: labelled spans marked, the image block summarised.

        Labelled tokens are wrapped as ``[[i| ... ]]`` (turn i), or coloured with ``color``.
        """
        out, i, n = [], 0, len(encoded)
        while i < n:
            if i == encoded.image_start:
                out.append(self.image_summary(image_size))
                i += encoded.image_tokens
                continue
            j = i
            while j < n and encoded.turn_ids[j] == encoded.turn_ids[i] and j != encoded.image_start:
                j += 1
            text, turn = self.decode(encoded.input_ids[i:j]), int(encoded.turn_ids[i])
            if turn > 0:
                text = f"\033[1;3{1 + turn % 6}m{text}\033[0m" if color else f"[[{turn}|{text}]]"
            out.append(text)
            i = j
        return "".join(out)
