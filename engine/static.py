"""The static decode loop (HFSampler(continuous=False)): fixed batches; a row that ends leaves, no row takes its place.

- decode_static: one pass per round of requests; the requests that on_done returns wait for the next pass (one
  prefill per pass): rounds with a barrier.
- static_pass: the pass's distinct sequences (parents) prefilled in groups of ~group_tokens tokens, shortest first,
  each group's rows decoded in batches of batch_size.
- decode_batch: one batch, at shrinking width until its longest row ends: finished rows leave once they are a quarter
  of the batch, and the batch regroups in place.

Every row keeps its prefix in the prefill cache and only its own new tokens in the suffix cache; its noise is a hash of
(seed, row key, step, token), so its tokens do not depend on what shares its batch (engine/decoding.py).

Shapes: B = rows in a batch, L = layers, Hkv = KV heads, D = head dim, Ws = the batch's longest budget, V = vocab,
hidden = the model's width.
"""
import time
from functools import partial

import torch

from engine.decoding import decode_attention, decoder_forward, next_tokens, prefix_layout, suffix_layout
from engine.rows import StopRule, distinct_sequences, show_progress
from engine.workspace import Workspace, prefix_ends, wait_for_device
from sampling import Request, Sample


def decode_static(work: Workspace, stop: StopRule, *, sequences, prefix_lens, budgets, requests: list[Request],
                  on_done, temperature, top_p, bar, batch_size: int, group_tokens: int, reuse_prefixes: bool):
    """Sample `requests`, then what on_done returns for them, pass after pass until it returns nothing."""
    while requests:
        requests = static_pass(work, stop, sequences=sequences, prefix_lens=prefix_lens, budgets=budgets,
                               requests=requests, on_done=on_done, temperature=temperature, top_p=top_p, bar=bar,
                               batch_size=batch_size, group_tokens=group_tokens, reuse_prefixes=reuse_prefixes)
        bar.total += sum(r.n for r in requests)


def static_pass(work: Workspace, stop: StopRule, *, sequences, prefix_lens, budgets, requests: list[Request], on_done,
                temperature, top_p, bar, batch_size: int, group_tokens: int, reuse_prefixes: bool) -> list[Request]:
    """The static loop over `requests`: their distinct sequences prefilled in groups of ~group_tokens, each
    group's rows decoded in batches of batch_size. Returns what on_done returns for them, to be the next pass."""
    parent_of, parents, need = distinct_sequences(sequences, prefix_lens, states=[r.state for r in requests],
                                                  reuse=reuse_prefixes)
    order = sorted(range(len(parents)), key=lambda p: need[p])  # similar lengths prefill and decode together
    rank = {p: r for r, p in enumerate(order)}
    rows = sorted(((parent_of[r.state], prefix_lens[r.state], budgets[r.state], r.state * r.n + j, r.seed,
                    number, j) for number, r in enumerate(requests) for j in range(r.n)),
                  key=lambda row: (rank[row[0]], row[1]))
    out = [[None] * r.n for r in requests]
    group_start = 0
    while group_start < len(order):  # groups of parents whose KV caches are held at once
        group, tokens = [], 0
        while group_start + len(group) < len(order) and (not group or tokens < group_tokens):
            group.append(order[group_start + len(group)])
            tokens += need[group[-1]]
        group_start += len(group)
        cache = work.prefill([parents[p][:need[p]] for p in group])
        slot = {p: s for s, p in enumerate(group)}
        group_rows = [row for row in rows if row[0] in slot]
        for start in range(0, len(group_rows), batch_size):
            batch = group_rows[start:start + batch_size]
            samples = decode_batch(work, stop, [(slot[p], L, b, key, seed) for p, L, b, key, seed, _, _ in batch],
                                   cache, temperature=temperature, top_p=top_p, bar=bar)
            for row, sample in zip(batch, samples):
                out[row[5]][row[6]] = sample
    return [more for r, samples in zip(requests, out) for more in on_done(r, samples)]


