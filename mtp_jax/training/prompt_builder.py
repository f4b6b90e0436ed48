"""Offline prompts for self-distillation and evaluation: chat, code, math, summarisation and technical explanations.

Sources, all on this machine: hand-written templates, topics and tasks (below), arithmetic word problems with
seeded numbers, and docstrings of the Python standard library's modules and of their public functions and classes
(for summarisation; their text depends on the Python version). Every (template, subject) pair is assigned to
"train" or "eval" by a stable hash, and eval subjects are never used for training, so the two sets are disjoint by
construction.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
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
    "Write a blog post introduction about {}.",
    "Explain {} in simple terms, as if to a ten-year-old.",
    "List three interesting facts about {}.",
    "How would you teach a beginner about {}?",
    "Write a dialogue between two friends discussing {}.",
    "Summarize what everyone should know about {}.",
    "What questions do people often ask about {}? Answer two of them.",
    "Write a product description for a book about {}.",
    "Give a step-by-step overview of how {} works.",
    "Compare {} with something from everyday life.",
    "Write a motivational speech that mentions {}.",
    "What is the future of {}?",
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
    "the solar system", "the human heart", "DNA", "evolution", "plate tectonics", "the ozone layer", "coral reefs",
    "penguins", "elephants", "ants", "spiders", "sharks", "wolves", "forests", "wetlands", "the Amazon river",
    "the Great Wall of China", "the pyramids", "the Vikings", "the Middle Ages", "the Industrial Revolution",
    "the telephone", "television", "radio", "the steam engine", "nuclear energy", "wind turbines", "hydrogen fuel",
    "smartphones", "social media", "online privacy", "open source software", "cloud computing", "databases",
    "programming", "artificial intelligence", "self-driving cars", "drones", "satellites", "telescopes",
    "microscopes", "the scientific method", "mathematics", "prime numbers", "probability", "statistics",
    "geometry", "music theory", "the piano", "the guitar", "opera", "painting", "sculpture", "architecture",
    "poetry", "novels", "theater", "film making", "animation", "comic books", "fashion", "cooking pasta",
    "vegetarian food", "chocolate", "cheese", "spices", "farming", "composting", "beekeeping", "fishing",
    "hiking", "camping", "swimming", "yoga", "football", "basketball", "tennis", "the Tour de France",
    "first aid", "hand washing", "exercise", "stress", "happiness", "kindness", "teamwork", "leadership",
    "negotiation", "job interviews", "writing a resume", "saving money", "investing", "small businesses",
    "marketing", "customer service", "urban planning", "public transport", "traffic", "air pollution",
    "water purification", "deforestation", "endangered species", "national parks", "volunteer firefighters",
    "the postal service", "elections", "human rights", "philosophy", "ethics", "languages of the world",
    "writing systems", "the alphabet", "mythology", "fairy tales", "holidays", "birthdays", "weddings",
]  # fmt: skip
CODE_TEMPLATES = [
    "Write a Python function that {}.",
    "Write a JavaScript function that {}.",
    "Explain step by step how to write a program that {}.",
    "Write a Python function that {}, and include a docstring and two example calls.",
    "Write a C function that {}.",
    "Write a Python class with a method that {}.",
    "Write unit tests for a Python function that {}.",
    "Describe an efficient algorithm that {}, and give its time complexity.",
    "Write a Rust function that {}.",
    "Write a TypeScript function that {}.",
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
    "checks whether two strings are anagrams", "converts a binary string to an integer", "computes a running sum",
    "finds the most common element of a list", "splits a list into chunks of size n", "reverses a linked list",
    "computes the distance between two points", "checks whether a number is a perfect square",
    "counts the lines in a file", "removes punctuation from a string", "computes the least common multiple",
    "finds the index of the smallest element", "zips two lists into a dictionary", "filters even numbers",
    "computes the average word length of a sentence", "generates a random password",
    "converts a string to title case", "checks whether a list is sorted", "implements insertion sort",
    "implements merge sort", "implements quicksort", "computes the n-th triangular number",
    "returns the unique characters of a string", "counts the occurrences of a substring",
    "formats a number with thousands separators", "parses a date string", "computes the area of a circle",
    "converts kilometers to miles", "finds pairs of numbers that add up to a target", "validates a phone number",
    "computes the dot product of two vectors", "multiplies two matrices", "implements a binary search tree",
    "performs a breadth-first search on a graph", "computes the Levenshtein distance between two strings",
    "caches the results of a slow function",
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
    "Tom reads {b} pages a day. How many days does he need for a book of {c} pages?",
    "A car uses {b} liters of fuel per 100 kilometers. How much fuel does it need for {c} kilometers?",
    "What is the sum of {a}, {b} and {c}? Explain your method.",
    "A class has {a} students and {b} of them are absent. What fraction of the class is present?",
    "Divide {c} by {b} and explain the remainder.",
    "A square has a side of {b} centimeters. What are its area and perimeter?",
    "A worker earns {a} dollars an hour and works {b} hours. How much does she earn?",
    "Convert {c} minutes into hours and minutes.",
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
SUMMARY_MEMBERS_PER_MODULE = 12  # public functions and classes a module gives docstrings of, at most
EXPLAIN_TEMPLATES = [
    "Explain {} in one paragraph.",
    "What is {}?",
    "How does {} work?",
    "Explain {} briefly to a software engineer.",
    "Describe {} and why it matters.",
    "Give a short technical overview of {}.",
    "What problem does {} solve, and how?",
    "Explain {} with a simple example.",
    "What are the trade-offs of {}?",
    "Write a short paragraph explaining {} to a student.",
]
EXPLAIN_TOPICS = [
    "binary search trees", "linked lists", "dynamic programming", "recursion", "garbage collection",
    "virtual memory", "CPU caches", "branch prediction", "pipelining in processors", "SIMD instructions",
    "multithreading", "deadlocks", "mutexes", "semaphores", "event loops", "asynchronous programming",
    "message queues", "load balancing", "content delivery networks", "DNS", "TCP", "UDP", "IP addresses",
    "public key cryptography", "digital signatures", "password hashing", "two-factor authentication", "firewalls",
    "VPNs", "containers", "virtual machines", "Kubernetes", "microservices", "REST APIs", "GraphQL",
    "relational databases", "SQL joins", "database indexes", "transactions and ACID", "eventual consistency",
    "the CAP theorem", "consensus algorithms", "distributed caching", "MapReduce", "stream processing",
    "version control with Git", "continuous integration", "unit testing", "code review", "refactoring",
    "design patterns", "object-oriented programming", "functional programming", "type systems",
    "interpreters", "just-in-time compilation", "bytecode", "regular expressions", "parsing", "Big O notation",
    "sorting algorithms", "graph algorithms", "shortest path algorithms", "hashing", "bloom filters",
    "data compression", "error-correcting codes", "checksums", "floating-point numbers", "integer overflow",
    "neural networks", "backpropagation", "overfitting", "regularization", "convolutional neural networks",
    "recurrent neural networks", "the attention mechanism", "word embeddings", "tokenization in language models",
    "large language models", "fine-tuning a model", "reinforcement learning", "decision trees", "random forests",
    "k-means clustering", "principal component analysis", "cross-validation", "the bias-variance trade-off",
    "batch normalization", "dropout", "learning rate schedules", "quantization of neural networks",
    "knowledge distillation", "beam search", "sampling temperature in text generation", "GPUs",
    "TPUs", "matrix multiplication", "memory bandwidth", "parallel computing", "cloud storage",
    "operating system kernels", "file systems", "device drivers", "interrupts", "the boot process",
    "web browsers", "cookies", "HTML and CSS", "JavaScript engines", "WebAssembly", "search engines",
    "recommendation systems", "A/B testing", "data pipelines", "data warehouses", "spreadsheets",
    "Bayes' theorem", "linear regression", "logistic regression", "eigenvalues", "Fourier transforms",
    "entropy in information theory", "Markov chains", "Monte Carlo methods", "numerical integration",
    "the speed of light", "quantum computing", "semiconductors", "transistors", "lasers", "GPS",
    "wireless networks", "Bluetooth", "fiber optics", "radar", "jet engines", "heat pumps",
]  # fmt: skip
CATEGORIES = ("chat", "code", "math", "summarisation", "explain")  # their order indexes shards' `categories`
MIXED_CATEGORIES = CATEGORIES[:4]  # what a prompt list mixes unless told otherwise (the first shards were made so)


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


def _member_passages(module_name: str) -> list[str]:
    """Docstring passages of a module's public functions and classes (those long enough), in name order."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    passages = []
    for name in sorted(vars(module)):
        member = getattr(module, name)
        if name.startswith("_") or not (inspect.isfunction(member) or inspect.isclass(member)):
            continue
        if getattr(member, "__module__", None) != module_name:
            continue
        text = " ".join((inspect.getdoc(member) or "").split())
        if len(text) > 300:
            passages.append(textwrap.shorten(f"{module_name}.{name}: {text}", 900, placeholder="..."))
        if len(passages) == SUMMARY_MEMBERS_PER_MODULE:
            break
    return passages


