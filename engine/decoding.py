"""Fast decoding on a CPU, as pure functions: the decoder with a preallocated KV cache, attention that reads a shared
prefix once for all the rows continuing it, and seeded top-p sampling. The decode loops (engine/static.py,
engine/continuous.py) drive them, in fp32 or bf16: weights and the prefill cache in the sampler's dtype; the softmax, the generated tokens' cache and sampling in
fp32.

- decoder_forward runs the model's own modules (Llama family: pre-norm, RoPE, grouped-query attention), with the
  attention step delegated: prefill_attention while prefilling sequences, decode_attention while generating.
- decode_attention splits each row's context in two: its prefix, a *view* of the sequence's prefill cache shared by
  every row that continues it (the K vines of a state, the states of one response), and the few tokens the row
  generated itself; it scores both, then takes one softmax over the joined scores.
- decode_attention also reads each row's own generated tokens from its slot of the suffix cache; rows may be at
  different steps (continuous batching refills a finished row's slot with a new row): suffix_layout says where each
  row writes and how far it reads.
- sample_tokens draws top-p samples with the Gumbel-max trick. Its noise is a hash of (seed, row key, step, token),
  each per row, so a row samples the same tokens whatever else shares its batch and whenever it started (finished
  rows leave, batches regroup, slots are refilled).

Shapes: B = rows, t = new positions, T = prefill length, W = cache width, V = vocab, L = layers, H = query heads,
Hkv = KV heads, G = H / Hkv, D = head dim, k = top-p candidates, S = sequences (prefixes) in a batch, R = rows per
sequence, Wp = prefix columns, Ws = suffix cache width (the longest budget), n = suffix columns read.
"""
import importlib

import torch
import torch.nn.functional as F

from model import nucleus_keep

TOP_K_FIRST = 64  # top-p looks at the 64 likeliest tokens first; rows whose nucleus is wider fall back to a full sort


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic; >> made logical by masking)."""
    x = x + -7046029254386353131  # 0x9E3779B97F4A7C15
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


def per_row(x, rows: torch.Tensor) -> torch.Tensor:
    """(B,) int64: x as one value per row, x an int (shared by every row) or already (B,)."""
    return torch.as_tensor(x, dtype=torch.long, device=rows.device).expand(rows.shape)


def gumbel(*, seed, rows: torch.Tensor, step, token_ids: torch.Tensor) -> torch.Tensor:
    """(B, k) Gumbel noise that depends only on (seed, row key, step, token id); seed and step are ints (the same for
    every row) or (B,) tensors (each row its own: rows of a continuous batch are at different steps)."""
    x = mix64(mix64(mix64(per_row(seed, rows)) ^ rows) ^ per_row(step, rows))[:, None]  # (B, 1)
    u = ((mix64(x ^ token_ids) >> 11) & ((1 << 53) - 1)).double().add(0.5).div(2.0 ** 53)  # (B, k) in (0, 1)
    return -torch.log(-torch.log(u)).float()


def sample_tokens(logits: torch.Tensor, *, temperature: float, top_p: float, seed, rows: torch.Tensor,
                  step) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) next tokens from logits (B, V), greedy at temperature 0, else top-p sampling by the Gumbel-max trick;
    and (B,) their log-probs under the distribution sampled from: softmax(logits / T) renormalised over the top-p
    nucleus (the whole vocabulary at T = 1 when greedy), as vLLM reports them (sampling.py). In fp32 whatever the
    logits' dtype. Only the candidates' log-probs are formed (logit / T - logsumexp), not a (B, V) log-softmax.
    seed, step: ints or (B,) (gumbel)."""
    seed, step = per_row(seed, rows), per_row(step, rows)  # (B,), (B,)
    scaled = logits.float() if temperature in (0, 1) else logits.float() / temperature  # (B, V)
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (B, 1)
    log_mass = torch.zeros(len(scaled), device=scaled.device)  # (B,) log of the nucleus' mass
    if temperature == 0:
        chosen = scaled.argmax(-1)
    elif top_p >= 1:
        ids = torch.arange(scaled.shape[1], device=scaled.device).expand_as(scaled)
        chosen = (scaled + gumbel(seed=seed, rows=rows, step=step, token_ids=ids)).argmax(-1)
    else:
        cand_logits, cand_ids = scaled.topk(min(TOP_K_FIRST, scaled.shape[1]), dim=-1)  # (B, k), likeliest first
        cand_logp = cand_logits - lse  # (B, k)
        wide = cand_logp.exp().sum(-1) < top_p  # (B,) rows whose nucleus needs more than k tokens
        chosen = torch.empty(len(scaled), dtype=torch.long, device=scaled.device)
        if wide.any():  # rare at T = 0.6: sort the whole vocabulary for these rows only
            full_logits, full_ids = scaled[wide].sort(dim=-1, descending=True)  # (b, V)
            chosen[wide], log_mass[wide] = nucleus_pick(full_logits - lse[wide], full_ids, top_p=top_p,
                                                        seed=seed[wide], rows=rows[wide], step=step[wide])
        chosen[~wide], log_mass[~wide] = nucleus_pick(cand_logp[~wide], cand_ids[~wide], top_p=top_p,
                                                      seed=seed[~wide], rows=rows[~wide], step=step[~wide])
    return chosen, (scaled.gather(-1, chosen[:, None]) - lse).squeeze(-1) - log_mass


