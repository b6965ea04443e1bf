"""Distillation prompts for the tiny drafters: every benchmark's kind of text, none of them an
evaluation or calibration prompt (:func:`distillation_prompts`, used by :mod:`specpilot.tiny.build`).
"""

from __future__ import annotations

import os
import random
import re

from .formats import BOXED_SUFFIX, HUMANEVAL_PREFIX, HUMANEVAL_SUFFIX
from .sources import BENCHMARKS, MBPP_TEST_TASK_IDS, load_source, row_field
from .subsets import calibration_pool, select, training_pairs

# kind -> share of the distillation prompts (sums to 1); see :func:`distillation_prompts`
DISTILL_MIX: dict[str, float] = {"word_maths": 0.3, "code_task": 0.15, "code_completion": 0.2,
                                 "competition_maths": 0.175, "chat": 0.175}
# share of the code_completion and chat prompts given a long context (2-5 solved MBPP functions
# before the stub; 4-10 other instructions before the chat request), as HumanEval's and MT-Bench's
# longer prompts (200-500 tokens of the tiny tokenizer) have: without it the drafters' tau fell to
# ~1.2-1.5 on every prompt longer than ~190 tokens (README, Measured)
DISTILL_LONG: float = 0.5

_MATH_TEMPLATES = (
    "What is the value of ${a}^2 - {b}^2$?",
    "Find the remainder when ${n}$ is divided by ${m}$.",
    "Solve for $x$: ${a}x + {b} = {c}$.",
    "How many positive divisors does ${n}$ have?",
    "Simplify $\\frac{{{n}}}{{{m}}}$.",
    "If $f(x) = {a}x^2 + {b}x + {c}$, what is $f({d})$?",
    "What is the sum of the first ${n}$ positive odd integers?",
    "Compute $\\dbinom{{{a}}}{{{d}}}$.",
    "The sum of two numbers is ${n}$ and their difference is ${b}$. What is the larger number?",
    "Find the greatest common divisor of ${n}$ and ${m}$.",
    "A rectangle has a perimeter of ${n}$ units and a length of ${a}$ units. What is its area, in square units?",
    "What is the smallest positive integer $n$ such that ${a}n \\equiv {b} \\pmod{{{m}}}$?",
    "Evaluate $\\log_{{{d}}} {n}$ to the nearest integer.",
    "The first term of an arithmetic sequence is ${a}$ and the common difference is ${b}$. What is the ${c}$th term?",
    "How many ways are there to choose ${d}$ books from a shelf of ${a}$ different books?",
    "Find the area of a triangle with vertices $(0,0)$, $({a},0)$ and $(0,{b})$.",
)
_CHAT_TEMPLATES = (
    "Write a {adj} {form} about {topic}.",
    "Explain {concept} to a {audience} in a few paragraphs.",
    "Give me {k} tips for {activity}.",
    "Compose an email to your {person} asking for {thing}.",
    "What are the main differences between {concept} and {concept2}?",
    "Describe a {place} you would like to visit and explain why.",
    "Imagine you are a {role}. How would you {task}?",
    "Summarize the advantages and disadvantages of {topic}.",
    "Draft a short speech for {event} that mentions {topic}.",
    "Rewrite the following sentence in a more {adj} tone: \"{topic} is important for everyone.\"",
)
_CHAT_WORDS = {
    "adj": ("engaging", "formal", "friendly", "persuasive", "humorous", "concise", "poetic", "professional"),
    "form": ("blog post", "short story", "poem", "product description", "letter", "news article", "dialogue"),
    "topic": ("a recent trip to the mountains", "renewable energy", "a small bakery", "learning a new language",
              "city gardens", "a rainy weekend", "public libraries", "electric cars", "a school science fair",
              "remote work", "healthy breakfasts", "an old lighthouse"),
    "concept": ("photosynthesis", "inflation", "machine learning", "the water cycle", "compound interest",
                "gravity", "supply and demand", "vaccination", "recycling", "democracy"),
    "concept2": ("respiration", "deflation", "statistics", "the carbon cycle", "simple interest", "magnetism",
                 "taxation", "medication", "composting", "monarchy"),
    "audience": ("child", "high school student", "new employee", "grandparent", "beginner programmer"),
    "activity": ("studying for exams", "saving money", "running a marathon", "public speaking", "cooking rice",
                 "writing a resume", "sleeping better", "planning a trip"),
    "person": ("supervisor", "teacher", "landlord", "colleague", "neighbor", "customer"),
    "thing": ("feedback on a report", "a day off", "a meeting next week", "a reference letter", "help with a move"),
    "place": ("city", "national park", "museum", "island", "village", "market"),
    "role": ("ship captain", "museum guide", "chef", "detective", "teacher", "mayor"),
    "task": ("plan a busy week", "explain your job to a child", "handle an unhappy customer",
             "organize a charity event"),
    "event": ("a graduation", "a wedding", "a team meeting", "a product launch", "a retirement party"),
}


def _math_problem(rng: random.Random) -> str:
    t = rng.choice(_MATH_TEMPLATES)
    v = dict(a=rng.randint(2, 40), b=rng.randint(1, 30), c=rng.randint(3, 99), d=rng.randint(2, 9),
             n=rng.randint(12, 999), m=rng.randint(3, 48))
    return t.format(**v) + BOXED_SUFFIX


def _chat_prompt(rng: random.Random) -> str:
    t = rng.choice(_CHAT_TEMPLATES)
    v = {k: rng.choice(words) for k, words in _CHAT_WORDS.items()}
    return t.format(k=rng.randint(3, 7), **v)


