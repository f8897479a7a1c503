"""Fast decoding on a CPU, as pure functions: the decoder with a preallocated KV cache, attention that reads a shared
prefix once for all the rows continuing it, and seeded top-p sampling. rollout.HFSampler drives them.

- decoder_forward runs the model's own modules (Llama family: pre-norm, RoPE, grouped-query attention), with the
  attention step delegated: prefill_attention while prefilling sequences, decode_attention while generating.
- decode_attention splits each row's context in two: its prefix, a *view* of the sequence's prefill cache shared by
  every row that continues it (the K vines of a state, the states of one response), and the few tokens the row
  generated itself. Softmax over both = the two partial softmaxes merged by their log-sum-exps.
- sample_tokens draws top-p samples with the Gumbel-max trick. Its noise is a hash of (seed, row, step, token), so a
  row samples the same tokens whatever else shares its batch (finished rows leave, batches regroup).

Shapes: B = rows, t = new positions, T = prefill length, W = cache width, V = vocab, L = layers, H = query heads,
Hkv = KV heads, G = H / Hkv, D = head dim, k = top-p candidates, S = sequences (prefixes) in a batch, R = rows per
sequence, Wp = prefix columns.
"""
import importlib

import torch
import torch.nn.functional as F

TOP_K_FIRST = 64  # top-p looks at the 64 likeliest tokens first; rows whose nucleus is wider fall back to a full sort


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic; >> made logical by masking)."""
    x = x + -7046029254386353131  # 0x9E3779B97F4A7C15
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


def gumbel(*, seed: int, rows: torch.Tensor, step: int, token_ids: torch.Tensor) -> torch.Tensor:
    """(B, k) Gumbel noise that depends only on (seed, row key, step, token id)."""
    x = mix64(mix64(mix64(torch.full_like(rows, seed)) ^ rows) ^ step)[:, None]  # (B, 1)
    u = ((mix64(x ^ token_ids) >> 11) & ((1 << 53) - 1)).double().add(0.5).div(2.0 ** 53)  # (B, k) in (0, 1)
    return -torch.log(-torch.log(u)).float()


def sample_tokens(logits: torch.Tensor, *, temperature: float, top_p: float, seed: int, rows: torch.Tensor,
                  step: int) -> torch.Tensor:
    """(B,) next tokens from logits (B, V): greedy at temperature 0, else top-p sampling by the Gumbel-max trick.
    Only the candidates' log-probs are formed (logit / T - logsumexp), not a (B, V) log-softmax."""
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits if temperature == 1 else logits.float() / temperature  # (B, V)
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (B, 1)
    if top_p >= 1:
        ids = torch.arange(scaled.shape[1], device=scaled.device).expand_as(scaled)
        return (scaled + gumbel(seed=seed, rows=rows, step=step, token_ids=ids)).argmax(-1)
    cand_logits, cand_ids = scaled.topk(min(TOP_K_FIRST, scaled.shape[1]), dim=-1)  # (B, k), likeliest first
    cand_logp = cand_logits - lse  # (B, k)
    wide = cand_logp.exp().sum(-1) < top_p  # (B,) rows whose nucleus needs more than k tokens
    if wide.any():  # rare at T = 0.6: sort the whole vocabulary for these rows only
        full_logits, full_ids = scaled[wide].sort(dim=-1, descending=True)  # (b, V)
        chosen = torch.empty(len(scaled), dtype=torch.long, device=scaled.device)
        chosen[wide] = nucleus_pick(full_logits - lse[wide], full_ids, top_p=top_p, seed=seed, rows=rows[wide],
                                    step=step)
        chosen[~wide] = nucleus_pick(cand_logp[~wide], cand_ids[~wide], top_p=top_p, seed=seed, rows=rows[~wide],
                                     step=step)
        return chosen
    return nucleus_pick(cand_logp, cand_ids, top_p=top_p, seed=seed, rows=rows, step=step)