def next_tokens(model, hidden: torch.Tensor, *, rows: torch.Tensor, seed, step, temperature: float, top_p: float,
                logits: torch.Tensor, scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) tokens sampled from the last hidden states (B, hidden), and their log-probs (B,) (see sample_tokens).
    The logits are written into `logits`, a reused (>= B, V) buffer in the model's dtype: a fresh 50 MB tensor per
    step costs more in page faults than its matmul saves. The temperature divides the hidden state (lm_head has no
    bias), not the (B, V) logits. Sampling goes len(scratch) rows at a time, in fp32: bf16 logits are first copied
    into `scratch`, a reused (chunk, V) fp32 buffer. seed, step: ints or (B,), as in gumbel."""
    seed, step = per_row(seed, rows), per_row(step, rows)  # (B,), (B,)
    if temperature > 0:
        hidden = hidden / temperature
    logits = torch.mm(hidden, model.lm_head.weight.t(), out=logits[:len(hidden)])  # (B, V)
    picks, chunk = [], len(scratch)
    for i in range(0, len(hidden), chunk):
        part = logits[i:i + chunk]  # (chunk, V)
        if part.dtype != torch.float32:
            part = scratch[:len(part)].copy_(part)
        picks.append(sample_tokens(part, temperature=float(temperature > 0), top_p=top_p, rows=rows[i:i + chunk],
                                   seed=seed[i:i + chunk], step=step[i:i + chunk]))
    return torch.cat([tokens for tokens, _ in picks]), torch.cat([logp for _, logp in picks])


def nucleus_pick(sorted_logp, sorted_ids, *, top_p: float, seed, rows, step):
    """Sample among the smallest likeliest-first prefix of tokens whose probability reaches top_p; returns the tokens
    (B,) and the log of that nucleus' mass (B,)."""
    probs = sorted_logp.exp()  # (B, k)
    keep = nucleus_keep(probs, top_p=top_p)  # (B, k) the mass before a kept token is under top_p
    scores = (sorted_logp + gumbel(seed=seed, rows=rows, step=step, token_ids=sorted_ids)).masked_fill(~keep, -1e30)
    chosen = sorted_ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)  # (B,)
    return chosen, (probs * keep).sum(-1).log()


