"""Planning paused by batch size. No torch.

Planning costs a few microseconds of Python per request and step (the
drafter's context class, a decision): a few percent of a step at large batch
sizes, where drafts seldom pay. So a batch size whose
plans keep granting no drafts stops planning for a while, as a context class
does: after ``IDLE_PLANS`` such plans in a row at batch sizes of one
power-of-two bucket (8-15, 16-31, ...), that bucket is not planned for 8, 16,
... 128 steps, and the engine does not even ask the drafter for those
requests' classes. This depends only on past plans. The policy
(``SpecPolicy.plans_shared``) still plans isolated (seeded) requests.
"""

from dataclasses import dataclass, field

IDLE_PLANS = 8  # plans in a row that granted no drafts before a batch size bucket stops planning
MIN_BATCH_PAUSE, MAX_BATCH_PAUSE = 8, 128  # steps it then stops for (doubling while plans stay idle)
MIN_PAUSED_BATCH = 8  # smaller batches always plan: their planning is cheap beside a step


@dataclass
class _Bucket:
    idle: int = 0  # plans in a row that granted no drafts
    paused_until: int = 0  # step index before which shared requests are not planned
    pause_len: int = MIN_BATCH_PAUSE


@dataclass
class BatchPauses:
    """Per bucket of batch sizes, whether its plans grant drafts."""

    buckets: dict[int, _Bucket] = field(default_factory=dict)  # batch.bit_length() -> record

    def plans(self, step: int, batch: int) -> bool:
        """Whether step ``step``, with ``batch`` decoding requests, plans them."""
        b = self.buckets.get(batch.bit_length()) if batch >= MIN_PAUSED_BATCH else None
        return b is None or step >= b.paused_until

    def record(self, step: int, batch: int, granted: bool) -> None:
        """Step ``step`` planned its ``batch`` decoding requests and ``granted`` drafts (or not)."""
        if batch < MIN_PAUSED_BATCH:
            return
        b = self.buckets.setdefault(batch.bit_length(), _Bucket())
        if granted:
            b.idle, b.pause_len = 0, MIN_BATCH_PAUSE
            return
        b.idle += 1
        if b.idle >= IDLE_PLANS:
            b.idle, b.paused_until = 0, step + 1 + b.pause_len
            b.pause_len = min(2 * b.pause_len, MAX_BATCH_PAUSE)
