"""The worker side of the vLLM backend: a `worker_extension_cls` mixed into every vLLM worker, whose
methods the engine calls by name through `collective_rpc`. Weights travel as a safetensors file on the
host's shared memory (only its path and version cross the RPC), so an update is never pickled.

Imported by vLLM's worker processes only; must not import vLLM at module level (it is named by its
qualified name, `posttrain.engine.vllm_worker.WeightLoader`).
"""

from __future__ import annotations


class WeightLoader:
    """Mixed into vLLM's worker (`reload_weights` is the worker's: vLLM's in-place reload, which repacks
    each layer into the kernel's layout, as the CPU backend's linear layers need)."""

    def posttrain_load_weights(self, path: str, version: int) -> dict[str, int] | dict[str, str]:
        """Load every tensor of the safetensors file at `path` into the model in place. The file's
        metadata must name `version` and hold the tensor count it declares: a stale or truncated file is
        refused before anything is copied, and the refusal is returned (`{"refused": why}`), not raised:
        an exception in a worker RPC kills vLLM's engine process."""
        from safetensors import safe_open

        try:
            f = safe_open(path, framework="pt", device="cpu")
        except Exception as err:  # a truncated or corrupt header: safetensors' own error type
            return {"refused": f"weight file {path} is unreadable ({type(err).__name__}: {err})"}
        with f:
            meta = f.metadata() or {}
            names = list(f.keys())
            if meta.get("posttrain_version") != str(version) or meta.get("posttrain_tensors") != str(
                len(names)
            ):
                return {
                    "refused": f"weight file {path} holds version {meta.get('posttrain_version')!r} with "
                    f"{len(names)} tensors (declared {meta.get('posttrain_tensors')!r}); expected version "
                    f"{version}"
                }
            self.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names))  # type: ignore[attr-defined]
        return {"version": int(version), "tensors": len(names)}
