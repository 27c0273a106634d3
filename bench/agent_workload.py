"""Generated traffic where suffix decoding is meant to pay (nothing downloaded): agent loops,
repeated tasks, retries, beside a few Spec-Bench questions.

A workload is a list of sessions; a session is a list of user turns sent one after the
other, each with the conversation so far (the model's own earlier answers included), as
agent frameworks do. Plain data, no torch.
"""

import random

from bench.common import spec_bench

NAMES = ["total", "count", "items", "limit", "result", "offset", "buffer", "window"]
RENAMES = [("total", "amount"), ("count", "n"), ("items", "entries"), ("limit", "cap"), ("result", "out")]


def code_file(seed: int) -> str:
    """A short Python module of a few functions over the same identifiers."""
    rng = random.Random(seed)
    a, b, c = rng.sample(NAMES[:5], 3)
    return (
        f"def accumulate({a}, {b}):\n"
        f"    {c} = 0\n"
        f"    for value in {b}:\n"
        f"        if value > {a}:\n"
        f"            {c} += value\n"
        f"    return {c}\n\n\n"
        f"def scale({b}, factor):\n"
        f"    return [value * factor for value in {b}]\n\n\n"
        f"def summary({b}):\n"
        f"    return {{\"size\": len({b}), \"max\": max({b}), \"min\": min({b})}}\n"
    )


def agent_code(n: int, turns: int = 3) -> list[list[str]]:
    """Sessions editing one file turn after turn: each answer re-emits the whole file."""
    out = []
    for s in range(n):
        code = code_file(s)
        present = [(x, y) for x, y in RENAMES if x in code]
        first = (f"Here is my file:\n```python\n{code}```\nRename `{present[0][0]}` to `{present[0][1]}` everywhere. "
                 "Reply with the whole file only.")
        later = [f"Now rename `{x}` to `{y}` everywhere. Reply with the whole file only." for x, y in present[1:turns]]
        out.append([first] + later)
    return out


TOOLS = ('You are an agent. To call a tool, reply with one JSON object only: {"tool": NAME, "arguments": {...}}. '
         'Tools: get_weather(city, unit), search_flights(origin, destination, date), book_hotel(city, nights, guests).')
CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Lima", "Cairo", "Seoul"]


def agent_tools(n: int, turns: int = 3) -> list[list[str]]:
    """Sessions of JSON tool calls: the same call shape again with other arguments."""
    out = []
    for s in range(n):
        rng = random.Random(100 + s)
        cities = rng.sample(CITIES, turns + 1)
        first = f"{TOOLS}\n\nUser: what is the weather in {cities[0]} in celsius? Then find flights to it."
        later = [f'Tool result: {{"city": "{cities[i]}", "temp": {10 + i}}}. Do the same call for {cities[i + 1]}.'
                 for i in range(turns - 1)]
        out.append([first] + later)
    return out


PEOPLE = [("Alice Moreau", 34, "Lyon", "nurse"), ("Bob Chen", 41, "Toronto", "pilot"),
          ("Carla Diaz", 29, "Seville", "chemist"), ("Dmitri Ivanov", 52, "Kazan", "teacher"),
          ("Emma Olsen", 23, "Bergen", "student"), ("Farid Haddad", 38, "Beirut", "architect"),
          ("Grace Kim", 45, "Busan", "lawyer"), ("Hugo Weber", 61, "Graz", "baker")]


def repeated_task(n: int) -> list[list[str]]:
    """One template, one answer shape: extraction of the same fields as JSON."""
    out = []
    for i in range(n):
        name, age, city, job = PEOPLE[i % len(PEOPLE)]
        out.append([f"Extract the person's name, age, city and job from the text as a JSON object with keys "
                    f'"name", "age", "city", "job". Reply with the JSON only.\n\nText: {name} is a {age}-year-old '
                    f"{job} who lives in {city}."])
    return out


def retries(n: int, copies: int = 3) -> list[list[str]]:
    """Identical requests sent again (a client's retries): ``n`` prompts, ``copies`` times each."""
    base = [agent_code(n)[i][0] if i % 2 == 0 else repeated_task(n)[i][0] for i in range(n)]
    return [[p] for _ in range(copies) for p in base]


def spec_bench_sessions(n: int, categories=("coding", "extraction", "summarization", "qa")) -> list[list[str]]:
    return [[p] for c in categories for p in spec_bench(c, n)]


def workloads(scale: int = 1) -> dict[str, list[list[str]]]:
    """name -> sessions; ``scale`` multiplies the sessions of each."""
    return {
        "agent-code": agent_code(2 * scale),
        "agent-tools": agent_tools(2 * scale),
        "repeated-task": repeated_task(6 * scale),
        "retries": retries(2 * scale),
        "spec-bench": spec_bench_sessions(scale),
    }
