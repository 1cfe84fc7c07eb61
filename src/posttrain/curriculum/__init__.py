"""Adaptive multi-domain sampling: which (domain, difficulty) arm and which prompt the next groups come
from, driven by learnability and measured forgetting. Owns sampling weights, their signals and state;
does not run rollouts, score probes or touch tensors (no torch import). The loop-facing API:

    from posttrain.curriculum import Arm, make_sampler
    sampler = make_sampler(cfg.curriculum, [Arm("math", 0), Arm("math", 1), ...], seed=cfg.seed)
    for step in range(steps):
        if sampler.probe_due(step):                      # adaptive only; every probe_every steps from 0
            for arm in sampler.arms: sampler.record_probe(step, arm, greedy_accuracy(arm), n=n_prompts)
        arms = sampler.sample(tasks_per_step)            # one arm per group
        prompt = sampler.choose_prompt(arm, candidate_ids)
        ... rollouts ...
        sampler.record_prompt(arm, prompt, rewards_of_that_prompt)
        sampler.update(step, arm, [group1_rewards, group2_rewards, ...])   # once per arm per step
        if sampler.filters_groups: keep = sampler.filter_groups(all_group_rewards)
        log(sampler.signals())                           # curriculum/weight/math:0, .../L/..., .../F/...
    checkpoint["curriculum"] = sampler.state_dict()      # JSON; load_state_dict restores it exactly

Other calls: `weights() -> dict[Arm, float]`; `set_data_size(arm, n)` (0 removes an arm until it is
restored; `uniform_by_data` weighs by these sizes); `plot_domain_shares(rows, path)` for the report.

The default rule (`adaptive`), per available arm k of K:
  L_k  = EMA (rate alpha) of the per-update mean |r - group mean|, divided by the domain's running reward
         range (starts at [0, 1], widens to every reward seen), so binary and scalar rewards compare;
  F_k  = max(0, best probe score so far - latest - forget_z * SE), SE the binomial standard error of
         that difference from the two probes' prompt counts (record_probe's n; default probe_size), so
         a drop within probe noise is not read as forgetting (forget_z = 0: the plain difference);
  s_k  = L_k + c*sqrt(ln(N+1)/(n_k+1)) + lam*F_k   (n_k groups seen from arm k, N in total),
         min-max normalised across the available arms to [0, 1];
  pi   = (1-eps)*softmax(s/tau) + eps/K, clipped to [eps/K, max(max_share, 1/K)] and renormalised by
         water-filling: arms over the cap are set to it and the excess goes to the others in proportion
         to their weights, repeated until none exceeds it (then the same for the floor), so pi sums to 1
         and every available arm keeps at least eps/K; unsampled arms never decay to zero.
Arms with data size 0 get weight 0 and K counts only the others. Comparison samplers:
`uniform_by_domain`, `uniform_by_data`, `dapo_filter_only` (uniform_by_domain + dropping all-equal
groups), `sec` (Boltzmann over a TD(0) value of mean GRPO |advantage|), `dump` (softmax over UCB of a
window of GRPO |advantage|). Each class docstring in `samplers.py` states its exact rule.
"""

from posttrain.curriculum.arms import Arm, arm_from_key
from posttrain.curriculum.plot import plot_domain_shares
from posttrain.curriculum.samplers import SAMPLERS, Sampler, make_sampler

__all__ = ["SAMPLERS", "Arm", "Sampler", "arm_from_key", "make_sampler", "plot_domain_shares"]
