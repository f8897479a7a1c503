"""The continuous decode loop (HFSampler(continuous=True), the default): a full decode batch until the last row.

The static loop (engine/static.py) decodes fixed batches: a row that ends leaves, no row takes its place, and each
batch runs at shrinking width until its longest row ends (vines differ a lot in length: a state-0 vine writes the
whole answer, a last-state vine one line). Here, as in vLLM's scheduler, rows are admitted as others finish:

- Rows wait in queues, one per distinct sequence (parent), each row a state's prefix, its budget and its noise key.
  A free slot takes the next row of the parent with the fewest rows decoding (decode_attention pads every parent's
  rows to the most any parent has: balanced, the padding is small), and in each parent the longest budget first
  (a state-0 vine has the most left to write): the long rows start early, the batch's last steps go to short ones.
- The pool: the prefill cache of up to P parents at the width W of the longest one, P x W about group_tokens (the
  static loop's bound on one prefill group, rounded up to whole parents). A parent is prefilled into a free place
  as soon as one of its rows is queued, ahead of the decode slots' need; once no queued or decoding row continues
  it, it stays until its place is needed by another. When every parent fits (a default CPU iteration's 16
  responses do), each is prefilled once per call, however many rounds of vines its states get; otherwise parents
  are served P at a time, in prefill order, and one whose rows come back after it left is prefilled again.
- The decode batch: B slots of the suffix cache. A slot freed by a finished row is refilled at the next step by the
  best queued row of a placed parent. Its first token comes from its prefix's last hidden state, drawn before it
  is admitted: once a parent is in the pool, the first tokens of all its queued rows are drawn together, up to B
  rows per pass of lm_head (first_tokens), not a pass per step for the few rows a step admits. Its suffix starts
  empty (what the slot's last row left is masked: decoding.suffix_layout), its step at 0 and its positions at its
  prefix length + its own step. Its noise (seed, key, its own step, token), and so its tokens in
  fp32, do not depend on what shares its batch or when it started. When nothing can be admitted, finished rows
  leave once they are a quarter of the batch, as in the static loop.
- Rows of different ages share the batch: every resort_every steps they are sorted oldest first (sort_by_age), so
  that each block of suffix_block slots reads its suffix only as far as its own oldest row (decoding.suffix_layout).
- When a request's rows are all done, on_done(request, samples) is called at once; the requests it returns join the
  queues in the same step (values.py: a state's next round of vines, with no barrier).

decode_continuous runs the loop; it takes the Workspace (engine/workspace.py: the model, its caches, prefill, timing),
the StopRule (engine/rows.py) and its own settings as keywords. The rest are its steps: enqueue, to_prefill,
first_tokens, next_row, draw, record_finished (with finish), sort_by_age.

Shapes: B = decode slots, b = rows sampled together (those just admitted, or the live ones), P = pool places,
W = pool width, V = vocab, hidden = the model's width, L = layers, Hkv = KV heads, Ws = the longest budget,
D = head dim.
"""
import heapq
import math
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from engine.decoding import decode_attention, decoder_forward, next_tokens, prefix_layout, suffix_layout
from engine.rows import StopRule, distinct_sequences, show_progress
from engine.workspace import Workspace, prefix_ends
from sampling import Request


@dataclass
class Row:
    state: int
    parent: int
    prefix_len: int
    budget: int
    seed: int
    key: int  # state * n + j: row j of its request
    request: int  # its request's number in Schedule.open
    index: int  # j
    place: int = -1  # its parent's place in the pool, from its admission on
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    done: bool = False


@dataclass
class Schedule:
    """The continuous loop's bookkeeping: what waits, what is prefilled, what is still open."""
    parent_of: list[int]  # state -> parent
    rank: list[int]  # parent -> its place in prefill order (by length)
    window: int  # P: parents the pool holds
    queues: list[list]  # parent -> heap of (priority, request number, j, Row)
    place: dict = field(default_factory=dict)  # parent -> its place in the pool
    free: list = field(default_factory=list)  # places no parent has taken yet
    users: list = field(default_factory=list)  # parent -> its rows queued or decoding
    open: dict = field(default_factory=dict)  # request number -> [request, rows not done, samples]
    made: int = 0  # requests so far
    rows: int = 0  # rows so far


