"""--vine-temperature T: sample the vines at their own temperature instead of the rollouts' (docs/forking.md's example).

The paper samples vines from the current policy at the rollout temperature, so that a vine is a sample of the same
policy the response came from and V(state) is that policy's value. A cooler vine estimates the value of a greedier
policy (less noise, a biased V); a hotter one, of a more exploratory one. 0 (the default) is the paper's. It joins
the paper's path at advantages.values_for (`if cfg.vine_temperature != 0`).
"""


def vine_temperature(*, rollout: float, vine: float) -> float:
    """The temperature the vines are sampled at: `vine` when set (> 0), else the rollouts' `rollout`."""
    return vine if vine > 0 else rollout
