"""Chat prompts for ``train-eagle``'s self-distillation (written for this module; no
benchmark's questions).

The target answers them and the head learns from the answers, so they should span
what a chat model is asked: explanations of science, history and the arts; writing
in many forms; role play; arithmetic and reasoning; summaries and extraction over a
given text (Python's own documentation, ``pydoc_data.topics``, shipped with the
standard library); code. A head learns the kind of text it is trained on: one trained
on explanations alone drafts other kinds of chat far worse. Everything is deterministic (numbers come from a seeded generator).
"""

import random

SUBJECTS = (
    "photosynthesis", "black holes", "the French Revolution", "supply and demand", "the immune system",
    "plate tectonics", "the Roman Empire", "machine learning", "climate change", "the printing press",
    "quantum mechanics", "the water cycle", "Shakespeare's plays", "the stock market", "DNA replication",
    "the Industrial Revolution", "volcanoes", "democracy", "the human brain", "renewable energy",
    "ancient Egypt", "probability", "the solar system", "impressionist painting", "vaccines",
    "the Cold War", "electricity", "philosophy of mind", "ocean currents", "the Renaissance",
    "inflation", "evolution by natural selection", "the internet", "Greek mythology", "nutrition",
    "the theory of relativity", "world religions", "chemical bonds", "urban planning", "jazz music",
    "the Silk Road", "sleep", "cryptography", "ethics", "rainforests", "the Moon landing",
    "linear algebra", "public health", "the novel as a literary form", "earthquakes",
    "thermodynamics", "the periodic table", "cell division", "the nervous system", "antibiotics",
    "genetics", "the speed of light", "magnetism", "nuclear energy", "the greenhouse effect",
    "the human heart", "bacteria and viruses", "the Big Bang", "gravity", "sound waves",
    "the chemistry of cooking", "batteries", "the carbon cycle", "coral reefs", "deserts",
    "glaciers", "weather forecasting", "the atmosphere", "soil", "bees and pollination",
    "calculus", "statistics", "prime numbers", "geometry", "game theory",
    "algorithms", "databases", "operating systems", "computer networks", "artificial intelligence",
    "robotics", "space exploration", "telescopes", "the history of medicine", "the scientific method",
    "the American Revolution", "World War I", "World War II", "the Ottoman Empire", "the Mongol Empire",
    "ancient Greece", "the Maya civilization", "feudalism", "the Reformation", "colonialism",
    "the civil rights movement", "the fall of the Berlin Wall", "the history of writing", "the Enlightenment",
    "the Byzantine Empire", "existentialism", "Stoicism", "utilitarianism", "free will", "the social contract",
    "poetry", "Greek tragedy", "the history of film", "classical music", "architecture",
    "photography", "the Baroque period", "modern art", "mythology in literature", "storytelling",
    "globalization", "international trade", "taxation", "unemployment", "central banks",
    "entrepreneurship", "marketing", "personal finance", "cryptocurrency", "the gig economy",
    "psychology of learning", "memory", "motivation", "language acquisition", "social media",
    "education systems", "human rights", "the United Nations", "journalism", "copyright law",
    "sustainable agriculture", "water scarcity", "biodiversity", "recycling", "electric cars",
    "the history of mathematics", "the Olympic Games", "the history of chess", "archaeology", "linguistics",
)
EXPLAIN = (
    "Explain {} to a beginner.",
    "Describe the history of {}.",
    "What are common misconceptions about {}?",
    "How does {} affect everyday life?",
    "What are the main arguments for and against {}?",
    "What questions do researchers still ask about {}?",
    "Give five interesting facts about {}.",
    "Summarize what a student should know about {}.",
    "What are the most important ideas about {}?",
)
WRITING = (
    "Write a persuasive essay arguing that {} deserves more attention in schools.",
    "Compose a short poem about {}.",
    "Write a short story in which {} plays a central role.",
    "Draft a formal email to a colleague proposing a workshop on {}.",
    "Write a blog post for teenagers about {}.",
    "Write a five-minute speech for a school assembly about {}.",
    "Write a dialogue between two friends who disagree about {}.",
    "Write a product description for a board game about {}.",
    "Write a travel blog post about visiting a museum exhibition on {}.",
    "Write a letter to your younger self explaining why {} matters.",
    "Write the opening paragraph of a mystery novel that involves {}.",
    "Write a newspaper article reporting a surprising discovery about {}.",
    "Write a limerick about {}.",
    "Write a podcast script introducing {} to curious listeners.",
    "Write a motivational message for someone starting to learn about {}.",
    "Write a review of an imaginary documentary about {}.",
)
ROLES = (
    "a medieval knight", "a detective in 1920s London", "a ship's captain", "a famous chef", "a kindergarten teacher",
    "an astronaut on the International Space Station", "a tour guide in Rome", "a wise old wizard",
    "a personal fitness coach", "a museum curator", "a startup founder", "a marine biologist",
    "a librarian", "a park ranger", "a travel agent", "a robot learning about humans",
    "a pirate", "a sports commentator", "a career counselor", "a gardener",
)
ROLE_QUESTIONS = (
    "Describe your typical day.",
    "What advice would you give to someone new to your work?",
    "Tell me about the greatest challenge you have faced.",
    "How would you introduce yourself at a party?",
    "What do people misunderstand about your job?",
    "Describe the most memorable moment of your career.",
    "What would you change about the world if you could?",
    "How do you handle a difficult day?",
    "Recommend three things I should try this weekend.",
    "Explain the rules you live by.",
)
CODING_TASKS = (
    "reverses a string", "checks whether a number is prime", "merges two sorted lists", "counts word frequencies",
    "computes Fibonacci numbers", "finds the longest common prefix", "validates an email address",
    "flattens a nested list", "implements binary search", "parses a CSV line", "removes duplicates from a list",
    "computes the factorial of n", "checks for balanced parentheses", "converts Celsius to Fahrenheit",
    "finds the median of a list", "implements a stack class", "transposes a matrix", "sorts a dictionary by value",
    "computes the greatest common divisor", "reads a file and counts its lines",
    "checks whether a string is a palindrome", "implements a queue with two stacks", "finds the maximum subarray sum",
    "implements bubble sort", "implements quicksort", "implements merge sort", "counts the vowels in a string",
    "converts a decimal number to binary", "finds all anagrams of a word in a list", "implements a linked list",
    "computes the power set of a set", "finds the shortest path in a graph", "implements a binary search tree",
    "rotates an array by k positions", "checks whether two strings are anagrams", "finds the second largest number",
    "implements a simple calculator", "generates all permutations of a list", "computes the edit distance of two strings",
    "capitalizes the first letter of each word", "finds the most common element in a list", "implements an LRU cache",
    "computes the sum of the digits of a number", "checks whether a year is a leap year", "implements depth-first search",
    "implements breadth-first search", "multiplies two matrices", "finds prime numbers with a sieve",
    "converts a Roman numeral to an integer", "finds the intersection of two lists",
)
LANGUAGES = ("Python", "JavaScript", "C++", "Java")
NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Ivy", "Jack")
EXTRACT = (
    "Summarize the following documentation in three sentences.\n\n{}",
    "List the key terms in the following text and explain each in one line.\n\n{}",
)


