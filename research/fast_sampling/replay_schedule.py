"""Replay recorded vines through the static loop's and the continuous loop's schedules, with a decode step costing
F + c x (rows in the batch): how much can continuous batching win on a machine with that cost line?

    python -m research.fast_sampling.replay_schedule research/fast_sampling/results/continuous-batching/vine-rows-amd-fp32.json --fixed 0.2 --per-row 0.00425

The rows file holds each vine's parent (distinct sequence), budget, prefix length and the tokens it sampled (n): a
row of n tokens takes n - 1 decode steps (its first token comes from its prefix's last hidden state). Schedules:

- static: HFSampler(continuous=False): rows in prefill order (parents by length, then prefix length), batches of B,
  each decoded until its longest row ends; finished rows leave once they are a quarter of the batch.
- continuous: decode_continuous's admission: a freed slot takes the longest-budget row of the parent with the fewest
  rows decoding; when nothing waits, finished rows leave once they are a quarter of the batch.
- budget-first: the longest budget over all parents (ties: the parent with the fewest rows decoding).
- oracle: the longest true length first (longest-processing-time; a scheduler cannot know n in advance).

For each: decode steps, rows x steps (the work), the mean prefix stack per row (decode_attention pads every
parent's rows to the most any parent has: S x R / rows), and the cost F x steps + c x rows x steps in seconds.
The cost line leaves out what depends on context length and the stack padding; it fits the recorded runs within
a few percent (docs/fast-sampling.md).
"""
import argparse
import json


def static_schedule(rows: list[dict], *, B: int) -> list[int]:
    """Batch width at every decode step of the static loop."""
    need = {}
    for r in rows:
        need[r["parent"]] = max(need.get(r["parent"], 0), r["prefix_len"])
    rank = {p: i for i, p in enumerate(sorted(need, key=lambda p: need[p]))}
    order = sorted(rows, key=lambda r: (rank[r["parent"]], r["prefix_len"]))
    widths = []
    for b0 in range(0, len(order), B):
        left = [r["n"] - 1 for r in order[b0:b0 + B]]  # decode steps each row still needs
        alive = [x for x in left]
        while any(alive):
            widths.append(len(alive))
            alive = [x - 1 if x else 0 for x in alive]
            if sum(x == 0 for x in alive) * 4 >= len(alive):
                alive = [x for x in alive if x]
    return widths


def continuous_schedule(rows: list[dict], *, B: int, order: str) -> tuple[list[int], list[int]]:
    """Batch width and prefix stack size (parents x most rows of one parent) at every decode step of the continuous
    loop, admitting rows in `order` (balanced, budget-first or oracle: the module's docstring)."""
    queues = {}
    for r in sorted(rows, key=lambda r: (-r["n"],) if order == "oracle" else (-r["budget"], r["prefix_len"])):
        queues.setdefault(r["parent"], []).append(r)
    decoding = {p: 0 for p in queues}
    key = {"balanced": lambda p: (decoding[p], -queues[p][0]["budget"]),
           "budget-first": lambda p: (-queues[p][0]["budget"], decoding[p]),
           "oracle": lambda p: (-queues[p][0]["n"], decoding[p])}[order]
    batch, widths, stacks = [], [], []  # batch[slot]: [steps left, parent] or None (free)
    while True:
        free = [s for s, x in enumerate(batch) if x is None] + list(range(len(batch), B))
        while free and (ready := [p for p in queues if queues[p]]):
            r = queues[min(ready, key=key)].pop(0)
            if r["n"] > 1:  # a one-token row ends at its admission
                slot = free.pop(0)
                batch[slot:slot + 1] = [[r["n"] - 1, r["parent"]]]
                decoding[r["parent"]] += 1
        live = [x for x in batch if x is not None]
        if not live:
            return widths, stacks
        if (len(batch) - len(live)) * 4 >= len(batch):
            batch = live
        per_parent = {}
        for _, p in live:
            per_parent[p] = per_parent.get(p, 0) + 1
        widths.append(len(batch))
        stacks.append(len(per_parent) * max(per_parent.values()))
        for s, x in enumerate(batch):
            if x is not None:
                x[0] -= 1
                if x[0] == 0:
                    decoding[x[1]] -= 1
                    batch[s] = None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", help="a JSON file with a 'rows' list (research/fast_sampling/results/continuous-batching/)")
    parser.add_argument("--fixed", type=float, default=0.2, help="F: seconds of a decode step whatever its width")
    parser.add_argument("--per-row", type=float, default=0.00425, help="c: seconds a decode step costs per row")
    parser.add_argument("--batch", type=int, default=256, help="B: decode slots (--gen-batch-size)")
    args = parser.parse_args()
    if args.fixed < 0 or args.per_row <= 0 or args.batch < 1:
        raise SystemExit("error: --fixed must be >= 0, --per-row > 0 and --batch >= 1")
    try:
        with open(args.rows) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: {args.rows}: not a rows file ({e})")
    cost = lambda widths: args.fixed * len(widths) + args.per_row * sum(widths)
    static = static_schedule(rows, B=args.batch)
    print(f"{len(rows)} rows, {sum(r['n'] for r in rows)} tokens; step cost {args.fixed * 1e3:.0f} ms + "
          f"{args.per_row * 1e3:.2f} ms/row, B = {args.batch}")
    print(f"static: {len(static)} steps, {sum(static)} rows x steps, {cost(static):.1f} s")
    for order in ("balanced", "budget-first", "oracle"):
        widths, stacks = continuous_schedule(rows, B=args.batch, order=order)
        print(f"continuous {order}: {len(widths)} steps, {sum(widths)} rows x steps, prefix stack / rows "
              f"{sum(stacks) / sum(widths):.2f}, {cost(widths):.1f} s, static / this {cost(static) / cost(widths):.2f}")


if __name__ == "__main__":
    main()
