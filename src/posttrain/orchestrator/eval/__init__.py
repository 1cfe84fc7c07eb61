"""Evaluation of a policy and what leaves a run: held-out scoring with bootstrap intervals over a local
engine or an OpenAI-compatible endpoint (`evaluate.py`), sweeps over context lengths (`length_eval.py`),
and export of a checkpoint as a Hugging Face folder (`export.py`). Trains nothing."""
