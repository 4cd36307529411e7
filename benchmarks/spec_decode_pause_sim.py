"""The copy and open sets of ``spec_decode.py`` on a CPU with a GPU's slot cost: what a history
proposer's pauses (``pagoda.spec_decode.pause``) do to its steps where a step with draft slots
costs more than one without.

On a CPU no step waits for a read, so the runner measures a slot cost of about 0 and requests
never pause for it. This fixes ``SlotCost.cost`` at ``--slot-cost`` (an H200's measured value:
``slot_cost.cost`` in a GPU run's results), optionally sets the proposer's ``DraftPause``
``yield_weight``, runs ``spec_decode.py`` with the remaining arguments, and adds to its results
file the pauses taken for the cost and a modeled speed-up: plain steps over steps plus
``slot_cost`` for each step the proposer was asked in (a step with slots costs ``1 +
slot_cost`` plain steps). Greedy tokens do not depend on the cost, so the steps are the GPU's
for the same tokens.

    python benchmarks/spec_decode_pause_sim.py --slot-cost 0.21 [--yield-weight 0.2] -- \\
        --method suffix --prompts copy --batch-size 1 --dtype float32 --max-tokens 128 \\
        --device cpu --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

from pagoda.spec_decode import pause
from pagoda.worker import slot_cost

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slot-cost", type=float, required=True)
    parser.add_argument("--yield-weight", type=float, default=None)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="spec_decode.py's arguments")
    given = sys.argv[1:]
    args = parser.parse_args()
    rest = [a for a in args.rest if a != "--"]
    out = rest[rest.index("--output-json") + 1] if "--output-json" in rest else None
    cost = args.slot_cost
    slot_cost.SlotCost.cost = lambda self, num_reqs: cost  # type: ignore[method-assign]
    pauses = {"cost_pauses": 0, "cost_paused_steps": 0}
    weigh, init = pause.DraftPause._weigh, pause.DraftPause.__init__

    def counted(self, req_ids, num_tokens, cost_now):  # type: ignore[no-untyped-def]
        before = dict(self.resume_at)
        weigh(self, req_ids, num_tokens, cost_now)
        for i, req_id in enumerate(req_ids):
            at = self.resume_at.get(req_id)
            if at is not None and at != before.get(req_id):
                pauses["cost_pauses"] += 1
                pauses["cost_paused_steps"] += at - int(num_tokens[i]) - 1

    def weighted(self, *a, **k):  # type: ignore[no-untyped-def]
        init(self, *a, **k)
        if args.yield_weight is not None:
            self.yield_weight = args.yield_weight

    pause.DraftPause._weigh = counted  # type: ignore[method-assign]
    pause.DraftPause.__init__ = weighted  # type: ignore[method-assign]
    sys.argv = ["spec_decode.py", *rest]
    runpy.run_path(str(HERE / "spec_decode.py"), run_name="__main__")
    if out is None:
        print(json.dumps(pauses))
        return
    result = json.loads(Path(out).read_text())
    steps, asked = result["engine_steps"], result["proposals"]["asked"]
    modeled = steps["off"]["steps"] / (steps["spec"]["steps"] + cost * asked)
    result["pause_sim"] = {
        "slot_cost": cost,
        "yield_weight": args.yield_weight,
        **pauses,
        "modeled_speedup": round(modeled, 3),
    }
    shown = [
        a
        for i, a in enumerate(given)
        if a != "--output-json" and given[i - 1 : i] != ["--output-json"]
    ]
    result["command"] = " ".join(["python benchmarks/spec_decode_pause_sim.py", *shown])
    Path(out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["pause_sim"]))


if __name__ == "__main__":
    main()
