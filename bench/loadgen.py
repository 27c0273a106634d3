"""The load generator behind ``bench.load`` and its in-suite test: a seeded plan of
mixed requests, an asyncio client that streams them at a fixed concurrency, and
the checks every answer must pass.

A plan mixes prompt lengths (a few tokens to a few hundred), both routes,
greedy and sampled settings (seeds, top-p / top-k, penalties, stop strings,
n = 2, logprobs, speculation opt-out) and two kinds of misbehaving clients:
``disconnect`` jobs hang up after a few events, ``invalid`` jobs carry a bad
parameter and must get a 4xx. Everything is bounded: a fixed number of jobs,
a per-request timeout and a deadline for the whole run, after which the jobs
left are not sent.
"""

import asyncio
import itertools
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

TOPICS = ["the sea", "a fox", "Paris", "rain", "a robot", "green tea", "the moon", "bread", "a violin", "snow"]
PARAGRAPH = (
    "The river wound through the valley, past fields of barley and the old stone mill, "
    "where the miller's children watched the boats go by every afternoon. "
)


def prompt_text(rng: random.Random) -> str:
    """A prompt of one of four shapes: short, medium, long (hundreds of tokens), copy-heavy."""
    topic = rng.choice(TOPICS)
    shape = rng.choice(["short", "medium", "long", "copy"])
    if shape == "short":
        return rng.choice([f"{topic.title()}:", "Hi", f"Describe {topic}."])
    if shape == "medium":
        return f"Write two sentences about {topic}, in the style of a travel guide, for a curious child."
    if shape == "long":
        return PARAGRAPH * rng.randint(3, 8) + f"\nSummarize the story above and mention {topic}."
    items = ", ".join(f"{topic} {i}" for i in range(rng.randint(4, 12)))
    return f"Repeat this list exactly, twice: {items}."


INVALID = [  # (fields laid over a valid body, expected status)
    ({"temperature": -1}, 400),
    ({"top_p": 2.0}, 400),
    ({"max_tokens": -1}, 400),  # 0 is valid: the prompt scored, nothing written
    ({"max_tokens": 10**9}, 400),
    ({"n": 0}, 400),
    ({"n": 10**6}, 400),
    ({"logprobs": 99}, 400),
    ({"logit_bias": {"not-a-token": 5}}, 400),
    ({"stop": [""]}, 400),
    ({"presence_penalty": "high"}, 400),
    ({"model": "no-such-model"}, 404),
    ({"seed": -5}, 400),
]


@dataclass
class Job:
    id: int
    route: str  # "completions" | "chat"
    body: dict  # always stream=True with usage
    kind: str = "normal"  # "normal" | "disconnect" | "invalid"
    expect_status: int = 200
    disconnect_after: int = 0  # data events read before hanging up
    prompt: str = ""

    @property
    def path(self) -> str:
        return "/v1/completions" if self.route == "completions" else "/v1/chat/completions"

    @property
    def greedy(self) -> bool:
        return self.kind == "normal" and self.body.get("temperature") == 0

    @property
    def n(self) -> int:
        return self.body.get("n") or 1


def make_plan(num: int, seed: int = 0, max_tokens: tuple[int, int] = (8, 32), bad_share: float = 0.1) -> list[Job]:
    """``num`` jobs; ``bad_share`` of them disconnect mid-stream and as many carry invalid parameters."""
    rng = random.Random(seed)
    kinds = ["disconnect"] * round(num * bad_share) + ["invalid"] * round(num * bad_share)
    kinds += ["normal"] * (num - len(kinds))
    rng.shuffle(kinds)
    jobs = []
    for i, kind in enumerate(kinds):
        text = prompt_text(rng)
        route = rng.choice(["completions", "chat"])
        body: dict = {"max_tokens": rng.randint(*max_tokens), "stream": True, "stream_options": {"include_usage": True}}
        if route == "completions":
            body["prompt"] = text
        else:
            body["messages"] = [{"role": "user", "content": text}]
        body.update(_sampling(rng, route))
        job = Job(i, route, body, kind, prompt=text)
        if kind == "disconnect":
            job.disconnect_after = rng.randint(1, 3)
            job.body["max_tokens"] = max(job.body["max_tokens"], 16)
        elif kind == "invalid":
            fields, job.expect_status = rng.choice(INVALID)
            job.body.update(fields)
        jobs.append(job)
    return jobs


