"""Adaptive multi-domain sampling: which (domain, difficulty) arm and which prompt the next groups come
from, driven by learnability and measured forgetting. Owns sampling weights, their signals and state;
does not run rollouts, score probes or touch tensors (no torch import). The loop-facing API:

    from posttrain.curriculum import Arm, make_sampler
    sampler = make_sampler(cfg.curriculum, [Arm("math", 0), Arm("math", 1), ...], seed=cfg.seed)
    for step in range(steps):
        sampler.set_progress(spent_share)                # in [0, 1]: the schedule below reads it
        for arm in sampler.probe_arms(step):             # adaptive only; every probe_every steps from 0,
            sampler.record_probe(step, arm, greedy_accuracy(arm), n=n_prompts)  # arms training left unmeasured
        arms = sampler.sample(prompts_per_step)          # one arm per group (cfg.batch)
        prompt = sampler.choose_prompt(arm, candidate_ids)
        ... rollouts ...
        sampler.record_prompt(arm, prompt, rewards_of_that_prompt)
        sampler.update(step, arm, [group1_rewards, ...], tokens=generated)  # once per arm per step; tokens
                                                         # optional (only cost_aware reads them)
        if sampler.filters_groups: keep = sampler.filter_groups(all_group_rewards)
        log(sampler.signals())                           # curriculum/weight/math:0, .../L/..., .../F/...
    checkpoint["curriculum"] = sampler.state_dict()      # JSON; load_state_dict restores it exactly
The RL loop in async mode (staleness k) makes the update/record_prompt calls of batch j just before it
picks batch j + k + 1, from the rollout thread, so what the sampler has heard at a pick never depends on
thread timing (`orchestrator.rl.schedule.AsyncPipeline`).

Other calls: `probe_due(step)` (probe_arms is not empty); `weights() -> dict[Arm, float]`;
`set_data_size(arm, n)` (0 removes an arm until it is restored; `uniform_by_data` weighs by these
sizes). The simulator that the samplers are benchmarked on, and its planners, live in `posttrain.bench`.

The default rule (`adaptive`), per available arm k of K:
  L_k  = EMA (rate alpha) of the per-update mean |r - group mean|, divided by the domain's running reward
         range (starts at [0, 1], widens to every reward seen), so binary and scalar rewards compare;
  F_k  = max(0, best probe score so far - latest - forget_z * SE), SE the binomial standard error of
         that difference from the two probes' prompt counts (record_probe's n; default probe_size), so
         a drop within probe noise is not read as forgetting (forget_z = 0: the plain difference);
  s_k  = L_k + c*sqrt(ln(N+1)/(n_k+1)) + lam*F_k + nu*W_k (+ mu*LP_k)   (n_k groups seen from arm k,
         N in total), min-max normalised across the available arms to [0, 1];
  pi   = (1-eps)*softmax(s/tau) + eps/K, clipped to [eps/K, max(max_share, 1/K)] and renormalised by
         water-filling: arms over the cap are set to it and the excess goes to the others in proportion
         to their weights, repeated until none exceeds it (then the same for the floor), so pi sums to 1
         and every available arm keeps at least eps/K; unsampled arms never decay to zero.
Over the run (the loop reports its spent share f in [0, 1] through `set_progress`: the further of
step / orchestrator.steps and generated tokens / orchestrator.token_budget; a run resumed with another
orchestrator.steps re-times the rest of the schedule, one resumed with the same steps or token budget not):
  eps_f = eps + (eps_end - eps) * f   (eps_end = None: eps throughout);
  pi_f  = (1 - m*f) * pi + m*f * uniform_by_domain, m = domain_mix, renormalised again into
          [eps_f/K, max(max_share, 1/K)]: the mix turns toward uniform_by_domain as the budget runs out.
Signals read from the arm's own training groups (free; `AdaptiveSampler` states them exactly), from two
EMAs of its success rate per update (rates lp_fast = 0.2, lp_slow = 0.1) and their variances:
  F_k  with train_retention (default on) is the larger of the probe drop and the drop of the slow EMA
       below its best so far, beyond forget_z standard errors: a sampled arm's decline shows without a probe;
  W_k  = 1 - slow EMA, the arm's headroom, weight nu = `weakness` (0.4): L is symmetric in p, so an arm
       stuck at p = 0.1 looked no more worth training than a mastered one at p = 0.9;
  LP_k = |fast - slow| beyond forget_z SE, TSCL's learning progress, weight mu = lp_weight (0 by default:
       it did not help in the simulation benchmark; see the figures below).
Probes: `probe_arms(step)` skips arms with >= probe_skip_rollouts (64) training rollouts since their
last probe, so held-out prompts go to arms the training groups no longer measure (long unsampled).
Optional, off by default:
  cost_aware: the softmax part is divided by each arm's tokens per rollout relative to the others (from
       update's `tokens`; an arm with no report counts as 1), so it splits tokens, not groups. On the real
       model it lost to uniform (5 paired seeds, -0.029 [-0.054, -0.005]) where splitting groups tied it
       (+0.002 [-0.020, +0.023]): it sent groups to the arms with the shortest answers. In the simulation
       it forgot a little less (0.0100 against 0.0109, seeds 0-31).
  cover_batch: one group per available arm in every batch with room for all; weights() then reports the
       rest's split (it did not help in the simulation).
Defaults: tau 0.5, c 0.4, eps 0.2 -> eps_end 0.3, domain_mix 0.3, lam 10, weakness 0.4, probe_size 16,
from a search over that family on simulation seeds 100-131 for the fewest tokens to threshold with
forgetting no worse than uniform's, checked on seeds 0-31 and 400-463. What they measure, in simulation
and on the real model, is in docs/curriculum.md with the settings tried before them.
Arms with data size 0 get weight 0 and K counts only the others. Comparison samplers:
`uniform_by_domain`, `uniform_by_data` (the simulator only: the task generators have no data size, so a
run config does not offer it), `dapo_filter_only` (uniform_by_domain + dropping all-equal groups; the RL
loop filters and refills for it as for algorithm.dynamic_sampling), `sec` (Boltzmann over a TD(0) value
of mean GRPO |advantage|), `dump` (softmax over UCB of a window of GRPO |advantage|). Each class
docstring in `samplers.py` states its exact rule. `make_sampler(..., domain_weights={domain: w})`
(envs.domains[].weight) sets the prior: uniform_by_domain splits in proportion to it; adaptive, sec and
dump multiply each arm's softmax term by it (adaptive's eps/K floor stays uniform); equal weights are
the plain rules exactly.
"""

from posttrain.curriculum.arms import Arm, arm_from_key
from posttrain.curriculum.feedback import GroupFeedback
from posttrain.curriculum.samplers import SAMPLERS, Sampler, make_sampler

__all__ = ["SAMPLERS", "Arm", "GroupFeedback", "Sampler", "arm_from_key", "make_sampler"]
