#!/usr/bin/env python3
"""Writes bench/data/prompt-sensitivity.json, deterministically (fixed seed, no inputs).

"trivial" groups: one instruction spelled with differences that carry no meaning (whitespace,
smart quotes, NBSP, zero-width characters, CRLF, trailing spaces, blank lines); normalization
should map every variant of a group to one text.
"distinct" groups: pairs that differ in meaning (a word, a number, code); normalization must
keep them apart. The last ones sit next to the phrases `full` mode's rewrite rules know
("Don't use markdown tables." is not "Don't use markdown.").
"phrasing" groups: one format instruction worded differently ("Don't use markdown." / "No
markdown."), some variants also with trivial damage; only `full` mode is expected to collapse
them.

Run: python3 bench/data/gen_prompt_sensitivity.py
"""
import json
import os
import random

rng = random.Random(17)

SUBJECTS = ["the report", "this email", "the user's question", "the following text", "the code",
            "the meeting notes", "the article", "the error log", "the product review", "the poem"]
ACTIONS = ["Summarize", "Translate into French", "List the key points of", "Rewrite formally",
           "Find the bugs in", "Give a title for", "Count the names in", "Classify the tone of",
           "Extract the dates from", "Answer questions about"]
TAILS = ["Don't use markdown.", "Keep it under 50 words.", "Use \"bullet points\".",
         "It's for a child.", "Reply in one line.", "Be concise.",
         "Use the term 'latency' as defined.", "Explain each step.\n\nThen give a verdict.",
         "Start with `SELECT *` if needed.", "Number the items."]



def smart_quotes(s):
    out, open_dq = [], True
    for c in s:
        if c == "'":
            out.append("\u2019")
        elif c == '"':
            out.append("\u201c" if open_dq else "\u201d")
            open_dq = not open_dq
        else:
            out.append(c)
    return "".join(out)


def outside_code(f):
    """Applies f only to text outside backtick spans."""
    def g(s):
        parts = s.split("`")
        return "`".join(f(p) if i % 2 == 0 else p for i, p in enumerate(parts))
    return g


VARIANTS = [
    lambda s: "  " + s + "  ",
    outside_code(smart_quotes),
    outside_code(lambda s: s.replace(" ", "\u00a0", 2)),
    outside_code(lambda s: s.replace(" ", " \u200b", 3)),
    lambda s: "\ufeff" + s,
    lambda s: s.replace("\n", "\r\n") + "\r\n",
    lambda s: "\n".join(line + "  " for line in s.split("\n")),
    outside_code(lambda s: s.replace(" ", "   ", 2)),
    lambda s: s.replace("\n\n", "\n\n\n\n") + "\n\n\n",
    outside_code(lambda s: s.replace(" ", "\u3000", 1)),
    outside_code(lambda s: s.replace(" ", "\t", 1)),
]


def base(i):
    a, s, t = ACTIONS[i % 10], SUBJECTS[(i // 10) % 10], TAILS[(i * 7 + i // 10) % 10]
    return f"{a} {s}. {t}"


def trivial_groups(n):
    groups = []
    for i in range(n):
        b = base(i)
        picks = rng.sample(VARIANTS, 4)
        variants = [b] + [v(b) for v in picks]
        # one variant stacks two differences
        variants.append(picks[0](picks[1](b)))
        groups.append(list(dict.fromkeys(variants)))
    return groups


def distinct_groups(n):
    groups = []
    swaps = [("Summarize", "Expand"), ("Don't", "Do"), ("50", "500"), ("French", "German"),
             ("one line", "one page"), ("formally", "casually"), ("`SELECT *`", "`SELECT id`"),
             ("concise", "detailed"), ("child", "lawyer"), ("bugs", "tests")]
    i = 0
    while len(groups) < n:
        b = base(i)
        for old, new in swaps:
            if old in b and len(groups) < n:
                groups.append([b, b.replace(old, new, 1)])
        i += 1
    # code that differs only in whitespace is different code
    groups.append(["Run `a  b` now.", "Run `a b` now."])
    groups.append(["```\nx  = 1\n```", "```\nx = 1\n```"])
    groups.append(['{"a":  "it\u2019s"}', "{\"a\":  \"it's\"}"])
    return groups


PHRASINGS = [
    ["Don't use markdown.", "Do not use markdown.", "No markdown.",
     "Please don't use any markdown formatting.", "Never use markdown."],
    ["Be brief.", "Be concise.", "Keep it short.", "Keep your answer brief.", "Please be succinct."],
    ["Use bullet points.", "Use bullets.", "Answer in bullet points.", "Reply with a bulleted list."],
    ["Respond in JSON.", "Reply with JSON.", "Return JSON only.", "JSON only."],
    ["Don't explain.", "No explanation needed.", "Without any explanation.",
     "Do not explain your answer."],
]

# (a phrase a rule knows, a neighbour with another meaning)
RULE_NEIGHBOURS = [
    ("Don't use markdown.", "Don't use markdown tables."), ("Be brief.", "Be detailed."),
    ("Respond in JSON.", "Respond in YAML."), ("Use bullet points.", "Use numbered points."),
    ("Don't explain.", "Do explain."), ("No markdown.", "Markdown is fine."),
    ("Keep it short.", "Keep it long."), ("Be brief.", "Be brief about the history."),
    ("Don't use markdown.", "Don't use markdown?"),
    ("No explanation needed.", "No explanation needed for the first part."),
]


def subject_sentence(i):
    return f"{ACTIONS[i % 10]} {SUBJECTS[(i // 10) % 10]}."


def phrasing_groups(n):
    groups = []
    for i in range(n):
        lead = subject_sentence(i * 3)
        variants = [f"{lead} {p}" for p in PHRASINGS[i % len(PHRASINGS)]]
        variants.append(VARIANTS[i % len(VARIANTS)](variants[-1]))
        groups.append(list(dict.fromkeys(variants)))
    return groups


def rule_neighbour_groups(n):
    return [[f"{subject_sentence(i * 7)} {a}", f"{subject_sentence(i * 7)} {b}"]
            for i, (a, b) in ((i, RULE_NEIGHBOURS[i % len(RULE_NEIGHBOURS)]) for i in range(n))]


data = {
    "description": "Prompt-sensitivity set: trivial groups should collapse to one "
                   "canonical text under syntax normalization; phrasing groups (one format "
                   "instruction worded differently) under full normalization; distinct groups "
                   "must stay apart in every mode.",
    "trivial": trivial_groups(220),
    "distinct": distinct_groups(60) + rule_neighbour_groups(30),
    "phrasing": phrasing_groups(50),
}
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompt-sensitivity.json")
with open(path, "w", encoding="utf-8") as f:
    json.dump(data, f, ensure_ascii=True, indent=1)
    f.write("\n")
print(path, len(data["trivial"]), len(data["distinct"]), len(data["phrasing"]))