def next_tokens(model, hidden: torch.Tensor, *, rows: torch.Tensor, temperature: float, logits: torch.Tensor,
                chunk: int = 64, **sampling) -> torch.Tensor:
    """(B,) tokens sampled from the last hidden states (B, hidden). The logits are written into `logits`, a reused
    (>= B, V) buffer: a fresh 50 MB tensor per step costs more in page faults than its matmul saves. The temperature
    divides the hidden state (lm_head has no bias), not the (B, V) logits; sampling goes `chunk` rows at a time, so
    its temporaries stay small."""
    if temperature > 0:
        hidden = hidden / temperature
    logits = torch.mm(hidden, model.lm_head.weight.t(), out=logits[:len(hidden)])  # (B, V)
    return torch.cat([sample_tokens(logits[i:i + chunk], temperature=float(temperature > 0), rows=rows[i:i + chunk],
                                    **sampling) for i in range(0, len(hidden), chunk)])


def nucleus_pick(sorted_logp, sorted_ids, *, top_p: float, seed: int, rows, step: int) -> torch.Tensor:
    """Sample among the smallest likeliest-first prefix of tokens whose probability reaches top_p."""
    probs = sorted_logp.exp()  # (B, k)
    keep = probs.cumsum(-1) - probs < top_p  # (B, k) the mass before a kept token is under top_p
    scores = (sorted_logp + gumbel(seed=seed, rows=rows, step=step, token_ids=sorted_ids)).masked_fill(~keep, -1e30)
    return sorted_ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)  # (B,)


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


def prefill_attention(layer: int, q, k, v, *, scale: float, keys, values, start: int, bias) -> torch.Tensor:
    """Prefill: store k, v (B, Hkv, T, D) at cache columns [start, start + T) of keys/values (L, B, Hkv, D, W),
    stored transposed (see decode_attention); attend among the T new positions with bias (B, 1, T, T) (0: allowed,
    -inf: not)."""
    T = q.shape[2]
    keys[layer][:, :, :, start:start + T] = k.transpose(-1, -2)
    values[layer][:, :, :, start:start + T] = v.transpose(-1, -2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def prefix_layout(*, slots: list[int], lens: list[int], cache: dict, heads_per_kv: int) -> dict:
    """How decoding rows read their prefixes from the prefill cache. Row r continues sequence slots[r] after its
    first lens[r] tokens. Rows of the same sequence are stacked, so that sequence's keys and values are read once per
    step for all of them (K vines of a state, and the states of one response, share one cache)."""
    s0, s1, B = min(slots), max(slots) + 1, len(slots)
    members = [[] for _ in range(s1 - s0)]
    for r, s in enumerate(slots):
        members[s - s0].append(r)
    R, W = max(map(len, members)), cache["width"]
    c0 = min(W - cache["lens"][s] for s in range(s0, s1))  # no sequence of this batch starts left of c0
    gather = torch.full((s1 - s0, R), B)  # (S, R) row of each (sequence, place); B: a dummy all-zero query
    row_place = torch.empty(B, dtype=torch.long)  # (B,) each row's place in the flattened (S * R) stack
    allowed = torch.zeros(s1 - s0, R, W - c0, dtype=torch.bool)  # (S, R, Wp)
    allowed[:, :, -1] = True  # dummy places attend somewhere, so their softmax stays finite (and is discarded)
    for p, rows in enumerate(members):
        first = W - cache["lens"][s0 + p] - c0  # where the sequence starts in the sliced cache
        for j, r in enumerate(rows):
            gather[p, j], row_place[r] = r, p * R + j
            allowed[p, j] = False
            allowed[p, j, first:first + lens[r]] = True
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))  # (S, R, Wp)
    num_kv = cache["keys"].shape[2]
    bias = bias[:, None, :, None, :].expand(-1, num_kv, -1, heads_per_kv, -1)  # (S, Hkv, R, G, Wp)
    device = cache["keys"].device
    return {"s0": s0, "s1": s1, "c0": c0, "gather": gather.to(device), "row_place": row_place.to(device),
            "in_order": row_place.tolist() == list(range(B)),
            "bias": bias.reshape((s1 - s0) * num_kv, R * heads_per_kv, -1).to(device)}  # (S * Hkv, R * G, Wp)