def _stub(row: dict) -> str | None:
    """A HumanEval-style prompt from an MBPP task: the code's first ``def`` line, the task text
    as docstring, its first test as a doctest (None when the code has no top-level def)."""
    code = row.get("code", "").replace("\r\n", "\n")
    m = re.search(r"^def \w+\(.*\)\s*:", code, re.M)
    if not m:
        return None
    doc = f'    """ {row.get("text", "").strip()}\n'
    tests = row.get("test_list") or []
    t = re.match(r"assert\s+(.+?)\s*==\s*(.+)$", tests[0].strip()) if tests else None
    if t:
        doc += f"    >>> {t.group(1)}\n    {t.group(2)}\n"
    return HUMANEVAL_PREFIX + m.group(0).rstrip() + "\n" + doc + '    """\n' + HUMANEVAL_SUFFIX


def distillation_prompts(n: int, rng: random.Random, data_dir: str | os.PathLike | None = None
                         ) -> list[tuple[str, str]]:
    """``n`` (kind, user text) prompts the tiny drafters are distilled on, covering every
    benchmark's kind of text, none of them an evaluation or calibration prompt.

    Kinds and shares (:data:`DISTILL_MIX`; a :data:`DISTILL_LONG` share of the code_completion
    and chat prompts has a long context, :func:`_long_context`): ``word_maths`` = gsm8k train
    questions with the gsm8k suffix; ``code_task`` = MBPP non-test task texts; ``code_completion`` = HumanEval-style
    prompts synthesized from MBPP non-test tasks (:func:`_stub`); ``competition_maths`` =
    MATH-style problems from templates with random numbers, with the boxed suffix;
    ``chat`` = MT-Bench-style instructions from templates. The rows come from
    :func:`training_pairs` (so the held-out texts are already excluded); a synthesized text
    equal to any evaluation or calibration prompt is dropped. Deterministic for a given ``rng``
    state.

    Args:
        n: prompts asked for; rng: the random source (advanced); data_dir: as for
            :func:`~specpilot.prompts.sources.load_rows`.
    Returns:
        (kind, user text) pairs grouped by kind in :data:`DISTILL_MIX` order: at most ``n`` (a
        sampled pool smaller than its share, or a sampled text that is held out, gives fewer).
    Raises:
        SpecpilotError: as :func:`~specpilot.prompts.subsets.training_pairs`.
    """
    pairs = training_pairs(data_dir)
    mbpp_texts = {row_field(r, "text", "mbpp", i) for i, r in enumerate(load_source("mbpp-all", "mbpp", data_dir))
                  if r.get("task_id") not in MBPP_TEST_TASK_IDS}
    word = [u for u, _ in pairs if u.endswith(BOXED_SUFFIX)]
    code = [u for u, _ in pairs if u in mbpp_texts]
    stubs = [s for r in load_source("mbpp-all", "mbpp", data_dir)
             if r.get("task_id") not in MBPP_TEST_TASK_IDS and r.get("text") in set(code)
             for s in [_stub(r)] if s]
    held = {t for b in BENCHMARKS for r in select(b, "all", data_dir=data_dir) for t in r["turns"][:1]}
    held |= {t for b in BENCHMARKS for r in calibration_pool(b, data_dir) for t in r["turns"][:1]}
    counts = {k: int(round(share * n)) for k, share in DISTILL_MIX.items()}
    counts["word_maths"] += n - sum(counts.values())
    out: list[tuple[str, str]] = []
    for kind, k in counts.items():
        if kind == "word_maths":
            texts = rng.sample(word, min(k, len(word)))
        elif kind == "code_task":
            texts = rng.sample(code, min(k, len(code)))
        elif kind == "code_completion":
            texts = rng.sample(stubs, min(k, len(stubs)))
        else:
            make = _math_problem if kind == "competition_maths" else _chat_prompt
            texts = []
            while len(texts) < k:
                t = make(rng)
                if t not in held and t not in texts:
                    texts.append(t)
        out += [(kind, t) for t in texts if t not in held]
    solutions = [r["code"].replace("\r\n", "\n").replace("\t", "    ").strip()
                 for r in load_source("mbpp-all", "mbpp", data_dir)
                 if r.get("task_id") not in MBPP_TEST_TASK_IDS and r.get("code")]
    return _long_context(out, rng, solutions)


def _long_context(prompts: list[tuple[str, str]], rng: random.Random, solutions: list[str]
                  ) -> list[tuple[str, str]]:
    """A :data:`DISTILL_LONG` share of the code_completion and chat prompts with context before
    them: 2-5 solved MBPP non-test functions inside the code block before the stub (a file with
    helpers, as many HumanEval prompts are), 4-10 other chat instructions before the request.
    Context comes only from the distillation pool and MBPP's non-test rows."""
    chats = [t for k, t in prompts if k == "chat"]
    out = list(prompts)
    for i, (kind, text) in enumerate(prompts):
        if kind not in ("code_completion", "chat") or rng.random() >= DISTILL_LONG:
            continue
        n = rng.randint(2, 5) if kind == "code_completion" else rng.randint(4, 10)
        if kind == "code_completion" and solutions and text.startswith(HUMANEVAL_PREFIX):
            ctx = "\n\n\n".join(rng.choice(solutions) for _ in range(n))
            out[i] = (kind, HUMANEVAL_PREFIX + ctx + "\n\n\n" + text[len(HUMANEVAL_PREFIX):])
        elif kind == "chat" and len(chats) > 1:
            ctx = [c for c in (rng.choice(chats) for _ in range(n)) if c != text]
            out[i] = (kind, "\n\n".join(ctx + [text]))
    return out
