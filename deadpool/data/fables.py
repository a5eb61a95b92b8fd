"""The shipped corpus, ``data/fables.txt``: short fables generated from a small grammar.

``python -m deadpool.data.fables --out data/fables.txt`` writes it; the repository ships the
output, so a fresh machine needs neither a download nor this script, and a test checks the
shipped bytes against a regeneration. The text is the same on every machine: the generator draws
from its own integer PRNG (splitmix64), not from Python's ``random``, and uses nothing that
depends on the platform, locale or Python version. Written for the project, so free of any
licence question.

Each fable is a paragraph (``prepare --documents paragraph``): a cast, a setting, a problem, a
helper, an outcome and a moral, with names and agreements that recur across sentences, so a
model has structure at several ranges to learn and its validation loss falls.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ANIMALS = ["fox", "hare", "crow", "tortoise", "mouse", "lion", "goat", "owl", "frog", "badger",
           "heron", "wolf", "sparrow", "bear", "otter", "beetle", "donkey", "cat", "duck", "ant"]
NAMES = ["Tansy", "Bram", "Odo", "Wren", "Pip", "Marlo", "Ysolde", "Fen", "Corin", "Hazel",
         "Juniper", "Tobin", "Alder", "Bryony", "Quill", "Sorrel", "Ember", "Rook", "Lark", "Moss"]
ADJS = ["clever", "proud", "patient", "greedy", "kind", "lazy", "careful", "boastful", "shy",
        "brave", "hungry", "old", "young", "restless", "honest", "curious"]
PLACES = ["by the river", "at the edge of the wood", "under the old bridge", "on the hill",
          "in the reeds", "beside the mill", "near the orchard", "in a hollow oak",
          "behind the barn", "on the bank of the pond"]
ROUTINES = ["gathered seeds before the sun was high", "counted the clouds", "swept the path",
            "sang to the morning", "walked to the well", "mended its nest", "watched the road",
            "looked for berries"]
PROBLEMS = [("the winter came early", "had stored no food"),
            ("a storm broke the bridge", "could not cross the water"),
            ("the well ran dry", "had nothing to drink"),
            ("a hunter set a trap", "was caught by the leg"),
            ("the river rose in the night", "lost its home"),
            ("a stone rolled onto the path", "could not get home")]
HELPS = ["shared its food", "showed the way", "pulled with all its strength", "kept watch all night",
         "carried the news to the others", "built a raft of sticks", "dug a new channel"]
MORALS = ["Those who help others are helped in turn.", "Slow and steady work is never wasted.",
          "Pride goes before a fall.", "A friend in need is a friend indeed.",
          "It is wise to prepare for hard days.", "Small hands can do great things together.",
          "Greed loses what it has in reaching for more.", "Listen before you boast."]

_M64 = (1 << 64) - 1


class Rng:
    """splitmix64: the same sequence on every machine and Python version."""

    def __init__(self, seed: int):
        self.x = seed & _M64

    def next(self) -> int:
        self.x = (self.x + 0x9E3779B97F4A7C15) & _M64
        z = self.x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)

    def pick(self, xs):
        return xs[self.next() % len(xs)]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def fable(rng: Rng) -> str:
    hero, helper = rng.pick(ANIMALS), rng.pick(ANIMALS)
    while helper == hero:
        helper = rng.pick(ANIMALS)
    name, other = rng.pick(NAMES), rng.pick(NAMES)
    while other == name:
        other = rng.pick(NAMES)
    adj, kind = rng.pick(ADJS), rng.pick(ADJS)
    trouble, result = rng.pick(PROBLEMS)
    good = rng.next() % 3 != 0  # most fables end well
    s = [f"Once there was {_a(adj)} {hero} named {name} who lived {rng.pick(PLACES)}.",
         f"Every morning {name} the {hero} {rng.pick(ROUTINES)}.",
         f"Not far away lived {_a(kind)} {helper} called {other}.",
         f"One year {trouble}, and {name} {result}.",
         f'"What shall I do?" cried {name}.']
    if good:
        s += [f"{other} the {helper} heard the cry and {rng.pick(HELPS)}.",
              f'"Thank you, {other}," said {name}, "I will not forget this."',
              f"From that day the {hero} and the {helper} were friends."]
    else:
        s += [f'"That is no business of mine," said {other} the {helper}, and went away.',
              f"So {name} the {hero} had to manage alone, and it went hard with {name}."]
    s.append(rng.pick(MORALS))
    return " ".join(s)


def generate(num_fables: int = 1500, seed: int = 23) -> str:
    rng = Rng(seed)
    return "\n\n".join(fable(rng) for _ in range(num_fables)) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/fables.txt")
    ap.add_argument("--num-fables", type=int, default=1500)
    a = ap.parse_args(argv)
    text = generate(a.num_fables)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text, encoding="utf-8")
    print(f"wrote {a.out}: {a.num_fables} fables, {len(text.encode()):,} bytes")


if __name__ == "__main__":
    main()
