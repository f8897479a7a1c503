"""The ablations: each in a file named for it, joining the paper's path (rollout -> values -> advantages -> ppo) at
one call site chosen by its flag. docs/forking.md shows how to add one.

    adaptive_k.py     --k-mode adaptive / budget / official: how many vines a state gets, in rounds
    free_samples.py   --free-samples add / topup: the group's own responses as samples of a state's value
    branching.py      --step-split tokens:N / lowprob:P / entropy:F: where vines branch other than at text steps
    silent_groups.py  --vines-where silent, --resample-silent: the groups whose responses all got one reward
    vine_temperature.py  --vine-temperature T: vines at a temperature of their own (docs/forking.md's example)
    critic_head.py    --critic head: PPO's critic as a head on the policy's trunk (the paper's is separate: critic.py)
"""