def candidate_prompts(category: str, split: str) -> list[str]:
    """Every prompt of a category in a split, in a fixed order."""
    if category == "chat":
        pairs = [(t, s) for t in CHAT_TEMPLATES for s in CHAT_TOPICS]
    elif category == "code":
        pairs = [(t, s) for t in CODE_TEMPLATES for s in CODE_TASKS]
    elif category == "summarisation":
        pairs = [(SUMMARY_TEMPLATE, p) for m in SUMMARY_MODULES if (p := _docstring_passage(m))]
        pairs += [(SUMMARY_TEMPLATE, p) for m in SUMMARY_MODULES for p in _member_passages(m)]
    elif category == "explain":
        pairs = [(t, s) for t in EXPLAIN_TEMPLATES for s in EXPLAIN_TOPICS]
    elif category == "math":
        pairs = []
        for seed, count in (("math", 80), ("math, more", 160)):  # the first set as it was, then more of each
            rng = random.Random(seed)
            for template in MATH_TEMPLATES:
                for _ in range(count):
                    a, b = rng.randint(2, 97), rng.randint(2, 19)
                    pairs.append(("{}", template.format(a=a, b=b, c=a * rng.randint(2, 9) + b)))
    else:
        raise ValueError(f"unknown category {category!r}; known: {CATEGORIES}")
    return list(dict.fromkeys(t.format(s) for t, s in pairs if split_of(f"{t}|{s}") == split))


def build_prompts(
    num_prompts: int, split: str, seed: int, categories: tuple[str, ...] = MIXED_CATEGORIES
) -> list[dict]:
    """`num_prompts` prompts of a split, `categories` interleaved, shuffled by `seed` (no repeats when possible)."""
    rng = random.Random(seed)
    pools = {c: candidate_prompts(c, split) for c in categories}
    for pool in pools.values():
        rng.shuffle(pool)
    prompts, index = [], 0
    while len(prompts) < num_prompts and any(index < len(pool) for pool in pools.values()):
        for category in categories:
            if index < len(pools[category]) and len(prompts) < num_prompts:
                prompts.append({"prompt": pools[category][index], "category": category})
        index += 1
    return prompts
