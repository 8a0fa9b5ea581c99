"""Random baselines of the gui suite's grid layout with cell actions (`grid=`, `actions=cell`):
the success a learning run must beat, on held-out tasks, played through the real adapter.

    python benchmarks/gui_random.py [--episodes 500] [--grids 2x2,3x3] [--icons 2,3,4]
                                    [--slacks default,0] [--turns 1] [--screen 320x200]

Each setting is `width=W height=H grid=G icons=I actions=cell min_turns=T max_turns=T`
plus `slack=S` (S=default leaves the suite's budget, 2 * oracle_turns + 2). Its episodes are
the eval split's tasks (tiderl.envs.tasks.TaskSource("gui", "eval"), group_size 1: held-out
seeds task_seed + 2g + 1, one task each), every policy playing the same tasks to the end of
each task's budget:
  random_cell   a uniformly random cell 1..N every turn (never 0, the close reply);
  random_click  the suite's `random_action`: a uniform click on the screen every turn;
  random_icon   a uniformly random cell that holds an icon every turn (it reads the screen
                but not the task: what a policy that has learned to see icons, and no more,
                gets);
  random_bytes  two uniformly random bytes (0-255, read as Latin-1) every turn: an untrained
                byte-level policy with 2 action tokens (configs/vlm-smoke.yaml's
                rollout.max_action_tokens), its special tokens left out; its valid replies are
                the ones with a digit of a cell;
  oracle        the scripted solver's replies (`oracle_action`, digits under actions=cell).
Success is the fraction of episodes with reward 1 (as a run's evaluation counts it), with its
standard error. The last line is one JSON object: {setting: {policy: success}}.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from tiderl.envs.adapters.gui import GuiDesktop, random_action  # noqa: E402
from tiderl.envs.tasks import TaskSource  # noqa: E402

POLICIES = ("random_cell", "random_click", "random_icon", "random_bytes", "oracle")


def options(grid: str, icons: int, slack: str, turns: int,
            screen: str = "320x200") -> dict[str, str]:
    width, height = screen.lower().split("x")
    o = {"width": width, "height": height, "grid": grid, "icons": str(icons), "actions": "cell",
         "min_turns": str(turns), "max_turns": str(turns)}
    if slack != "default":
        o["slack"] = slack
    return o


def reply(adapter: GuiDesktop, policy: str, rng: random.Random) -> str:
    if policy == "random_cell":
        return str(rng.randint(1, adapter.cells))
    if policy == "random_click":
        return random_action(rng, adapter.width, adapter.height)
    if policy == "random_icon":
        assert adapter.desk is not None
        return str(rng.choice([icon.cell for icon in adapter.desk.icons]))
    if policy == "random_bytes":
        return bytes(rng.randrange(256) for _ in range(2)).decode("latin-1")
    return adapter.oracle_action()


def play(adapter: GuiDesktop, task: dict, policy: str, rng: random.Random) -> bool:
    adapter.reset(task)
    while not adapter.step(reply(adapter, policy, rng)).done:
        pass
    reward, info = adapter.close()
    assert (reward == 1.0) == info["success"]
    return bool(info["success"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=500)
    ap.add_argument("--grids", default="2x2,3x3")
    ap.add_argument("--icons", default="2,3,4")
    ap.add_argument("--slacks", default="default,0")
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--task-seed", type=int, default=0)
    ap.add_argument("--screen", default="320x200", help="WIDTHxHEIGHT of the screen")
    args = ap.parse_args()
    source = TaskSource("gui", "eval", groups=args.episodes, group_size=1,
                        task_seed=args.task_seed)
    tasks = [source[g]["tasks"][0] for g in range(args.episodes)]
    out: dict[str, dict[str, float]] = {}
    for grid in args.grids.split(","):
        for icons in map(int, args.icons.split(",")):
            for slack in args.slacks.split(","):
                opts = options(grid, icons, slack, args.turns, args.screen)
                adapter = GuiDesktop(opts)
                name = " ".join(f"{k}={v}" for k, v in opts.items())
                t0 = time.perf_counter()
                rates = {}
                for policy in POLICIES:
                    rng = random.Random(12345)
                    wins = sum(play(adapter, t, policy, rng) for t in tasks)
                    rates[policy] = wins / len(tasks)
                budget = adapter.budget
                shown = "  ".join(
                    f"{p} {r:.3f}±{math.sqrt(r * (1 - r) / len(tasks)):.3f}"
                    for p, r in rates.items())
                print(f"{name} (budget {budget}): {shown}  [{time.perf_counter() - t0:.1f} s]",
                      flush=True)
                out[name] = {**rates, "budget": budget, "episodes": len(tasks)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
