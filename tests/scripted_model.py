"""A served test model with fixed replies: ``python -m fire_jax.serve --plugin scripted_model --model
NAME=scripted:FILE.json`` (tests/ on the path; ``loopback.server`` puts it there).

FILE.json holds ``{"rules": [{"contains": "...", "reply": "...", "delay_s": 0, "errors": []}, ...],
"default": "..."}``: the first rule whose ``contains`` occurs in the request's text (all messages joined)
gives the reply (after ``delay_s`` seconds, to stand for a slow model), else ``default``, else a 400 error.
``errors`` (HTTP statuses, e.g. ``[503, 429]``) answer the rule's first requests with those errors, to stand
for a flaky endpoint. ``/health`` counts the requests each rule got.
"""

import json

from fire_jax.serving.limits import BadRequest


class Script:
    """Fixed replies chosen by substrings of the request text (see the module docstring)."""

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

    def reply(self, text: str) -> tuple[str, float]:
        """(reply, delay in seconds) for a request whose messages' text is ``text``."""
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


def register(register_replier) -> None:
    """Called by ``fire_jax.serve --plugin scripted_model``."""
    register_replier("scripted:", Script)
