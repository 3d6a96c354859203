"""Chat templates: a tokenizer's Jinja template rendered as ``apply_chat_template`` renders it, cut into pieces.

A :class:`ChatTemplate` renders a message list to the exact string transformers' ``apply_chat_template``
gives for the same template (the same sandboxed Jinja environment: ``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, ``tojson``, the ``{% generation %}`` block). For tokenising and for loss masks it also
cuts that string into :class:`Piece` s, found by rendering with sentinels in place of every message text:

- ``template``: text the template writes (headers, role names, separators, end-of-turn tokens): tokenised
  with special tokens active, so ``<|im_end|>`` is one id;
- ``text``: a message's own text: tokenised as plain text, so a ``<image>`` or ``<|eot_id|>`` typed by a user
  stays text;
- ``image``: where an image goes (a template that takes typed content parts writes the image token itself;
  one that takes strings gets ``"<image>\\n"`` before the message's text, as LLaVA's data has it).

Which tokens are labelled follows from the rendered text, never from a model's header tokens: an assistant
turn's labelled span is its text plus the special token the template writes right after it (``<|eot_id|>``,
``<|im_end|>``). A template that closes an assistant turn with no token (llava-hf's Vicuna v1: a space)
gets the tokenizer's EOS after the answer, as LLaVA's "v1" conversation format trains it (``</s>``); the
rendered string itself stays the template's.

Shipped templates (``fire_jax/assets/chat_templates``):
- ``llama3``: Llama-3-Instruct's layout with each image as ``<image>\n`` before its message's text, as the
  LLaVA-NeXT training code (``conv_llava_llama_3``) renders a conversation: fire_jax's default at 8B;
- ``llava_hf_llama3``: the template llava-hf publishes with ``llama3-llava-next-8b-hf``. It writes no BOS (the
  tokenizer adds it) and a ``"\n"`` before every text part: a message with an image renders as in ``llama3``
  (``<image>\n`` + text), a text-only one gets one newline more after its header (``"\n\n\n"``);
- ``chatml``: SmolLM2-Instruct's, as its GGUF file carries it;
- ``vicuna_v1``: llava-hf's LLaVA-1.5 / LLaVA-NeXT-Vicuna template (``llava-1.5-7b-hf``);
- the FIRE release's (MM-FIRE/FIRE ``llava/conversation.py``), each rendering what its ``Conversation.get_prompt()``
  renders for the same messages, with its own system prompt (a system message given is not written):
  ``llama_v3_student`` / ``llama_v3_teacher`` (identical: Llama-3 headers in ``SeparatorStyle.MPT``, sep
  ``<|eot_id|>``) and ``llava_v1_student_feedback`` / ``llava_v1_teacher_feedback`` (``SeparatorStyle.FEEDBACK``:
  ``USER: text `` and ``ASSISTANT: text</s>``; the teacher's system prompt holds the feedback format), which the
  release's ``llava/eval/eval_feedback.py`` renders fixed dialogues with.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Sequence

TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "chat_templates")
SHIPPED = ("llama3", "llava_hf_llama3", "chatml", "vicuna_v1", "llama_v3_student", "llama_v3_teacher",
           "llava_v1_student_feedback", "llava_v1_teacher_feedback")
#: The shipped templates of Llama-3 models (BOS ``<|begin_of_text|>``, EOS ``<|end_of_text|>``).
LLAMA3_FAMILY = ("llama3", "llama_v3_student", "llama_v3_teacher")
IMAGE_TOKEN = "<image>"

_TEXT = "\ue000{}\ue001"  # a message text's sentinel (private-use code points: in no real text)
_IMAGE = "\ue002"
_SENTINEL = re.compile("\ue000(\\d+)\ue001|\ue002")


def _inline(message) -> bool:
    """Whether a message's images stand where its text has ``<image>`` (``Message.inline``)."""
    return bool(getattr(message, "inline", False))