def decoder_forward(model, *, ids, positions, attend) -> torch.Tensor:
    """The decoder's layers on new tokens ids (B, t) at positions (B, t), with attention delegated to
    attend(layer_index, q (B, H, t, D), k, v (B, Hkv, t, D), scale) -> (B, H, t, D), which also stores k and v.
    Returns the final hidden states (B, t, hidden)."""
    inner, cfg = model.model, model.config
    B, t = ids.shape
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    rope = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
    x = inner.embed_tokens(ids)  # (B, t, hidden)
    cos, sin = inner.rotary_emb(x, positions)  # (B, t, D)
    for i, layer in enumerate(inner.layers):
        attn, h = layer.self_attn, layer.input_layernorm(x)
        q = attn.q_proj(h).view(B, t, H, D).transpose(1, 2)  # (B, H, t, D)
        k = attn.k_proj(h).view(B, t, Hkv, D).transpose(1, 2)  # (B, Hkv, t, D)
        v = attn.v_proj(h).view(B, t, Hkv, D).transpose(1, 2)  # (B, Hkv, t, D)
        q, k = rope(q, k, cos, sin)
        o = attend(i, q, k, v, scale=attn.scaling)  # (B, H, t, D)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(B, t, H * D))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return inner.norm(x)


def prefill_attention(layer: int, q, k, v, *, scale: float, keys, values, places, start: int, bias) -> torch.Tensor:
    """Prefill: store k, v (B, Hkv, T, D) at cache columns [start, start + T) of sequences `places` (a slice, or a
    (B,) index tensor: the free places of continuous batching's pool) of keys/values (L, G, Hkv, D, W), stored
    transposed (see decode_attention); attend among the T new positions with bias (B, 1, T, T) (0: allowed, -inf:
    not)."""
    T = q.shape[2]
    keys[layer][places, :, :, start:start + T] = k.transpose(-1, -2)
    values[layer][places, :, :, start:start + T] = v.transpose(-1, -2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def prefix_layout(*, slots: list[int], lens: list[int], cache: dict, heads_per_kv: int) -> dict:
    """How decoding rows read their prefixes from the prefill cache. Row r continues sequence slots[r] after its
    first lens[r] tokens. Rows of the same sequence are stacked, so that sequence's keys and values are read once per
    step for all of them (K vines of a state, and the states of one response, share one cache)."""
    s0, s1, B, W = min(slots), max(slots) + 1, len(slots), cache["width"]
    seq = torch.tensor(slots) - s0  # (B,) each row's sequence in this batch
    counts = torch.bincount(seq, minlength=s1 - s0)  # (S,) rows per sequence
    R = int(counts.max())
    order = torch.argsort(seq, stable=True)  # rows grouped by sequence, in row order within each
    j = torch.empty(B, dtype=torch.long)  # (B,) each row's place among its sequence's rows
    j[order] = torch.arange(B) - (counts.cumsum(0) - counts)[seq[order]]
    gather = torch.full((s1 - s0, R), B)  # (S, R) row of each (sequence, place); B: a dummy all-zero query
    gather[seq, j] = torch.arange(B)
    row_place = seq * R + j  # (B,) each row's place in the flattened (S * R) stack
    starts = W - torch.tensor(cache["lens"][s0:s1])  # (S,) where each sequence starts in the cache
    c0 = int(starts.min())  # no sequence of this batch starts left of c0
    first = (starts - c0)[seq][:, None]  # (B, 1) where each row's sequence starts in the sliced cache
    columns = torch.arange(W - c0)  # (Wp,)
    allowed = torch.zeros(s1 - s0, R, W - c0, dtype=torch.bool)  # (S, R, Wp)
    allowed[:, :, -1] = True  # dummy places attend somewhere, so their softmax stays finite (and is discarded)
    allowed[seq, j] = (columns >= first) & (columns < first + torch.tensor(lens)[:, None])  # each row its prefix
    bias = torch.zeros(allowed.shape, dtype=cache["keys"].dtype).masked_fill_(~allowed, float("-inf"))  # (S, R, Wp)
    num_kv = cache["keys"].shape[2]
    bias = bias[:, None, :, None, :].expand(-1, num_kv, -1, heads_per_kv, -1)  # (S, Hkv, R, G, Wp)
    device = cache["keys"].device
    return {"s0": s0, "s1": s1, "c0": c0, "gather": gather.to(device), "row_place": row_place.to(device),
            "in_order": row_place.tolist() == list(range(B)),
            "bias": bias.reshape((s1 - s0) * num_kv, R * heads_per_kv, -1).to(device)}  # (S * Hkv, R * G, Wp)


def to_sequences(x: torch.Tensor, prefix: dict) -> torch.Tensor:
    """Rows (B, Hkv, G, n) -> sequence-major (S * Hkv, R * G, n): the rows of each sequence stacked, so that one
    batched matmul per (sequence, KV head) serves all of them. Places no row fills are zero."""
    S, R = prefix["gather"].shape
    B, Hkv, G, n = x.shape
    x = torch.cat([x, x.new_zeros(1, Hkv, G, n)])[prefix["gather"]]  # (S, R, Hkv, G, n)
    return x.permute(0, 2, 1, 3, 4).reshape(S * Hkv, R * G, n)


def to_rows(x: torch.Tensor, prefix: dict, Hkv: int) -> torch.Tensor:
    """The inverse of to_sequences: (S * Hkv, R * G, n) -> (B, Hkv, G, n)."""
    S, R = prefix["gather"].shape
    n = x.shape[-1]
    x = x.view(S, Hkv, R, -1, n).permute(0, 2, 1, 3, 4).reshape(S * R, Hkv, -1, n)  # (S * R, Hkv, G, n)
    return x[prefix["row_place"]]


def suffix_layout(steps: list[int], *, device, block: int = 32) -> dict:
    """Where each decoding row keeps its own generated tokens: row r (slot r of the suffix cache) writes this step's
    key/value at column steps[r] (its own step) and reads columns 0..steps[r]; columns past it (a longer row beside
    it, or what an earlier row of the slot left) are masked out with -inf. When every row is at the same step
    (the static loop) there is nothing to mask.
    Rows at different steps (continuous batching) would all read up to the furthest row's step; instead each
    `block` of consecutive slots reads up to its own furthest row's (`blocks`: (first slot, end, columns)), where
    that reads at most 3/4 of the columns one width would (otherwise `blocks` is None: one matmul is cheaper)."""
    width = max(steps) + 1
    at = torch.tensor(steps, device=device)  # (B,)
    bias, blocks = None, None
    if min(steps) != max(steps):
        bias = torch.zeros(len(steps), 1, 1, width, device=device)  # (B, 1, 1, n) n = width
        bias.masked_fill_(torch.arange(width, device=device) > at[:, None, None, None], float("-inf"))
        blocks = [(b, min(b + block, len(steps)), max(steps[b:b + block]) + 1) for b in range(0, len(steps), block)]
        if sum((end - b) * n for b, end, n in blocks) > 0.75 * len(steps) * width:
            blocks = None
    return {"steps": at, "rows": torch.arange(len(steps), device=device), "width": width, "bias": bias,
            "blocks": blocks}


def decode_attention(layer: int, q, k, v, *, scale: float, prefix: dict, prefix_keys, prefix_values, suffix_keys,
                     suffix_values, suffix: dict) -> torch.Tensor:
    """Decoding one token per row (t = 1). Row r attends to its prefix, a view of the prefill cache (never copied),
    and to the tokens it generated itself, kept in its slot of suffix_keys (L, B, Hkv, D, Ws), stored transposed (4x
    faster q.K than (Ws, D) rows here once rows are ~100+ tokens in), and suffix_values (L, B, Hkv, Ws, D), in fp32
    whatever the model's dtype: on this CPU bf16's tiny per-row matmuls run slower than fp32's.
    `suffix` (suffix_layout) gives each row's own step: its new key/value goes to that column, and it reads the
    columns up to it. The prefix cache (L, S, Hkv, D, Wp) is stored transposed: on this CPU both of its batched
    matmuls then run at the speed of reading the cache, 1.25-1.9x faster than on (Wp, D) blocks. The scores of both
    parts are joined for one fp32 softmax; the weights go back to the cache's dtype for the two weighted sums."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    n = suffix["width"]  # suffix columns read: the furthest row's step + 1
    if suffix["bias"] is None:  # every row at step n - 1
        suffix_keys[layer][..., n - 1] = k[:, :, 0]
        suffix_values[layer][:, :, n - 1] = v[:, :, 0]
    else:
        suffix_keys[layer][suffix["rows"], :, :, suffix["steps"]] = k[:, :, 0].to(suffix_keys.dtype)  # (B, Hkv, D)
        suffix_values[layer][suffix["rows"], :, suffix["steps"]] = v[:, :, 0].to(suffix_values.dtype)
    q = q.reshape(B, Hkv, G, D) * scale  # (B, Hkv, G, D): the G query heads sharing a KV head
    S, R = prefix["gather"].shape
    one_each = R == 1 and S == B and prefix["in_order"]  # plain sampling: each row its own sequence, in order
    pk = prefix_keys[layer][prefix["s0"]:prefix["s1"], :, :, prefix["c0"]:].flatten(0, 1)  # (S * Hkv, D, Wp), a view
    pv = prefix_values[layer][prefix["s0"]:prefix["s1"], :, :, prefix["c0"]:].flatten(0, 1)  # (S * Hkv, D, Wp)
    Wp = pk.shape[-1]
    # 1. Scores. Prefixes sequence-major: qp (S * Hkv, R * G, D) against that sequence's keys; then back to rows.
    qp = q.reshape(S * Hkv, G, D) if one_each else to_sequences(q, prefix)
    scores_p = torch.baddbmm(prefix["bias"], qp, pk)  # (S * Hkv, R * G, Wp), masked by the bias
    scores_p = scores_p.view(B, Hkv, G, Wp) if one_each else to_rows(scores_p, prefix, Hkv)  # (B, Hkv, G, Wp)
    sk, sv = suffix_keys[layer][..., :n], suffix_values[layer][:, :, :n]  # (B, Hkv, D, n), (B, Hkv, n, D)
    blocks = suffix.get("blocks")
    if blocks is None:
        scores_s = torch.matmul(q.float(), sk)  # (B, Hkv, G, n)
    else:  # each block of slots reads its own columns; the ones it skips are masked by the bias
        scores_s = q.new_zeros((B, Hkv, G, n), dtype=torch.float32)  # (B, Hkv, G, n)
        for b0, b1, m in blocks:
            scores_s[b0:b1, ..., :m] = torch.matmul(q[b0:b1].float(), sk[b0:b1, ..., :m])  # (b, Hkv, G, m)
    if suffix["bias"] is not None:
        scores_s += suffix["bias"]  # (B, 1, 1, n): each row reads only its own steps
    # 2. One softmax over both parts, in fp32.
    weights = torch.softmax(torch.cat([scores_p.float(), scores_s], -1), dim=-1)  # (B, Hkv, G, Wp + n)
    # 3. Weighted sums: the prefix values sequence-major again (in the cache's dtype), the generated tokens' row by row.
    w_p = weights[..., :Wp].to(pv.dtype)  # (B, Hkv, G, Wp)
    w_p = w_p.reshape(S * Hkv, G, Wp) if one_each else to_sequences(w_p, prefix)  # (S * Hkv, R * G, Wp)
    out_p = torch.bmm(w_p, pv.transpose(1, 2))  # (S * Hkv, R * G, D)
    out_p = out_p.view(B, Hkv, G, D) if one_each else to_rows(out_p, prefix, Hkv)  # (B, Hkv, G, D)
    if blocks is None:
        out = out_p.float() + torch.matmul(weights[..., Wp:], sv)  # (B, Hkv, G, D)
    else:
        out = out_p.float()  # (B, Hkv, G, D)
        for b0, b1, m in blocks:
            out[b0:b1] += torch.matmul(weights[b0:b1, ..., Wp:Wp + m], sv[b0:b1, :, :m])  # (b, Hkv, G, D)
    return out.reshape(B, H, 1, D).to(q.dtype)
