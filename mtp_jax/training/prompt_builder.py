"""Offline prompts for self-distillation and evaluation: chat, code, math and summarisation.

Sources, all on this machine: hand-written topic and task lists (below), arithmetic word problems with seeded
numbers, and docstrings of the Python standard library (for summarisation; their text depends on the Python
version). Every (template, subject) pair is assigned to "train" or "eval" by a stable hash, and eval subjects are
never used for training, so the two sets are disjoint by construction.
"""

from __future__ import annotations

import hashlib
import importlib
import random
import textwrap

CHAT_TEMPLATES = [
    "Explain {} to a curious teenager.",
    "What are the main advantages and disadvantages of {}?",
    "Write a short story that involves {}.",
    "Give me five practical tips about {}.",
    "Describe the history of {} in a few paragraphs.",
    "Write a friendly email inviting a colleague to learn about {}.",
    "What are common misconceptions about {}?",
    "Compose a short poem about {}.",
]
CHAT_TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "the French Revolution", "the Roman Empire",
    "climate change", "renewable energy", "electric cars", "machine learning", "the immune system", "sleep",
    "healthy eating", "learning a new language", "public speaking", "time management", "gardening", "chess",
    "the internet", "cryptography", "the printing press", "ancient Egypt", "honeybees", "ocean tides",
    "earthquakes", "the stock market", "inflation", "budgeting", "remote work", "meditation", "running a marathon",
    "coffee", "tea ceremonies", "jazz music", "the Renaissance", "democracy", "recycling", "space exploration",
    "the Moon landing", "dinosaurs", "rainforests", "deserts", "glaciers", "vaccines", "antibiotics",
    "the human brain", "friendship", "volunteering", "photography", "baking bread", "cycling", "bridges",
    "skyscrapers", "trains", "airplanes", "submarines", "solar panels", "batteries", "3D printing", "robots",
    "video games", "board games", "libraries", "museums", "the Olympic Games", "mountains", "rivers", "birds",
    "cats", "dogs", "whales", "octopuses", "mushrooms", "the periodic table", "gravity", "light", "sound",
    "magnets", "electricity", "weather forecasts", "maps", "calendars", "clocks", "money", "taxes", "cities",
]  # fmt: skip
CODE_TEMPLATES = [
    "Write a Python function that {}.",
    "Write a JavaScript function that {}.",
    "Explain step by step how to write a program that {}.",
    "Write a Python function that {}, and include a docstring and two example calls.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "sorts a list of dictionaries by a key", "counts the words in a text",
    "removes duplicates from a list while keeping order", "merges two sorted lists", "finds the maximum of a list",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit", "flattens a nested list",
    "computes the greatest common divisor of two numbers", "parses a CSV line into fields",
    "validates an email address with a regular expression", "reads a file and prints its lines in reverse",
    "implements binary search", "implements bubble sort", "computes the mean and median of numbers",
    "groups words by their first letter", "counts character frequencies", "transposes a matrix",
    "checks whether brackets in a string are balanced", "converts a number to Roman numerals",
    "generates all permutations of a list", "computes the sum of digits of an integer",
    "finds the longest word in a sentence", "capitalizes the first letter of each word",
    "returns the intersection of two lists", "computes compound interest", "simulates rolling two dice",
    "checks whether a year is a leap year", "converts a dictionary to a JSON string", "implements a stack class",
    "implements a queue with two stacks", "finds all prime numbers below n", "computes the power set of a set",
    "rotates a list by k positions", "counts vowels in a string", "finds the second largest number in a list",
]  # fmt: skip
MATH_TEMPLATES = [
    "A shop sells pencils for {a} cents each. How much do {b} pencils cost in dollars? Explain your steps.",
    "A train travels {a} kilometers in {b} hours. What is its average speed? Show your work.",
    "If a rectangle is {a} meters long and {b} meters wide, what are its area and perimeter?",
    "Sarah has {a} apples and gives away {b}. Then she buys twice as many as she has left. How many now?",
    "What is {a} multiplied by {b}? Explain how to compute it by hand.",
    "A recipe needs {a} grams of flour for {b} people. How much flour is needed for 12 people?",
    "Solve for x: {a}x + {b} = {c}. Explain each step.",
    "What is {a} percent of {c}? Show the calculation.",
]
SUMMARY_TEMPLATE = "Summarize the following text in two or three sentences:\n\n{}"
SUMMARY_MODULES = [
    "abc", "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "colorsys", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fileinput", "fnmatch", "fractions",
    "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "imaplib", "inspect",
    "ipaddress", "json", "linecache", "locale", "logging", "mailbox", "mimetypes", "numbers", "operator",
    "optparse", "os", "pathlib", "pdb", "pickle", "pkgutil", "platform", "plistlib", "poplib", "pprint",
    "queue", "quopri", "random", "re", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib",
    "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "trace", "traceback", "typing", "unittest", "urllib", "uuid", "warnings",
    "wave", "weakref", "webbrowser", "zipfile", "zipimport", "zlib",
]  # fmt: skip
CATEGORIES = ("chat", "code", "math", "summarisation")


def split_of(key: str) -> str:
    """'eval' for about one key in eight, 'train' otherwise: stable across runs and machines."""
    return "eval" if int(hashlib.sha256(key.encode()).hexdigest(), 16) % 8 == 0 else "train"


def _docstring_passage(module_name: str) -> str | None:
    try:
        doc = importlib.import_module(module_name).__doc__ or ""
    except ImportError:
        return None
    text = " ".join(doc.split())
    return textwrap.shorten(text, 900, placeholder="...") if len(text) > 300 else None


def candidate_prompts(category: str, split: str) -> list[str]:
    """Every prompt of a category in a split, in a fixed order."""
    if category == "chat":
        pairs = [(t, s) for t in CHAT_TEMPLATES for s in CHAT_TOPICS]
    elif category == "code":
        pairs = [(t, s) for t in CODE_TEMPLATES for s in CODE_TASKS]
    elif category == "summarisation":
        pairs = [(SUMMARY_TEMPLATE, p) for m in SUMMARY_MODULES if (p := _docstring_passage(m))]
    elif category == "math":
        rng = random.Random("math")
        pairs = []
        for template in MATH_TEMPLATES:
            for _ in range(80):
                a, b = rng.randint(2, 97), rng.randint(2, 19)
                pairs.append(("{}", template.format(a=a, b=b, c=a * rng.randint(2, 9) + b)))
    else:
        raise ValueError(f"unknown category {category!r}; known: {CATEGORIES}")
    return list(dict.fromkeys(t.format(s) for t, s in pairs if split_of(f"{t}|{s}") == split))


def build_prompts(num_prompts: int, split: str, seed: int) -> list[dict]:
    """`num_prompts` prompts of a split, categories interleaved, shuffled by `seed` (no repeats when possible)."""
    rng = random.Random(seed)
    pools = {c: candidate_prompts(c, split) for c in CATEGORIES}
    for pool in pools.values():
        rng.shuffle(pool)
    prompts, index = [], 0
    while len(prompts) < num_prompts and any(index < len(pool) for pool in pools.values()):
        for category in CATEGORIES:
            if index < len(pools[category]) and len(prompts) < num_prompts:
                prompts.append({"prompt": pools[category][index], "category": category})
        index += 1
    return prompts
