"""The runs, one subpackage per kind, over the layers below; implements no math the other layers own.

`rl/` the RL run (RLRun, its sync and async schedules, task picking, run state, weight sync, placement,
the learner group, probes) · `offline/` runs on fixed or sampled data (SFT, preference pairs, DPO, reward
models) · `eval/` held-out evaluation, length sweeps and export · `checkpoint.py` atomic checkpoint dirs
and resume's metrics trim · `signals.py` SIGINT/SIGTERM. Every kind imports the shared modules here and
`eval/`; none imports another kind."""
