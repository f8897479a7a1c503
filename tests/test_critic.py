"""The PPO baseline's critic (--estimator critic): the paper's separate network (critic.py, --critic separate) and the
head on the policy's trunk (--critic head), on a tiny random Llama and a fixed batch: sections 4-6 of train.py."""
import pickle
import random
from types import SimpleNamespace

import pytest
import torch

from ablations.critic_head import new_value_head
from advantages import advantages_for, values_for
from checkpoint import restore, save_critic
from config import config_changes, parse_config
from critic import Critic, SeparateCritic, critic_update, load_critic
from dist_worker import episodes, tiny_policy
from model import Scorer
from ppo import make_optimizer, micro_batches, pad_episodes, policy_update

REWARDS = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]


def cfg(**kw):
    return SimpleNamespace(temperature=1.0, top_p=1.0, gamma=1.0, lam=1.0, whiten=True, epochs=2, minibatch_size=4,
                           clip=0.2, kl_coef=0.1, max_grad_norm=1.0, vf_coef=0.1, value_clip=0.2, tis_cap=0.0,
                           prompts_per_iter=4, samples_per_prompt=2, micro_batch_size=2, **kw)  # 8 episodes


def fixed_batch():
    prompts, responses, _, _ = episodes()
    ids, attn, resp, P = pad_episodes(prompts, responses, pad_id=0)
    eps = SimpleNamespace(responses=responses, groups=[0, 0, 1, 1, 2, 2, 3, 3], samples=[])
    sampler_logprobs = [[-1.0] * len(r) for r in responses]
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp}, P, eps, sampler_logprobs


def sections_4_to_6(scorer, optimizer, scheduler, *, critic=None):
    """values_for, advantages_for, policy_update and critic_update on the fixed batch (fp32, one thread)."""
    batch, P, eps, sampler_logprobs = fixed_batch()
    micro = micro_batches(8, size=2, generator=torch.Generator().manual_seed(5))
    values, starts, value_stats = values_for("critic", episodes=eps, rewards=REWARDS, batch=batch, P=P, micro=micro,
                                             sampler=None, scorer=scorer, tokenizer=None, cfg=cfg(), seed=0,
                                             critic=critic)
    advantages_for("critic", values=values, starts=starts, rewards=REWARDS, episodes=eps, batch=batch, cfg=cfg())
    torch.manual_seed(7)
    stats = policy_update(scorer, scorer, optimizer, scheduler, batch, P, groups=micro,
                          sampler_logprobs=sampler_logprobs, cfg=cfg())
    stats.update(critic_update(critic, batch, P, groups=micro, cfg=cfg()))
    return {**value_stats, **stats}, batch


def abs_sum(module) -> float:
    return float(sum(p.detach().double().abs().sum() for p in module.parameters()))


