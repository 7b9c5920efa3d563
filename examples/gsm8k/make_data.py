"""A small GSM8K-style data set made here, so that the example needs no download: word problems of one to four
arithmetic steps with GSM8K's two columns, `question` and `answer`, the answer written as GSM8K writes it (one worked
line per step, each calculation annotated `<<a*b=c>>`, then a last line `#### N`).

    python examples/gsm8k/make_data.py            # writes train.jsonl and test.jsonl beside this file
    python examples/gsm8k/make_data.py --check    # exit 1 if the committed files differ from what it makes

The rows are drawn from one seeded `random.Random`, so the files are the same on every machine and Python version.
Every question is distinct, and the test split holds none of the training questions: a held-out score measures
problems the model has not trained on. The real GSM8K has the same columns (docs/gsm8k-example.md loads it by name).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 53
NUM_TRAIN = 400
NUM_TEST = 100

NAMES = ["Ava", "Ben", "Carlos", "Dina", "Elif", "Farid", "Grace", "Hugo", "Imani", "Jonas", "Keiko", "Liam", "Maya",
         "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tariq"]
ITEMS = ["apples", "pencils", "stickers", "cookies", "marbles", "books", "cards", "shells"]


def _one_step(rng: random.Random) -> tuple[str, list[str], int]:
    """Addition: two amounts bought on two days."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(5, 90), rng.randint(5, 90)
    c = a + b
    question = (f"{name} buys {a} {item} on Monday and {b} {item} on Tuesday. "
                f"How many {item} does {name} buy in the two days?")
    return question, [f"{name} buys {a} + {b} = <<{a}+{b}={c}>>{c} {item} in the two days."], c


def _two_steps(rng: random.Random) -> tuple[str, list[str], int]:
    """Multiplication, then subtraction: packs bought, some given away."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    packs, per_pack = rng.randint(2, 12), rng.randint(3, 15)
    total = packs * per_pack
    given = rng.randint(1, total - 1)
    left = total - given
    question = (f"{name} buys {packs} packs of {item} with {per_pack} {item} in each pack. "
                f"{name} gives {given} {item} to friends. How many {item} does {name} have left?")
    lines = [f"{name} buys {packs} * {per_pack} = <<{packs}*{per_pack}={total}>>{total} {item}.",
             f"{name} has {total} - {given} = <<{total}-{given}={left}>>{left} {item} left."]
    return question, lines, left


def _three_steps(rng: random.Random) -> tuple[str, list[str], int]:
    """Money: an hourly wage over hours and days, minus what is spent."""
    name = rng.choice(NAMES)
    wage, hours, days = rng.randint(8, 30), rng.randint(2, 8), rng.randint(2, 6)
    daily = wage * hours
    earned = daily * days
    spent = rng.randint(1, earned - 1)
    left = earned - spent
    question = (f"{name} earns ${wage} an hour and works {hours} hours a day for {days} days. "
                f"{name} then spends ${spent} on a bike. How much money does {name} have left?")
    lines = [f"{name} earns {wage} * {hours} = $<<{wage}*{hours}={daily}>>{daily} a day.",
             f"In {days} days {name} earns {daily} * {days} = $<<{daily}*{days}={earned}>>{earned}.",
             f"After the bike {name} has {earned} - {spent} = $<<{earned}-{spent}={left}>>{left} left."]
    return question, lines, left


def _four_steps(rng: random.Random) -> tuple[str, list[str], int]:
    """Two products, their sum, shared equally (a division with no remainder)."""
    divisors = []
    while not divisors:  # a prime total cannot be shared: drawn again
        boxes_a, per_a = rng.randint(2, 9), rng.randint(4, 20)
        boxes_b, per_b = rng.randint(2, 9), rng.randint(4, 20)
        apples, oranges = boxes_a * per_a, boxes_b * per_b
        total = apples + oranges
        divisors = [d for d in range(2, 13) if total % d == 0]
    sharers = rng.choice(divisors)
    each = total // sharers
    question = (f"A school orders {boxes_a} boxes of apples with {per_a} apples in each box and {boxes_b} boxes of "
                f"oranges with {per_b} oranges in each box. The fruit is shared equally among {sharers} classes. "
                "How many pieces of fruit does each class get?")
    lines = [f"The school orders {boxes_a} * {per_a} = <<{boxes_a}*{per_a}={apples}>>{apples} apples.",
             f"It orders {boxes_b} * {per_b} = <<{boxes_b}*{per_b}={oranges}>>{oranges} oranges.",
             f"That is {apples} + {oranges} = <<{apples}+{oranges}={total}>>{total} pieces of fruit.",
             f"Each class gets {total} / {sharers} = <<{total}/{sharers}={each}>>{each} pieces of fruit."]
    return question, lines, each


TEMPLATES = (_one_step, _two_steps, _three_steps, _four_steps)


def make_rows(seed: int = SEED, num_train: int = NUM_TRAIN, num_test: int = NUM_TEST) -> tuple[list[dict], list[dict]]:
    """The two splits, as lists of {"question", "answer"} rows.

    Args:
        seed: the seed of the one random.Random every row is drawn from.
        num_train, num_test: rows per split; the templates take turns, so each split has each number of steps.

    Returns:
        (train, test): distinct questions, none of them in both splits."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < num_train + num_test:
        template = TEMPLATES[len(rows) % len(TEMPLATES)]
        question, lines, result = template(rng)
        if question in seen:  # a repeated draw: drawn again, so no question is in both splits (or twice in one)
            continue
        seen.add(question)
        rows.append({"question": question, "answer": "\n".join(lines + [f"#### {result}"])})
    return rows[:num_train], rows[num_train:]


def jsonl_text(rows: list[dict]) -> str:
    """The rows as JSON Lines, one object per line, keys in the order question, answer."""
    return "".join(json.dumps(row, ensure_ascii=True) + "\n" for row in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    options = parser.parse_args(argv)
    train, test = make_rows()
    differ = []
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        path = HERE / name
        text = jsonl_text(rows)
        if options.check:
            if not path.exists() or path.read_text() != text:
                differ.append(str(path))
        else:
            path.write_text(text)
            print(f"wrote {len(rows)} rows to {path}")
    if differ:
        print(f"differ from what make_data.py makes: {', '.join(differ)} (run python {__file__} to remake them)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
