"""Run by tests/test_dist.py, alone (`python tests/dist_worker.py CASES OUT`) or under
`torchrun --nproc_per_node=2 tests/dist_worker.py CASES OUT`: the same global batch either way, each rank taking its
share; rank 0 writes what the tests compare (OUT, a torch file: case -> result). CASES is comma-separated: one launch
runs several (a launch costs more than a case; each case seeds its own generators, so the order does not matter).

Cases: ppo, ppo-critic, ppo-fsdp (one PPO iteration of a tiny random Llama, 8 episodes whose response lengths differ
a lot between the first and the second half), critic-separate, critic-separate-fsdp (the separate critic's value
update on the same episodes), sft, sft-fsdp (one sft.py step of it on 8 such instances, then its
final model saved), split (estimate_values with a fake sampler that records the states it is asked to continue).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dist  # noqa: E402
from ablations.critic_head import new_value_head  # noqa: E402
from checkpoint import save_final  # noqa: E402
from model import Scorer  # noqa: E402
from ppo import batch_logprobs, pad_episodes, pad_rows, ppo_update  # noqa: E402
from rollout import Sample  # noqa: E402
from sampling import requests_in_waves  # noqa: E402
from sft import sft_step  # noqa: E402
from values import estimate_values  # noqa: E402


def tiny_policy():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def episodes(n: int = 8):
    """n prompts + responses; the first half's responses short (2-4 tokens), the second half's long (9-14)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 64, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    lengths = [int(torch.randint(2, 5, (1,), generator=g)) if i < n // 2 else int(torch.randint(9, 15, (1,), generator=g))
               for i in range(n)]
    responses = [torch.randint(1, 64, (L,), generator=g).tolist() for L in lengths]
    advantages = [torch.randn(L, generator=g) for L in lengths]
    returns = [torch.rand(L, generator=g) for L in lengths]
    return prompts, responses, advantages, returns


