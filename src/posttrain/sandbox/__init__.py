"""Isolated execution of untrusted code (filled by the sandbox issue). Must not import torch."""