def decode_batch(work: Workspace, stop: StopRule, batch, cache: dict, *, temperature: float, top_p: float,
                 bar=None) -> list[Sample]:
    """Sample the rows of `batch` = [(slot, prefix length, budget, row key, seed)] (sorted by slot) from a prefilled
    cache. Prefixes stay in the prefill cache; each row's cache holds only the tokens it generates. `bar`, a
    tqdm bar counting rows, gets finished rows and the tokens generated so far after every step."""
    started = time.perf_counter()
    B, G, V = len(batch), work.heads_per_kv, work.vocab
    slots, lens, budgets = [row[0] for row in batch], [row[1] for row in batch], [row[2] for row in batch]
    suffix_keys, suffix_values = work.suffix_cache(B, max(budgets))  # (L, B, Hkv, D, Ws), (L, B, Hkv, Ws, D)
    logits = work.buffer("logits", (B, V))  # (B, V), refilled every step
    scratch = work.buffer("logits_fp32", (min(B, 64), V), dtype=torch.float32)  # (chunk, V) sampling in fp32
    layout = prefix_layout(slots=slots, lens=lens, cache=cache, heads_per_kv=G)
    hidden = prefix_ends(cache, slots, lens)  # (B, hidden)
    positions = torch.tensor(lens, device=hidden.device)  # (B,) the position of each row's first new token
    rows = torch.tensor([row[3] for row in batch], device=hidden.device)  # (B,) row keys
    seeds = torch.tensor([row[4] for row in batch], device=hidden.device)  # (B,)
    alive = list(range(B))  # batch index of each cache row still decoding
    generated, logprobs, finished = [[] for _ in batch], [[] for _ in batch], [False] * B
    wait_for_device(hidden.device)
    work.timing["prefill_s"] += time.perf_counter() - started
    started = time.perf_counter()
    for step in range(max(budgets)):
        tokens, token_logprobs = next_tokens(work.model, hidden, rows=rows, temperature=temperature, top_p=top_p,
                                             seed=seeds, step=step, logits=logits, scratch=scratch)  # (B,), (B,)
        new_tokens, newly_finished = 0, 0
        for c, (token, logp) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
            r = alive[c]
            if not finished[r]:
                generated[r].append(token)
                logprobs[r].append(logp)
                finished[r] = stop.finished(generated[r], budgets[r])
                new_tokens, newly_finished = new_tokens + 1, newly_finished + finished[r]
        done = [finished[r] for r in alive]
        if bar is not None:
            show_progress(bar, tokens=new_tokens, rows=newly_finished)
        if all(done):
            break
        if sum(done) * 4 >= len(done):  # finished rows leave the batch once they are a quarter of it
            keep = [c for c, d in enumerate(done) if not d]
            for new, old in enumerate(keep):  # in place: no fresh GB-sized tensor
                if new != old:
                    suffix_keys[:, new], suffix_values[:, new] = suffix_keys[:, old], suffix_values[:, old]
            suffix_keys, suffix_values = suffix_keys[:, :len(keep)], suffix_values[:, :len(keep)]
            index = torch.tensor(keep, device=hidden.device)
            positions, rows, seeds, tokens = positions[index], rows[index], seeds[index], tokens[index]
            alive = [alive[c] for c in keep]
            layout = prefix_layout(slots=[slots[r] for r in alive], lens=[lens[r] for r in alive], cache=cache,
                                   heads_per_kv=G)
        attend = partial(decode_attention, prefix=layout, prefix_keys=cache["keys"],
                         prefix_values=cache["values"], suffix_keys=suffix_keys, suffix_values=suffix_values,
                         suffix=suffix_layout([step] * len(alive), device=hidden.device))
        hidden = decoder_forward(work.model, ids=tokens[:, None], positions=(positions + step)[:, None],
                                 attend=attend)[:, -1]  # (B, hidden)
    work.timing["decode_s"] += time.perf_counter() - started
    return [stop.cut(ids, lps, b) for ids, lps, b in zip(generated, logprobs, budgets)]
