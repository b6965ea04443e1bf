"""Agent policies: how a direction's agent picks candidates within its trial budget.

- :class:`OfflinePolicy` (default): successive halving (Jamieson & Talwalkar 2016) over the
  direction's grid: many candidates on half of rung 0's calibration prompts (one measurement
  each), the better half by point gain (grid order among equal gains) again as full trials:
  sequential over the calibration rungs (:meth:`specpilot.agent.trial.Evaluator.trial`), their
  decision by interval (:func:`specpilot.agent.decide.choose`).
- :class:`LLMPolicy`: any OpenAI-compatible endpoint through the ``openai`` package. The model
  sees the cost report, the direction's JSON schema, memory entries and past trials, and must
  answer with JSON ``{"params": {...}, "rationale": "..."}`` whose params validate against the
  schema. Malformed or out-of-space answers are rejected with the reason logged; transport
  errors are retried with exponential backoff, then the agent falls back to the offline policy.
  The API key is read from the environment variable named in the config and never logged.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Callable

import jsonschema

from .directions import Direction

log = logging.getLogger("specpilot.agent")

Trial = Callable[[dict, bool], dict]  # (params, full) -> trial result with "gain" (None = rejected)


def grid_order(direction: Direction, base: dict, hints: list[dict]) -> list[dict]:
    """The direction's grid points in a fixed order (no timing in it): memory hints first, then by
    distance from the base config, then in grid order. Ties the measurement cannot resolve are
    broken in this order (:func:`specpilot.agent.decide.rank`)."""
    grid = direction.candidates()

    def at(vals: list, b) -> float:
        """The grid position of the base's value; one off the grid (a drafter's own block of 11 in a
        grid of 10 and 12) sits between its numeric neighbours, anything else at the start."""
        if b in vals:
            return vals.index(b)
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if isinstance(b, (int, float)) and not isinstance(b, bool) and len(nums) == len(vals) > 1:
            below = [i for i, v in enumerate(vals) if v < b]
            if not below:
                return -0.5
            return below[-1] + 0.5
        return 0

    def dist(c):
        d = 0.0
        for k, v in c.items():
            vals = direction.space[k]
            d += abs(vals.index(v) - at(vals, base.get(k, vals[0])))
        return d

    hinted = [h for i, h in enumerate(hints) if h in grid and h not in hints[:i]]  # each hint once
    rest = sorted((c for c in grid if c not in hinted), key=dist)
    return hinted + rest


class OfflinePolicy:
    """Successive halving within ``budget`` trials (each candidate-on-a-prompt-set counts one)."""

    name = "offline"

    def search(self, direction: Direction, base: dict, budget: int, trial: Trial, hints: list[dict],
               context: dict) -> list[dict]:
        order = [c for c in grid_order(direction, base, hints) if direction.apply(base, c) != base]
        if not order or budget < 1:
            return []
        n_full = max(1, budget // 3)
        n_half = min(len(order), budget - n_full) if budget > 1 else 0
        results = []
        if n_half > n_full:
            first = [dict(trial(c, False), params=c, rung=0) for c in order[:n_half]]
            results += first
            # the screen promotes by point gain: at half the prompts nearly every interval overlaps
            # the best one's, so the tie order (the grid's) would promote the grid's first points
            # whatever they measured; the full trials' decision is by interval (decide.choose)
            passed = [r for r in first if r["gain"] is not None]
            survivors = [r["params"] for r in sorted(passed, key=lambda r: (-r["gain"], order.index(r["params"])))
                         ][:n_full]
        else:
            survivors = order[:n_full]
        results += [dict(trial(c, True), params=c, rung=1) for c in survivors]
        return results


class LLMPolicy:
    """Proposals from an OpenAI-compatible chat endpoint, validated against the direction schema."""

    name = "llm"

    def __init__(self, base_url: str, model: str, api_key_env: str | None, retries: int = 3,
                 backoff_s: float = 0.5, timeout_s: float = 30.0):
        self.base_url, self.model, self.api_key_env = base_url, model, api_key_env
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s

    def _client(self):
        from openai import OpenAI

        key = os.environ.get(self.api_key_env or "", "") or "none"
        return OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=self.timeout_s)

    def _ask(self, client, messages: list[dict]) -> str:
        import openai

        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                resp = client.chat.completions.create(model=self.model, messages=messages, temperature=0)
                return resp.choices[0].message.content or ""
            except (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError,
                    openai.InternalServerError) as e:
                log.warning("llm: transport error (attempt %d/%d): %s", attempt, self.retries, type(e).__name__)
                if attempt == self.retries:
                    raise
                time.sleep(delay)
                delay *= 2
        raise RuntimeError("unreachable")

    @staticmethod
    def parse(text: str, direction: Direction) -> dict:
        """Extract and validate ``params`` from the model's answer; raises ValueError with the reason."""
        s = text.strip()
        if s.startswith("```"):
            s = s.strip("`")
            s = s[s.find("{"):]
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed JSON: {e}") from None
        params = obj.get("params") if isinstance(obj, dict) else None
        if not isinstance(params, dict):
            raise ValueError("answer has no 'params' object")
        try:
            jsonschema.validate(params, direction.schema())
        except jsonschema.ValidationError as e:
            raise ValueError(f"params outside the direction's space: {e.message}") from None
        return params

    def search(self, direction: Direction, base: dict, budget: int, trial: Trial, hints: list[dict],
               context: dict) -> list[dict]:
        import openai

        results, rejected = [], []
        client = self._client()
        for i in range(budget):
            messages = [
                {"role": "system", "content": "You tune a speculative decoding engine. Answer only with JSON "
                 '{"params": {...}, "rationale": "..."} where params validates against the given schema.'},
                {"role": "user", "content": json.dumps({
                    "direction": direction.name, "description": direction.description,
                    "schema": direction.schema(), "base_config": base, "cost_report": context.get("report", ""),
                    "memory": context.get("memory", []),
                    "past_trials": [{"params": r["params"], "gain": r["gain"], "gate": r["gate"]["passed"]}
                                    for r in results], "rejected": rejected})},
            ]
            try:
                answer = self._ask(client, messages)
            except (openai.APIError, OSError) as e:
                log.warning("llm: endpoint unusable after %d attempts (%s); falling back to the offline policy",
                            self.retries, type(e).__name__)
                rest = OfflinePolicy().search(direction, base, budget - i, trial, hints, context)
                return results + [dict(r, policy="offline-fallback") for r in rest]
            try:
                params = self.parse(answer, direction)
            except ValueError as e:
                log.warning("llm: proposal %d rejected: %s", i + 1, e)
                rejected.append({"answer": answer[:200], "reason": str(e)})
                continue
            if any(r["params"] == params for r in results):
                log.info("llm: proposal %d repeats an earlier trial; skipped", i + 1)
                continue
            results.append(dict(trial(params, True), params=params, rung=1, policy="llm"))
        if not results:
            log.warning("llm: no valid proposal in %d answers; falling back to the offline policy", budget)
            return [dict(r, policy="offline-fallback") for r in
                    OfflinePolicy().search(direction, base, budget, trial, hints, context)]
        return results


def make_policy(llm_cfg: dict | None):
    """The LLM policy when base_url and model are configured and the key variable is set, else offline."""
    llm_cfg = llm_cfg or {}
    if not (llm_cfg.get("base_url") and llm_cfg.get("model")):
        log.info("agent policy: offline (no LLM endpoint configured)")
        return OfflinePolicy()
    env = llm_cfg.get("api_key_env")
    if env and not os.environ.get(env):
        log.info("agent policy: offline (the API key variable %s is not set)", env)
        return OfflinePolicy()
    log.info("agent policy: llm (%s at %s)", llm_cfg["model"], llm_cfg["base_url"])
    return LLMPolicy(llm_cfg["base_url"], llm_cfg["model"], env)
