"""Per-request speculative decoding statistics on each choice (vLLM's
``--per-request-spec-decode-stats none|summary|detailed``): how much speculation paid
for that request. Summed over choices, the counts equal the ``vllm:spec_decode_*``
counters (``num_spec_steps``: ``num_drafts``; ``num_draft_tokens``;
``num_accepted_draft_tokens``: ``num_accepted_tokens``)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecStats:
    detail: str  # none | summary | detailed
    num_spec_tokens: int  # the configured most drafts per step
    speculating: bool  # a drafter is configured: a choice that never drafted reports zeros

    @classmethod
    def of(cls, serving) -> "SpecStats":
        """From a ``ServingEngine``: the setting, and the speculation of the engine it serves."""
        speculating, num_spec_tokens = serving.engine.speculation()
        return cls(serving.settings.per_request_spec_decode_stats, num_spec_tokens, speculating)

    def of_choice(self, summary: dict) -> dict | None:
        """The choice's ``speculative_decoding_stats`` from the engine's record of it
        (``SpecState.summary``), or None where they are not asked for."""
        if self.detail == "none" or not (summary or self.speculating):
            return None
        drafted, accepted = summary.get("per_step_drafted", []), summary.get("per_step_accepted", [])
        steps, d, a = len(drafted), sum(drafted), sum(accepted)
        histogram = [0] * (max([self.num_spec_tokens, *accepted]) + 1)  # steps by drafts accepted
        for n in accepted:
            histogram[n] += 1
        out = {
            "mean_acceptance_length": round(1 + a / steps, 4) if steps else 1.0,
            "draft_acceptance_rate": round(a / d, 4) if d else 0.0,
            "acceptance_histogram": histogram,
            "num_spec_steps": steps,
            "num_accepted_draft_tokens": a,
            "num_draft_tokens": d,
            "num_spec_tokens": self.num_spec_tokens,
        }
        if self.detail == "detailed":
            out |= {"per_step_accepted": list(accepted), "per_step_drafted": list(drafted)}
        return out