def ppo_case(case: str) -> dict:
    rank, world = dist.rank(), dist.world()
    prompts, responses, advantages, returns = episodes()
    # Rank r holds episodes {2r, 2r+1} of each half: one short pair and one long pair per rank (2 ranks), and one
    # rank alone holds them all. Micro-batches are pairs; a minibatch is one pair per rank, i.e. 4 episodes.
    pairs = [[0, 1], [4, 5], [2, 3], [6, 7]]  # step 1: pairs 0 and 1; step 2: pairs 2 and 3
    mine = [i for pair in pairs[rank::world] for i in pair]
    ids, attn, resp, P = pad_episodes([prompts[i] for i in mine], [responses[i] for i in mine], pad_id=0)
    width = resp.shape[1]
    batch = {"input_ids": ids, "attention_mask": attn, "response_mask": resp,
             "advantages": pad_rows([advantages[i] for i in mine], width)}
    policy = tiny_policy()
    value_head = new_value_head(policy) if case == "ppo-critic" else None
    if value_head is not None:
        batch["returns"] = pad_rows([returns[i] for i in mine], width)
    start = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    scorer = dist.wrap(Scorer(policy, value_head), fsdp=case == "ppo-fsdp")
    groups = [torch.tensor([2 * j, 2 * j + 1]) for j in range(len(mine) // 2)]
    batch["old_logprobs"], old_values, _ = batch_logprobs(scorer, batch, P, groups=groups, temperature=1.0)
    batch["ref_logprobs"] = batch["old_logprobs"] - 0.1 * batch["advantages"]  # a reference the policy differs from
    if value_head is not None:
        batch["old_values"] = old_values
    params = list(policy.parameters()) + (list(value_head.parameters()) if value_head is not None else [])
    optimizer = torch.optim.SGD(params, lr=0.5)  # SGD: a step is the gradient itself, scale and all
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    torch.manual_seed(3)
    stats = ppo_update(scorer, optimizer, scheduler, batch, P, groups=groups, epochs=1, minibatch_size=4 // world,
                       clip=0.2, kl_coef=0.1, temperature=1.0, max_grad_norm=1.0)
    weights = dist.full_state_dict(policy)
    if value_head is not None:
        weights.update({f"value_head.{k}": v for k, v in dist.full_state_dict(value_head).items()})
    return {"weights": {k: v.detach().clone() for k, v in weights.items()}, "start": start, "stats": stats}


def critic_case(case: str) -> dict:
    """Two steps of critic.value_update (SGD) on the same episodes and pairs as ppo_case: the separate critic, a copy
    of the tiny model's trunk with a small random head, under DDP or FSDP2."""
    from critic import Critic, SeparateCritic, value_update
    rank, world = dist.rank(), dist.world()
    prompts, responses, _, returns = episodes()
    pairs = [[0, 1], [4, 5], [2, 3], [6, 7]]
    mine = [i for pair in pairs[rank::world] for i in pair]
    ids, attn, resp, P = pad_episodes([prompts[i] for i in mine], [responses[i] for i in mine], pad_id=0)
    width = resp.shape[1]
    torch.manual_seed(4)
    head = torch.nn.Linear(32, 1)
    model = Critic(tiny_policy().model, head)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    module = dist.wrap(model, fsdp=case.endswith("fsdp"))
    groups = [torch.tensor([2 * j, 2 * j + 1]) for j in range(len(mine) // 2)]
    batch = {"input_ids": ids, "attention_mask": attn, "response_mask": resp,
             "returns": pad_rows([returns[i] for i in mine], width), "old_values": torch.zeros(len(mine), width)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    torch.manual_seed(3)
    stats = value_update(SeparateCritic(model, module, optimizer, scheduler, 0.5), batch, P, groups=groups, epochs=1,
                         minibatch_size=4 // world, value_clip=10.0, max_grad_norm=1.0)
    stats["optimizer_steps"], stats["loss"] = stats.pop("value_steps"), stats["value_loss"]
    weights = dist.full_state_dict(model)
    return {"weights": {k: v.detach().clone() for k, v in weights.items()}, "start": start, "stats": stats}


def sft_case(case: str, out: str) -> dict:
    """One sft_step (SGD) on a batch of 8: rank r takes instances r, r + world, ... (as sft.py deals them), so with
    2 ranks one rank holds the short targets and the other the long ones; then checkpoint.save_final writes the model."""
    rank, world = dist.rank(), dist.world()
    prompts, responses, _, _ = episodes()
    order = [0, 4, 1, 5, 2, 6, 3, 7]  # short and long alternate: rank 0 gets 0-3 (short), rank 1 gets 4-7 (long)
    pairs = [(prompts[i], responses[i]) for i in order][rank::world]
    policy = tiny_policy()
    start = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    scorer = dist.wrap(Scorer(policy), fsdp=case == "sft-fsdp")
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)  # SGD: a step is the gradient itself, scale and all
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = sft_step(scorer, optimizer, scheduler, pairs, batch_size=8, micro_batch_size=2, pad_id=0,
                     max_grad_norm=1e9)
    weights = dist.full_state_dict(policy)
    folder = Path(out).parent / f"final-{case}-{world}"  # sft.py's final model, gathered from shards under FSDP2
    folder.mkdir(exist_ok=True)
    save_final(folder, policy=policy, tokenizer=FakeTokenizer(), prompt_format="chat")
    return {"weights": {k: v.detach().clone() for k, v in weights.items()}, "start": start, "stats": stats,
            "saved": str(folder)}


class FakeTokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["" for _ in rows]

    def save_pretrained(self, folder):
        pass


class RecordingSampler:
    """Continues each state with max_new_tokens filler tokens and records which states it was asked for, and their
    expected cost: K x the tokens the sampled response had left after the state."""

    tokenizer = FakeTokenizer()

    def __init__(self):
        self.states, self.cost = [], 0

    def sample_requests(self, sequences, prefix_lens, requests, **kwargs):
        requests_in_waves(self.sample_prefixes, sequences, prefix_lens, requests, **kwargs)

    def sample_prefixes(self, sequences, prefix_lens, *, n, temperature, top_p, max_new_tokens, seed=0):
        self.states += [tuple(seq[:L]) for seq, L in zip(sequences, prefix_lens)]
        self.cost += sum(n * (len(seq) - L) for seq, L in zip(sequences, prefix_lens))  # what the split balances
        return [[Sample(token_ids=[7] * budget, text="", finished=True, logprobs=[0.0] * budget) for _ in range(n)]
                for budget in max_new_tokens]


def split_case() -> dict:
    rank, world = dist.rank(), dist.world()
    g = torch.Generator().manual_seed(2)
    prompts, responses, starts = [], [], []
    for i in range(12):  # 6 problems x 2 responses; the two responses to a problem share their first step
        prompt = [1, 2, 3, i // 2]
        first = [10 + i // 2] * 3
        rest = torch.randint(20, 60, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        response = first + rest
        cuts = sorted({0, 3, *torch.randint(4, len(response), (3,), generator=g).tolist()} - {len(response)})
        prompts.append(prompt)
        responses.append(response)
        starts.append(cuts)
    mine = list(range(rank, 12, world))
    sampler = RecordingSampler()
    values, stats = estimate_values(
        sampler=sampler, prompts=[prompts[i] for i in mine], responses=[responses[i] for i in mine],
        step_starts=[starts[i] for i in mine], rewards=[1.0] * len(mine), answers=["1"] * len(mine), grader="gsm8k",
        K=3, temperature=1.0, top_p=1.0, max_new_tokens=64)
    everyone = dist.all_gather({"states": sampler.states, "values": dict(zip(mine, values)),
                                "cost": sampler.cost})
    return {"ranks": everyone, "stats": stats}


if __name__ == "__main__":
    cases, out = sys.argv[1].split(","), sys.argv[2]
    dist.init(torch.device("cpu"))
    torch.set_num_threads(1)
    results = {case: split_case() if case == "split" else sft_case(case, out) if case.startswith("sft") else
               critic_case(case) if case.startswith("critic") else ppo_case(case) for case in cases}
    if dist.rank() == 0:
        torch.save(results, out)
    dist.finish()
