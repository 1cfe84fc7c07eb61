"""Long context: RoPE scaling (linear, dynamic NTK, YaRN, Llama-3) as transformers computes it, for the
engine and the Learner (`rope`), and context-parallel ring attention over torch.distributed (`ring`).
Does not know about tasks (the long-context domains are `envs/domains/longctx_*.py`)."""
