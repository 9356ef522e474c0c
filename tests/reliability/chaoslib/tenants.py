"""Two tenants apart (issue 49, P3): the same prompt sent by two clients with different `cache_salt`s shares
no KV block, while the traffic and the other faults run.

  salted_tenants  a fresh prompt (random words, several blocks long) sent whole with max_tokens 1 by tenant A
                  (its salt), then by tenant B (another salt), then by A again. The server runs with
                  --enable-prompt-tokens-details: B's usage must say 0 cached tokens ("tenants_apart"), A's
                  second may say more (its own blocks; noted, not required: they may have been evicted).
A request answered with an error is noted and checks nothing (a fault elsewhere may have struck it).
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from tests.reliability.chaoslib.log import ChaosLog
from tests.reliability.soaklib.traffic import WORDS

PROMPT_WORDS = 120  # several KV blocks of the tiny model's and SmolLM2's tokenizer
TIMEOUT_S = 120.0


@dataclass
class SaltedTenants:
    client: httpx.AsyncClient
    log: ChaosLog
    model: str
    rng: random.Random

    async def probe(self) -> str:
        prompt = " ".join(self.rng.choice(WORDS) for _ in range(PROMPT_WORDS)) + f" {uuid.uuid4().hex}"
        run = uuid.uuid4().hex[:8]
        started = self.log.now()
        first = await self._cached_tokens(prompt, f"tenant-a-{run}")
        other = await self._cached_tokens(prompt, f"tenant-b-{run}")
        again = await self._cached_tokens(prompt, f"tenant-a-{run}")
        self.log.event("salted_tenants", first=first, other_tenant=other, same_tenant_again=again,
                       start_s=round(started, 3), end_s=round(self.log.now(), 3))
        if other is None:
            return "skipped (the other tenant's request failed)"
        if other > 0:
            self.log.violate("tenants_apart", f"a prompt sent under another cache_salt found {other} of its "
                             "tokens cached: one tenant's blocks served another's", first=first, again=again)
            return "shared across salts"
        return "apart" if again is None or again == 0 else "apart, shared within the tenant"

    async def _cached_tokens(self, prompt: str, salt: str) -> int | None:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                "cache_salt": salt}
        try:
            answer = await self.client.post("/v1/completions", json=body, timeout=TIMEOUT_S)
        except httpx.HTTPError as error:
            self.log.event("salted_tenants_error", error=f"{type(error).__name__}: {error}")
            return None
        if answer.status_code != 200:
            self.log.event("salted_tenants_error", status=answer.status_code, body=answer.text[:300])
            return None
        # Present only when some prompt tokens were cached (as vLLM's, with the flag the run serves with).
        details = answer.json()["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)