def distillation_prompts() -> list[str]:
    """About 2,500 distinct prompts: explanations (1,350), writing (400), role play (200),
    reasoning and arithmetic (200), extraction (156), code (200)."""
    prompts = [t.format(s) for s in SUBJECTS for t in EXPLAIN]
    prompts += [WRITING[(3 * i + j) % len(WRITING)].format(s) for i, s in enumerate(SUBJECTS[:134]) for j in range(3)][:400]
    prompts += [f"Pretend you are {r}. {q}" for r in ROLES for q in ROLE_QUESTIONS]
    prompts += reasoning_prompts(200)
    prompts += extraction_prompts()
    prompts += [f"Write a {lang} function that {task}." for task in CODING_TASKS for lang in LANGUAGES]
    return prompts


def reasoning_prompts(n: int) -> list[str]:
    """``n`` distinct word problems, equations and small logic puzzles (seeded numbers)."""
    rng = random.Random(0)
    makers = (
        lambda a, b, c: f"A shop sells notebooks for ${a} each. How much do {b} notebooks cost? Explain step by step.",
        lambda a, b, c: f"Solve the equation {a}x + {b} = {a * c + b} and check your answer.",
        lambda a, b, c: f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        lambda a, b, c: f"If {a} workers finish a job in {b} days, how long would {a + c} workers take?",
        lambda a, b, c: f"What is {a}% of {b * 10}? Show your reasoning.",
        lambda a, b, c: (f"A train travels {a * 10} km in {b} hours. What is its average speed, and how far does it go "
                         f"in {c} hours?"),
        lambda a, b, c: f"Find the derivative of f(x) = {a}x^{b % 5 + 2} + {c}x.",
        lambda a, b, c: "{} is {} cm taller than {}, and {} is {} cm taller than {}. Who is the shortest, and "
                        "how much taller is the tallest than the shortest?".format(*_names_and_heights(a, b, c)),
        lambda a, b, c: f"What is the sum of all integers from 1 to {a * b}? Explain the method.",
        lambda a, b, c: f"A bag holds {a} red and {b} blue marbles. If you draw two without replacement, "
                        f"what is the probability that both are red?",
    )
    out: list[str] = []
    while len(out) < n:
        p = makers[len(out) % len(makers)](rng.randint(2, 30), rng.randint(2, 20), rng.randint(2, 12))
        if p not in out:
            out.append(p)
    return out


def _names_and_heights(a: int, b: int, c: int) -> tuple:
    """Three distinct names for a height puzzle (the middle one twice), with two heights."""
    x, y, z = NAMES[c % 10], NAMES[(c + 3) % 10], NAMES[(c + 7) % 10]
    return x, a, y, y, b, z


def extraction_prompts() -> list[str]:
    """Summaries and key terms of each ``pydoc_data.topics`` entry's opening (~800 characters)."""
    from pydoc_data.topics import topics

    openings = dict.fromkeys(topics[name][:800].strip() for name in sorted(topics))  # some topics share a text
    return [t.format(text) for text in openings for t in EXTRACT]
