"""Llama-3 chat rendering of student and teacher sequences, with loss masks (SPEC 3).

A sequence is a list of :class:`Message`; ``turn > 0`` marks a labelled
assistant message (r_i for the student, f_i for the teacher, Eq. 5 / Eq. 6).
:func:`segments` turns messages into template text pieces, each either fully
labelled or not, and :class:`ChatTokenizer` tokenises the pieces one by one,
so every labelled span decodes back to exactly the turn text + ``<|eot_id|>``.
The ``<image>`` placeholder becomes ``geometry.num_tokens(image_size)`` copies
of the image token id (the Hugging Face "expanded" convention).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from fire_jax.data.records import IMAGE_PLACEHOLDER, Conversation, Instruction, Record
from fire_jax.geometry import ImageGeometry, unpadded_size

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
LLAMA3_SPECIAL_TOKENS = (BOS, EOS, START_HEADER, END_HEADER, EOT)

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

ROLES = ("student", "teacher")
TEACHER_HISTORIES = ("full", "latest")


@dataclasses.dataclass(frozen=True)
class Message:
    role: str  # "user" or "assistant"
    text: str
    turn: int = -1  # i > 0: labelled, the span of r_i / f_i; -1: not labelled


def student_messages(conv: Conversation, *, first_turn_labelled: bool = False,
                     until_turn: int | None = None) -> list[Message]:
    """Student sequence (Eq. 5): user "<image>\\n{q}", assistant r_1, user f_1, assistant r_2, ...

    Labels r_i for i >= 2 (and r_1 with ``first_turn_labelled``). The sequence
    ends with r_n: f_n is never a target. With ``until_turn=k`` it is the prompt
    for r_k instead (through user f_{k-1}; encode with ``add_generation_prompt``).
    """
    messages = [Message("user", f"{IMAGE_PLACEHOLDER}\n{conv.question}")]
    if until_turn is not None:
        for turn in conv.turns[:until_turn - 1]:
            messages += [Message("assistant", turn.response), Message("user", turn.feedback_text)]
        return messages
    for i, turn in enumerate(conv.turns, 1):
        if i > 1:
            messages.append(Message("user", conv.turns[i - 2].feedback_text))
        messages.append(Message("assistant", turn.response, i if (i >= 2 or first_turn_labelled) else -1))
    return messages


def teacher_messages(conv: Conversation, *, history: str = "full", until_turn: int | None = None) -> list[Message]:
    """Teacher sequence (Eq. 6): user Question/Groundtruth, user TEACHER_INSTRUCTION, user r_1, assistant f_1, ...

    Labels every f_i (whole, score line included). ``history="latest"`` keeps only
    the last turn (or turn ``until_turn``), as the teacher sees it in free
    dialogues. With ``until_turn=k`` it is the prompt for f_k (ends with user r_k).
    """
    if history not in TEACHER_HISTORIES:
        raise ValueError(f"teacher history must be one of {TEACHER_HISTORIES}, got {history!r}")
    messages = [Message("user", f"{IMAGE_PLACEHOLDER}\nQuestion: {conv.question}\nGroundtruth: {conv.groundtruth}"),
                Message("user", TEACHER_INSTRUCTION)]
    last = len(conv.turns) if until_turn is None else until_turn
    first = last if history == "latest" else 1
    for i in range(first, last + 1):
        turn = conv.turns[i - 1]
        messages.append(Message("user", turn.response))
        if until_turn is None or i < until_turn:
            messages.append(Message("assistant", turn.feedback, i))
    return messages


def instruction_messages(record: Instruction) -> list[Message]:
    """LLaVA-665K-style record: every assistant message labelled (turn k for the k-th answer)."""
    messages, answers = [], 0
    for role, text in record.messages:
        if role == "assistant":
            answers += 1
        if not messages and record.image is not None:
            text = f"{IMAGE_PLACEHOLDER}\n{text}"
        messages.append(Message(role, text, answers if role == "assistant" else -1))
    return messages


def training_messages(record: Record, role: str, *, first_turn_labelled: bool = False,
                      teacher_history: str = "full") -> list[Message]:
    """The labelled sequence of one record for a model of ``role`` ("student" or "teacher")."""
    if isinstance(record, Instruction):
        return instruction_messages(record)
    if role == "student":
        return student_messages(record, first_turn_labelled=first_turn_labelled)
    if role == "teacher":
        return teacher_messages(record, history=teacher_history)
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def segments(messages: Sequence[Message], *, add_generation_prompt: bool = False) -> list[tuple[str, int]]:
    """The Llama-3 template as (text, turn) pieces; joined, they are the rendered string.

    Each labelled piece is exactly an assistant text + ``<|eot_id|>``; headers
    and everything else carry turn -1. Exactly one BOS, then the system prompt.
    """
    pieces = [(f"{BOS}{START_HEADER}system{END_HEADER}\n\n{SYSTEM}{EOT}", -1)]
    for message in messages:
        pieces.append((f"{START_HEADER}{message.role}{END_HEADER}\n\n", -1))
        pieces.append((f"{message.text}{EOT}", message.turn))
    if add_generation_prompt:
        pieces.append((f"{START_HEADER}assistant{END_HEADER}\n\n", -1))
    return pieces


def render(messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
    """The rendered chat string, with the ``<image>`` placeholder not expanded."""
    return "".join(text for text, _ in segments(messages, add_generation_prompt=add_generation_prompt))


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
    """A Hugging Face ``tokenizers`` tokenizer plus the image geometry of one model.

    The tokenizer must define the Llama-3 special tokens and the image
    placeholder ``<image>``; ``pad_token`` falls back to ``<|end_of_text|>``.
    """

    def __init__(self, tokenizer, geometry: ImageGeometry, *, image_token: str = IMAGE_PLACEHOLDER,
                 pad_token: str = "<pad>", name: str = "tokenizer"):
        self.tokenizer, self.geometry, self.image_token = tokenizer, geometry, image_token
        missing = [t for t in (*LLAMA3_SPECIAL_TOKENS, image_token) if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"{name}: tokens {missing} are not in the vocabulary")
        self.image_token_id = tokenizer.token_to_id(image_token)
        self.eot_id = tokenizer.token_to_id(EOT)
        self.eos_id = tokenizer.token_to_id(EOS)
        self.bos_id = tokenizer.token_to_id(BOS)
        pad = tokenizer.token_to_id(pad_token)
        self.pad_id = self.eos_id if pad is None else pad
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_file(cls, path: str, geometry: ImageGeometry, **kwargs) -> "ChatTokenizer":
        import tokenizers
        return cls(tokenizers.Tokenizer.from_file(path), geometry, name=path, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def _ids(self, text: str, cache: bool) -> list[int]:
        if cache and text in self._cache:
            return self._cache[text]
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if cache:
            self._cache[text] = ids
        return ids

    def encode(self, messages: Sequence[Message], image_size: Sequence[int] | None = None, *,
               add_generation_prompt: bool = False, image_sizes: Sequence[Sequence[int]] | None = None,
               system: str | None = None) -> Encoded:
        """Token ids, loss mask and turn ids of a message list.

        One image: ``image_size`` (h, w) is required iff the messages contain ``<image>``
        (once); the placeholder expands to ``geometry.num_tokens(image_size)`` tokens.
        Several images (VLRMBench's multi-image samples, a served chat): ``image_sizes``, one per
        ``<image>`` in order, each expanded for its own size; ``image_start`` is then the first image's
        and ``image_tokens`` all images' count. ``system`` replaces the system prompt's text.
        """
        if image_sizes is not None:
            return self._encode_images(messages, list(image_sizes), add_generation_prompt, system)
        ids, labels, image_start, image_tokens = [], [], -1, 0
        for text, turn in self._segments(messages, add_generation_prompt, system):
            piece = self._ids(text, cache=turn < 0 and self.image_token not in text and len(text) < 2048)
            if self.image_token_id in piece:
                if image_start >= 0 or piece.count(self.image_token_id) > 1:
                    raise ValueError("more than one image placeholder in one sequence")
                if image_size is None:
                    raise ValueError("the messages contain an image placeholder but no image_size was given")
                at = piece.index(self.image_token_id)
                image_start, image_tokens = len(ids) + at, self.geometry.num_tokens(image_size)
                piece = piece[:at] + [self.image_token_id] * image_tokens + piece[at + 1:]
            ids += piece
            labels += [turn] * len(piece)
        if image_size is not None and image_start < 0:
            raise ValueError("an image_size was given but the messages contain no image placeholder")
        return self._encoded(ids, labels, image_start, image_tokens)

    @staticmethod
    def _segments(messages, add_generation_prompt: bool, system: str | None):
        pieces = segments(messages, add_generation_prompt=add_generation_prompt)
        if system is not None:
            pieces[0] = (pieces[0][0].replace(SYSTEM, system, 1), pieces[0][1])
        return pieces

    @staticmethod
    def _encoded(ids, labels, image_start: int, image_tokens: int) -> Encoded:
        turn_ids = np.asarray(labels, np.int32)
        return Encoded(input_ids=np.asarray(ids, np.int32), loss_mask=(turn_ids > 0).astype(np.float32),
                       turn_ids=turn_ids, image_start=image_start, image_tokens=image_tokens)

    def _encode_images(self, messages, sizes: list, add_generation_prompt: bool, system: str | None) -> Encoded:
        pieces = [(self._ids(text, cache=False), turn)
                  for text, turn in self._segments(messages, add_generation_prompt, system)]
        found = sum(piece.count(self.image_token_id) for piece, _ in pieces)
        if found != len(sizes):
            raise ValueError(f"{len(sizes)} images but {found} image placeholders (is {self.image_token!r} in the "
                             f"text, or an image missing?)")
        ids, labels, image_start, image_tokens, k = [], [], -1, 0, 0
        for piece, turn in pieces:
            for token in piece:
                n = 1
                if token == self.image_token_id:
                    n = self.geometry.num_tokens(sizes[k])
                    image_start = len(ids) if image_start < 0 else image_start
                    image_tokens += n
                    k += 1
                ids += [token] * n
                labels += [turn] * n
        return self._encoded(ids, labels, image_start, image_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def image_summary(self, image_size: Sequence[int]) -> str:
        """"<image x 212: base 16 + grid 2x3 unpadded 8x12 + 8 newlines>" for one image."""
        g = self.geometry
        n = g.num_tokens(image_size)
        if g.mode == "pad":
            return f"<image x {n}: pad {g.tokens_per_tile}" + (" + 1 newline>" if g.pad_newline else ">")
        rows, cols = g.grid_shape(image_size)
        h, w = unpadded_size(image_size, rows, cols, g.grid)
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
