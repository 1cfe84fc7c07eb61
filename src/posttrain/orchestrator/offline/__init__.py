"""Runs that train on data the run does not generate step by step: SFT on chat rows or an environment's
reference solutions (`sft.py`), preference pairs from files or sampled by verifier outcome (`pairs.py`),
DPO and its online variant (`dpo.py`) and reward models (`rm.py`). The RL loop is `orchestrator.rl`'s."""