def _sampling(rng: random.Random, route: str) -> dict:
    r = rng.random()
    if r < 0.45:
        out: dict = {"temperature": 0}
        if rng.random() < 0.2:
            out["frequency_penalty"] = 0.5
    elif r < 0.8:
        out = {"temperature": rng.choice([0.6, 0.8, 1.0]), "top_p": rng.choice([0.9, 1.0]), "seed": rng.randint(0, 999)}
        if rng.random() < 0.5:
            out["top_k"] = rng.choice([20, 50])
    else:
        out = {"temperature": 1.0, "min_p": 0.05, "presence_penalty": 0.3}
    if rng.random() < 0.15:
        out["n"] = 2
    if rng.random() < 0.2:
        out["stop"] = [".", "\n\n"]
    if rng.random() < 0.25:
        out["speculative_decoding"] = False
    if rng.random() < 0.2:
        if route == "completions":
            out["logprobs"] = rng.choice([0, 2])
        else:
            out.update(logprobs=True, top_logprobs=2)
    return out


@dataclass
class Result:
    job: Job
    status: int = 0
    events: list = field(default_factory=list)  # parsed JSON events; "[DONE]" as a string
    error: str | None = None  # a transport failure or a timeout
    t_start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each event carrying output
    t_end: float = 0.0
    malformed: list[str] = field(default_factory=list)  # lines that are not "data: <json>" / [DONE]

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.t_start if self.chunk_times else None


def _has_output(event: dict) -> bool:
    for c in event.get("choices", ()):
        if c.get("text") or (c.get("delta") or {}).get("content") or c.get("logprobs"):
            return True
    return False


async def send(client: httpx.AsyncClient, job: Job, timeout: float) -> Result:
    """Streams one job; a transport failure or running past ``timeout`` is recorded, not raised."""
    res = Result(job, t_start=time.perf_counter())
    try:
        await asyncio.wait_for(_stream(client, job, res), timeout)
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.t_end = time.perf_counter()
    return res


async def _stream(client: httpx.AsyncClient, job: Job, res: Result) -> None:
    headers = {"X-Request-Id": f"load-{job.id}"}
    if job.body.get("stream") is False:  # one JSON answer: its arrival is the one output event
        r = await client.post(job.path, json=job.body, headers=headers)
        res.status, res.events = r.status_code, [r.json()]
        res.chunk_times.append(time.perf_counter())
        return
    async with client.stream("POST", job.path, json=job.body, headers=headers) as r:
        res.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            res.events = [r.json()]
            return
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line[len("data: ") :] if line.startswith("data: ") else None
            try:
                event = data if data == "[DONE]" else json.loads(data) if data is not None else None
            except json.JSONDecodeError:
                event = None
            if event is None:
                res.malformed.append(line[:200])
                continue
            res.events.append(event)
            if isinstance(event, dict) and _has_output(event):
                res.chunk_times.append(time.perf_counter())
            if job.kind == "disconnect" and len(res.events) >= job.disconnect_after:
                return  # leaving the block closes the connection mid-stream


async def run_load(url: str, jobs: list[Job], concurrency: int, timeout: float, deadline: float) -> list[Result]:
    """Every job streamed with at most ``concurrency`` in flight; jobs not started
    within ``deadline`` seconds are skipped (a Result with error "not sent")."""
    gate = asyncio.Semaphore(concurrency)
    stop_at = time.perf_counter() + deadline
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:

        async def one(job: Job) -> Result:
            async with gate:
                if time.perf_counter() > stop_at:
                    return Result(job, error="not sent: deadline passed")
                return await send(client, job, timeout)

        return await asyncio.gather(*(one(j) for j in jobs))


async def run_alone(url: str, jobs: list[Job], timeout: float) -> dict[int, Result]:
    """Each greedy job again, one at a time (its reference output)."""
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        for job in jobs:
            if job.greedy:
                out[job.id] = await send(client, job, timeout)
    return out


# ---- checks ----


def choice_texts(res: Result) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in res.events:
        for c in e.get("choices", ()) if isinstance(e, dict) else ():
            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return texts


def finish_reasons(res: Result) -> dict[int, list[str]]:
    reasons: dict[int, list[str]] = {}
    for e in res.events:
        for c in e.get("choices", ()) if isinstance(e, dict) else ():
            if c.get("finish_reason"):
                reasons.setdefault(c["index"], []).append(c["finish_reason"])
    return reasons


def usage(res: Result) -> dict | None:
    found = [e["usage"] for e in res.events if isinstance(e, dict) and e.get("usage")]
    return found[-1] if found else None