def enqueue(schedule: Schedule, requests: list[Request], *, prefix_lens, budgets):
    """Queue every row of `requests`, longest budget first within a window of P parents (prefill order)."""
    for request in requests:
        number, p = schedule.made, schedule.parent_of[request.state]
        schedule.made += 1
        schedule.open[number] = [request, request.n, [None] * request.n]
        schedule.users[p] += request.n
        schedule.rows += request.n
        for j in range(request.n):
            row = Row(state=request.state, parent=p, prefix_len=prefix_lens[request.state],
                      budget=budgets[request.state], seed=request.seed, key=request.state * request.n + j,
                      request=number, index=j)
            priority = (schedule.rank[p] // schedule.window, -row.budget, schedule.rank[p], row.prefix_len)
            heapq.heappush(schedule.queues[p], (priority, number, j, row))


def to_prefill(schedule: Schedule) -> list[tuple[int, int]]:
    """(parent, place) for the parents with queued rows that are not in the pool, best first: into a free place,
    else into the place of a parent that no queued or decoding row continues (it leaves the pool)."""
    waiting = sorted([p for p, queue in enumerate(schedule.queues) if queue and p not in schedule.place],
                     key=lambda p: schedule.queues[p][0][:3])
    idle = sorted(p for p in schedule.place if schedule.users[p] == 0)
    out = []
    for p in waiting:
        if not schedule.free and not idle:
            break
        out.append((p, schedule.free.pop(0) if schedule.free else schedule.place.pop(idle.pop(0))))
    return out


def next_row(schedule: Schedule) -> Row | None:
    """The next row to decode, taken off its queue: of the parents in the pool (in the first window), the one with
    the fewest rows decoding, its best row. None if no queued row's parent is in the pool."""
    ready = [p for p in schedule.place if schedule.queues[p]]
    if not ready:
        return None
    decoding = {p: schedule.users[p] - len(schedule.queues[p]) for p in ready}
    best = min(ready, key=lambda p: (schedule.queues[p][0][0][0], decoding[p], schedule.queues[p][0][:3]))
    return heapq.heappop(schedule.queues[best])[-1]


def finish(schedule: Schedule, row: Row, sample, *, on_done) -> list[Request]:
    """Record a finished row; if it was its request's last, hand the request's samples to on_done and return the
    requests that it asks for next."""
    schedule.users[row.parent] -= 1
    entry = schedule.open[row.request]
    entry[1] -= 1
    entry[2][row.index] = sample
    if entry[1]:
        return []
    del schedule.open[row.request]
    return on_done(entry[0], entry[2])


def draw(work: Workspace, rows: list[Row], hidden: torch.Tensor, *, temperature, top_p) -> None:
    """Sample each row's next token from its hidden state (b, hidden), at its own step, and append it (and its
    log-prob) to the row; nothing else."""
    device, V = hidden.device, work.vocab
    logits = work.buffer("logits", (len(rows), V))  # (b, V), refilled every step
    scratch = work.buffer("logits_fp32", (min(len(rows), 64), V), dtype=torch.float32)  # (chunk, V) sampling
    tokens, logprobs = next_tokens(work.model, hidden, rows=torch.tensor([r.key for r in rows], device=device),
                                   seed=torch.tensor([r.seed for r in rows], device=device),
                                   step=torch.tensor([len(r.ids) for r in rows], device=device),
                                   temperature=temperature, top_p=top_p, logits=logits, scratch=scratch)  # (b,), (b,)
    for row, token, logp in zip(rows, tokens.tolist(), logprobs.tolist()):
        row.ids.append(token)
        row.logprobs.append(logp)


def record_finished(stop: StopRule, schedule: Schedule, rows: list[Row], *, on_done, prefix_lens, budgets, bar):
    """Rows that have just got a token: those that finish are recorded, and the requests their on_done asks for
    are queued."""
    finished = 0
    for row in rows:
        if stop.finished(row.ids, row.budget):
            row.done, finished = True, finished + 1
            sample = stop.cut(row.ids, row.logprobs, row.budget)
            enqueue(schedule, finish(schedule, row, sample, on_done=on_done), prefix_lens=prefix_lens,
                    budgets=budgets)
    bar.total = schedule.rows
    show_progress(bar, tokens=len(rows), rows=finished)


def first_tokens(work: Workspace, schedule: Schedule, cache: dict, *, chunk: int, temperature, top_p):
    """Draw the first token of every queued row whose parent is in the pool and that has none yet, from its prefix's
    last hidden state, `chunk` rows per pass of lm_head: a few passes for all K vines of all states, rather than
    one per decoding step that admits rows. A row's first token depends only on that state and its noise (seed,
    key, step 0), so drawing it early changes nothing but the count of passes."""
    todo = [entry[-1] for p in schedule.place for entry in schedule.queues[p] if not entry[-1].ids]
    for i in range(0, len(todo), chunk):
        rows = todo[i:i + chunk]
        places = [schedule.place[r.parent] for r in rows]
        hidden = prefix_ends(cache, places, [r.prefix_len for r in rows])  # (b, hidden) each prefix's last position
        draw(work, rows, hidden, temperature=temperature, top_p=top_p)


def sort_by_age(batch: list[Row], suffix_keys: torch.Tensor, suffix_values: torch.Tensor) -> list[Row]:
    """The batch reordered oldest row first, its suffix cache slots moved with it (in place, one cycle of the
    permutation at a time, each row's own columns only): consecutive slots then hold rows of similar age, so that
    decoding.suffix_layout's blocks read few columns past their rows' own."""
    order = sorted(range(len(batch)), key=lambda b: -len(batch[b].ids))  # new slot j <- old slot order[j]
    seen = [False] * len(batch)
    for j in range(len(batch)):
        if seen[j] or order[j] == j:
            seen[j] = True
            continue
        n = len(batch[j].ids)
        keep_k, keep_v = suffix_keys[:, j, ..., :n].clone(), suffix_values[:, j, :, :n].clone()  # slot j's row
        k = j
        while order[k] != j:
            seen[k], n = True, len(batch[order[k]].ids)
            suffix_keys[:, k, ..., :n], suffix_values[:, k, :, :n] = suffix_keys[:, order[k], ..., :n], \
                suffix_values[:, order[k], :, :n]
            k = order[k]
        seen[k], n = True, keep_k.shape[-1]
        suffix_keys[:, k, ..., :n], suffix_values[:, k, :, :n] = keep_k, keep_v
    return [batch[b] for b in order]


def decode_continuous(work: Workspace, stop: StopRule, *, sequences, prefix_lens, budgets, requests: list[Request],
                      on_done, temperature, top_p, bar, batch_size: int, group_tokens: int, reuse_prefixes: bool,
                      resort_every: int, suffix_block: int):
    """Sample `requests` (and whatever on_done adds) with continuous batching: see the module's docstring. Settings:
    batch_size decode slots; a pool of ~group_tokens prefilled tokens; reuse_prefixes (False: every state its own
    parent); rows sorted by age every resort_every steps (0: never); suffix read in blocks of suffix_block slots."""
    if not requests:
        return
    parent_of, parents, need = distinct_sequences(sequences, prefix_lens, states=list(range(len(sequences))),
                                                  reuse=reuse_prefixes)
    order = sorted(range(len(parents)), key=lambda p: need[p])
    rank = [0] * len(parents)
    for r, p in enumerate(order):
        rank[p] = r
    W = max(need)
    P = min(len(parents), max(1, math.ceil(group_tokens / W)))
    schedule = Schedule(parent_of=[parent_of[i] for i in range(len(sequences))], rank=rank, window=P,
                        queues=[[] for _ in parents], free=list(range(P)), users=[0] * len(parents))
    enqueue(schedule, requests, prefix_lens=prefix_lens, budgets=budgets)
    G = work.heads_per_kv
    B = min(batch_size, schedule.rows)  # slots: no more than the first requests' rows (in vine_rewards a
    # state has one round in flight at a time, so its later rounds never have more rows in flight than the first)
    cache = work.prefix_cache(P, W)
    suffix_keys, suffix_values = work.suffix_cache(B, max(budgets))  # (L, B, Hkv, D, Ws), (L, B, Hkv, Ws, D)
    sample = partial(draw, work, temperature=temperature, top_p=top_p)
    record = partial(record_finished, stop, schedule, on_done=on_done, prefix_lens=prefix_lens, budgets=budgets,
                     bar=bar)
    batch, layout, device = [], None, cache["keys"].device  # batch[b]: the row in slot b of the suffix cache
    started, prefill_before = time.perf_counter(), work.timing["prefill_s"]
    steps = 0
    while True:
        # 1. Admit: prefill the parents of waiting rows into free places, draw the first token of their queued rows
        #    (first_tokens), then fill free slots. Rows that finish at their first token free their slot again.
        changed, admitted = False, True
        while admitted:
            if new_parents := to_prefill(schedule):
                work.prefill([parents[p][:need[p]] for p, _ in new_parents], cache=cache,
                             places=[place for _, place in new_parents])  # its seconds go to timing["prefill_s"]
                schedule.place.update(new_parents)
            admitted, free = [], [b for b, row in enumerate(batch) if row.done] + list(range(len(batch), B))
            if free:
                first_tokens(work, schedule, cache, chunk=B, temperature=temperature, top_p=top_p)
            for b in free:
                if (row := next_row(schedule)) is None:
                    break
                row.place = schedule.place[row.parent]
                batch[b:b + 1] = [row]  # replaces slot b, or appends at b == len(batch)
                admitted.append(row)
            if admitted:
                changed = True
                record(admitted)
        live = [b for b, row in enumerate(batch) if not row.done]
        if not live:
            if any(schedule.queues):
                raise RuntimeError("continuous batching: rows are queued but none can be admitted")
            break
        # 2. Finished rows that no queued row replaces leave once they are a quarter of the batch (in place).
        if (len(batch) - len(live)) * 4 >= len(batch):
            for new, old in enumerate(live):
                if new != old:
                    suffix_keys[:, new], suffix_values[:, new] = suffix_keys[:, old], suffix_values[:, old]
            batch, live, changed = [batch[b] for b in live], list(range(len(live))), True
        steps += 1
        if resort_every and steps % resort_every == 0:
            batch, changed = sort_by_age(batch, suffix_keys, suffix_values), True
            live = [b for b, row in enumerate(batch) if not row.done]
        if changed:
            layout = prefix_layout(slots=[r.place for r in batch], lens=[r.prefix_len for r in batch], cache=cache,
                                   heads_per_kv=G)
        # 3. One step for every slot (a finished row not yet replaced repeats its last step; its output is unused).
        ids = torch.tensor([[r.ids[-1]] for r in batch], device=device)  # (B, 1)
        positions = torch.tensor([[r.prefix_len + len(r.ids) - 1] for r in batch], device=device)  # (B, 1)
        attend = partial(decode_attention, prefix=layout, prefix_keys=cache["keys"], prefix_values=cache["values"],
                         suffix_keys=suffix_keys[:, :len(batch)], suffix_values=suffix_values[:, :len(batch)],
                         suffix=suffix_layout([len(r.ids) - 1 for r in batch], device=device,
                                              block=suffix_block))
        hidden = decoder_forward(work.model, ids=ids, positions=positions, attend=attend)[:, -1]  # (B, hidden)
        live_rows = [batch[b] for b in live]
        sample(live_rows, hidden[live] if len(live) < len(batch) else hidden)
        record(live_rows)
    work.timing["decode_s"] += time.perf_counter() - started - (work.timing["prefill_s"] - prefill_before)