def test_critic_head_is_the_code_path_from_before_the_separate_critic():
    """--critic head: one iteration's value mean, losses and weights as the code before the separate critic gave them (captured
    at commit c5f4854 on an AMD EPYC with this very setup; fp32 on one thread, so within 1e-6 on another CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        policy = tiny_policy()
        head = new_value_head(policy)
        torch.nn.init.normal_(head.weight, std=0.1)
        optimizer, scheduler = make_optimizer([{"params": policy.parameters(), "lr": 1e-3},
                                               {"params": head.parameters(), "lr": 1e-2}], weight_decay=0.0,
                                              total_steps=4, warmup_ratio=0.0)
        stats, _ = sections_4_to_6(Scorer(policy, head), optimizer, scheduler)
    finally:
        torch.set_num_threads(threads)
    assert stats["value_mean"] == pytest.approx(-0.05656198849753728, abs=1e-6)
    assert stats["loss"] == pytest.approx(-0.21157589554786682, abs=1e-6)
    assert stats["value_loss"] == pytest.approx(0.3618280440568924, abs=1e-6)
    assert abs_sum(policy) == pytest.approx(489.131782659706, abs=1e-4)
    assert abs_sum(head) == pytest.approx(2.4676267293980345, abs=1e-6)


def new_separate_critic(policy, *, lr=1e-2, head_std=0.1) -> SeparateCritic:
    """A critic made as train.py makes one (a copy of the start model's trunk), its head given small random weights so
    that one step moves the trunk too."""
    start = tiny_policy()  # the same weights as `policy` (seeded): "loaded from the same start"
    head = torch.nn.Linear(start.config.hidden_size, 1)
    torch.nn.init.normal_(head.weight, std=head_std)
    torch.nn.init.zeros_(head.bias)
    model = Critic(start.model, head)
    optimizer, scheduler = make_optimizer([{"params": model.parameters(), "lr": lr}], weight_decay=0.0,
                                          total_steps=4, warmup_ratio=0.0)
    return SeparateCritic(model, model, optimizer, scheduler, lr)


def test_separate_critic_is_its_own_network_trained_by_the_value_loss_alone():
    """The critic starts equal to the policy's trunk but in other tensors; its V feed GAE (batch old_values); its
    update moves it and leaves the policy where the policy's own update left it."""
    torch.manual_seed(0)
    policy = tiny_policy()
    critic = new_separate_critic(policy)
    assert all(torch.equal(a, b) for a, b in zip(policy.model.parameters(), critic.model.trunk.parameters()))
    assert not {p.data_ptr() for p in policy.parameters()} & {p.data_ptr() for p in critic.model.parameters()}
    critic_start = {k: v.clone() for k, v in critic.model.state_dict().items()}
    optimizer, scheduler = make_optimizer([{"params": policy.parameters(), "lr": 1e-3}], weight_decay=0.0,
                                          total_steps=4, warmup_ratio=0.0)
    scorer = Scorer(policy)
    batch, P, eps, sampler_logprobs = fixed_batch()
    micro = micro_batches(8, size=2, generator=torch.Generator().manual_seed(5))
    values, _, _ = values_for("critic", episodes=eps, rewards=REWARDS, batch=batch, P=P, micro=micro, sampler=None,
                              scorer=scorer, tokenizer=None, cfg=cfg(), seed=0, critic=critic)
    with torch.no_grad():
        direct = critic.model(batch["input_ids"], batch["attention_mask"], response_start=P)  # (B, R)
    for i, v in enumerate(values):
        assert torch.allclose(v, direct[i, :len(v)], atol=1e-6)
    advantages_for("critic", values=values, starts=None, rewards=REWARDS, episodes=eps, batch=batch, cfg=cfg())
    policy_update(scorer, scorer, optimizer, scheduler, batch, P, groups=micro, sampler_logprobs=sampler_logprobs,
                  cfg=cfg())
    after_policy = {k: v.clone() for k, v in policy.state_dict().items()}
    stats = critic_update(critic, batch, P, groups=micro, cfg=cfg())
    assert stats["value_steps"] == 4 and stats["value_skipped"] == 0 and stats["value_loss"] > 0
    assert all(torch.equal(v, after_policy[k]) for k, v in policy.state_dict().items())  # the policy is untouched
    moved = {k: (v - critic_start[k]).abs().max().item() for k, v in critic.model.state_dict().items()}
    assert moved["head.weight"] > 1e-3 and max(v for k, v in moved.items() if k.startswith("trunk.")) > 1e-4


def test_the_policy_update_is_blind_to_the_critic_but_for_its_values():
    """With a separate critic the policy's step is exactly the step it takes with those same values handed in from
    outside: no gradient of the value loss reaches it, and the critic's own update leaves it alone."""
    torch.manual_seed(0)
    policy = tiny_policy()
    critic = new_separate_critic(policy)
    optimizer, scheduler = make_optimizer([{"params": policy.parameters(), "lr": 1e-3}], weight_decay=0.0,
                                          total_steps=4, warmup_ratio=0.0)
    stats, batch = sections_4_to_6(Scorer(policy), optimizer, scheduler, critic=critic)
    with_critic = {k: v.clone() for k, v in policy.state_dict().items()}
    values = [batch["old_values"][i, :int(n)] for i, n in enumerate(batch["response_mask"].sum(1))]

    torch.manual_seed(0)
    policy = tiny_policy()
    optimizer, scheduler = make_optimizer([{"params": policy.parameters(), "lr": 1e-3}], weight_decay=0.0,
                                          total_steps=4, warmup_ratio=0.0)
    scorer = Scorer(policy)
    fresh, P, eps, sampler_logprobs = fixed_batch()
    micro = micro_batches(8, size=2, generator=torch.Generator().manual_seed(5))
    from ppo import batch_logprobs
    fresh["old_logprobs"], _, fresh["log_mass"] = batch_logprobs(scorer, fresh, P, groups=micro, temperature=1.0)
    advantages_for("critic", values=values, starts=None, rewards=REWARDS, episodes=eps, batch=fresh, cfg=cfg())
    torch.manual_seed(7)
    policy_update(scorer, scorer, optimizer, scheduler, fresh, P, groups=micro, sampler_logprobs=sampler_logprobs,
                  cfg=cfg())
    for k, v in policy.state_dict().items():
        assert torch.equal(v, with_critic[k]), k
    assert stats["value_steps"] == 4 and stats["value_loss"] > 0


def test_a_saved_critic_loads_back_the_same_without_running_code(tmp_path):
    """ckpt-*/critic: a Hugging Face folder (safetensors) and value_head.safetensors; loaded back it predicts the same
    values; a value head that is not safetensors is a one-line error, and nothing in it runs."""
    torch.manual_seed(0)
    critic = new_separate_critic(tiny_policy())
    save_critic(tmp_path / "critic", critic.model, critic.model.state_dict())
    assert {p.name for p in (tmp_path / "critic").iterdir()} >= {"config.json", "model.safetensors",
                                                                 "value_head.safetensors"}
    loaded = load_critic(str(tmp_path / "critic"), device=torch.device("cpu"), dtype=torch.float32)
    batch, P, _, _ = fixed_batch()
    with torch.no_grad():
        a = critic.model(batch["input_ids"], batch["attention_mask"], response_start=P)
        b = loaded(batch["input_ids"], batch["attention_mask"], response_start=P)
    assert torch.equal(a, b) and a.abs().max() > 0
    (tmp_path / "critic" / "value_head.safetensors").write_bytes(pickle.dumps({"weight": "x"}))
    with pytest.raises(SystemExit) as e:
        load_critic(str(tmp_path / "critic"), device=torch.device("cpu"), dtype=torch.float32)
    assert "value_head.safetensors: not a value head this program wrote" in str(e.value) and "\n" not in str(e.value)


def test_a_new_critic_starts_at_zero_from_the_start_models_trunk(tmp_path):
    """From a causal LM's folder (what --model names) the critic takes its trunk, without the output layer, and a zero
    head: every V is 0 before it trains."""
    torch.manual_seed(0)
    tiny_policy().save_pretrained(tmp_path / "lm")
    critic = load_critic(str(tmp_path / "lm"), device=torch.device("cpu"), dtype=torch.float32)
    assert not hasattr(critic.trunk, "lm_head")
    assert all(torch.equal(a, b) for a, b in zip(tiny_policy().model.state_dict().values(),
                                                 critic.trunk.state_dict().values()))
    batch, P, _, _ = fixed_batch()
    with torch.no_grad():
        assert torch.equal(critic(batch["input_ids"], batch["attention_mask"], response_start=P),
                           torch.zeros(batch["response_mask"].shape))


def test_restore_loads_the_critics_optimizer_and_schedule():
    torch.manual_seed(0)
    critic = new_separate_critic(tiny_policy(), lr=1e-2)
    policy = torch.nn.Linear(2, 1)
    optimizer, scheduler = make_optimizer([{"params": policy.parameters(), "lr": 1e-3}], weight_decay=0.0,
                                          total_steps=4, warmup_ratio=0.0)
    for p in critic.model.parameters():
        p.grad = torch.ones_like(p)
    critic.optimizer.step()
    critic.scheduler.step()
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "iteration": 1,
             "train_seconds": 2.0, "python_rng": random.Random(1).getstate(), "torch_rng": torch.get_rng_state(),
             "critic_optimizer": critic.optimizer.state_dict(), "critic_scheduler": critic.scheduler.state_dict()}
    again = new_separate_critic(tiny_policy(), lr=5e-3)  # a changed --value-lr applies on resume
    assert restore(state, scorer=policy, optimizer=optimizer, scheduler=scheduler, rng=random.Random(), lrs=[1e-3],
                   critic=again) == (1, 2.0)
    saved = critic.optimizer.state_dict()["state"]
    for i, s in again.optimizer.state_dict()["state"].items():
        assert torch.equal(s["exp_avg"], saved[i]["exp_avg"]) and int(s["step"]) == 1
    assert again.scheduler.last_epoch == 1  # the new base lr, at the saved step of its linear decay over 4 steps
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3 * 3 / 4)


