"""The gui suite's baselines: success rates of a random clicker, a random clicker that also
types the task's words, and the scripted oracle, played through the real adapter.

    python benchmarks/gui_baseline.py [--tasks 500] [--min-turns 1] [--max-turns 8]

Each policy plays the same tasks (env seeds 0..tasks-1, tiderl.envs.adapters.gui.GuiDesktop at
its default 640x400 screen and 6 icons) to the end of each task's budget (2 * oracle turns + 2):
  random_clicks   a uniform click on the screen every turn;
  random_words    as above, but one turn in four types one of the task's own words (the
                  random policy that knows the action format and the words to type);
  oracle          the scripted solver reading the desk's state (must be 1.0).
Success is also split by the task's oracle length. A vision policy must beat random_words.
The last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from tiderl.envs.adapters.gui import GuiDesktop, random_action  # noqa: E402

BUCKETS = ((1, 2), (3, 5), (6, 10), (11, 20), (21, 50))


def play(adapter: GuiDesktop, seed: int, policy: str) -> tuple[bool, int]:
    adapter.reset({"seed": seed})
    rng = random.Random(seed * 31 + 7)
    words = [w for g in adapter.goals for _, w in g[2]] if policy == "random_words" else []
    while True:
        if policy == "oracle":
            action = adapter.oracle_action()
        else:
            action = random_action(rng, adapter.width, adapter.height, words)
        if adapter.step(action).done:
            break
    _, info = adapter.close()
    return bool(info["success"]), int(info["oracle_turns"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=500)
    ap.add_argument("--min-turns", type=int, default=1)
    ap.add_argument("--max-turns", type=int, default=8)
    args = ap.parse_args()
    adapter = GuiDesktop({"min_turns": str(args.min_turns), "max_turns": str(args.max_turns)})
    rates: dict[str, float] = {}
    for policy in ("random_clicks", "random_words", "oracle"):
        results = [play(adapter, seed, policy) for seed in range(args.tasks)]
        rates[policy] = sum(ok for ok, _ in results) / len(results)
        split = []
        for lo, hi in BUCKETS:
            part = [ok for ok, n in results if lo <= n <= hi]
            if part:
                split.append(f"{lo}-{hi} turns: {sum(part) / len(part):.3f} (n={len(part)})")
        print(f"{policy:14s} success {rates[policy]:.3f}   " + "; ".join(split), flush=True)
    print(json.dumps({"tasks": args.tasks, "min_turns": args.min_turns,
                      "max_turns": args.max_turns, **rates}))


if __name__ == "__main__":
    main()