def softmax_attend(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(scores) @ values, with the log-sum-exp of the scores appended: (..., n, D + 1) from scores (..., n, W)
    and values (..., W, D). One exp pass, in place (scores is a fresh tensor the caller gives up)."""
    top = scores.amax(-1, keepdim=True)  # (..., n, 1)
    weights = scores.sub_(top).exp_()  # (..., n, W) unnormalised
    total = weights.sum(-1, keepdim=True)  # (..., n, 1)
    return torch.cat([torch.matmul(weights, values).div_(total), top + total.log()], -1)


def decode_attention(layer: int, q, k, v, *, scale: float, prefix: dict, prefix_keys, prefix_values, suffix_keys,
                     suffix_values, step: int) -> torch.Tensor:
    """Decoding one token per row (t = 1). Row r attends to its prefix, a view of the prefill cache (never copied),
    and to the `step + 1` tokens it generated, kept in suffix_keys/values (L, B, Hkv, S, D). The prefix cache
    (L, S, Hkv, D, Wp) is stored transposed: on this CPU both of its batched matmuls then run at the speed of reading
    the cache, 1.25-1.9x faster than on (Wp, D) blocks. The two softmaxes are computed apart and merged by their
    log-sum-exps."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    suffix_keys[layer][:, :, step] = k[:, :, 0]
    suffix_values[layer][:, :, step] = v[:, :, 0]
    q = q.reshape(B, Hkv, G, D) * scale  # (B, Hkv, G, D): the G query heads sharing a KV head
    # 1. The prefixes, sequence-major: qp (S * Hkv, R * G, D) against that sequence's keys (S * Hkv, Wp, D).
    S, R = prefix["gather"].shape
    one_each = R == 1 and S == B and prefix["in_order"]  # plain sampling: each row its own sequence, in order
    qp = q if one_each else torch.cat([q, q.new_zeros(1, Hkv, G, D)])[prefix["gather"]]  # (S, R, Hkv, G, D)
    qp = qp.reshape(S * Hkv, G, D) if one_each else qp.permute(0, 2, 1, 3, 4).reshape(S * Hkv, R * G, D)
    pk = prefix_keys[layer][prefix["s0"]:prefix["s1"], :, :, prefix["c0"]:].flatten(0, 1)  # (S * Hkv, D, Wp), a view
    pv = prefix_values[layer][prefix["s0"]:prefix["s1"], :, :, prefix["c0"]:].flatten(0, 1)  # (S * Hkv, D, Wp)
    scores = torch.baddbmm(prefix["bias"], qp, pk)  # (S * Hkv, R * G, Wp), masked by the bias
    out_p = softmax_attend(scores, pv.transpose(1, 2))  # (S * Hkv, R * G, D + 1)
    if one_each:
        out_p = out_p.view(B, Hkv, G, D + 1)
    else:  # back to rows: (B, Hkv, G, D + 1)
        out_p = out_p.view(S, Hkv, R, G, D + 1).permute(0, 2, 1, 3, 4).reshape(S * R, Hkv, G, D + 1)
        out_p = out_p[prefix["row_place"]]
    # 2. The generated tokens, row by row.
    sk, sv = suffix_keys[layer][:, :, :step + 1], suffix_values[layer][:, :, :step + 1]  # (B, Hkv, step + 1, D)
    out_s = softmax_attend(torch.matmul(q, sk.transpose(-1, -2)), sv)  # (B, Hkv, G, D + 1)
    # 3. Merge: softmax over both parts = each part's softmax weighted by its share of the total mass.
    lse = torch.logaddexp(out_p[..., D:], out_s[..., D:])  # (B, Hkv, G, 1)
    out = out_p[..., :D] * torch.exp(out_p[..., D:] - lse) + out_s[..., :D] * torch.exp(out_s[..., D:] - lse)
    return out.reshape(B, H, 1, D)
