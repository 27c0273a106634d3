"""The soak, three minutes: ``bench.soak``'s mixed traffic (streams and single answers,
n = 2, logprobs, JSON schemas, tools, seeded sampling, speculation off per request, 10%
hang-ups, 10% invalid requests) at 32 concurrent against a live ngram server. The full
run is ``python -m bench soak`` (an hour)."""

import pytest

from bench import soak


@pytest.mark.slow
def test_three_minutes_of_mixed_traffic(tmp_path):
    args = soak.parse_args(["--seconds", "180", "--warmup", "60", "--window", "60"])
    result, rows, verdicts = soak.run(args, tmp_path / "server.log")
    assert not result.problems, result.problems
    kinds = {r.job.kind for r in result.results}
    assert kinds == {"normal", "disconnect", "invalid"}, kinds
    bodies = [r.job.body for r in result.results]
    assert any(b.get("stream") is False for b in bodies) and any("tools" in b for b in bodies)
    assert any("response_format" in b for b in bodies) and any(b.get("n") == 2 for b in bodies)
    assert len(rows) == 3 and set(verdicts) == {"RSS growth after warm-up", "p99 ITL drift"}
