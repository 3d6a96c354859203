"""A served test model with fixed replies: ``python -m fire_jax.serve --plugin scripted_model --model
NAME=scripted:FILE.json`` (tests/ on the path; ``loopback.server`` puts it there).

FILE.json holds ``{"rules": [{"contains": "...", "reply": "...", "delay_s": 0, "errors": []}, ...],
"default": "..."}``: the first rule whose ``contains`` occurs in the request's text (all messages joined)
gives the reply (after ``delay_s`` seconds, to stand for a slow model), else ``default``, else a 400 error.
``errors`` (HTTP statuses, e.g. ``[503, 429]``) answer the rule's first requests with those errors, to stand
for a flaky endpoint. ``/health`` counts the requests each rule got.

It is served on the server's backend protocol (:class:`fire_jax.infer.backends.ServedBackend`), registered
with :func:`fire_jax.infer.factory.register_serving` as this module is imported: its requests are admitted,
queued, cancelled, streamed and ended by a shutdown exactly as a model's are.
"""

import json
import threading

from fire_jax.infer.backends import Refused, Update
from fire_jax.infer.factory import register_serving
from fire_jax.serving.limits import BadRequest


class ScriptedBackend:
    """Fixed replies chosen by substrings of the request text (see the module docstring), each sent whole after
    its delay by a timer thread."""

    context, tokenizer, max_images = 0, None, 16  # the text and images bounded by the server's flags alone

    def __init__(self, path: str):
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        rules = spec.get("rules") if isinstance(spec, dict) else None
        if not isinstance(rules, list) or not all(
                isinstance(r, dict) and isinstance(r.get("contains"), str) and isinstance(r.get("reply"), str)
                for r in rules):
            raise ValueError(f"{path}: expected {{'rules': [{{'contains': str, 'reply': str, 'delay_s'?: float}}, ...], "
                             "'default'?: str}")
        self.path, self.rules, self.default = path, rules, spec.get("default")
        self.description = f"scripted replies from {path}"
        self.counts = {rule["contains"]: 0 for rule in rules}
        self._lock, self._pending, self._stopped = threading.Lock(), {}, False

    def summary(self) -> str:
        return self.description

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def health(self) -> dict:
        return {"in_flight": self.in_flight, "requests": dict(self.counts)}

    def request(self, messages, images, sampling, *, system=None) -> tuple[str, float]:
        """(reply, delay in seconds) for a chat, by its messages' text; a rule's scripted errors and a chat no
        rule matches raise :class:`BadRequest` (the endpoint's status)."""
        text = "\n".join(([system] if system else []) + [m.text for m in messages])
        for rule in self.rules:
            if rule["contains"] in text:
                self.counts[rule["contains"]] += 1
                errors = rule.get("errors", [])
                if self.counts[rule["contains"]] <= len(errors):
                    raise BadRequest(int(errors[self.counts[rule["contains"]] - 1]), "scripted failure",
                                     "scripted_error", {"Retry-After": "0"})
                return rule["reply"], float(rule.get("delay_s", 0))
        if self.default is None:
            raise BadRequest(400, f"scripted model {self.path}: no rule matches the request", "no_scripted_reply")
        return self.default, 0.0

    def submit(self, request: tuple[str, float], on_update):
        """The reply as one update after its delay; the ticket is the timer."""
        text, delay = request
        with self._lock:
            if self._stopped:
                raise Refused("the scripted model is stopping", "stopping")
            ticket = threading.Timer(delay, lambda: self._finish(ticket, on_update, text))
            self._pending[ticket] = on_update
        ticket.start()
        return ticket

    def _finish(self, ticket, on_update, text: str) -> None:
        with self._lock:
            if self._pending.pop(ticket, None) is None:
                return  # cancelled
        on_update(Update(text, "stop", text, 0, 0, None))

    def cancel(self, ticket) -> bool:
        with self._lock:
            on_update = self._pending.pop(ticket, None)
        if on_update is None:
            return False
        ticket.cancel()
        on_update(Update("", "cancelled", "", 0, 0, None))
        return True

    def start(self) -> "ScriptedBackend":
        return self

    def stop(self, drain: bool = True) -> None:
        with self._lock:
            self._stopped = True
            pending = list(self._pending)
        for ticket in pending:
            if drain:
                ticket.join()
            else:
                self.cancel(ticket)

    def warm_up(self) -> int:
        return 0


register_serving("scripted:", ScriptedBackend)