def _inline_text(message, image: str) -> str:
    """A message's text for the template: an inline message's ``<image>`` placeholders as ``image``."""
    return message.text.replace(IMAGE_TOKEN, image) if _inline(message) else message.text


@dataclasses.dataclass(frozen=True)
class Piece:
    text: str
    kind: str  # "template", "text", "image", or "eos" (an EOS the template does not write, see above)
    turn: int = -1  # > 0: labelled, part of r_i / f_i


def template_source(name_or_path: str) -> str:
    """A shipped template by name (:data:`SHIPPED`) or a ``.jinja`` file's contents."""
    path = os.path.join(TEMPLATES_DIR, f"{name_or_path}.jinja") if name_or_path in SHIPPED else name_or_path
    if not os.path.exists(path):
        raise FileNotFoundError(f"chat template {name_or_path!r}: neither one of {SHIPPED} nor a file")
    with open(path, encoding="utf-8") as f:
        return f.read()


def _environment():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """transformers' ``{% generation %}...{% endgeneration %}`` (marks assistant text): rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None, **kw: __import__("json").dumps(x, indent=indent,
                                                                                   ensure_ascii=False)
    return env


class ChatTemplate:
    """One Jinja chat template plus the special tokens it may write.

    ``special_tokens``: the tokenizer's special token strings (an assistant turn's end token is the one the
    template writes right after the turn's text); ``bos_token`` / ``eos_token`` are passed to the template
    as transformers passes them.
    """

    def __init__(self, source: str, *, special_tokens: Sequence[str], bos_token: str = "", eos_token: str = "",
                 name: str = "chat template"):
        self.source, self.name = source, name
        self.bos_token, self.eos_token = bos_token, eos_token
        self.special_tokens = sorted(set(special_tokens), key=len, reverse=True)  # longest match first
        self._template = _environment().from_string(source)
        self.typed_parts = self._takes_typed_parts()
        self.strips_text = self._strips_text()
        self.end_token = self._end_token()
        self.own_system = self._own_system()

    # ------------------------------------------------------------------ rendering
    def _render(self, conversation: list[dict], add_generation_prompt: bool) -> str:
        return self._template.render(messages=conversation, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token, eos_token=self.eos_token)

    def _content(self, text: str, images: int, image: str = IMAGE_TOKEN):
        if self.typed_parts:
            return [{"type": "image"}] * images + [{"type": "text", "text": text}]
        return f"{image}\n" * images + text

    def conversation(self, messages, system: str | None, image: str = IMAGE_TOKEN) -> list[dict]:
        """The ``messages`` argument transformers' ``apply_chat_template`` takes for the same chat: a system
        message first (when ``system`` is not None), then every message, images as content parts (typed
        templates) or ``"<image>\\n"`` before the text."""
        out = [] if system is None else [{"role": "system", "content": self._content(system, 0)}]
        return out + [{"role": m.role, "content": self._content(_inline_text(m, image), 0 if _inline(m) else m.images,
                                                                image)} for m in messages]

    def render(self, messages, *, system: str | None, add_generation_prompt: bool = False) -> str:
        """The rendered chat, equal to ``apply_chat_template(conversation(...), tokenize=False)``."""
        return self._render(self.conversation(messages, system), add_generation_prompt)

    def pieces(self, messages, *, system: str | None, add_generation_prompt: bool = False) -> list[Piece]:
        """The rendered chat as pieces: their texts joined are :meth:`render`'s string, except the EOS
        pieces (kind ``"eos"``) a template that writes no end token gets after each labelled answer."""
        texts = ([] if system is None else [system]) + [m.text for m in messages]
        turns = ([] if system is None else [-1]) + [m.turn for m in messages]
        inline = ([] if system is None else [False]) + [_inline(m) for m in messages]
        first = 0 if system is None else 1
        # an inline message's images are placed with its text (below), not by the template
        marked = [dataclasses.replace(m, text=_TEXT.format(first + i), **(dict(inline=False, images=0) if inline[first + i]
                                                                           else {})) for i, m in enumerate(messages)]
        conversation = self.conversation(marked, None if system is None else _TEXT.format(0), image=_IMAGE)
        rendered = self._render(conversation, add_generation_prompt)
        pieces: list[Piece] = []
        seen = 0  # message texts rendered
        at, close = 0, -1  # close: the labelled turn whose end token the next template text starts with
        for match in _SENTINEL.finditer(rendered):
            self._template_pieces(pieces, rendered[at:match.start()], close)
            close = -1
            if match.group(1) is None:
                pieces.append(Piece(IMAGE_TOKEN, "image"))
            else:
                i = int(match.group(1))
                text = texts[i].strip() if self.strips_text else texts[i]
                for j, part in enumerate(text.split(IMAGE_TOKEN) if inline[i] else [text]):
                    if j:  # an image where the message's text has its placeholder
                        pieces.append(Piece(IMAGE_TOKEN, "image"))
                    if part or not inline[i]:
                        pieces.append(Piece(part, "text", turns[i]))
                seen += 1
                close = turns[i]
            at = match.end()
        self._template_pieces(pieces, rendered[at:], close)
        if seen != len(texts) - (system is not None and self.own_system):
            raise ValueError(f"{self.name}: rendered {seen} of {len(texts)} message texts (does it drop the system "
                             f"message or a role?)")
        return pieces

    def _template_pieces(self, pieces: list[Piece], text: str, close: int) -> None:
        """Template text; after a labelled answer (``close`` > 0) its end token joins the answer's label."""
        if close > 0:
            end = next((t for t in self.special_tokens if text.startswith(t)), None)
            if end is not None:
                pieces.append(Piece(end, "template", close))
                text = text[len(end):]
            elif self.eos_token:  # no end token written: the answer is trained to end with EOS
                pieces.append(Piece(self.eos_token, "eos", close))
            else:
                raise ValueError(f"{self.name}: an assistant turn ends with no special token and no EOS is set")
        parts = text.split(IMAGE_TOKEN) if self.typed_parts else [text]  # a typed template writes images itself
        for i, part in enumerate(parts):
            if i:
                pieces.append(Piece(IMAGE_TOKEN, "image"))
            if part:
                pieces.append(Piece(part, "template"))

    # ------------------------------------------------------------------ probes of the template's shape
    def _takes_typed_parts(self) -> bool:
        """True when the template reads ``[{"type": "text", "text": ...}]`` content (llava-hf's), False when it
        concatenates string content (ChatML)."""
        try:
            out = self._render([{"role": "user", "content": [{"type": "text", "text": _TEXT.format(0)}]}], False)
        except Exception:  # noqa: BLE001 - a template that cannot take parts (string concatenation raises)
            return False
        return _TEXT.format(0) in out and "'type'" not in out

    def _probe(self, text: str) -> str:
        return self._render([{"role": "user", "content": [{"type": "text", "text": text}] if self.typed_parts
                              else text}], False)

    def _strips_text(self) -> bool:
        """Whether the template trims message texts (``| trim``, ``.strip()``)."""
        return f" {_IMAGE} " not in self._probe(f" {_IMAGE} ")

    def _own_system(self) -> bool:
        """Whether the template writes a system prompt of its own instead of a system message's text."""
        marker = _TEXT.format(0)
        return marker not in self._render([{"role": "system", "content": self._content(marker, 0)}], False)

    def _end_token(self) -> str:
        """The token that ends an assistant turn: the special token written right after its text, else EOS."""
        marker = _TEXT.format(0)
        conversation = [{"role": "user", "content": self._content("q", 0)},
                        {"role": "assistant", "content": self._content(marker, 0)}]
        after = self._render(conversation, False).split(marker, 1)[-1]
        end = next((t for t in self.special_tokens if after.startswith(t)), None)
        return end or self.eos_token