def test_critic_flag_defaults_and_errors(tmp_path, capsys):
    assert parse_config(["--estimator", "critic", "--out-dir", str(tmp_path)]).critic == "separate"  # the paper's
    assert parse_config(["--estimator", "critic", "--critic", "head", "--out-dir", str(tmp_path)]).critic == "head"
    assert parse_config(["--out-dir", str(tmp_path)]).critic is None  # vine has no critic
    for argv, message in ((["--critic", "head"], "--critic head chooses the value network of --estimator critic "
                                                 "(got --estimator vine)"),
                          (["--estimator", "grpo", "--critic", "separate"], "(got --estimator grpo)"),
                          (["--estimator", "critic", "--critic", "shared"], "invalid choice: 'shared'")):
        with pytest.raises(SystemExit):
            parse_config([*argv, "--out-dir", str(tmp_path)])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in error, error
    # a checkpoint from before --critic was a head: resuming it with --critic head is the same run, separate is not
    old = vars(parse_config(["--estimator", "critic", "--critic", "head", "--out-dir", str(tmp_path)])).copy()
    del old["critic"]
    head = parse_config(["--estimator", "critic", "--critic", "head", "--out-dir", str(tmp_path), "--resume"])
    assert config_changes(old, head)[0] == []
    separate = parse_config(["--estimator", "critic", "--out-dir", str(tmp_path), "--resume"])
    assert config_changes(old, separate)[0] == ["--critic head -> separate"]