def check_stream(res: Result, prompt_tokens: int | None) -> list[str]:
    """Why a completed normal stream is not well formed ([] when it is)."""
    job, problems = res.job, []
    if res.error or res.status != 200:
        return [f"status {res.status} {res.error or ''} {str(res.events)[:200]}"]
    if res.malformed:
        problems.append(f"malformed lines {res.malformed[:2]}")
    if res.events.count("[DONE]") != 1 or res.events[-1] != "[DONE]":
        problems.append("does not end with exactly one [DONE]")
    errors = [e["error"] for e in res.events if isinstance(e, dict) and "error" in e]
    if errors:
        problems.append(f"error event {errors[0]}")
    reasons = finish_reasons(res)
    allowed = ("stop", "length", "tool_calls") if job.body.get("tools") else ("stop", "length")
    if sorted(reasons) != list(range(job.n)) or any(len(r) != 1 or r[0] not in allowed for r in reasons.values()):
        problems.append(f"finish reasons {reasons}")
    u = usage(res)
    if u is None:
        return problems + ["no usage chunk"]
    if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]:
        problems.append(f"usage does not add up {u}")
    if prompt_tokens is not None and u["prompt_tokens"] != prompt_tokens:
        problems.append(f"prompt_tokens {u['prompt_tokens']} != {prompt_tokens}")
    max_tokens, n = job.body["max_tokens"], job.n
    all_length = all(r == ["length"] for r in reasons.values())
    if not (n <= u["completion_tokens"] <= n * max_tokens) or (all_length and u["completion_tokens"] != n * max_tokens):
        problems.append(f"completion_tokens {u['completion_tokens']} for n={n}, max_tokens={max_tokens}, {reasons}")
    logprob_tokens = _logprob_tokens(res)
    if logprob_tokens is not None and logprob_tokens != u["completion_tokens"]:
        problems.append(f"{logprob_tokens} tokens with logprobs, usage says {u['completion_tokens']}")
    return problems


def _logprob_tokens(res: Result) -> int | None:
    body = res.job.body
    if res.job.route == "completions" and body.get("logprobs") is not None:
        return sum(
            len(c["logprobs"]["tokens"])
            for e in res.events
            if isinstance(e, dict)
            for c in e["choices"]
            if c.get("logprobs")
        )
    if res.job.route == "chat" and body.get("logprobs"):
        return sum(
            len(c["logprobs"]["content"] or [])
            for e in res.events
            if isinstance(e, dict)
            for c in e["choices"]
            if c.get("logprobs")
        )
    return None


def check_greedy(res: Result, alone: Result) -> list[str]:
    """A greedy job under load must write what it writes alone."""
    got, want = choice_texts(res), choice_texts(alone)
    problems = [] if got == want else [f"text under load {got!r} != alone {want!r}"]
    if (usage(res) or {}).get("completion_tokens") != (usage(alone) or {}).get("completion_tokens"):
        problems.append("completion_tokens differ from the run alone")
    if res.job.n > 1 and len(set(got.values())) != 1:
        problems.append(f"greedy choices differ {got!r}")
    return problems


def check_rejected(res: Result) -> list[str]:
    if res.status != res.job.expect_status:
        return [f"invalid job got {res.status}, expected {res.job.expect_status}: {str(res.events)[:200]}"]
    error = res.events[0].get("error", {}) if res.events else {}
    return [] if error.get("message") and error.get("type") else [f"no error body: {res.events!r:.200}"]


def percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    if len(values) == 1:
        return values[0], values[0]
    q = statistics.quantiles(values, n=100, method="inclusive")
    return statistics.median(values), q[98]


def latencies(results: list[Result]) -> dict[str, list[float]]:
    """TTFT per request; inter-token gaps (gap between output events / tokens they carry is
    not visible to a client, so gaps between output events) and time per output token."""
    ttft, itl, tpot = [], [], []
    for r in results:
        if r.job.kind != "normal" or r.status != 200 or not r.chunk_times:
            continue
        ttft.append(r.ttft)
        itl += [b - a for a, b in itertools.pairwise(r.chunk_times)]
        u = usage(r)
        per_choice = (u["completion_tokens"] / r.job.n) if u else 0
        if per_choice > 1:
            tpot.append((r.chunk_times[-1] - r.chunk_times[0]) / (per_choice - 1))
    return {"ttft": ttft, "itl": itl, "tpot": tpot}
