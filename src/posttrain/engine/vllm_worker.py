"""The worker side of the vLLM backend: a `worker_extension_cls` mixed into every vLLM worker, whose
methods the engine calls by name through `collective_rpc`. Weights travel as a safetensors file on the
host's shared memory (only its path and version cross the RPC), so an update is never pickled.

Imported by vLLM's worker processes only; must not import vLLM at module level (it is named by its
qualified name, `posttrain.engine.vllm_worker.WeightLoader`).
"""

from __future__ import annotations


class WeightLoader:
    """Mixed into vLLM's GPU worker (`self.model_runner`, `self.device` are the worker's)."""

    def posttrain_load_weights(self, path: str, version: int) -> dict[str, int]:
        """Load every tensor of the safetensors file at `path` into the model in place. The file's
        metadata must name `version` and hold the tensor count it declares: a stale or truncated file is
        refused (ValueError) before anything is copied."""
        from safetensors import safe_open

        model = self.model_runner.model  # type: ignore[attr-defined]
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            if meta.get("posttrain_version") != str(version) or meta.get("posttrain_tensors") != str(
                len(names)
            ):
                raise ValueError(
                    f"weight file {path} holds version {meta.get('posttrain_version')!r} with {len(names)} tensors "
                    f"(declared {meta.get('posttrain_tensors')!r}); expected version {version}: refused"
                )
            model.load_weights(weights=((n, f.get_tensor(n)) for n in names))
        return {"version": int(version), "tensors": len(names)}
